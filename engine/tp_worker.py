"""Tensor-parallel workers: ranks 1..N-1, each in a process of its own, started, fed and stopped by rank 0.

Rank 0 stays in the engine process: its ModelRunner sizes the KV cache, schedules and samples as with one device.
For every step it sends the step's host inputs (``StepInputs``, a few small numpy arrays) once to each worker
over a pipe; every rank then runs the same forward on its shard and meets the others in the collectives of
engine/parallel.py. The pipe, not a collective, carries the inputs so an idle worker may wait for the next step
as long as the server is idle (collectives time out) and learns of a vanished driver at once (EOF).

Failure: a worker that dies makes rank 0's next collective raise (gloo sees the closed peer at once; otherwise
after the collective timeout) or its next send fail; ``TPWorkers`` then turns into a failed state whose error
every later step raises, so requests end with an error instead of hanging. ``stop`` ends the workers.
"""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import EngineArgs
from engine.cuda_graph import StepInputs
from engine.errors import EngineError, EngineStepError
from engine.parallel import TPGroup, join_store, make_store

log = logging.getLogger("pagoda.tp")

STOP_SECONDS = 5.0  # a worker asked to stop is killed after this long


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to load its shard (pickled to the spawned process)."""

    rank: int
    world_size: int
    port: int  # rank 0's TCPStore
    model_dir: str
    device: str
    dtype: torch.dtype
    max_model_len: int
    args: EngineArgs


@dataclass(frozen=True)
class AllocateKV:
    """Allocate the KV cache: the same blocks as rank 0, this rank's KV heads."""

    num_blocks: int
    block_size: int


@dataclass(frozen=True)
class ProfileForward:
    """Take part in rank 0's memory-profiling forward of ``num_tokens`` prompt tokens (into a scratch KV)."""

    num_tokens: int
    block_size: int


@dataclass(frozen=True)
class RunStep:
    """One step: the copy-on-write block pairs, then the forward over ``inputs`` (None: nothing scheduled)."""

    inputs: StepInputs | None
    copy_on_write: list[tuple[int, int]]


@dataclass(frozen=True)
class StopWorker:
    """End the loop and the process."""


Message = AllocateKV | ProfileForward | RunStep | StopWorker


def worker_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: the next CUDA devices after rank 0's, or the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


# ---- the worker process --------------------------------------------------------------------------------------
def worker_main(spec: WorkerSpec, conn) -> None:
    """Entry point of a spawned worker: join the group, load the shard, report, then serve messages."""
    try:
        model, device = _load_shard(spec)
    except EngineError as exc:
        conn.send(("error", exc.message, exc.param))
        return
    except BaseException as exc:  # noqa: BLE001 -- reported to rank 0, which raises it
        conn.send(("error", f"rank {spec.rank}: {type(exc).__name__}: {exc}", None))
        return
    conn.send(("ready", model.weight_bytes()))
    _serve(model, conn, device, spec.dtype)


