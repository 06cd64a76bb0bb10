"""Weights and KV tensors on the device: sizes the KV pool, builds ForwardBatches, runs forward + sampling."""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.block_table import BlockTableRows
from engine.config import EngineArgs, ModelConfig
from engine.cuda_graph import StepGraphs, StepInputs
from engine.errors import EngineError
from engine.fit import cpu_kv_cache_bytes, cuda_budget_bytes
from engine.forward_batch import ForwardBatch
from engine.host_to_device import to_device
from engine.memory import TorchPoolLimit, device_bytes_outside_torch
from engine.model_loader import load_model, read_config_dict
from engine.parallel import check_divides
from engine.request import Request
from engine.sampler import PendingSample, Sampler, SamplerOutput
from engine.stream_gate import StreamGate, register_host_memory, unregister_host_memory
from engine.structured_output import GrammarStep, TokenMasks
from engine.warmup import eager_seq_buckets, eager_step, sampler_trial_requests
from kernels.ops import Backend

log = logging.getLogger("pagoda.runner")

@dataclass(frozen=True)
class KVCacheLayout:
    num_blocks: int
    block_size: int
    bytes_per_block: int  # all layers, K and V

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size


@dataclass(frozen=True)
class MemoryProfile:
    """What the device budget went to when the KV pool was sized (bytes), as the driver counts the process:
    budget >= start_up_peak + outside_torch + kv_cache."""

    budget: int
    weights: int
    activation_peak: int  # measured: one forward at the full token budget (what the allocator reserved for it)
    kv_cache: int
    start_up_peak: int = 0  # torch's reserved peak over the trial start-up (weights included, no KV), measured,
    # plus one activation peak more: serving's eager steps vary in size, and the allocator's segments of one
    # size do not always serve another (7B AWQ under 24 GiB, a ShareGPT-like mix: torch's pool grew 72 MiB
    # past the trial's peak, BENCHMARKS.md issue 16 session 16)
    outside_torch: int = 0  # measured after the trial: the CUDA context, loaded kernels, graph executables
    torch_limit: int = 0  # what torch's caching allocator may hold for this engine while serving: the budget


@dataclass(frozen=True)
class TrialStartUp:
    """What ``ModelRunner._trial_start_up`` measured (bytes, seconds, counts)."""

    torch_peak: int  # torch's reserved peak, the scratch KV left out
    outside_torch: int  # device memory beside torch's pool while the trial's graphs were alive
    graphs: int  # CUDA graphs captured
    eager_forwards: int  # eager warm-up forwards run
    seconds: float
    stage_peaks: dict[str, int]  # torch's reserved peak in each stage (graphs, eager, sampler), no scratch KV


@dataclass
class PendingStep:
    """A launched step: ``result()`` waits for the sampled tokens of ``to_sample`` (None: nothing sampled).
    ``grammar`` is the step's grammar work in the grammar process (waited for here: its errors are raised here,
    and the engine reads which grammars completed). Without a stream gate, ``launch_sample`` queues the
    sampling once the masks are ready: it runs at ``result()``, so the masks are computed while the caller does
    its text work."""

    to_sample: list[Request]
    sample: PendingSample | None
    launch_sample: Callable[[], PendingSample] | None = None
    grammar: GrammarStep | None = None

    def result(self) -> tuple[list[Request], SamplerOutput | None]:
        if self.grammar is not None:
            self.grammar.finish()
        if self.launch_sample is not None:
            self.sample, self.launch_sample = self.launch_sample(), None
        return self.to_sample, (self.sample.result() if self.sample is not None else None)


