"""The step loop: schedule -> run -> update; requests in, RequestOutputs out (offline and for the async server)."""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from engine.admission import Admission, check_request_id
from engine.bundled import pagoda_home
from engine.catalog import resolve_model
from engine.config import EngineArgs, ModelConfig, resolve_device, resolve_dtype
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import EngineError
from engine.kv_cache_manager import KVCacheManager
from engine.model_loader import read_config_dict
from engine.model_runner import ModelRunner, PendingStep
from engine.request import (
    CompletionOutput,
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
)
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.structured_output import GrammarStep, StructuredOutputManager
from engine.tokenizer import Tokenizer
from engine.warmup import run_warmup_requests, settle_garbage_collector, use_triton_cache_under

log = logging.getLogger("pagoda.engine")


@dataclass
class RequestGroup:
    """The ``n`` samples of one user request, with their detokenizers."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[Request]
    detokenizers: list[IncrementalDetokenizer]
    arrival_time: float = field(default_factory=time.monotonic)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.samples)


@dataclass
class EngineCounters:
    """Monotonic totals for /metrics (Prometheus counters) and the dashboard."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: Counter = field(default_factory=Counter)  # finish_reason -> count


def read_eos_token_ids(model_dir: Path, config: ModelConfig, tokenizer: Tokenizer) -> tuple[int, ...]:
    """EOS ids from config.json, generation_config.json (Llama 3 lists several) and the tokenizer."""
    ids = set(config.eos_token_ids)
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


@dataclass
class InFlightStep:
    """A launched step. ``advanced``: the next step was scheduled ahead of it, so its tokens fill placeholders
    (``Scheduler.advance_ahead``) rather than being appended."""

    plan: SchedulerOutput
    pending: PendingStep
    advanced: bool = False