def _load_shard(spec: WorkerSpec):
    from engine.model_loader import load_model
    from kernels.ops import Backend

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))  # the ranks share the host's cores
    device = worker_device(torch.device(spec.device), spec.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = TPGroup.create(join_store(spec.port, spec.world_size), spec.rank, spec.world_size, device)
    backend = Backend.for_device(device, force_reference=spec.args.force_reference_kernels)
    model = load_model(Path(spec.model_dir), device, spec.dtype, backend, max_positions=spec.max_model_len,
                       fuse_decode=False, tp=group, lm_head_quantization=spec.args.lm_head_quantization)
    return model, device


def _serve(model, conn, device: torch.device, dtype: torch.dtype) -> None:
    """Run rank 0's messages until StopWorker or until rank 0 is gone (EOF on the pipe)."""
    from engine.model_runner import allocate_kv_cache, copy_blocks, profile_forward

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        match message:
            case StopWorker():
                return
            case AllocateKV(num_blocks, block_size):
                kv_caches = allocate_kv_cache(model.config, num_blocks, block_size, device, dtype)
                model.bind_kv_caches(kv_caches)
            case ProfileForward(num_tokens, block_size):
                profile_forward(model, num_tokens, block_size, device, dtype)
            case RunStep(inputs, copy_on_write):
                copy_blocks(kv_caches, copy_on_write, device)
                if inputs is not None:
                    model.forward(inputs.to_batch(device))


# ---- rank 0's handle -----------------------------------------------------------------------------------------
class TPWorkers:
    """Rank 0's handle on the worker processes: start them, send each step, notice a dead one, stop them."""

    def __init__(self, processes: list, conns: list, store):
        self.processes, self.conns, self.store = processes, conns, store
        self.failed: str | None = None  # once set, every later step raises EngineStepError(failed)

    @staticmethod
    def start(args: EngineArgs, model_dir: Path, device: torch.device, dtype: torch.dtype,
              max_model_len: int) -> tuple[TPWorkers, TPGroup]:
        """Spawn ranks 1..N-1 and join the group with them as rank 0; returns the handle and rank 0's group."""
        world_size = args.tensor_parallel_size
        if device.type == "cuda" and (device.index or 0) + world_size > torch.cuda.device_count():
            raise EngineError(f"--tensor-parallel-size {world_size} needs {world_size} GPUs from {device}; "
                              f"{torch.cuda.device_count()} are visible", param="tensor_parallel_size")
        store = make_store(world_size)
        context = multiprocessing.get_context("spawn")  # fork would copy this process's threads and CUDA state
        processes, conns = [], []
        for rank in range(1, world_size):
            spec = WorkerSpec(rank, world_size, store.port, str(model_dir), str(device), dtype, max_model_len, args)
            parent, child = context.Pipe()
            process = context.Process(target=worker_main, args=(spec, child), name=f"pagoda-tp-rank{rank}",
                                      daemon=True)
            process.start()
            child.close()
            processes.append(process)
            conns.append(parent)
        workers = TPWorkers(processes, conns, store)
        try:
            group = workers._join(world_size, device)
        except BaseException:
            workers.stop()
            raise
        return workers, group

    def _join(self, world_size: int, device: torch.device) -> TPGroup:
        """Rank 0's side of the rendezvous, on a thread so a worker that dies before joining is noticed."""
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagoda-tp-join")
        future = pool.submit(TPGroup.create, self.store, 0, world_size, device)
        pool.shutdown(wait=False)
        while True:
            try:
                return future.result(timeout=0.1)
            except concurrent.futures.TimeoutError:
                self._raise_if_dead(EngineError)

    def wait_ready(self) -> list[int]:
        """Each worker's weight bytes once it has loaded its shard; its load error, raised, if it failed."""
        sizes = []
        for rank, conn in enumerate(self.conns, start=1):
            while not conn.poll(0.1):
                self._raise_if_dead(EngineError)
            status, *rest = conn.recv()
            if status == "error":
                message, param = rest
                raise EngineError(message, param=param)
            sizes.append(rest[0])
        return sizes

    def dead(self) -> list[str]:
        return [f"rank {rank} (pid {p.pid}, exit code {p.exitcode})"
                for rank, p in enumerate(self.processes, start=1) if not p.is_alive()]

    def _raise_if_dead(self, error_type: type[Exception]) -> None:
        dead = self.dead()
        if dead:
            raise error_type(f"tensor-parallel worker {', '.join(dead)} exited")

    def send(self, message: Message) -> None:
        """Send ``message`` to every worker; raises EngineStepError when the group has failed."""
        if self.failed is None and self.dead():
            self.failed = f"tensor-parallel worker {', '.join(self.dead())} exited; reload the model"
        if self.failed is not None:
            raise EngineStepError(self.failed)
        try:
            for conn in self.conns:
                conn.send(message)
        except (OSError, EOFError) as exc:
            raise self.failure(exc) from exc

    def failure(self, exc: BaseException) -> EngineStepError:
        """The error of a step that failed on rank 0 (a collective raised, a pipe broke); the group stays
        failed. A collective that saw a worker die can raise before the process has fully exited."""
        deadline = time.monotonic() + 1.0
        while not self.dead() and time.monotonic() < deadline:
            time.sleep(0.02)
        dead = self.dead()
        cause = f"worker {', '.join(dead)} exited" if dead else f"{type(exc).__name__}: {exc}"
        self.failed = f"tensor-parallel group failed ({cause}); reload the model"
        return EngineStepError(self.failed)

    def stop(self) -> None:
        """Ask every live worker to stop, kill those that do not within STOP_SECONDS, close the pipes."""
        for conn in self.conns:
            try:
                conn.send(StopWorker())
            except (OSError, EOFError, ValueError):
                pass
        deadline = time.monotonic() + STOP_SECONDS
        for process in self.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                log.warning("tensor-parallel worker %s did not stop; killing it", process.name)
                process.kill()
                process.join(timeout=STOP_SECONDS)
        for conn in self.conns:
            conn.close()
        self.conns = []
        self.failed = self.failed or "the tensor-parallel workers were stopped"

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]
