"""CUDA graphs for small steps: one captured forward per padded shape, replayed instead of ~15 launches a layer.

A step that moves few tokens is launch-bound: eager PyTorch + Triton spends ~0.7 ms of host time per layer
(23 ms for a 32-layer 7B forward, BENCHMARKS.md) while the GPU needs 3.5 ms. A captured graph replays all
launches with one call. Graphs bake in tensor addresses and shapes, so a step's inputs are copied into static
buffers and the step is padded up to a captured shape. Two families share one memory pool:

- decode graphs, one per padded batch size (1, 2, 4, 8, 16, 24, 32, 48, ...): one new token per sequence, the
  split-KV decode attention kernel; padding rows write to slot -1 (skipped) and attend to one token of block 0;
- ragged graphs, one per padded token count (16 .. 512): any mix of prefill chunks and decodes over at most
  ``max_num_seqs`` sequences through the prefill attention kernel; sequences beyond the real ones have no
  query rows and padding tokens belong to no sequence, so the kernels skip both. This is what makes a
  prefix-cache hit or a short chat turn cost a few milliseconds instead of an eager forward.

Larger steps run eagerly: their GPU time exceeds the host's launch time, so launches overlap with work.
The KV cache tensors must stay put while the graphs live.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from engine.forward_batch import ForwardBatch
from engine.host_to_device import to_device

log = logging.getLogger("pagoda.graphs")

RAGGED_TOKEN_SIZES = (16, 32, 64, 128, 256, 512)


def capture_sizes(max_batch: int) -> list[int]:
    """Padded decode batch sizes to capture, ascending, up to the first one >= ``max_batch``.

    Dense where padding would cost a large share of a small batch, sparse beyond 32 rows: a padding row costs
    one token of attention and its share of the matmuls, whose weight reads dominate a large batch anyway.
    """
    sizes = []
    for size in [1, 2, 4, 8, 16, 24, 32, 48, 64, 96] + list(range(128, max(max_batch, 128) + 32, 32)):
        sizes.append(size)
        if size >= max_batch:
            break
    return sizes


def ragged_sizes(max_tokens: int) -> list[int]:
    """Padded token counts of the ragged graphs: those of RAGGED_TOKEN_SIZES within the step's token budget."""
    return [s for s in RAGGED_TOKEN_SIZES if s <= max_tokens] or [RAGGED_TOKEN_SIZES[0]]


@dataclass
class StepInputs:
    """One step's inputs on the host: ``num_tokens`` new tokens of ``num_seqs`` sequences (numpy arrays)."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [S + 1] int32
    context_lens: np.ndarray  # [S] int32
    block_tables: np.ndarray  # [S, W] int32
    logits_indices: np.ndarray  # [num_sampled] int64
    is_decode: bool

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @property
    def width(self) -> int:
        return self.block_tables.shape[1]

    def to_batch(self, device: torch.device) -> ForwardBatch:
        """Device tensors for an eager forward."""
        return ForwardBatch(input_ids=to_device(self.input_ids, device),
                            positions=to_device(self.positions, device),
                            slot_mapping=to_device(self.slot_mapping, device),
                            block_tables=to_device(self.block_tables, device),
                            query_start_loc=to_device(self.query_start_loc, device),
                            context_lens=to_device(self.context_lens, device),
                            logits_indices=to_device(self.logits_indices, device), is_decode=self.is_decode)


class _Region:
    """A device tensor with a pinned host twin: values are staged in ``host`` (numpy view), ``send`` copies
    the first rows over without blocking."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.device_tensor = torch.zeros(shape, dtype=dtype, device=device)
        self.host_tensor = torch.zeros(shape, dtype=dtype, pin_memory=device.type == "cuda")
        self.host = self.host_tensor.numpy()

    def send(self, rows: int) -> None:
        self.device_tensor[:rows].copy_(self.host_tensor[:rows], non_blocking=True)


