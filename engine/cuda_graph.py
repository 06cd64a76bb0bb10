"""CUDA graphs for decode steps: one graph per padded batch size, replayed instead of ~10 launches per layer.

A decode step of a small model is launch-bound: SmolLM2-135M runs ~15 kernels in each of 30 layers, and eager
PyTorch spends ~17 ms of Python per step on them (BENCHMARKS.md). A captured graph replays all launches with
one call. Graphs bake in tensor addresses and shapes, so the step's inputs are copied into static buffers sized
for the largest batch, a batch is padded up to the next captured size (padding rows write to slot -1, which the
cache kernel skips, and attend to one token of block 0), and the KV cache tensors must stay put while the
graphs live. Sizes follow vLLM: 1, 2, 4, then multiples of 8 up to ``max_num_seqs``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from engine.forward_batch import ForwardBatch

log = logging.getLogger("pagoda.graphs")


def capture_sizes(max_batch: int) -> list[int]:
    """Padded decode batch sizes to capture, ascending, up to the first one >= ``max_batch``.

    Dense where padding would cost a large share of a small batch, sparse beyond 32 rows: a padding row costs
    one token of attention and its share of the matmuls, whose weight reads dominate a large batch anyway.
    Each size costs a warm-up forward and a capture at start-up (ten sizes for 128 rows).
    """
    sizes = []
    for size in [1, 2, 4, 8, 16, 24, 32, 48, 64, 96] + list(range(128, max(max_batch, 128) + 32, 32)):
        sizes.append(size)
        if size >= max_batch:
            break
    return sizes


@dataclass
class DecodeInputs:
    """One decode step's inputs on the host (numpy), for ``num_seqs`` real sequences."""

    input_ids: np.ndarray  # [num_seqs] int64
    positions: np.ndarray  # [num_seqs] int64
    slot_mapping: np.ndarray  # [num_seqs] int64
    context_lens: np.ndarray  # [num_seqs] int32
    block_tables: np.ndarray  # [num_seqs, width] int32, width <= max_blocks

    @property
    def num_seqs(self) -> int:
        return self.input_ids.shape[0]


class StaticDecodeBuffers:
    """Device tensors a graph reads, and pinned host twins so one step costs two small host->device copies."""

    def __init__(self, max_batch: int, max_blocks: int, device: torch.device):
        self.max_batch, self.max_blocks = max_batch, max_blocks
        # int64 rows: input_ids, positions, slot_mapping; int32: context_lens then the flattened block tables
        self.i64 = torch.zeros((3, max_batch), dtype=torch.int64, device=device)
        self.i32 = torch.zeros(max_batch + max_batch * max_blocks, dtype=torch.int32, device=device)
        self.host_i64 = torch.zeros((3, max_batch), dtype=torch.int64, pin_memory=True)
        self.host_i32 = torch.zeros(self.i32.shape[0], dtype=torch.int32, pin_memory=True)
        self.block_tables = self.i32[max_batch:].view(max_batch, max_blocks)  # [max_batch, max_blocks]
        self.logits_rows = torch.arange(max_batch, device=device)  # [max_batch] int64
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)  # one token each

    def batch(self, size: int) -> ForwardBatch:
        """The static ForwardBatch a graph of ``size`` rows is captured with (views into the buffers)."""
        return ForwardBatch(
            input_ids=self.i64[0, :size], positions=self.i64[1, :size], slot_mapping=self.i64[2, :size],
            block_tables=self.block_tables[:size], query_start_loc=self.query_start_loc[:size + 1],
            context_lens=self.i32[:size], logits_indices=self.logits_rows[:size], is_decode=True)

    def load(self, inputs: DecodeInputs, size: int) -> None:
        """Copy a step's inputs in, padding rows ``num_seqs..size`` as harmless dummies."""
        n, width = inputs.num_seqs, inputs.block_tables.shape[1]
        host64 = self.host_i64.numpy()
        host64[0, :n], host64[1, :n], host64[2, :n] = inputs.input_ids, inputs.positions, inputs.slot_mapping
        host64[:2, n:size], host64[2, n:size] = 0, -1
        host32 = self.host_i32.numpy()
        host32[:n], host32[n:size] = inputs.context_lens, 1
        tables = host32[self.max_batch:].reshape(self.max_batch, self.max_blocks)
        tables[:n, :width] = inputs.block_tables
        tables[n:size, 0] = 0
        self.i64[:, :size].copy_(self.host_i64[:, :size], non_blocking=True)
        # context lens + the table rows in use: one contiguous prefix would include unused rows, so two copies
        self.i32[:size].copy_(self.host_i32[:size], non_blocking=True)
        self.block_tables[:size].copy_(
            self.host_i32[self.max_batch:self.max_batch + size * self.max_blocks].view(size, self.max_blocks),
            non_blocking=True)


class DecodeGraphs:
    """Captured decode forwards for each padded batch size; ``run`` replays the smallest one that fits."""

    def __init__(self, model, max_batch: int, max_blocks: int, device: torch.device):
        self.model, self.device = model, device
        self.sizes = capture_sizes(max_batch)
        self.buffers = StaticDecodeBuffers(self.sizes[-1], max_blocks, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # size -> static [size, vocab] float32 output
        self.pool_bytes = 0
        self.capture_seconds = 0.0
        self.replays = 0

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def capture(self) -> None:
        """Warm up (Triton compiles and autotunes outside the capture), then capture largest first so the
        smaller graphs reuse the largest one's memory pool."""
        start = time.perf_counter()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # so the reserved-memory difference below is the graphs' pool alone
        before = torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        self.buffers.load(self._dummy_inputs(), self.max_batch)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                batch = self.buffers.batch(size)
                self.model.forward(batch)  # compiles and autotunes the kernels for this size
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.logits[size] = self.model.forward(batch)
                self.graphs[size] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # drop what the warm-ups left in the general pool
        self.pool_bytes = torch.cuda.memory_reserved(self.device) - before
        self.capture_seconds = time.perf_counter() - start
        log.info("captured %d decode graphs (batch 1..%d) in %.2f s, %.1f MiB", len(self.graphs), self.max_batch,
                 self.capture_seconds, self.pool_bytes / 2**20)

    def run(self, inputs: DecodeInputs) -> torch.Tensor:
        """Replay the graph for this batch; returns logits [num_seqs, vocab] float32 (a view of static memory,
        valid until the next replay)."""
        n = inputs.num_seqs
        size = next(s for s in self.sizes if s >= n)
        self.buffers.load(inputs, size)
        self.graphs[size].replay()
        self.replays += 1
        return self.logits[size][:n]

    def fits(self, num_seqs: int, width: int) -> bool:
        return num_seqs <= self.max_batch and width <= self.buffers.max_blocks

    def _dummy_inputs(self) -> DecodeInputs:
        n = self.max_batch
        zeros = np.zeros(n, dtype=np.int64)
        return DecodeInputs(zeros, zeros, np.full(n, -1, dtype=np.int64), np.ones(n, dtype=np.int32),
                            np.zeros((n, 1), dtype=np.int32))
