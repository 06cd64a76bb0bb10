"""The grammar process: llguidance matchers advanced and masked in a process of their own, beside the engine's.

A constrained step needs every constrained row's matcher advanced by its newest token and its token mask (for 32
rows in a JSON string about 80 us on the H200 host). On a thread of the engine's process that work needs the
GIL to start and at every return from llguidance, while the engine's thread runs the step's Python (launch,
sampling, text), and a batch-32 step stayed 15-21% slower than its plain twin whatever the thread did
(BENCHMARKS.md, issue 17, session 8). A process has no GIL to share: it polls a shared-memory step counter, does
the step's work and writes the masks straight into the shared buffer the sampler uploads from, then the "done"
word, which also gates the device stream (engine/stream_gate.py) on a GPU. The engine's thread only writes the
step's small arrays and the counter.

One ``GrammarProcess`` per engine, started on the first constrained request. Messages (add a matcher to a slot,
free a slot, stop, wake) go over a socket pair and are applied before the next step; an add waits for the process's answer,
so a grammar that does not compile is the request's 400. No torch here, and the child imports only numpy and
llguidance.

Shared layout (int32): a header, then per row of the step: the consume list (slot, token, status out), the mask
list (row, slot), then the bitmask [max_rows, words] the sampler uploads rows of.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import weakref
from collections import OrderedDict
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from engine.errors import EngineError

log = logging.getLogger("pagoda.grammar")

GRAMMAR_CACHE_SIZE = 128  # compiled grammars kept in the process (a repeated schema is a deep copy)
_SEQ, _DONE, _NUM_CONSUME, _NUM_MASK, _FAILED = range(5)
_HEADER_WORDS = 16  # 64 bytes: the counters on their own cache line
STATUS_OK, STATUS_STOPPED, STATUS_REJECTED = 0, 1, 2  # a consumed token: accepted; accepted and complete; refused
_SPIN_BEFORE_SLEEP_S = 0.02  # the child polls without sleeping for this long after a step, then naps
_MAX_NAP_S = 0.005
_SPINS_PER_MESSAGE_POLL = 64  # while polling steps, also look for an add (the engine waits for its answer)
_START_TIMEOUT_S = 120.0
_STEP_TIMEOUT_S = 60.0  # a step's work is microseconds; a first grammar compile can take a while


class SharedStep:
    """Views of the shared buffer, the same in both processes."""

    def __init__(self, buffer, max_rows: int, words: int):
        def view(offset: int, count: int) -> np.ndarray:
            return np.frombuffer(buffer, dtype=np.int32, count=count, offset=offset * 4)

        self.max_rows, self.words = max_rows, words
        self.header = view(0, _HEADER_WORDS)
        at = _HEADER_WORDS
        self.consume_slots, self.consume_tokens, self.consume_status = (view(at + i * max_rows, max_rows)
                                                                        for i in range(3))
        at += 3 * max_rows
        self.mask_rows, self.mask_slots = view(at, max_rows), view(at + max_rows, max_rows)
        at += 2 * max_rows
        self.bitmask = view(at, max_rows * words).reshape(max_rows, words)  # [max_rows, words] int32

    @staticmethod
    def num_bytes(max_rows: int, words: int) -> int:
        size = (_HEADER_WORDS + 5 * max_rows + max_rows * words) * 4
        return -(-size // mmap.PAGESIZE) * mmap.PAGESIZE


@dataclass(frozen=True)
class WorkerSpec:
    """What the child needs (its first message)."""

    buffer_path: str
    max_rows: int
    words: int
    tokenizer_json: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]


class GrammarProcess:
    """The engine's side: starts the child, sends matcher messages, posts steps and collects their results."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...], max_rows: int):
        words = (vocab_size + 31) // 32
        fd, path = tempfile.mkstemp(prefix="pagoda-grammar-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        try:
            size = SharedStep.num_bytes(max_rows, words)
            os.ftruncate(fd, size)
            self._mmap = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.shared = SharedStep(self._mmap, max_rows, words)
        ours, theirs = socket.socketpair()
        self._conn = Connection(ours.detach())
        try:
            # a fresh interpreter running this module (not multiprocessing's spawn, which re-imports the user's
            # __main__ script in the child, and not fork, which would copy the engine's threads and CUDA state)
            root = str(Path(__file__).resolve().parents[1])
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
            self._process = subprocess.Popen([sys.executable, "-m", "engine.grammar_worker", str(theirs.fileno())],
                                             pass_fds=[theirs.fileno()], env=env)
            theirs.close()
            # stopped and reaped when closed, or when this object goes away without a close (no zombie left)
            self._finalizer = weakref.finalize(self, _stop_child, self._process, self._conn)
            self._conn.send(asdict(WorkerSpec(path, max_rows, words, tokenizer_json, vocab_size, eos_token_ids)))
            self._expect("ready", _START_TIMEOUT_S)
        except BaseException:
            theirs.close()
            self.close()
            raise
        finally:
            os.unlink(path)  # both processes hold the mapping; the name is not needed any more
        self._seq, self._last_post = 0, 0.0

    @property
    def buffer_address_and_size(self) -> tuple[int, int]:
        """Where the shared buffer lives in this process (the runner pins it for uploads and the stream gate)."""
        return self.shared.header.ctypes.data, len(self._mmap)

    def add(self, slot: int, source: str) -> bool:
        """Give ``slot`` a fresh matcher for grammar ``source``; True when the grammar was compiled (not a
        copy of a cached one). EngineError with the compiler's message when it does not compile."""
        self._conn.send(("add", slot, source))
        return bool(self._expect("added", _STEP_TIMEOUT_S))

    def free(self, slot: int) -> None:
        try:
            self._conn.send(("free", slot))
        except OSError:  # the child is gone, and its matchers with it
            pass

    def post(self, consumes: list[tuple[int, int]], masks: list[tuple[int, int]]) -> int:
        """Start a step: advance ``consumes`` ((slot, token) pairs), then write the masks of ``masks`` ((row,
        slot) pairs) into ``shared.bitmask`` rows. Returns the step's number, which the child writes into the
        done word (the gate's ticket) once the masks are written."""
        shared = self.shared
        if len(consumes) > shared.max_rows or len(masks) > shared.max_rows:
            raise EngineError(f"a step with {max(len(consumes), len(masks))} constrained rows exceeds the grammar "
                              f"buffer's {shared.max_rows}")
        if consumes:
            shared.consume_slots[:len(consumes)], shared.consume_tokens[:len(consumes)] = zip(*consumes)
        if masks:
            shared.mask_rows[:len(masks)], shared.mask_slots[:len(masks)] = zip(*masks)
        shared.header[_NUM_CONSUME], shared.header[_NUM_MASK] = len(consumes), len(masks)
        self._seq = (self._seq + 1) % 2**31
        shared.header[_SEQ] = self._seq  # last: the child reads the lists once it sees the new number
        now = time.monotonic()
        if now - self._last_post > _SPIN_BEFORE_SLEEP_S / 2:  # the child may be napping: wake it now
            try:
                self._conn.send(("wake",))
            except OSError:  # the child is gone: wait() says so
                pass
        self._last_post = now
        return self._seq

    @property
    def done_word(self) -> np.ndarray:
        """[1] int32: the number of the last step whose masks are written."""
        return self.shared.header[_DONE:_DONE + 1]

    @property
    def alive(self) -> bool:
        return getattr(self, "_process", None) is not None and self._process.poll() is None

    def wait(self, seq: int) -> np.ndarray:
        """Wait until step ``seq`` is done; its consume statuses [num_consume] int32 (STATUS_*)."""
        header, started, spins = self.shared.header, time.monotonic(), 0
        while header[_DONE] != seq:
            spins += 1
            if spins % 256 == 0:
                if not self.alive:
                    raise EngineError("the grammar process died (constrained requests cannot continue)",
                                      code="grammar_process_died")
                if time.monotonic() - started > _STEP_TIMEOUT_S:  # stuck: it must not write masks late
                    self._process.kill()
                    raise EngineError("the grammar process did not answer", code="grammar_process_timeout")
                time.sleep(0)
        if header[_FAILED]:
            header[_FAILED] = 0
            self._expect("no message", 1.0)  # raises the child's error
        return self.shared.consume_status[:header[_NUM_CONSUME]].copy()

    def release_stream(self, seq: int) -> None:
        """Write ``seq`` into the done word from this side (the child died: the device must not wait forever)."""
        self.shared.header[_DONE] = seq

    def _expect(self, kind: str, timeout: float):
        if not self._conn.poll(timeout):
            raise EngineError(f"the grammar process did not answer ({kind})", code="grammar_process_timeout")
        reply = self._conn.recv()
        if reply[0] == "error":
            raise EngineError(reply[1], code=reply[2], param=reply[3] if len(reply) > 3 else None)
        if reply[0] != kind:
            raise EngineError(f"the grammar process answered {reply[0]!r}, not {kind!r}")
        return reply[1] if len(reply) > 1 else None

    def close(self) -> None:
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()
        else:
            self._conn.close()


def _stop_child(process: subprocess.Popen, conn: Connection) -> None:
    """Ask the child to stop, wait for it (kill it after 5 s) and reap it."""
    if process.poll() is None:
        try:
            conn.send(("stop",))
            process.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            process.kill()
            process.wait()
    conn.close()


# ---- the child ------------------------------------------------------------------------------------------------
def worker_main(conn: Connection) -> None:
    """The child's life: read its spec, build llguidance's tokenizer, then serve messages and steps until told
    to stop or the engine's end of the connection closes."""
    spec = WorkerSpec(**conn.recv())
    import llguidance

    with open(spec.buffer_path, "r+b") as file:
        buffer = mmap.mmap(file.fileno(), SharedStep.num_bytes(spec.max_rows, spec.words))
    shared = SharedStep(buffer, spec.max_rows, spec.words)
    try:
        tokenizer = llguidance.LLTokenizer(spec.tokenizer_json, n_vocab=spec.vocab_size,
                                           eos_token=list(spec.eos_token_ids) or None)
    except Exception as exc:  # noqa: BLE001 -- a tokenizer llguidance cannot read
        conn.send(("error", f"structured outputs are not available for this model's tokenizer: {exc}",
                   "structured_outputs_unsupported"))
        return
    matchers = _Matchers(tokenizer, llguidance)
    executor = llguidance.LLExecutor(num_threads=1)
    last_seq, last_step, spins = int(shared.header[_SEQ]), time.monotonic(), 0  # before "ready": no step yet
    conn.send(("ready",))
    while True:
        seq = int(shared.header[_SEQ])
        if seq == last_seq:  # poll: a step follows the last one within milliseconds while requests run
            spins += 1
            idle = time.monotonic() - last_step
            napping = idle > _SPIN_BEFORE_SLEEP_S  # then wake at a tenth of the gap so far (a message wakes at once)
            if (napping or spins % _SPINS_PER_MESSAGE_POLL == 0) and not _serve_messages(
                    conn, matchers, timeout=min(idle / 10, _MAX_NAP_S) if napping else 0):
                return
            continue
        if not _serve_messages(conn, matchers, timeout=0):  # adds and frees sent before this step
            return
        try:
            _run_step(shared, matchers, executor)
        except Exception:  # noqa: BLE001 -- reported to the engine, which fails the step
            shared.header[_FAILED] = 1
            conn.send(("error", f"the grammar process failed: {traceback.format_exc(limit=3)}", "grammar_failed"))
        shared.header[_DONE] = seq
        last_seq, last_step = seq, time.monotonic()


def _serve_messages(conn, matchers: _Matchers, timeout: float) -> bool:
    """Apply the messages waiting (waiting ``timeout`` for the first); False when told to stop or orphaned."""
    try:
        while conn.poll(timeout):
            timeout = 0
            message = conn.recv()
            if message[0] == "stop":
                return False
            if message[0] == "add":
                _, slot, source = message
                try:
                    conn.send(("added", matchers.add(slot, source)))
                except EngineError as exc:
                    conn.send(("error", str(exc), exc.code, "structured_outputs"))
            elif message[0] == "free":
                matchers.free(message[1])
            # "wake": nothing to do, it only ended a nap
    except (EOFError, OSError):
        return False
    return True


def _run_step(shared: SharedStep, matchers: _Matchers, executor) -> None:
    num_consume, num_mask = int(shared.header[_NUM_CONSUME]), int(shared.header[_NUM_MASK])
    for i in range(num_consume):
        matcher = matchers.slots[int(shared.consume_slots[i])]
        if not matcher.consume_token(int(shared.consume_tokens[i])):
            shared.consume_status[i] = STATUS_REJECTED
        else:
            shared.consume_status[i] = STATUS_STOPPED if matcher.is_stopped() else STATUS_OK
    if num_mask:
        # a stopped or broken matcher's mask allows only EOS
        rows = [(matchers.slots[int(s)], int(r)) for r, s in zip(shared.mask_rows[:num_mask],
                                                                   shared.mask_slots[:num_mask])]
        address = shared.bitmask.ctypes.data
        executor.unsafe_compute_mask_ptr(rows, address, shared.words * 4, shared.max_rows)


class _Matchers:
    """The child's matchers by slot, and an LRU of compiled grammars to copy from."""

    def __init__(self, tokenizer, llguidance):
        self._tokenizer, self._llguidance = tokenizer, llguidance
        self.slots: dict[int, object] = {}
        self._templates: OrderedDict[str, object] = OrderedDict()

    def add(self, slot: int, source: str) -> bool:
        template = self._templates.get(source)
        compiled = template is None
        if compiled:
            matcher_class = self._llguidance.LLMatcher
            is_error, messages = matcher_class.validate_grammar_with_warnings(source, self._tokenizer)
            if is_error:
                raise EngineError(f"the grammar cannot be compiled: {_first_line(messages)}")
            template = matcher_class(self._tokenizer, source, log_level=0)
            if template.is_error():
                raise EngineError(f"the grammar cannot be compiled: {_first_line([template.get_error()])}")
            self._templates[source] = template
            while len(self._templates) > GRAMMAR_CACHE_SIZE:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(source)
        self.slots[slot] = template.deep_copy()
        return compiled

    def free(self, slot: int) -> None:
        self.slots.pop(slot, None)


def _first_line(messages: list[str]) -> str:
    text = " ".join(messages).strip()
    return text.splitlines()[0] if text else "unknown error"


if __name__ == "__main__":
    worker_main(Connection(int(sys.argv[1])))