class StaticBuffers:
    """The tensors the graphs read, sized for the largest step any graph covers."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device):
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        self.input_ids = _Region((max_tokens,), torch.int64, device)
        self.positions = _Region((max_tokens,), torch.int64, device)
        self.slot_mapping = _Region((max_tokens,), torch.int64, device)
        self.query_start_loc = _Region((max_seqs + 1,), torch.int32, device)
        self.context_lens = _Region((max_seqs,), torch.int32, device)
        self.block_tables = _Region((max_seqs, max_blocks), torch.int32, device)
        self.logits_indices = _Region((max_seqs,), torch.int64, device)
        self._sent: torch.cuda.Event | None = None  # recorded after the last step's copies were queued

    def batch(self, num_tokens: int, num_seqs: int, is_decode: bool) -> ForwardBatch:
        """The static ForwardBatch a graph is captured with (views into the buffers)."""
        return ForwardBatch(
            input_ids=self.input_ids.device_tensor[:num_tokens],
            positions=self.positions.device_tensor[:num_tokens],
            slot_mapping=self.slot_mapping.device_tensor[:num_tokens],
            block_tables=self.block_tables.device_tensor[:num_seqs],
            query_start_loc=self.query_start_loc.device_tensor[:num_seqs + 1],
            context_lens=self.context_lens.device_tensor[:num_seqs],
            logits_indices=self.logits_indices.device_tensor[:num_seqs], is_decode=is_decode)

    def load(self, inputs: StepInputs, num_tokens: int, num_seqs: int) -> None:
        """Stage a step padded to ``num_tokens`` tokens and ``num_seqs`` sequences, then copy it over. The
        host staging is reused: a step launched ahead of the previous one's tokens first waits until that
        step's copies have left it (the copies run when the device reaches them)."""
        if self._sent is not None:
            self._sent.synchronize()
        t, s, w, n = inputs.num_tokens, inputs.num_seqs, inputs.width, inputs.logits_indices.shape[0]
        self.input_ids.host[:t], self.input_ids.host[t:num_tokens] = inputs.input_ids, 0
        self.positions.host[:t], self.positions.host[t:num_tokens] = inputs.positions, 0
        self.slot_mapping.host[:t], self.slot_mapping.host[t:num_tokens] = inputs.slot_mapping, -1
        qsl = self.query_start_loc.host
        if inputs.is_decode:  # padding rows are one-token sequences of their own
            qsl[:num_seqs + 1] = np.arange(num_seqs + 1)
        else:  # padding sequences own no rows; padding tokens belong to no sequence
            qsl[:s + 1], qsl[s + 1:num_seqs + 1] = inputs.query_start_loc, t
        self.context_lens.host[:s], self.context_lens.host[s:num_seqs] = inputs.context_lens, 1
        self.block_tables.host[:s, :w] = inputs.block_tables
        self.block_tables.host[s:num_seqs, 0] = 0
        self.logits_indices.host[:n], self.logits_indices.host[n:num_seqs] = inputs.logits_indices, 0
        for region, rows in zip(self.regions(), (num_tokens, num_tokens, num_tokens, num_seqs + 1, num_seqs,
                                                  num_seqs, num_seqs)):
            region.send(rows)
        if self.input_ids.device_tensor.is_cuda:
            self._sent = torch.cuda.Event()
            self._sent.record()

    def regions(self) -> tuple[_Region, ...]:
        return (self.input_ids, self.positions, self.slot_mapping, self.query_start_loc, self.context_lens,
                self.block_tables, self.logits_indices)


