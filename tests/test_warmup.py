"""Issue 14: the start-up warm-up covers the eager step shapes and leaves the engine exactly as it found it.

On a GPU the engine runs it before serving (engine/warmup.py); here its pieces run on the CPU engine, where
the same scheduler, sampler and model code take the same requests.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from engine import SamplingParams
from engine.llm import LLM
from engine.warmup import eager_seq_buckets, eager_step, run_warmup_requests, use_triton_cache_under


@pytest.mark.parametrize("max_num_seqs, expected", [(64, [64]), (256, [64, 128, 256]), (100, [64, 100]),
                                                    (8, [8])])
def test_one_eager_warmup_step_per_sequence_bucket(max_num_seqs, expected):
    assert eager_seq_buckets(max_num_seqs, 64) == expected


def test_eager_warmup_step_spreads_tokens_and_writes_no_slot():
    step = eager_step(num_tokens=2050, num_seqs=64, block_size=16)
    lengths = np.diff(step.query_start_loc)
    assert step.num_tokens == 2050 and step.num_seqs == 64 and lengths.sum() == 2050
    assert lengths.max() - lengths.min() <= 1 and (step.context_lens == lengths).all()
    assert (step.slot_mapping == -1).all() and not step.is_decode
    assert step.width * 16 >= lengths.max() and (step.block_tables == 0).all()
    assert (step.logits_indices == step.query_start_loc[1:] - 1).all()


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(str(default_model_dir), dtype="float32", device="cpu", kv_cache_memory="64MiB")


def test_eager_warmup_forward_leaves_the_kv_cache_untouched(llm):
    runner = llm.engine.runner
    before = [k.clone() for k, _ in runner.kv_caches[:2]]
    step = eager_step(num_tokens=100, num_seqs=3, block_size=runner.args.block_size)
    logits = runner.model.forward(step.to_batch(runner.device))
    assert logits.shape == (3, runner.config.vocab_size) and torch.isfinite(logits).all()
    assert all(torch.equal(b, k) for b, (k, _) in zip(before, runner.kv_caches[:2]))


def test_warmup_requests_leave_no_trace(llm, default_model_dir):
    engine = llm.engine
    prompt = "The capital of France is"
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=12)
    stats_before = engine.stats()
    steps = run_warmup_requests(engine)
    assert steps > 3
    assert engine.stats() == stats_before  # counters, KV usage, prefix-cache figures all as they were
    kv = engine.kv_manager
    assert kv.block_pool.num_free_blocks == kv.num_total_blocks and kv.block_pool.num_cached_blocks == 0
    assert not engine.groups and not engine.has_unfinished_requests()
    assert engine.runner.sampler.num_request_generators == 0
    fresh = LLM(str(default_model_dir), dtype="float32", device="cpu", kv_cache_memory="64MiB")
    for params in (greedy, seeded):
        warmed_out = llm.generate(prompt, params)[0].outputs[0].token_ids
        fresh_out = fresh.generate(prompt, params)[0].outputs[0].token_ids
        assert warmed_out == fresh_out, params


def test_triton_cache_goes_under_pagoda_home_unless_chosen(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    use_triton_cache_under(tmp_path)
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere")
    use_triton_cache_under(tmp_path)
    assert os.environ["TRITON_CACHE_DIR"] == "/elsewhere"
