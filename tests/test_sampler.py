"""Sampler: greedy is argmax, truncation never samples masked tokens, seeds are batch-independent, penalties,
min_tokens, logit_bias and logprobs agree with hand-written per-row references."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from engine.admission import check_params_vocab
from engine.errors import EngineError
from engine.request import Request, SamplingParams
from engine.sampler import Sampler, TokenHistory, apply_logits_processors

VOCAB = 32
NUM_DRAWS = 8192  # rows per statistical check: a frequency's std is at most 0.0055


def make_request(request_id: str = "r", prompt=(1, 2, 3), output=(), eos=(0,), sample_index: int = 0,
                 **params) -> Request:
    return Request(request_id, list(prompt), SamplingParams(max_tokens=None, **params), eos_token_ids=tuple(eos),
                   output_token_ids=list(output), sample_index=sample_index)


def empirical(tokens: list[int], vocab: int) -> torch.Tensor:
    counts = Counter(tokens)
    return torch.tensor([counts[i] / len(tokens) for i in range(vocab)])


def draw(logits_row: torch.Tensor, seed: int = 0, **params) -> list[int]:
    """NUM_DRAWS independent unseeded samples of one distribution, in one batched call."""
    requests = [make_request(f"r{i}", **params) for i in range(NUM_DRAWS)]
    return Sampler(seed=seed).sample(logits_row.expand(NUM_DRAWS, -1).contiguous(), requests).token_ids


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # (torch.testing.assert_close would import torch.distributed on first use: seconds on a small CI box)
    assert torch.allclose(actual, expected, rtol=1e-6, atol=1e-5), (actual, expected)


def softmax(values: list[float]) -> list[float]:
    top = max(values)
    exps = [math.exp(v - top) if v != -math.inf else 0.0 for v in values]
    return [e / sum(exps) for e in exps]


# --- reference truncations, written per row with plain Python -----------------------------------------------

def ref_top_k(logits: list[float], k: int) -> set[int]:
    return set(sorted(range(len(logits)), key=lambda i: (-logits[i], i))[:k])


def ref_top_p(logits: list[float], p: float) -> set[int]:
    probs = softmax(logits)
    kept, mass = set(), 0.0
    for i in sorted(range(len(logits)), key=lambda i: -probs[i]):
        if mass >= p:
            break
        kept.add(i)
        mass += probs[i]
    return kept


def ref_min_p(logits: list[float], min_p: float) -> set[int]:
    probs = softmax(logits)
    return {i for i, q in enumerate(probs) if q >= min_p * max(probs)}


def renormalized(logits: list[float], allowed: set[int]) -> torch.Tensor:
    return torch.tensor(softmax([v if i in allowed else -math.inf for i, v in enumerate(logits)]))


# --- greedy ---------------------------------------------------------------------------------------------------

def test_greedy_equals_argmax_with_ties_and_mixed_rows():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 1000, generator=gen)
    logits[4, [10, 20, 30]] = 50.0  # ties: the lowest id wins, like torch.argmax
    logits[5] = 0.0
    requests = [make_request(f"r{i}", temperature=0.0 if i % 2 == 0 else 1.0) for i in range(16)]
    requests[5] = make_request("r5", temperature=0.0)
    out = Sampler().sample(logits, requests)
    expected = logits.argmax(dim=-1).tolist()
    for i, request in enumerate(requests):
        if request.sampling_params.is_greedy:
            assert out.token_ids[i] == expected[i]
    assert out.token_ids[4] == 10 and out.token_ids[5] == 0
    assert out.logprobs == [None] * 16


def test_top_k_one_equals_greedy():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 500, generator=gen)
    logits[7, [3, 9]] = 40.0
    requests = [make_request(f"r{i}", temperature=1.5, top_k=1, seed=i if i % 2 else None) for i in range(64)]
    out = Sampler(seed=3).sample(logits, requests)
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_sampler_does_not_modify_logits():
    logits = torch.randn(4, VOCAB)
    before = logits.clone()
    requests = [make_request(f"r{i}", temperature=0.7, top_p=0.5, repetition_penalty=1.3, presence_penalty=0.5,
                             logit_bias={4: 2.0}, min_tokens=2, output=[5, 6]) for i in range(4)]
    Sampler().sample(logits, requests)
    assert torch.equal(logits, before)


# --- truncation: never a masked token, and the right distribution over the rest ------------------------------

@pytest.mark.parametrize("params,allowed_fn", [
    ({"top_k": 5}, lambda lg: ref_top_k(lg, 5)),
    ({"top_p": 0.6}, lambda lg: ref_top_p(lg, 0.6)),
    ({"min_p": 0.1}, lambda lg: ref_min_p(lg, 0.1)),
])
def test_truncation_never_samples_masked_tokens(params, allowed_fn):
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(7)) * 2.0
    allowed = allowed_fn(logits.tolist())
    assert 1 < len(allowed) < VOCAB  # the check is not vacuous
    tokens = draw(logits, **params)
    assert set(tokens) <= allowed
    expected = renormalized(logits.tolist(), allowed)
    assert (empirical(tokens, VOCAB) - expected).abs().max() < 0.025


def test_top_k_then_top_p_then_min_p_combined():
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(8)) * 2.0
    values = logits.tolist()
    allowed = ref_top_k(values, 8)
    after_k = [v if i in allowed else -math.inf for i, v in enumerate(values)]
    allowed &= ref_top_p(after_k, 0.9)
    after_p = [v if i in allowed else -math.inf for i, v in enumerate(values)]
    allowed &= ref_min_p(after_p, 0.05)
    tokens = draw(logits, top_k=8, top_p=0.9, min_p=0.05)
    assert set(tokens) <= allowed
    assert (empirical(tokens, VOCAB) - renormalized(values, allowed)).abs().max() < 0.025


def test_temperature_sharpens_distribution():
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(9))
    best = int(logits.argmax())
    argmax_share = []
    for temperature in (2.0, 1.0, 0.5):
        tokens = draw(logits, temperature=temperature)
        expected = torch.softmax(logits / temperature, dim=-1)
        assert (empirical(tokens, VOCAB) - expected).abs().max() < 0.025
        argmax_share.append(tokens.count(best) / len(tokens))
    assert argmax_share[0] < argmax_share[1] < argmax_share[2]


# --- seeds ---------------------------------------------------------------------------------------------------

def _seeded_stream(steps: list[torch.Tensor], batch_plan, sampler_seed: int, seed: int = 1234,
                   sample_index: int = 0) -> list[int]:
    """Generate with request 'a' (seeded) for len(steps) steps, each step inside the batch that
    ``batch_plan(step)`` describes: (position of 'a', list of other requests)."""
    sampler = Sampler(seed=sampler_seed)
    target = make_request("a", seed=seed, sample_index=sample_index, temperature=0.9, top_p=0.95,
                          repetition_penalty=1.1)
    gen = torch.Generator().manual_seed(sampler_seed + 1)
    for step, row in enumerate(steps):
        position, others = batch_plan(step)
        rows = [torch.randn(row.shape[0], generator=gen) for _ in others]
        rows.insert(position, row)
        batch = list(others)
        batch.insert(position, target)
        out = sampler.sample(torch.stack(rows), batch)
        target.output_token_ids.append(out.token_ids[position])
    return target.output_token_ids


def _steps(num: int = 12, vocab: int = 2000) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(42)
    return [torch.randn(vocab, generator=gen) * 0.5 for _ in range(num)]


def _mixed_batch(step: int):
    kinds = [
        make_request("g", temperature=0.0),
        make_request("s", seed=7, temperature=1.0),
        make_request("u", temperature=1.3, top_k=50),
        make_request("s2", seed=1234, sample_index=1, min_p=0.1),  # same seed, other sample
        make_request("u2", temperature=0.8, presence_penalty=0.5, output=[1, 2, 2]),
    ]
    size = step % len(kinds) + 1
    others = [kinds[(step + j) % len(kinds)] for j in range(size)]
    return step % (size + 1), others


def test_seeded_request_is_reproducible_across_batch_compositions():
    steps = _steps()
    alone = _seeded_stream(steps, lambda step: (0, []), sampler_seed=0)
    mixed = _seeded_stream(steps, _mixed_batch, sampler_seed=99)
    assert alone == mixed
    assert len(set(alone)) > 3  # really sampled, not a constant argmax


def test_different_seeds_and_sample_indices_give_different_streams():
    steps = _steps()
    base = _seeded_stream(steps, lambda step: (0, []), sampler_seed=0, seed=1)
    assert _seeded_stream(steps, lambda step: (0, []), sampler_seed=0, seed=2) != base
    assert _seeded_stream(steps, lambda step: (0, []), sampler_seed=0, seed=1, sample_index=1) != base


def test_unseeded_rows_follow_the_sampler_seed():
    logits = torch.zeros(8, 1000)
    requests = [make_request(f"r{i}") for i in range(8)]
    first = Sampler(seed=5).sample(logits, requests).token_ids
    assert Sampler(seed=5).sample(logits, requests).token_ids == first
    assert Sampler(seed=6).sample(logits, requests).token_ids != first


def test_scratch_cut_from_full_size_blocks_draws_the_same_tokens():
    """The engine's sampler cuts its per-step temporaries from max_num_seqs-row blocks (so the GPU allocator
    reuses them): the draws of greedy, unseeded, seeded and truncated rows are those of row-sized temporaries."""
    logits = torch.randn(6, 300) * 3
    requests = [make_request("g", temperature=0.0), make_request("u", temperature=0.8),
                make_request("s", temperature=1.0, seed=11), make_request("k", temperature=1.2, top_k=5),
                make_request("p", temperature=0.9, top_p=0.7, seed=3), make_request("u2", temperature=1.0)]
    row_sized = Sampler(seed=4).sample(logits, requests).token_ids
    assert Sampler(seed=4, max_rows=256).sample(logits, requests).token_ids == row_sized
    assert Sampler(seed=4, max_rows=256).sample(logits[1:], requests[1:]).token_ids == \
        Sampler(seed=4).sample(logits[1:], requests[1:]).token_ids


def test_truncation_in_row_chunks_equals_all_rows_at_once():
    """The sampler applies top-k/top-p and min-p to 32 rows at a time (bounded temporaries): the masked logits
    of 70 rows (two whole chunks and a part) are those of the functions over all rows at once."""
    from engine.sampler import SAMPLER_CHUNK_ROWS, apply_min_p, apply_top_k_top_p, in_row_chunks

    rows = 2 * SAMPLER_CHUNK_ROWS + 6
    logits = torch.randn(rows, 500) * 4
    top_k = torch.randint(1, 501, (rows,))
    top_p = torch.rand(rows) * 0.9 + 0.1
    min_p = torch.rand(rows) * 0.3
    expected = apply_min_p(apply_top_k_top_p(logits, top_k, top_p), min_p)
    chunked = logits.clone()
    in_row_chunks(apply_top_k_top_p, chunked, top_k, top_p)
    in_row_chunks(apply_min_p, chunked, min_p)
    assert torch.equal(chunked, expected)
    assert torch.isinf(expected).any(1).all()  # every row lost tokens: the masks did something


def test_free_forgets_the_generator():
    sampler = Sampler()
    logits = torch.zeros(1, 1000)
    request = make_request("a", seed=11)
    first = [sampler.sample(logits, [request]).token_ids[0] for _ in range(3)]
    assert sampler.num_request_generators == 1
    sampler.free("a")
    assert sampler.num_request_generators == 0
    again = [sampler.sample(logits, [request]).token_ids[0] for _ in range(3)]
    assert again == first and len(set(first)) > 1


# --- penalties, min_tokens, logit_bias vs a per-row reference --------------------------------------------------

def reference_processed(row: torch.Tensor, request: Request) -> torch.Tensor:
    """The documented processing order, one row at a time with Python loops."""
    p = request.sampling_params
    row = row.clone().tolist()
    for token_id, bias in (p.logit_bias or {}).items():
        row[token_id] += bias
    if request.num_output_tokens < p.min_tokens:
        for token_id in list(p.stop_token_ids) + ([] if p.ignore_eos else list(request.eos_token_ids)):
            row[token_id] = -math.inf
    if p.repetition_penalty != 1.0:
        for token_id in set(request.prompt_token_ids + request.output_token_ids):
            value = row[token_id]
            row[token_id] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
    for token_id, count in Counter(request.output_token_ids).items():
        row[token_id] -= p.frequency_penalty * count + p.presence_penalty
    return torch.tensor(row)


def test_penalties_match_per_row_reference():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, VOCAB, generator=gen) * 3
    requests = [
        make_request("rep", prompt=[1, 2, 3, 3], output=[4, 5, 1], repetition_penalty=1.7),
        make_request("pres", output=[4, 4, 4, 9], presence_penalty=1.5),
        make_request("freq", output=[4, 4, 4, 9], frequency_penalty=0.75),
        make_request("all", prompt=[7, 8], output=[8, 8, 10], repetition_penalty=0.8, presence_penalty=-0.5,
                     frequency_penalty=1.25, logit_bias={10: 3.0, 11: -2.0}, min_tokens=5, stop_token_ids=[12],
                     eos=(0, 2)),
        make_request("plain", output=[4, 5]),
        make_request("bias", logit_bias={0: 100.0, 31: -100.0}),
    ]
    processed = apply_logits_processors(logits, requests)
    for i, request in enumerate(requests):
        assert_close(processed[i], reference_processed(logits[i], request))
    # And the greedy choice is the argmax of the reference-processed logits.
    for request in requests:
        request.sampling_params.temperature = 0.0
    chosen = Sampler().sample(logits, requests).token_ids
    assert chosen == [int(reference_processed(logits[i], r).argmax()) for i, r in enumerate(requests)]


def test_penalties_follow_a_growing_history():
    """The sampler keeps each request's token history between steps; it must track appended tokens,
    a request whose outputs were reset, and a freed request id that comes back with other tokens."""
    gen = torch.Generator().manual_seed(6)
    history = TokenHistory()
    requests = [make_request("a", prompt=[3, 4], repetition_penalty=1.4, frequency_penalty=0.5),
                make_request("b", prompt=list(range(20)), presence_penalty=0.9, repetition_penalty=0.7)]
    for step in range(40):
        logits = torch.randn(2, VOCAB, generator=gen) * 3
        processed = apply_logits_processors(logits, requests, history)
        for i, request in enumerate(requests):
            assert_close(processed[i], reference_processed(logits[i], request))
        for request in requests:
            request.output_token_ids.extend(torch.randint(VOCAB, (step % 3,), generator=gen).tolist())
        if step == 20:
            requests[0].output_token_ids.clear()
        if step == 30:
            history.free("b")
            requests[1] = make_request("b", prompt=[9], output=[9, 9], frequency_penalty=-1.0)


def test_repetition_penalty_direction():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    request = make_request(prompt=[0, 1], output=[], repetition_penalty=2.0, eos=())
    processed = apply_logits_processors(logits, [request])
    assert processed.tolist() == [[1.0, -4.0, 2.0, -2.0]]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_blocks_eos_and_stop_token_ids(temperature):
    logits = torch.zeros(256, VOCAB)
    logits[:, 2] = 10.0  # eos
    logits[:, 9] = 9.0  # a stop token id
    for num_output in range(3):
        requests = [make_request(f"r{i}", output=[5] * num_output, eos=(2,), stop_token_ids=[9], min_tokens=3,
                                 temperature=temperature) for i in range(256)]
        tokens = Sampler(seed=num_output).sample(logits, requests).token_ids
        assert 2 not in tokens and 9 not in tokens
    done = make_request(output=[5, 5, 5], eos=(2,), stop_token_ids=[9], min_tokens=3, temperature=0.0)
    assert Sampler().sample(logits[:1], [done]).token_ids == [2]
    # ignore_eos: eos does not end the request, so min_tokens has no reason to hide it (vLLM semantics).
    ignoring = make_request(output=[], eos=(2,), stop_token_ids=[9], min_tokens=3, ignore_eos=True,
                            temperature=0.0)
    assert Sampler().sample(logits[:1], [ignoring]).token_ids == [2]


def test_logit_bias_forces_and_forbids_tokens():
    logits = torch.randn(512, VOCAB, generator=torch.Generator().manual_seed(4))
    forced = [make_request(f"f{i}", logit_bias={17: 100.0}) for i in range(512)]
    assert set(Sampler().sample(logits, forced).token_ids) == {17}
    flat = torch.zeros(512, VOCAB)
    banned = [make_request(f"b{i}", logit_bias={t: -100.0 for t in range(16)}) for i in range(512)]
    tokens = Sampler().sample(flat, banned).token_ids
    assert min(tokens) >= 16 and len(set(tokens)) > 8


def test_validate_for_vocab_rejects_unknown_ids():
    with pytest.raises(EngineError) as info:
        check_params_vocab(SamplingParams(logit_bias={VOCAB: 1.0}), VOCAB)
    assert info.value.param == "logit_bias"
    with pytest.raises(EngineError):
        check_params_vocab(SamplingParams(stop_token_ids=[-1]), VOCAB)
    check_params_vocab(SamplingParams(logit_bias={VOCAB - 1: 1.0}, stop_token_ids=[0]), VOCAB)


# --- logprobs ----------------------------------------------------------------------------------------------------

def test_logprobs_come_from_raw_logits_and_include_top_k():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 200, generator=gen) * 2
    requests = [
        make_request("a", logprobs=3, temperature=0.7, repetition_penalty=1.5, output=[1, 2], top_k=20),
        make_request("b", logprobs=0, temperature=0.0, logit_bias={150: 50.0}),
        make_request("c"),
        make_request("d", logprobs=5, seed=3),
    ]
    out = Sampler().sample(logits, requests)
    reference = torch.log_softmax(logits.double(), dim=-1)
    assert out.logprobs[2] is None
    for i, request in enumerate(requests):
        entries = out.logprobs[i]
        if entries is None:
            continue
        chosen = out.token_ids[i]
        top = reference[i].topk(request.sampling_params.logprobs).indices.tolist()
        assert set(entries) == {chosen, *top}
        assert next(iter(entries)) == chosen  # the sampled token comes first
        for token_id, logprob in entries.items():
            assert logprob.token_id == token_id
            assert logprob.logprob == pytest.approx(float(reference[i, token_id]), abs=1e-5)
    assert out.token_ids[1] == 150 and list(out.logprobs[1]) == [150]  # biased choice, raw logprob


# --- GPU ------------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_greedy_and_seeded_reproducibility():
    device = torch.device("cuda")
    logits = torch.randn(64, 32000, device=device)
    greedy = [make_request(f"g{i}", temperature=0.0, top_p=0.9) for i in range(64)]
    assert Sampler().sample(logits, greedy).token_ids == logits.argmax(dim=-1).tolist()
    steps = [row.to(device) for row in _steps(vocab=32000)]
    sampler_alone, sampler_mixed = Sampler(seed=0), Sampler(seed=1)
    target_alone = make_request("a", seed=77, temperature=0.9, top_p=0.95)
    target_mixed = make_request("a", seed=77, temperature=0.9, top_p=0.95)
    for step, row in enumerate(steps):
        alone = sampler_alone.sample(row[None], [target_alone]).token_ids[0]
        position, others = _mixed_batch(step)
        batch = list(others)
        batch.insert(position, target_mixed)
        rows = torch.randn(len(batch), row.shape[0], device=device)
        rows[position] = row
        mixed = sampler_mixed.sample(rows, batch).token_ids[position]
        assert alone == mixed
        target_alone.output_token_ids.append(alone)
        target_mixed.output_token_ids.append(mixed)