class StepGraphs:
    """Captured forwards for decode batch sizes and ragged token counts; ``run`` replays the one that fits."""

    def __init__(self, model, max_seqs: int, max_tokens: int, max_blocks: int, device: torch.device,
                 stream: torch.cuda.Stream):
        """``stream``: the side stream to capture on. Pass the same one to every capture of a process: cuBLAS
        keeps a workspace per stream it runs on, which a new stream would allocate again."""
        self.model, self.device, self.stream = model, device, stream
        self.decode_sizes = capture_sizes(max_seqs)
        self.max_seqs = max_seqs
        self.ragged_sizes = ragged_sizes(max_tokens)
        # decode_sizes[-1] >= max_seqs: the last decode size covers both families' sequence counts
        self.buffers = StaticBuffers(max(self.decode_sizes[-1], self.ragged_sizes[-1]), self.decode_sizes[-1],
                                     max_blocks, device)
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        # every graph copies its logits into this one buffer, so no graph keeps an output of its own alive in
        # the pool (17 held outputs took 0.35 GiB on a 7B model's 32k vocabulary)
        self.logits = torch.empty((self.buffers.max_seqs, model.config.vocab_size), dtype=torch.float32,
                                  device=device)  # [max rows, vocab]
        self.pool_bytes = 0
        self.capture_seconds = 0.0
        self.replays = {"decode": 0, "ragged": 0}

    def capture(self) -> None:
        """Warm up each shape once (Triton compiles and autotunes outside the capture), then capture it; the
        largest shapes first so the smaller ones reuse their memory in the shared pool."""
        start = time.perf_counter()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # so the reserved-memory difference below is the graphs' pool alone
        before = torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        shapes = [("ragged", t) for t in reversed(self.ragged_sizes)]
        shapes += [("decode", s) for s in reversed(self.decode_sizes)]
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for kind, size in shapes:
                t0 = time.perf_counter()
                batch = self._captured_batch(kind, size)
                self.model.forward(batch)  # compiles and autotunes the kernels for this shape
                t1 = time.perf_counter()
                graph = torch.cuda.CUDAGraph()
                rows = batch.logits_indices.shape[0]
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.logits[:rows].copy_(self.model.forward(batch))
                self.graphs[kind, size] = graph
                log.debug("graph %s %d: warm-up %.3f s (host: compile, autotune), capture %.3f s", kind, size,
                          t1 - t0, time.perf_counter() - t1)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self._replay_each_once()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # drop what the warm-ups left in the general pool
        static = sum(r.device_tensor.numel() * r.device_tensor.element_size() for r in self.buffers.regions())
        self.pool_bytes = torch.cuda.memory_reserved(self.device) - before + static + \
            self.logits.numel() * self.logits.element_size()
        self.capture_seconds = time.perf_counter() - start
        log.info("captured %d CUDA graphs (decode batch 1..%d, ragged steps of 16..%d tokens) in %.2f s, %.1f MiB",
                 len(self.graphs), self.decode_sizes[-1], self.ragged_sizes[-1], self.capture_seconds,
                 self.pool_bytes / 2**20)

    def _replay_each_once(self) -> None:
        """Launch every graph once on its dummy inputs: a graph's first launch uploads it to the device, which
        would otherwise fall on the first request of that size.

        Each first launch is waited for before the next. Queued back to back, the 20 first launches of a
        Llama-3-8B-shape AWQ engine (max_num_seqs 256) crashed the process inside the driver's cuGraphLaunch
        (SIGSEGV, driver 580, H200; BENCHMARKS.md, issue 16 session 11); with a wait after each, or any one
        graph launched alone, they ran. Serving never queues more than one step's graph."""
        for kind, size in self.graphs:
            self._captured_batch(kind, size)  # stage the shape's harmless inputs (no KV slot is written)
            log.debug("first replay of graph %s %d", kind, size)  # the last line before a crash names the graph
            self.graphs[kind, size].replay()
            torch.cuda.synchronize(self.device)

    def shape_for(self, inputs: StepInputs) -> tuple[str, int] | None:
        """The captured shape that covers this step, or None (run it eagerly)."""
        if inputs.width > self.buffers.max_blocks:
            return None
        if inputs.is_decode and inputs.num_seqs <= self.decode_sizes[-1]:
            return "decode", next(s for s in self.decode_sizes if s >= inputs.num_seqs)
        if inputs.num_seqs <= self.max_seqs and inputs.num_tokens <= self.ragged_sizes[-1]:
            return "ragged", next(t for t in self.ragged_sizes if t >= inputs.num_tokens)
        return None

    def run(self, inputs: StepInputs, shape: tuple[str, int], input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Replay ``shape`` (from ``shape_for``) on this step; returns logits [num_sampled, vocab] float32, a
        view of static memory valid until the next replay. ``input_ids`` [num_tokens] on the device replace
        the host's (a step scheduled ahead: its tokens are the previous step's samples)."""
        kind, size = shape
        rows = size if kind == "decode" else self.max_seqs
        self.buffers.load(inputs, size, rows)
        if input_ids is not None:
            self.buffers.input_ids.device_tensor[:input_ids.shape[0]].copy_(input_ids)
        self.graphs[shape].replay()
        self.replays[kind] += 1
        return self.logits[:inputs.logits_indices.shape[0]]

    def _captured_batch(self, kind: str, size: int) -> ForwardBatch:
        """Stage harmless dummy inputs for a shape and return its static batch."""
        rows = size if kind == "decode" else self.max_seqs
        one = np.ones(1, dtype=np.int32)
        if kind == "decode":
            dummy = StepInputs(np.zeros(1, np.int64), np.zeros(1, np.int64), np.full(1, -1, np.int64),
                               np.array([0, 1], np.int32), one, np.zeros((1, 1), np.int32),
                               np.zeros(1, np.int64), True)
        else:  # one sequence owning all tokens, so the warm-up runs every kernel at full size
            dummy = StepInputs(np.zeros(size, np.int64), np.arange(size, dtype=np.int64),
                               np.full(size, -1, np.int64), np.array([0, size], np.int32),
                               np.array([size], np.int32), np.zeros((1, self.buffers.max_blocks), np.int32),
                               np.array([size - 1], np.int64), False)
        self.buffers.load(dummy, size, rows)
        return self.buffers.batch(size, rows, is_decode=kind == "decode")