class LLMEngine:
    """One model, its KV cache, scheduler and sampler. Not thread-safe: AsyncEngine drives it from one thread."""

    def __init__(self, args: EngineArgs, log_fn: Callable[[str], None] = log.info):
        self.args = args
        started = time.perf_counter()
        self.device = resolve_device(args.device)
        if self.device.type == "cuda":
            use_triton_cache_under(pagoda_home())
        self.model_dir, self.model_name = resolve_model(args.model, log=log_fn)
        config = ModelConfig.from_dict(read_config_dict(self.model_dir))
        self.dtype = resolve_dtype(args.dtype, self.device, config.torch_dtype)
        max_model_len = args.max_model_len or config.max_position_embeddings
        if args.max_model_len is not None:
            self._require_fit_before_load(config)
        tokenizer_started = time.perf_counter()
        self.tokenizer = Tokenizer(self.model_dir)
        tokenizer_seconds = time.perf_counter() - tokenizer_started
        self.runner = ModelRunner(args, self.model_dir, self.device, self.dtype, max_model_len)
        self.model_config = self.runner.config
        self.max_model_len = self._fit_max_model_len(max_model_len)
        self.runner.prepare(self.max_model_len)
        self.admission = Admission(self.max_model_len, self.model_config.vocab_size)
        layout = self.runner.layout
        self.kv_manager = KVCacheManager(layout.num_blocks, layout.block_size, args.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=self.max_model_len, enable_chunked_prefill=args.enable_chunked_prefill),
            self.kv_manager)
        self.eos_token_ids = read_eos_token_ids(self.model_dir, self.model_config, self.tokenizer)
        self.structured = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids,
                                                  args.max_num_seqs)
        self.groups: dict[str, RequestGroup] = {}
        self._text_pending: list[tuple[Request, int | None]] = []  # (request, token) whose text is due
        self._grammar_pending: list[Request] = []  # constrained requests whose newest token no grammar has seen
        self._grammar_job: GrammarStep | None = None  # the step in flight's grammar work
        self._in_flight: InFlightStep | None = None  # a step launched ahead, finished by the next ``step``
        self.counters = EngineCounters()
        log_fn(f"{self.model_name}: KV cache {layout.num_blocks} blocks x {layout.block_size} tokens = "
               f"{layout.capacity_tokens} tokens; maximum concurrency for {self.max_model_len} tokens per request: "
               f"{layout.capacity_tokens / self.max_model_len:.2f}x")
        graphs, trial = self.runner.graphs, self.runner.trial
        trial_text = (f" (of which a trial start-up over a scratch KV: {trial.graphs} CUDA graphs, "
                      f"{trial.eager_forwards} eager warm-up forwards, sampling, {trial.seconds:.2f} s)" if trial else "")
        log_fn(f"{self.model_name}: engine ready in {time.perf_counter() - started:.2f} s (tokenizer "
               f"{tokenizer_seconds:.2f} s, weights {self.runner.load_seconds:.2f} s, KV sizing "
               f"{self.runner.sizing_seconds:.2f} s{trial_text}, CUDA graphs "
               f"{graphs.capture_seconds if graphs else 0.0:.2f} s)")

    def warm_up(self, log_fn: Callable[[str], None] = log.info) -> float:
        """On a GPU, take the sampler's paths and a long prompt's eager step once (engine/warmup.py), from the
        thread that will step the engine: cuBLAS handles and the current stream are per thread. Returns the
        seconds it took (0 on CPU, where nothing is compiled or loaded on first use)."""
        if self.device.type != "cuda":
            return 0.0
        started = time.perf_counter()
        steps = run_warmup_requests(self)
        settle_garbage_collector()
        self.runner.check_budget()
        seconds = time.perf_counter() - started
        log_fn(f"{self.model_name}: warm-up requests took {seconds:.2f} s ({steps} steps)")
        return seconds

    def _require_fit_before_load(self, config: ModelConfig) -> None:
        """Refuse, before reading any weights, a max_model_len whose one full request cannot fit the budget."""
        from engine.fit import cpu_kv_cache_bytes, cuda_budget_bytes, estimate_weight_bytes, require_fit
        from engine.memory import device_bytes_outside_torch

        args = self.args
        kv_bytes = None
        if self.device.type == "cuda":  # the CUDA context and other device memory come out of the budget
            budget = cuda_budget_bytes(args, self.device) - device_bytes_outside_torch(self.device)
        else:
            kv_bytes = cpu_kv_cache_bytes(args)
            budget = estimate_weight_bytes(config, self.dtype, args.lm_head_quantization) + kv_bytes
        require_fit(config, self.dtype, budget, args.max_model_len, args.block_size,
                    max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                    kv_cache_bytes=kv_bytes, activation_reserve_bytes=0 if kv_bytes is not None else None,
                    lm_head_quantization=args.lm_head_quantization)

    def _fit_max_model_len(self, requested: int) -> int:
        """An explicit --max-model-len must fit one full request in the KV pool; the default is capped to it."""
        capacity = self.runner.layout.capacity_tokens
        if requested <= capacity:
            return requested
        if self.args.max_model_len is None:
            return capacity
        raise EngineError(f"max_model_len {requested} needs {requested} KV tokens but the cache holds {capacity} "
                          f"({self.runner.layout.num_blocks} blocks); use --max-model-len {capacity} or less, "
                          "or give the KV cache more memory", param="max_model_len")

    # ---- requests --------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | None = None, prompt_token_ids: list[int] | None = None,
                    params: SamplingParams | None = None, prompt_param: str = "prompt") -> None:
        """Queue a request after the admission checks (engine/admission.py); ``prompt_param`` is the field the
        prompt came from, named in the EngineError of a refusal."""
        params = params or SamplingParams()
        check_request_id(request_id, self.groups)
        if prompt_token_ids is None:
            if prompt is None:
                raise EngineError("either a prompt or prompt_token_ids is required", param="prompt")
            prompt_token_ids = self.tokenizer.encode(prompt)
        self.admission.check_prompt(prompt_token_ids, prompt_param)
        self.admission.check_params(params)
        samples = [Request(request_id=request_id if params.n == 1 else f"{request_id}#{i}",
                           prompt_token_ids=list(prompt_token_ids), sampling_params=params,
                           eos_token_ids=self.eos_token_ids, parent_id=request_id, sample_index=i)
                   for i in range(params.n)]
        if params.structured_outputs is not None:  # compiled before anything is queued: a bad grammar is a 400
            self.structured.add([s.request_id for s in samples], params.structured_outputs)
        added = []  # the scheduler validates each sample: add all or none
        try:
            for sample in samples:
                self.scheduler.add_request(sample, prompt_param)
                added.append(sample)
        except EngineError:
            for sample in added:
                self.scheduler.abort_request(sample.request_id)
            for sample in samples:
                self.structured.free(sample.request_id)
            raise
        detoks = [IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens,
                                         params.stop, params.include_stop_str_in_output, min_tokens=params.min_tokens)
                  for _ in samples]
        self.groups[request_id] = RequestGroup(request_id, prompt, list(prompt_token_ids), samples, detoks)
        self.counters.prompt_tokens += len(prompt_token_ids)

    def abort_request(self, request_id: str) -> None:
        group = self.groups.pop(request_id, None)
        if group is None:
            return
        # its text is due no more: left queued, it kept has_unfinished_requests true, and after a failed step
        # (which raises before the text work) the loop stepped again and again
        self._text_pending = [(req, token) for req, token in self._text_pending if req.parent_id != request_id]
        for sample in group.samples:
            if not sample.is_finished:
                self.scheduler.abort_request(sample.request_id)
            self.counters.finished[sample.finish_reason] += 1  # "abort" unless it had ended before
            self.runner.free_request(sample.request_id)
            self.structured.free(sample.request_id)

    @property
    def tokens_in_flight(self) -> dict[str, int]:
        """Per request, the tokens of the step launched ahead (their KV slots are held, not yet computed)."""
        if self._in_flight is None:
            return {}
        return {item.request_id: item.num_new_tokens for item in self._in_flight.plan.scheduled}

    def has_unfinished_requests(self) -> bool:
        """Requests still running or waiting, tokens whose text is not out yet, or a step launched ahead (one
        more ``step`` each)."""
        return self.scheduler.has_unfinished_requests() or bool(self._text_pending) or self._in_flight is not None

    # ---- the step --------------------------------------------------------------------------------------------
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """Schedule and launch one step (unless the last call launched it ahead), then, while the device
        computes it, turn the previous step's tokens into text (detokenize, stop strings, outputs); where the
        step allows, schedule and launch the next decode step now, its input tokens read on the device from
        this step's samples; finally take this step's tokens and apply the stop rules that need no text (eos,
        stop token ids, lengths).

        So outputs trail the tokens by one step, and a stop string ends its request one step late: the token
        computed meanwhile is dropped (``update_after_step`` skips finished requests); a request that ends on
        a token (eos, max_tokens) has its row of the step ahead dropped the same way. The text work of 128
        running requests was ~2 ms of host time per step, now hidden behind the device's step; scheduling
        ahead hides the scheduling and input building of the next step too (1.5 ms of host time a step at 128
        rows, 7B, H200: BENCHMARKS.md issue 16 session 16). ``final_only`` (offline generation) builds outputs
        for finished groups only: a cumulative output copies every token id so far.
        """
        current = self._in_flight or self._launch(self.scheduler.schedule())
        self._in_flight = None
        outputs = self._process_text(final_only)
        if self._can_schedule_ahead(current):
            self.scheduler.advance_ahead(current.plan)
            current.advanced = True
            self._in_flight = self._launch(self.scheduler.schedule(), after=current.pending)
        self._finish(current)
        return outputs

    def _launch(self, plan: SchedulerOutput, after: PendingStep | None = None) -> InFlightStep:
        for req in plan.preempted:
            self.runner.forget_blocks(req.request_id)
        grammar = self._grammar_step if self.structured.num_requests else None
        return InFlightStep(plan, self.runner.launch(plan.scheduled, plan.copy_on_write, grammar, after))

    def _can_schedule_ahead(self, step: InFlightStep) -> bool:
        """Whether the next step can be launched before ``step``'s tokens are known: no request's next token
        would pass the context length (its slot would lie past the block table), and nothing the next step
        samples needs those tokens on the host (penalties count them, grammars advance on them, logprobs read
        the logits the next step overwrites). A request that ends on ``step``'s token (eos, a stop token,
        max_tokens) has its row of the next step dropped."""
        if (not self.args.async_scheduling or not self.runner.can_launch_ahead or self.structured.num_requests
                or step.pending.sample is None or not self.scheduler.can_schedule_ahead(step.plan)):
            return False
        limit = self.scheduler.max_request_tokens
        for item in step.plan.scheduled:
            request, params = item.request, item.request.sampling_params
            if (params.logprobs is not None or params.repetition_penalty != 1.0 or params.presence_penalty
                    or params.frequency_penalty or request.parent_id not in self.groups
                    or request.num_tokens + 1 >= limit):
                return False
        return True

    def _finish(self, step: InFlightStep) -> None:
        """Take ``step``'s tokens: count them (or fill the placeholders of a step scheduled ahead of), apply
        the stops that need no text, queue their text."""
        plan = step.plan
        to_sample, sampled = step.pending.result()
        self._end_completed_grammars()
        token_map = {} if sampled is None else {r.request_id: t for r, t in zip(to_sample, sampled.token_ids)}
        if sampled is not None:
            for req, logprobs in zip(to_sample, sampled.logprobs):
                if logprobs is not None:
                    req.output_logprobs.append(logprobs)
        if step.advanced:
            updated = self.scheduler.fill_ahead(plan, token_map)
        else:
            updated = self.scheduler.update_after_step(plan, token_map)
        updated = [req for req in updated if req.parent_id in self.groups]
        for req in updated:
            self.counters.generation_tokens += 1
            self._apply_token_stops(req)
        if self.structured.num_requests:
            self._grammar_pending += [req for req in updated if not req.is_finished]
        self._text_pending += [(req, req.output_token_ids[-1]) for req in updated]
        for req in plan.finished:  # the scheduler ended these itself (grew past what the KV cache can hold)
            if req.parent_id in self.groups:
                self._text_pending.append((req, None))

    def _process_text(self, final_only: bool) -> list[RequestOutput]:
        """Detokenize the tokens of the last step, end requests on stop strings, build outputs."""
        pending, self._text_pending = self._text_pending, []
        touched: dict[str, RequestGroup] = {}
        for req, token in pending:
            group = self.groups.get(req.parent_id)
            if group is None:  # aborted meanwhile
                continue
            self._apply_text_stops(group, req, token)
            touched[group.request_id] = group
        outputs = [self._make_output(group) for group in touched.values() if group.finished or not final_only]
        for group in touched.values():
            if group.finished:
                del self.groups[group.request_id]
                for sample in group.samples:
                    self.counters.finished[sample.finish_reason] += 1
                    self.runner.free_request(sample.request_id)
                    self.structured.free(sample.request_id)
        return outputs

    def _apply_token_stops(self, req: Request) -> None:
        """End a request on its newest token: eos, a stop token id, max_tokens or the context length."""
        token = req.output_token_ids[-1]
        params = req.sampling_params
        can_stop = req.num_output_tokens >= params.min_tokens
        status, reason = None, None
        if can_stop and not params.ignore_eos and token in self.eos_token_ids:
            status = RequestStatus.FINISHED_STOPPED
        elif can_stop and token in params.stop_token_ids:
            status, reason = RequestStatus.FINISHED_STOPPED, token
        elif ((params.max_tokens is not None and req.num_output_tokens >= params.max_tokens)
              or req.num_tokens >= self.scheduler.max_request_tokens):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            req.stop_reason = reason
            self.scheduler.finish_request(req.request_id, status)

    def _grammar_step(self, to_sample: list[Request]) -> GrammarStep | None:
        """Called by the runner once it knows the step's rows, before it queues the forward: the grammar work
        of the step (advance the matchers by the previous step's tokens, then this step's masks), posted to the
        grammar process, which does it beside the forward's launch and the previous step's text. Passed to the
        runner only while some request is constrained."""
        pending, self._grammar_pending = self._grammar_pending, []
        newest = [req for req in pending if not req.is_finished]
        self._grammar_job = self.structured.step_job(newest, to_sample)
        return self._grammar_job

    def _end_completed_grammars(self) -> None:
        """End each request whose grammar its newest token completed (before min_tokens: nothing but EOS could
        follow), unless it ignores EOS: then EOS is all it can still sample. One step late, like a stop string:
        the token this step computed for it is dropped (``update_after_step`` skips finished requests), so
        outputs are as if it ended at once. The text work of this step ran beside the grammar's, so the final
        output comes with the next step's."""
        job, self._grammar_job = self._grammar_job, None
        if job is None:
            return
        for req in job.completed:
            if not req.sampling_params.ignore_eos and not req.is_finished:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
                self._text_pending.append((req, None))  # its text is final: the next step's text work says so

    def _apply_text_stops(self, group: RequestGroup, req: Request, token: int | None) -> None:
        """Feed the token to the request's detokenizer; a completed stop string ends the request (or, when
        the same token also reached a length limit, makes that ending a stop, as eos and stop ids already
        are); a request that ended releases the text still held back."""
        detok = group.detokenizers[req.sample_index]
        if token is not None:
            detok.add_token(token)
        if detok.stop_string is not None and req.status != RequestStatus.FINISHED_STOPPED:
            if req.is_finished:  # a length limit reached meanwhile: the stop string came first
                req.status = RequestStatus.FINISHED_STOPPED
            else:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
            req.stop_reason = detok.stop_string
        elif req.is_finished and detok.stop_string is None:
            detok.flush()

    def _make_output(self, group: RequestGroup) -> RequestOutput:
        outputs = []
        for sample, detok in zip(group.samples, group.detokenizers):
            logprobs = list(sample.output_logprobs) if sample.sampling_params.logprobs is not None else None
            outputs.append(CompletionOutput(index=sample.sample_index, text=detok.text,
                                            token_ids=list(sample.output_token_ids),
                                            finish_reason=sample.finish_reason, stop_reason=sample.stop_reason,
                                            logprobs=logprobs))
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outputs, group.finished,
                             num_cached_tokens=group.samples[0].num_cached_tokens)

    # ---- introspection ---------------------------------------------------------------------------------------
    def snapshot(self, step: int = 0, memory=None):
        """The engine now as a frozen EngineSnapshot (engine/snapshot.py); the stepping thread calls this."""
        from engine.snapshot import take_snapshot

        return take_snapshot(self, step=step, memory=memory)

    def stats(self) -> dict:
        return self.snapshot().stats()

    def memory_report(self):
        """Where the device memory goes (engine/memory.py); the dashboard and /metrics read it."""
        from engine.memory import memory_report

        return memory_report(self)

    def release(self) -> None:
        """Abort everything and free the model's device memory (model switching, shutdown)."""
        for request_id in list(self.groups):
            self.abort_request(request_id)
        self._in_flight = None
        self.runner.release()
        self.structured.close()
