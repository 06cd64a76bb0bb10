"""Start-up warm-up: run every kind of step the engine can take once, before the first user request.

Triton compiles a kernel the first time it meets a new specialization (a new constexpr such as a block
count, an integer argument that is 1 or a multiple of 16, a new autotuning key), and CUDA loads a library's
kernels on their first call (sorting and random numbers in the sampler). Graph capture already runs the
decode batch sizes and the small ragged steps; what it leaves are the eager steps (more tokens than the
largest ragged graph: long prefill chunks, mixed prefill + decode steps) and the sampler's paths. Without this,
the first 128-request batch after a start ran at a fifth of the speed of the third, and the first chat's time
to first token was fifteen times the next one's.

The kernels keep the set small (step sizes that only bound loops are not specialized, sequence counts are
bucketed), so this is a handful of eager forwards, one per sequence-count bucket (run in the runner's trial
start-up, ``ModelRunner._trial_start_up``, which also measures their memory), and a few warm-up requests (``run_warmup_requests``) run from the thread
that will step the engine, since cuBLAS handles and CUDA's current stream belong to a thread. With Triton's
on-disk cache warm (``$PAGODA_HOME/triton``) both cost well under a second.

Nothing is left behind: the eager forwards write no KV slot (slot -1) and read only block 0, and the warm-up
requests are removed again, with the counters and the prefix cache as they were.
"""

from __future__ import annotations

import copy
import gc
import os
from pathlib import Path

import numpy as np

from engine.cuda_graph import StepInputs
from engine.request import Request, SamplingParams

TRITON_CACHE_ENV = "TRITON_CACHE_DIR"

# Sampled warm-up requests: greedy, and one that switches on every sampler feature at once.
WARMUP_SAMPLING = (
    SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1,
                   presence_penalty=0.5, frequency_penalty=0.5, seed=1, logprobs=2, logit_bias={0: 1.0},
                   min_tokens=1, max_tokens=3, ignore_eos=True),
)
WARMUP_PROMPT_LEN = 24
LONG_PROMPT_LEN = 600  # tokens: more than the largest ragged graph (512), so one step runs eagerly


def use_triton_cache_under(home: Path) -> None:
    """Keep Triton's compiled kernels and autotuning results in ``home/triton`` unless the user chose a place.

    Triton reads the variable when it compiles, so setting it before the first compile is enough; the
    environment is the process's one configuration channel Triton has (several engines share it gladly).
    """
    if not os.environ.get(TRITON_CACHE_ENV):
        os.environ[TRITON_CACHE_ENV] = str(home / "triton")


def eager_seq_buckets(max_num_seqs: int, bucket_floor: int) -> list[int]:
    """Sequence counts, one per power-of-two bucket the prefill attention kernel compiles for (see
    ``prefill_attention.seq_block``), covering 1 .. ``max_num_seqs``."""
    buckets, size = [], bucket_floor
    while True:
        buckets.append(min(size, max_num_seqs))
        if size >= max_num_seqs:
            return buckets
        size *= 2


def eager_step(num_tokens: int, num_seqs: int, block_size: int) -> StepInputs:
    """A ragged step of ``num_tokens`` prompt tokens split over ``num_seqs`` sequences that touches no KV:
    slots are -1 (the cache write skips them) and every block-table entry is block 0."""
    lengths = np.full(num_seqs, num_tokens // num_seqs, dtype=np.int32)
    lengths[: num_tokens % num_seqs] += 1
    starts = np.zeros(num_seqs + 1, dtype=np.int32)
    starts[1:] = np.cumsum(lengths)
    positions = np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])
    width = -(-int(lengths.max()) // block_size)
    return StepInputs(input_ids=np.zeros(num_tokens, np.int64), positions=positions,
                      slot_mapping=np.full(num_tokens, -1, np.int64), query_start_loc=starts,
                      context_lens=lengths.copy(), block_tables=np.zeros((num_seqs, width), np.int32),
                      logits_indices=(starts[1:] - 1).astype(np.int64), is_decode=False)


def sampler_trial_requests(rows: int) -> list[list[Request]]:
    """Two batches of ``rows`` requests for the sampler alone: every feature on (WARMUP_SAMPLING[1]), then
    greedy; each has a short prompt and one output token, so the penalties have a history to count."""
    return [[Request(request_id=f"pagoda-trial-{kind}-{i}", prompt_token_ids=[1 + i, 2, 3],
                     sampling_params=params, output_token_ids=[4]) for i in range(rows)]
            for kind, params in (("features", WARMUP_SAMPLING[1]), ("greedy", WARMUP_SAMPLING[0]))]


def warmup_prompts(lengths: list[int], vocab_size: int) -> list[list[int]]:
    """Distinct prompts of ordinary token ids (no prefix shared with each other or with user prompts)."""
    starts = np.cumsum([0, *lengths])
    return [[(7919 * (int(start) + j) + 17) % vocab_size for j in range(n)] for start, n in zip(starts, lengths)]


def run_warmup_requests(engine) -> int:
    """Generate a few tokens for each of WARMUP_SAMPLING together (the greedy one after a prompt long enough
    for an eager step, where the token budget and context allow), then for a greedy request alone (the
    sampler takes other paths when no row samples); afterwards the engine is as it was. Returns steps taken."""
    counters = copy.deepcopy(engine.counters)
    prefix_stats = copy.deepcopy(engine.kv_manager.prefix_cache_stats)
    long_len = LONG_PROMPT_LEN
    if long_len > min(engine.args.max_num_batched_tokens, engine.max_model_len - 8):
        long_len = WARMUP_PROMPT_LEN
    prompts = warmup_prompts([long_len] + [WARMUP_PROMPT_LEN] * len(WARMUP_SAMPLING),
                             engine.model_config.vocab_size)
    steps = 0
    for batch in (list(zip(prompts, WARMUP_SAMPLING)), [(prompts[-1], WARMUP_SAMPLING[0])]):
        ids = [f"pagoda-warmup-{steps}-{i}" for i in range(len(batch))]
        for request_id, (prompt, params) in zip(ids, batch):
            engine.add_request(request_id, prompt_token_ids=prompt, params=params)
        try:
            while engine.has_unfinished_requests():
                engine.step()
                steps += 1
        finally:
            for request_id in ids:
                engine.abort_request(request_id)
    engine.counters = counters
    engine.kv_manager.prefix_cache_stats = prefix_stats
    engine.kv_manager.block_pool.reset_prefix_cache()
    return steps


def settle_garbage_collector() -> None:
    """Collect start-up's garbage now and move what survives out of the collector's sight.

    Loading, compiling and capturing leave millions of objects; the first full collection over them would
    otherwise land in the middle of a user's first request. Freezing keeps later collections to the objects
    serving creates (what vLLM and SGLang do after start-up too).
    """
    gc.collect()
    gc.freeze()
