"""Turn one step's logits into next tokens: logit bias, penalties, temperature, top-k/top-p/min-p, seeds, logprobs.

The model runner calls ``Sampler.sample(logits, requests)`` once per step with one row of logits per running
request. Everything is vectorized over the batch: per-row parameters become small tensors on the logits'
device, penalties count tokens with one scatter-add over a flat token-id tensor (each request's history is
kept as a numpy array that grows by the new tokens only), so there is no Python loop over the vocabulary or
over the history, and the step runs on the GPU with one device-to-host copy at the end (two with logprobs).

Reproducibility: a request with ``sampling_params.seed`` owns a ``torch.Generator`` (seeded from its seed and
``sample_index``) and draws the random numbers for its own row only, so its tokens do not depend on what else is
in the batch. Sampling uses the exponential race: ``argmax(probs / E)`` with ``E ~ Exponential(1)`` i.i.d. per
token picks token ``i`` with probability ``probs[i]``, and needs one draw per vocabulary entry from the row's
own generator (no cumulative sums that mix rows).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from engine.host_to_device import to_device
from engine.request import Logprob, Request
from engine.structured_output import TokenMasks
from kernels.ops import Backend

_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # spreads sample_index over the 64-bit seed space
_NEG_INF = float("-inf")


class SamplerOutput(NamedTuple):
    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]  # per row; None when the request asked for no logprobs


def generator_seed(seed: int, sample_index: int) -> int:
    """The seed of sample ``sample_index`` of a request seeded with ``seed`` (sample 0 uses ``seed`` itself)."""
    return (seed + sample_index * _GOLDEN_GAMMA) % 2**64


class PendingSample:
    """A step's sampled token ids on their way to the host (``result`` waits for them and adds logprobs)."""

    def __init__(self, logits: torch.Tensor, token_ids: torch.Tensor, requests: list[Request]):
        self._logits, self._token_ids, self._requests = logits, token_ids, requests  # [n, vocab], [n]
        self._event = None
        if token_ids.is_cuda:  # a non-blocking copy lands in pinned memory; the event says when
            self._host_ids = token_ids.to("cpu", non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host_ids = token_ids

    @property
    def token_ids(self) -> torch.Tensor:
        """The sampled ids on the device ([n] int64), for a step launched before they reach the host."""
        return self._token_ids

    def result(self) -> SamplerOutput:
        if self._event is not None:
            self._event.synchronize()
        logprobs = _gather_logprobs(self._logits, self._token_ids, self._requests)
        return SamplerOutput(self._host_ids.tolist(), logprobs)


class Sampler:
    """Owns the random state of sampling: one generator per device for unseeded rows, one per seeded request."""

    def __init__(self, seed: int = 0, backend: Backend | None = None, max_rows: int = 0):
        self.seed = seed
        self.backend = backend or Backend(use_triton=False)  # applies grammar masks (a Triton pass on a GPU)
        self.max_rows = max_rows  # rows of a step at most (max_num_seqs): the size of every scratch tensor
        self._device_generators: dict[str, torch.Generator] = {}
        self._request_generators: dict[str, torch.Generator] = {}
        self._history = TokenHistory()

    def free(self, request_id: str) -> None:
        """Forget a finished request's generator and token history. Not on preemption: the stream continues."""
        self._request_generators.pop(request_id, None)
        self._history.free(request_id)

    @property
    def num_request_generators(self) -> int:
        return len(self._request_generators)

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """Pick one token per row. ``logits`` is not modified."""
        return self.sample_async(logits, requests).result()

    def sample_async(self, logits: torch.Tensor, requests: list[Request],
                     token_masks: TokenMasks | None = None) -> PendingSample:
        """Queue the sampling work; the token ids travel to the host without blocking the caller, so the
        engine can do the previous step's text work while the device computes. ``logits`` must stay valid
        until ``result()`` (the logprobs are read from it then, before any grammar mask: raw logprobs).
        ``token_masks``: the grammar bitmasks of constrained rows (engine/structured_output.py)."""
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(f"logits {tuple(logits.shape)} must be [num_seqs={len(requests)}, vocab]")
        logits = logits.float()  # [num_seqs, vocab]
        if token_masks is not None:
            allowed = apply_token_masks(logits, token_masks, self.backend)
        else:
            allowed = logits
        processed = apply_logits_processors(allowed, requests, self._history)  # [num_seqs, vocab]
        token_ids = processed.argmax(dim=-1)  # [num_seqs] greedy choice; ties -> lowest id
        random_rows = [i for i, r in enumerate(requests) if not r.sampling_params.is_greedy]
        if random_rows:
            rows = to_device(random_rows, logits.device)
            picked = torch.index_select(processed, 0, rows, out=self._scratch(len(random_rows), processed))
            token_ids[rows] = self._sample_rows(picked, [requests[i] for i in random_rows])
        return PendingSample(logits, token_ids, requests)

    def _sample_rows(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then the exponential race. ``logits``: [n, vocab], owned."""
        device = logits.device
        params = [r.sampling_params for r in requests]
        temperature = to_device([p.temperature for p in params], device)  # [n]
        logits = logits.div_(temperature[:, None])
        vocab = logits.shape[1]
        if any(0 < p.top_k < vocab or p.top_p < 1.0 for p in params):
            top_k = to_device([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device)
            top_p = to_device([p.top_p for p in params], device)
            in_row_chunks(apply_top_k_top_p, logits, top_k, top_p)
        if any(p.min_p > 0.0 for p in params):
            in_row_chunks(apply_min_p, logits, to_device([p.min_p for p in params], device))
        probs = torch.softmax(logits, dim=-1, out=self._scratch(logits.shape[0], logits))  # [n, vocab]
        noise = self._exponential_noise(requests, probs)  # [n, vocab]
        return probs.div_(noise).argmax(dim=-1)

    def _scratch(self, n: int, like: torch.Tensor) -> torch.Tensor:
        """An uninitialised [n, vocab] tensor (``like``'s vocab, dtype, device) cut from one of ``max_rows`` rows.

        Why: the caching allocator keeps a freed block for a request of its own size, so temporaries sized by
        each step's row count left new segments behind: a run of 256 requests on SmolLM2 grew torch's reserved
        pool by 642 MiB in 17 segments while the allocated peak grew by 192 MiB (H200, BENCHMARKS.md issue 16,
        session 9). Cut from full-size blocks, every step asks for the same sizes and reuses the same blocks
        (on CPU the untouched rows are never paged in)."""
        rows = max(n, self.max_rows)
        return torch.empty((rows, like.shape[1]), dtype=like.dtype, device=like.device)[:n]

    def _exponential_noise(self, requests: list[Request], like: torch.Tensor) -> torch.Tensor:
        """Exponential(1) noise shaped like ``like`` [n, vocab]; a seeded row is filled from its own generator,
        the rest from the sampler's."""
        shape, device = like.shape, like.device
        noise = self._scratch(shape[0], like)  # [n, vocab]
        unseeded = [i for i, r in enumerate(requests) if r.sampling_params.seed is None]
        if len(unseeded) == len(requests):
            noise.exponential_(generator=self._device_generator(device))
        elif unseeded:
            rows = to_device(unseeded, device)
            fresh = torch.empty((len(unseeded), shape[1]), device=device)
            noise[rows] = fresh.exponential_(generator=self._device_generator(device))
        for i, request in enumerate(requests):
            if request.sampling_params.seed is not None:
                noise[i].exponential_(generator=self._request_generator(request, device))
        # A zero draw would turn a masked (probability 0) token into 0/0 = NaN, which argmax would pick.
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)

    def _device_generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._device_generators:
            generator = torch.Generator(device=device)
            generator.manual_seed(self.seed % 2**64)
            self._device_generators[key] = generator
        return self._device_generators[key]

    def _request_generator(self, request: Request, device: torch.device) -> torch.Generator:
        generator = self._request_generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(generator_seed(request.sampling_params.seed, request.sample_index))
            self._request_generators[request.request_id] = generator
        return generator


def apply_token_masks(logits: torch.Tensor, masks: TokenMasks, backend: Backend | None = None) -> torch.Tensor:
    """A copy of ``logits`` with the tokens a row's grammar forbids at -inf (rows without a mask untouched).

    The packed bitmask ([rows, ceil(vocab / 32)] int32, bit ``i % 32`` of word ``i // 32`` for token ``i``)
    travels to the device as is (32x smaller than a bool mask), from pinned memory so the host does not wait
    for the forward, and is applied there in one pass (``Backend.masked_logits``: one Triton launch on a GPU).
    The grammar process writes every row's words into its shared buffer, which the runner registers with the
    driver on a GPU; with ``masks.wait`` it is still writing them, and the upload waits on the device for them
    (so it must not be staged through a pinned copy now).
    """
    if masks.bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"token masks for {masks.bitmask.shape[0]} rows, logits for {logits.shape[0]}")
    backend = backend or Backend(use_triton=False)
    if masks.wait is None:
        bits = to_device(masks.bitmask, logits.device)  # [rows, words] int32
    else:  # the bits are still being written: the copy must read them when the stream reaches it, not now
        masks.wait()
        bits = torch.from_numpy(masks.bitmask).to(logits.device, non_blocking=True)  # registered memory: DMA'd
    return backend.masked_logits(logits, bits)


def apply_logits_processors(logits: torch.Tensor, requests: list[Request],
                            history: TokenHistory | None = None) -> torch.Tensor:
    """logit_bias, min_tokens, repetition penalty, presence/frequency penalties, in that order.

    Returns a new tensor when anything applies (``logits`` itself otherwise); never writes into ``logits``.
    ``history`` caches the requests' token ids between steps (a throwaway one is used when not given).
    """
    history = history if history is not None else TokenHistory()
    out = logits
    for processor in (_apply_logit_bias, _apply_min_tokens, _apply_repetition_penalty,
                      _apply_presence_frequency):
        out = processor(out, requests, history, owned=out is not logits)
    return out


def _apply_logit_bias(logits: torch.Tensor, requests: list[Request], history: TokenHistory,
                      owned: bool) -> torch.Tensor:
    rows, cols, values = [], [], []
    vocab = logits.shape[1]
    for i, request in enumerate(requests):
        for token_id, bias in (request.sampling_params.logit_bias or {}).items():
            if 0 <= int(token_id) < vocab:  # out-of-range ids are refused at admission (engine/admission.py)
                rows.append(i), cols.append(int(token_id)), values.append(float(bias))
    if not rows:
        return logits
    out = logits if owned else logits.clone()
    index = (to_device(rows, out.device), to_device(cols, out.device))
    return out.index_put_(index, to_device(values, out.device), accumulate=True)


def _apply_min_tokens(logits: torch.Tensor, requests: list[Request], history: TokenHistory,
                      owned: bool) -> torch.Tensor:
    """Until ``min_tokens`` tokens exist, the tokens that would stop the request cannot be picked."""
    rows, cols = [], []
    vocab = logits.shape[1]
    for i, request in enumerate(requests):
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            continue
        stoppers = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            stoppers.update(request.eos_token_ids)
        for token_id in stoppers:
            if 0 <= token_id < vocab:
                rows.append(i), cols.append(token_id)
    if not rows:
        return logits
    out = logits if owned else logits.clone()
    out[to_device(rows, out.device), to_device(cols, out.device)] = _NEG_INF
    return out


def _apply_repetition_penalty(logits: torch.Tensor, requests: list[Request], history: TokenHistory,
                              owned: bool) -> torch.Tensor:
    """HF semantics over prompt + output: a seen token's logit is divided by p if positive, else multiplied."""
    selected = [i for i, r in enumerate(requests) if r.sampling_params.repetition_penalty != 1.0]
    if not selected:
        return logits
    device, vocab = logits.device, logits.shape[1]
    seen = _token_counts([history.all_ids(requests[i]) for i in selected], vocab, device) > 0  # [n, vocab]
    penalty = to_device([requests[i].sampling_params.repetition_penalty for i in selected], device)[:, None]  # [n, 1]
    rows = to_device(selected, device)
    sub = logits[rows]  # [n, vocab]
    penalized = torch.where(sub > 0, sub / penalty, sub * penalty)
    out = logits if owned else logits.clone()
    out[rows] = torch.where(seen, penalized, sub)
    return out


def _apply_presence_frequency(logits: torch.Tensor, requests: list[Request], history: TokenHistory,
                              owned: bool) -> torch.Tensor:
    """OpenAI semantics over output tokens: logit -= presence * (count > 0) + frequency * count."""
    selected = [i for i, r in enumerate(requests)
                if r.sampling_params.presence_penalty != 0.0 or r.sampling_params.frequency_penalty != 0.0]
    if not selected:
        return logits
    device, vocab = logits.device, logits.shape[1]
    counts = _token_counts([history.output_ids(requests[i]) for i in selected], vocab, device)  # [n, vocab]
    presence = to_device([requests[i].sampling_params.presence_penalty for i in selected], device)
    frequency = to_device([requests[i].sampling_params.frequency_penalty for i in selected], device)
    penalty = frequency[:, None] * counts + presence[:, None] * (counts > 0)  # [n, vocab]
    out = logits if owned else logits.clone()
    # index_put_ rather than a 2-D index_add_, which is pathologically slow on CPU in recent torch.
    return out.index_put_((to_device(selected, device),), -penalty, accumulate=True)


def _token_counts(id_arrays: list[np.ndarray], vocab: int, device: torch.device) -> torch.Tensor:
    """How often each vocabulary id occurs in each row's ids: [n, vocab] float32 on ``device``.

    The ids of all rows travel as one flat int64 tensor; a scatter-add of ones into the flattened
    [n * vocab] counts does the counting (sums of ones are exact, so the order of atomics does not matter).
    """
    lengths = np.array([len(ids) for ids in id_arrays], dtype=np.int64)
    rows = np.repeat(np.arange(len(id_arrays), dtype=np.int64), lengths)
    flat = np.concatenate(id_arrays) if id_arrays else np.zeros(0, dtype=np.int64)
    index = torch.from_numpy(rows * vocab + flat).to(device)  # [total_ids]
    counts = torch.zeros(len(id_arrays) * vocab, device=device)
    counts.index_add_(0, index, torch.ones(index.shape[0], device=device))
    return counts.view(len(id_arrays), vocab)


@dataclass
class _History:
    buffer: np.ndarray  # int64, capacity >= length
    length: int
    num_prompt_tokens: int


class TokenHistory:
    """Each request's prompt + output ids as a numpy array, extended by the new tokens only.

    Penalties need every row's full token history every step; converting Python lists to tensors from
    scratch would cost O(history) interpreter work per row per step. Keyed by request id; ``free`` on finish.
    If a request's tokens ever shrink (it was reset), its entry is rebuilt.
    """

    def __init__(self) -> None:
        self._entries: dict[str, _History] = {}

    def free(self, request_id: str) -> None:
        self._entries.pop(request_id, None)

    def all_ids(self, request: Request) -> np.ndarray:
        entry = self._entry(request)
        return entry.buffer[:entry.length]

    def output_ids(self, request: Request) -> np.ndarray:
        entry = self._entry(request)
        return entry.buffer[entry.num_prompt_tokens:entry.length]

    def _entry(self, request: Request) -> _History:
        entry = self._entries.get(request.request_id)
        num_tokens = request.num_tokens
        if entry is None or entry.length > num_tokens or entry.num_prompt_tokens != request.num_prompt_tokens:
            ids = np.array(request.all_token_ids, dtype=np.int64)
            entry = _History(np.resize(ids, max(16, 2 * len(ids))), len(ids), request.num_prompt_tokens)
            self._entries[request.request_id] = entry
        elif entry.length < num_tokens:
            new = request.output_token_ids[entry.length - entry.num_prompt_tokens:]
            if num_tokens > len(entry.buffer):
                entry.buffer = np.resize(entry.buffer[:entry.length], 2 * num_tokens)
            entry.buffer[entry.length:num_tokens] = new
            entry.length = num_tokens
        return entry


SAMPLER_CHUNK_ROWS = 32


def in_row_chunks(fn: Callable[..., torch.Tensor], logits: torch.Tensor, *per_row: torch.Tensor) -> None:
    """``logits[:] = fn(logits, *per_row)``, SAMPLER_CHUNK_ROWS rows at a time (``fn`` treats rows alone).

    Why: top-k/top-p sorts the rows, and its temporaries ([rows, vocab] values, int64 indices, cumulative
    sums) for all 256 rows of a 128k vocabulary at once added 0.83 GiB to torch's peak in the trial start-up
    (8B AWQ), with sizes that change with every step's row count; a top-p load then grew torch's pool 4.2 GiB
    past its budget (BENCHMARKS.md, issue 16, session 16: the sampler's varying sizes are the suspect). In
    chunks the temporaries are at most [32, vocab] and come in two sizes a step."""
    for start in range(0, logits.shape[0], SAMPLER_CHUNK_ROWS):
        rows = slice(start, start + SAMPLER_CHUNK_ROWS)
        logits[rows] = fn(logits[rows], *(values[rows] for values in per_row))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k, then outside its top-p nucleus.

    ``top_k``: [n] in 1..vocab (vocab = off); ``top_p``: [n] in (0, 1] (1 = off). The nucleus is the smallest
    set of most likely tokens whose probability (after top-k) reaches top_p; the most likely token always stays.
    Ties are ordered by token id (stable sort), so top_k=1 keeps exactly the argmax.
    """
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [n, vocab]
    positions = torch.arange(vocab, device=logits.device)  # [vocab]
    sorted_logits = sorted_logits.masked_fill(positions[None, :] >= top_k[:, None], _NEG_INF)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # [n, vocab] probability of the more likely tokens
    outside = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    outside[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(outside, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p`` times the row's top probability. ``min_p``: [n]."""
    probs = logits.softmax(dim=-1)  # [n, vocab]
    threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, _NEG_INF)