class ModelRunner:
    """Owns the model and the paged KV cache for one engine. Several runners may live in one process."""

    def __init__(self, args: EngineArgs, model_dir: Path, device: torch.device, dtype: torch.dtype,
                 max_model_len: int):
        self.args, self.device, self.dtype = args, device, dtype
        self._mask_region: tuple[int, int] | None = None  # the grammar process's shared buffer (address, bytes)
        self._mask_pinned = False  # whether that buffer is registered with the driver
        self._mask_gate: StreamGate | None = None  # the stream gate on its done word
        self.backend = Backend.for_device(device, force_reference=args.force_reference_kernels)
        self.workers = None  # tensor parallel: ranks 1..N-1 (engine/tp_worker.py); this runner is rank 0
        self._threads_before: int | None = None  # CPU tensor parallel: torch threads to restore at release
        if args.tensor_parallel_size < 1:
            raise EngineError(f"--tensor-parallel-size must be at least 1, not {args.tensor_parallel_size}",
                              param="tensor_parallel_size")
        self._pool_limit = self._limit_torch_pool()
        started = time.perf_counter()
        try:
            if args.tensor_parallel_size > 1:
                self.model = self._load_tensor_parallel(model_dir, max_model_len)
            else:
                self.model = load_model(model_dir, device, dtype, self.backend, max_positions=max_model_len,
                                        fuse_decode=args.fused_decode, x16_rows=args.x16_rows,
                                        lm_head_quantization=args.lm_head_quantization)
            self.load_seconds = time.perf_counter() - started
            self._size_and_allocate(max_model_len)
        except torch.OutOfMemoryError as error:
            self._give_back()
            raise EngineError(f"the model does not fit in its device memory budget of "
                              f"{self._budget_gib():.2f} GiB (--gpu-memory-limit / --gpu-memory-utilization): "
                              f"{str(error).splitlines()[0]}", param="gpu_memory_utilization") from None
        except BaseException:
            self._give_back()
            raise

    def _limit_torch_pool(self) -> TorchPoolLimit | None:
        """On a GPU, hold torch's caching allocator to the budget less what lies outside it (TorchPoolLimit says
        why) from the start: the load and the trial start-up count as much as serving. After the trial it is
        the budget itself (``_size_kv_cache`` says why); ``release`` (or garbage collection) gives it back."""
        if self.device.type != "cuda":
            return None
        gc.collect()  # engines dropped without release() give their shares back when collected: before this one
        limit = TorchPoolLimit(self.device)
        weakref.finalize(self, limit.release).atexit = False  # at exit nobody needs the room back
        limit.hold(cuda_budget_bytes(self.args, self.device) - device_bytes_outside_torch(self.device))
        return limit

    def _budget_gib(self) -> float:
        return cuda_budget_bytes(self.args, self.device) / 2**30

    def _give_back(self) -> None:
        """After a failed start: stop the workers, drop the limit this engine holds."""
        self._stop_workers()
        if self._pool_limit is not None:
            self._pool_limit.release()

    def _load_tensor_parallel(self, model_dir: Path, max_model_len: int):
        """Start the workers, load rank 0's shard while they load theirs, wait for them (their load errors
        are raised here); a failure stops them all."""
        from engine.tp_worker import TPWorkers

        size = self.args.tensor_parallel_size
        check_divides(ModelConfig.from_dict(read_config_dict(model_dir)), size)  # before any process starts
        self.workers, group = TPWorkers.start(self.args, model_dir, self.device, self.dtype, max_model_len)
        if self.device.type == "cpu":  # the ranks share the host's cores: oversubscribed threads spin and wait
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(max(1, self._threads_before // size))
        try:
            model = load_model(model_dir, self.device, self.dtype, self.backend, max_positions=max_model_len,
                               fuse_decode=self.args.fused_decode, tp=group,
                               lm_head_quantization=self.args.lm_head_quantization)
            self.workers.wait_ready()
        except BaseException:
            self._stop_workers()
            raise
        log.info("tensor parallel: %d ranks (worker pids %s)", size, self.workers.pids)
        return model

    def _stop_workers(self) -> None:
        if self.workers is not None:
            self.workers.stop()
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None

    def _size_and_allocate(self, max_model_len: int) -> None:
        """Size the KV pool after the weights (on a GPU: profiling one forward, then a trial start-up that
        measures everything else), allocate it, bind it."""
        args, device = self.args, self.device
        self._release_cached_blocks()  # loading's temporaries (checkpoint tensors before the repack)
        self.config: ModelConfig = self.model.config
        self.max_model_len = max_model_len
        self.sampler = Sampler(seed=args.seed, backend=self.backend, max_rows=args.max_num_seqs)
        self.weight_bytes = self.model.weight_bytes()
        self.use_cuda_graphs = (device.type == "cuda" and self.backend.use_triton and not args.enforce_eager
                                and self.workers is None)  # graphs do not capture the all-reduce yet
        self.graphs: StepGraphs | None = None
        self.trial: TrialStartUp | None = None  # on a GPU: what start-up adds besides the KV pool, measured
        self._capture_stream: torch.cuda.Stream | None = None  # one for every capture (StepGraphs says why)
        started = time.perf_counter()
        self.layout, self.memory_profile = self._size_kv_cache(max_model_len)
        self.kv_caches = self._bind_kv(self.layout.num_blocks)
        self.sizing_seconds = time.perf_counter() - started
        log.info("weights loaded in %.2f s (%.2f GiB); KV cache sized (profiling forward, trial start-up) and "
                 "allocated in %.2f s", self.load_seconds, self.weight_bytes / 2**30, self.sizing_seconds)
        self.block_rows = BlockTableRows(self._max_blocks(max_model_len))

    def _release_cached_blocks(self) -> None:
        """Return the caching allocator's free blocks to the driver before the next big allocation. Otherwise
        the KV pool is allocated next to the freed blocks of loading and profiling, which it cannot reuse (other
        sizes), and the process's reserved memory peaked at 1.032 x its --gpu-memory-limit (7B AWQ, 24 GiB)."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _max_blocks(self, max_model_len: int) -> int:
        return -(-max_model_len // self.args.block_size)

    @property
    def cuda_graph_pool_bytes(self) -> int:
        return self.graphs.pool_bytes if self.graphs else 0

    def prepare(self, max_model_len: int) -> None:
        """Take the engine's fitted max_model_len (the KV pool may cap the model's own): size the host block
        tables for it, and capture CUDA graphs for decode batches up to max_num_seqs and small ragged steps
        (after the KV cache exists: graphs keep its addresses) unless on CPU, with the reference kernels, or
        under --enforce-eager."""
        self.max_model_len = max_model_len
        max_blocks = self._max_blocks(max_model_len)
        self.block_rows = BlockTableRows(max_blocks)
        if not self.use_cuda_graphs:
            return
        self.graphs = self._capture_graphs(max_blocks)

    def _capture_graphs(self, max_blocks: int) -> StepGraphs:
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(self.device)
        graphs = StepGraphs(self.model, self.args.max_num_seqs, self.args.max_num_batched_tokens, max_blocks,
                            self.device, self._capture_stream)
        graphs.capture()
        return graphs

    def _eager_warm_up_forwards(self) -> int:
        """Run one eager forward at the full token budget per sequence-count bucket, so the kernel variants of
        long prefill chunks and mixed steps are compiled before serving (engine/warmup.py says why); returns
        how many ran. Nothing to do on CPU or with the reference kernels."""
        if self.device.type != "cuda" or not self.backend.use_triton:
            return 0
        from kernels.triton.prefill_attention import SEQ_BLOCK_FLOOR

        num_tokens = min(self.args.max_num_batched_tokens, self.max_model_len)
        if self.graphs is not None and num_tokens <= self.graphs.ragged_sizes[-1]:
            return 0  # every ragged step fits a graph, all captured already
        buckets = [s for s in eager_seq_buckets(self.args.max_num_seqs, SEQ_BLOCK_FLOOR) if s <= num_tokens]
        for num_seqs in buckets:
            inputs = eager_step(num_tokens, num_seqs, self.args.block_size)
            self._send_step(inputs, [])
            self._forward(inputs)
        torch.cuda.synchronize(self.device)
        return len(buckets)

    # ---- KV cache sizing -------------------------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        return self.config.kv_bytes_per_token(self.dtype) * self.args.block_size

    def _size_kv_cache(self, max_model_len: int) -> tuple[KVCacheLayout, MemoryProfile]:
        per_block = self.bytes_per_block()
        if self.device.type == "cuda":
            budget, activation_peak = self._profile_cuda()
            self.trial = self._trial_start_up(max_model_len, activation_peak)
            peak, outside = self.trial.torch_peak + activation_peak, self.trial.outside_torch
            kv_budget = budget - peak - outside
            # torch may reserve up to the whole budget: the room of what lies outside it (~0.8 GiB, the CUDA
            # context and modules) is what fragmentation may take. Held at budget - outside, the sampler ran out
            # of memory while serving (20 MiB short, 112 MiB reserved but in partly used blocks; BENCHMARKS.md
            # issue 15, session 18), so the process may pass the budget by at most that room, not by 4.2 GiB
            self._pool_limit.hold(budget)
        else:
            kv_budget = cpu_kv_cache_bytes(self.args)
            budget, activation_peak, peak, outside = self.weight_bytes + kv_budget, 0, self.weight_bytes, 0
        num_blocks = kv_budget // per_block
        if num_blocks < 1:
            raise EngineError(f"no memory left for the KV cache: budget {budget / 2**30:.2f} GiB, weights "
                              f"{self.weight_bytes / 2**30:.2f} GiB, activations {activation_peak / 2**30:.2f} GiB, "
                              f"start-up peak without KV (weights, activations, CUDA graphs, sampling) "
                              f"{peak / 2**30:.2f} GiB, CUDA context and other device memory "
                              f"{outside / 2**30:.2f} GiB", param="gpu_memory_utilization")
        layout = KVCacheLayout(int(num_blocks), self.args.block_size, per_block)
        limit = self._pool_limit.bytes if self._pool_limit is not None else 0
        return layout, MemoryProfile(budget, self.weight_bytes, activation_peak, layout.num_blocks * per_block,
                                     peak, outside, limit)

    def _trial_start_up(self, max_model_len: int, activation_peak: int) -> TrialStartUp:
        """Run what start-up and serving add to the device besides the KV pool once, over a one-block scratch KV,
        and measure the process as the driver counts it: the CUDA graphs (their pool and executables), the
        eager warm-up forwards, the sampler at max_num_seqs rows with every feature on, and the kernels and
        libraries they load. Then drop the graphs and the scratch; ``prepare`` captures again over the real pool.

        Why: sized from estimates made before any of this existed, the pool left the process over its budget
        (SmolLM2 fp16 under 6 GiB: 185 MiB over after 256 requests, BENCHMARKS.md issue 16 session 15), since
        graph executables and kernel modules loaded after sizing and torch's pool grew past the estimated
        reserve. The second capture compiles nothing (the trial did), so it costs only the capture itself.
        Every eager forward and graph dummy writes no KV slot and reads only block 0 (engine/warmup.py)."""
        started = time.perf_counter()
        device = self.device
        self._release_cached_blocks()  # the profiling forward's activations
        torch.cuda.reset_peak_memory_stats(device)
        held = torch.cuda.memory_reserved(device)  # the weights and what else outlives a step
        scratch = self._bind_kv(1)
        scratch_bytes = sum(2 * k.numel() * k.element_size() for k, _ in scratch)
        stage_peaks = {}

        def stage_done(name: str) -> None:
            torch.cuda.synchronize(device)
            stage_peaks[name] = torch.cuda.max_memory_reserved(device) - scratch_bytes
            torch.cuda.reset_peak_memory_stats(device)

        if self.use_cuda_graphs:
            self.graphs = self._capture_graphs(self._max_blocks(max_model_len))
        stage_done("graphs")
        eager_forwards = self._eager_warm_up_forwards()
        stage_done("eager")
        self._warm_up_sampler()
        stage_done("sampler")
        torch_peak = max(*stage_peaks.values(), held + activation_peak)
        outside = device_bytes_outside_torch(device)  # with the graphs alive: their executables count
        graphs = len(self.graphs.graphs) if self.graphs is not None else 0
        self.graphs = None
        self.model.kv_caches = []
        del scratch
        self._release_cached_blocks()
        log.info("trial start-up: torch's reserved peak %s MiB (graphs, eager forwards, sampling; weights "
                 "included), outside torch %.0f MiB", " / ".join(f"{v / 2**20:.0f}" for v in stage_peaks.values()),
                 outside / 2**20)
        return TrialStartUp(torch_peak, outside, graphs, eager_forwards, time.perf_counter() - started, stage_peaks)

    def _bind_kv(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Allocate a KV cache of ``num_blocks`` on every rank and bind it to the model."""
        kv = allocate_kv_cache(self.config, num_blocks, self.args.block_size, self.device, self.dtype)
        if self.workers is not None:
            from engine.tp_worker import AllocateKV

            self.workers.send(AllocateKV(num_blocks, self.args.block_size))
        self.model.bind_kv_caches(kv)
        return kv

    def _warm_up_sampler(self) -> None:
        """Sample max_num_seqs rows twice, every sampler feature on and greedy: its temporaries at their
        largest and the libraries it loads (sorting, random numbers) are then part of the trial's peak."""
        rows, vocab = self.args.max_num_seqs, self.config.vocab_size
        if self.graphs is not None:  # serving samples from the graphs' logits buffer: no second one
            logits = self.graphs.logits[:rows].normal_()
        else:
            logits = torch.randn((rows, vocab), device=self.device)  # [rows, vocab] float32
        for batch in sampler_trial_requests(rows):
            self.sampler.sample(logits, batch)
            for request in batch:
                self.sampler.free(request.request_id)

    def driver_counted_bytes(self) -> int:
        """This process's device memory as the driver counts it: torch's reserved pool plus everything outside
        it (see ``device_bytes_outside_torch``; 0 on CPU)."""
        if self.device.type != "cuda":
            return 0
        return torch.cuda.memory_reserved(self.device) + device_bytes_outside_torch(self.device)

    def check_budget(self) -> None:
        """After start-up (KV pool, graphs, warm-up requests): warn when the driver counts more at the peak than
        the budget. The trial start-up measured what the pool may not take; a warning means something grew
        after it."""
        if self.device.type != "cuda":
            return
        peak, outside = torch.cuda.max_memory_reserved(self.device), device_bytes_outside_torch(self.device)
        used, budget = peak + outside, self.memory_profile.budget
        if used > budget:
            log.warning("during start-up the device held up to %.2f GiB for this process (torch %.2f GiB + CUDA "
                        "context and other %.2f GiB), %.0f MiB over its %.2f GiB budget", used / 2**30,
                        peak / 2**30, outside / 2**30, (used - budget) / 2**20, budget / 2**30)

    def _profile_cuda(self) -> tuple[int, int]:
        """Budget from --gpu-memory-limit or --gpu-memory-utilization; activation peak of one full-budget forward
        (the larger of what it allocated and what the allocator reserved for it)."""
        budget = cuda_budget_bytes(self.args, self.device)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        allocated, reserved = torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)
        scratch_kv_bytes = self._dummy_forward(min(self.args.max_num_batched_tokens, self.max_model_len))
        torch.cuda.synchronize(self.device)
        # The scratch KV of the dummy forward is not an activation: the real pool replaces it. The driver sees
        # the segments the allocator reserved for the forward, which exceed what it handed out (rounding, splits).
        allocated_peak = torch.cuda.max_memory_allocated(self.device) - allocated
        reserved_peak = torch.cuda.max_memory_reserved(self.device) - reserved
        return budget, max(allocated_peak - scratch_kv_bytes, reserved_peak - scratch_kv_bytes, 0)

    def _dummy_forward(self, num_tokens: int) -> int:
        """One forward over ``num_tokens`` prompt tokens into a scratch KV (every rank: the forward has
        collectives); returns the scratch KV bytes."""
        if self.workers is not None:
            from engine.tp_worker import ProfileForward

            self.workers.send(ProfileForward(num_tokens, self.args.block_size))
        return profile_forward(self.model, num_tokens, self.args.block_size, self.device, self.dtype)

    # ---- one step --------------------------------------------------------------------------------------------
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate block contents (all layers) before a request writes into its private copy."""
        copy_blocks(self.kv_caches, pairs, self.device)

    def _forward(self, inputs: StepInputs, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """An eager forward over ``inputs`` (``input_ids`` on the device replacing the host's, see
        ``StepGraphs.run``): logits [num_sampled, vocab] float32. Under tensor parallelism the workers were
        sent the step first; a failed collective fails the group (EngineStepError)."""
        batch = inputs.to_batch(self.device)
        if input_ids is not None:
            batch = dataclasses.replace(batch, input_ids=input_ids)
        if self.workers is None:
            return self.model.forward(batch)
        try:
            return self.model.forward(batch)
        except Exception as exc:
            raise self.workers.failure(exc) from exc

    def _send_step(self, inputs: StepInputs | None, copy_on_write: list[tuple[int, int]]) -> None:
        """Tensor parallel: send the step to the workers (once; they run the same forward on their shards)."""
        if self.workers is not None:
            from engine.tp_worker import RunStep

            self.workers.send(RunStep(inputs, copy_on_write))

    def free_request(self, request_id: str) -> None:
        """A request finished, was aborted or preempted: drop its sampling state (unless preempted, see
        ``forget_blocks``) and its block-table row."""
        self.sampler.free(request_id)
        self.block_rows.free(request_id)

    def forget_blocks(self, request_id: str) -> None:
        """A preempted request lost its blocks: its row is rewritten whole when it is scheduled again."""
        self.block_rows.free(request_id)

    def _table_rows(self, scheduled) -> list[int]:
        """Bring each request's host block-table row up to date (from the first block this step writes)."""
        bs = self.args.block_size
        return [self.block_rows.update(item.request_id, item.block_table, item.num_computed_tokens // bs)
                for item in scheduled]

    def step_inputs(self, scheduled) -> tuple[StepInputs, list[Request]]:
        """From the scheduler's (request, num_new_tokens, block_table) list to host arrays.

        Python work is O(new tokens), not O(context): only the new tokens' ids are sliced, and block tables
        come from the host rows updated by deltas (engine/block_table.py).
        """
        bs = self.args.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts, ctx_lens, logits_idx, to_sample = [0], [], [], []
        rows = self._table_rows(scheduled)
        for item in scheduled:
            start, n, table = item.num_computed_tokens, item.num_new_tokens, item.block_table
            input_ids.extend(item.token_ids)
            positions.extend(item.positions)
            slots.extend(table[p // bs] * bs + p % bs for p in item.positions)
            starts.append(starts[-1] + n)
            ctx_lens.append(start + n)
            if item.needs_sample:  # the step completes what is known: sample the next token
                logits_idx.append(starts[-1] - 1)
                to_sample.append(item.request)
        inputs = StepInputs(
            input_ids=np.array(input_ids, dtype=np.int64), positions=np.array(positions, dtype=np.int64),
            slot_mapping=np.array(slots, dtype=np.int64), query_start_loc=np.array(starts, dtype=np.int32),
            context_lens=np.array(ctx_lens, dtype=np.int32),
            block_tables=self.block_rows.gather(rows, max(len(item.block_table) for item in scheduled)),
            logits_indices=np.array(logits_idx, dtype=np.int64),
            is_decode=all(item.num_new_tokens == 1 for item in scheduled))
        return inputs, to_sample

    @property
    def can_launch_ahead(self) -> bool:
        """Whether a step may read its input tokens from the previous step's samples on the device (not under
        tensor parallelism: the workers get the host's inputs)."""
        return self.workers is None

    def launch(self, scheduled, copy_on_write: list[tuple[int, int]],
               grammar: Callable[[list[Request]], GrammarStep | None] | None = None,
               after: PendingStep | None = None) -> PendingStep:
        """Queue one forward over the scheduled tokens (a graph replay when one covers the step) and the
        sampling of requests whose known tokens are all computed; the device works while the caller goes on.
        ``grammar`` posts the step's grammar work for the rows to sample to the grammar process (advance the
        matchers, then write the bitmasks), before the forward is queued. On a GPU the sampling is queued at
        once behind a stream gate the process opens when the masks are written (engine/stream_gate.py);
        without a gate it is queued at ``result()``, once the masks are there. ``after``: a decode step
        scheduled ahead of that launched step's tokens (``LLMEngine.step``), which it reads on the device."""
        self.copy_blocks(copy_on_write)
        if not scheduled:
            self._send_step(None, copy_on_write)
            return PendingStep([], None)
        inputs, to_sample = self.step_inputs(scheduled)
        input_ids = self._sampled_ids(after, scheduled) if after is not None else None  # [num_tokens]
        job = grammar(to_sample) if grammar is not None and to_sample else None
        self._send_step(inputs, copy_on_write)
        shape = self.graphs.shape_for(inputs) if self.graphs is not None else None
        if shape is not None:
            logits = self.graphs.run(inputs, shape, input_ids)  # [num_sampled, vocab] float32
        else:
            logits = self._forward(inputs, input_ids)  # [num_sampled, vocab] float32
        if not to_sample:
            return PendingStep([], None, grammar=job)
        if job is None or job.bitmask is None:
            return PendingStep(to_sample, self.sampler.sample_async(logits, to_sample), grammar=job)
        gate = self._mask_gate_for(job)
        if gate is not None:
            masks = TokenMasks(job.bitmask, functools.partial(gate.hold, job.ticket))
            return PendingStep(to_sample, self.sampler.sample_async(logits, to_sample, masks), grammar=job)
        return PendingStep(to_sample, None, lambda: self.sampler.sample_async(logits, to_sample, job.finish()),
                           grammar=job)

    def _sampled_ids(self, after: PendingStep, scheduled) -> torch.Tensor:
        """The input tokens of a decode step scheduled ahead of ``after``: each request's token sampled by
        ``after``, gathered on the device ([num_scheduled] int64; the host holds placeholders)."""
        row_of = {request.request_id: row for row, request in enumerate(after.to_sample)}
        rows = to_device(np.array([row_of[item.request_id] for item in scheduled], dtype=np.int64), self.device)
        return after.sample.token_ids.index_select(0, rows)

    def _mask_gate_for(self, job: GrammarStep) -> StreamGate | None:
        """The stream gate on the grammar process's done word, its shared buffer pinned for the mask uploads
        (once per buffer). None on CPU, for a step that posted nothing, or where the driver refuses."""
        if self.device.type != "cuda" or job.ticket is None:
            return None
        region = job.shared_region
        if region != self._mask_region:
            self._release_mask_region()
            self._mask_region, self._mask_pinned = region, register_host_memory(*region)
            self._mask_gate = StreamGate.for_device(self.device, job.done_word) if self._mask_pinned else None
            if self._mask_gate is None:
                log.info("no stream gate for the grammar masks: constrained steps sample once their masks are in")
        return self._mask_gate

    def _release_mask_region(self) -> None:
        if self._mask_pinned:
            unregister_host_memory(self._mask_region[0])
        self._mask_region, self._mask_pinned, self._mask_gate = None, False, None

    def release(self) -> None:
        """Drop every device tensor this runner holds so the memory can go back to the device, and stop the
        tensor-parallel workers."""
        self._stop_workers()
        self._release_mask_region()
        self.graphs = None
        self.model.kv_caches = []
        self.kv_caches = []
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            self._pool_limit.release()



# ---- shared with the tensor-parallel workers (engine/tp_worker.py) ------------------------------------------
def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, device: torch.device,
                      dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim], zeroed."""
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return [(torch.zeros(shape, device=device, dtype=dtype),
             torch.zeros(shape, device=device, dtype=dtype)) for _ in range(cfg.num_layers)]


def copy_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], pairs: list[tuple[int, int]],
                device: torch.device) -> None:
    """Copy (src, dst) block contents in every layer's K and V cache."""
    if not pairs:
        return
    src = to_device([s for s, _ in pairs], device)
    dst = to_device([d for _, d in pairs], device)
    for k_cache, v_cache in kv_caches:
        k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
        v_cache.index_copy_(0, dst, v_cache.index_select(0, src))


def profile_forward(model, num_tokens: int, block_size: int, device: torch.device, dtype: torch.dtype) -> int:
    """One forward over ``num_tokens`` prompt tokens into a scratch KV; returns the scratch KV bytes."""
    cfg = model.config
    bs = block_size
    num_blocks = (num_tokens + bs - 1) // bs
    shape = (num_blocks, bs, cfg.num_kv_heads, cfg.head_dim)
    scratch = [(torch.empty(shape, device=device, dtype=dtype),
                torch.empty(shape, device=device, dtype=dtype)) for _ in range(cfg.num_layers)]
    model.bind_kv_caches(scratch)
    positions = torch.arange(num_tokens, device=device)
    batch = ForwardBatch(
        input_ids=torch.zeros(num_tokens, dtype=torch.long, device=device), positions=positions,
        slot_mapping=positions.clone(),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        context_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        logits_indices=torch.tensor([num_tokens - 1], device=device), is_decode=False)
    model.forward(batch)
    scratch_bytes = sum(2 * k.numel() * k.element_size() for k, _ in scratch)
    del scratch
    model.kv_caches = []
    return scratch_bytes