def _gather_logprobs(raw_logits: torch.Tensor, token_ids: torch.Tensor,
                     requests: list[Request]) -> list[dict[int, Logprob] | None]:
    """The chosen token's logprob and the top-``logprobs`` tokens, from the raw (unprocessed) logits."""
    result: list[dict[int, Logprob] | None] = [None] * len(requests)
    wanted = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
    if not wanted:
        return result
    rows = to_device(wanted, raw_logits.device)
    logprobs = torch.log_softmax(raw_logits[rows], dim=-1)  # [m, vocab]
    chosen_ids = token_ids[rows]  # [m]
    chosen = logprobs.gather(1, chosen_ids[:, None]).squeeze(1)  # [m]
    k = max(requests[i].sampling_params.logprobs for i in wanted)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], chosen_ids[:, None][:, :0])
    # One copy to the host for everything.
    packed = torch.cat([chosen_ids[:, None], top_ids], dim=1).double()  # ids are exact in float64
    packed = torch.cat([packed[:, :1], chosen[:, None].double(), packed[:, 1:], top_values.double()], dim=1)
    packed_rows = packed.cpu().tolist()
    for row, i in zip(packed_rows, wanted):
        num_top = requests[i].sampling_params.logprobs
        chosen_id = int(row[0])
        entries = {chosen_id: Logprob(chosen_id, row[1])}
        for token_id, value in zip(row[2:2 + num_top], row[2 + k:2 + k + num_top]):
            entries.setdefault(int(token_id), Logprob(int(token_id), value))
        result[i] = entries
    return result
