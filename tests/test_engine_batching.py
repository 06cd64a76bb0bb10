"""Issue 3 end to end on the real default model: continuous batching, preemption, prefix caching, no leaks."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams

PASSAGE = ("The history of the river towns is a story of trade, floods and bridges. Merchants brought salt and "
           "cloth upstream, while farmers sent grain and wool to the coast. Every spring the water rose, and every "
           "summer the people rebuilt what the river had taken. Over centuries the bridges grew from rope to timber "
           "to stone, and the towns grew with them into cities with markets, schools and libraries.")
TEXT = PASSAGE.split()  # the words prompts are cut from


def mixed_prompts(count: int) -> list[str]:
    """Prompts of varied lengths (about 4 to 180 tokens) cut from one text at different offsets."""
    prompts = []
    for i in range(count):
        length = 3 + (i * 37) % 70
        start = (i * 11) % len(TEXT)
        words = (TEXT[start:] + TEXT)[:length]
        prompts.append(" ".join(words))
    return prompts


def make_llm(model_dir, **kwargs):
    from engine import LLM

    args = {"dtype": "float32", "device": "cpu", "kv_cache_memory": "256MiB"}
    args.update(kwargs)
    return LLM(str(model_dir), **args)


def assert_all_blocks_free(llm):
    stats = llm.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_free_blocks"] + stats["num_cached_blocks"] == stats["num_total_blocks"]
    assert stats["kv_cache_usage"] == 0.0


@pytest.fixture(scope="module")
def reference_outputs(default_model_dir):
    """Each prompt generated alone (one request in the engine at a time), no prefix caching."""
    llm = make_llm(default_model_dir, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return {p: llm.generate(p, params)[0].outputs[0].token_ids for p in mixed_prompts(32)}


def test_batched_with_preemption_matches_alone_and_transformers(default_model_dir, reference_outputs,
                                                                fp16_reference):
    # ~34 blocks of 16 tokens for 32 prompts of up to ~80 tokens + 12 outputs: preemption is forced,
    # and a 64-token budget chunks the long prompts and mixes them with decodes.
    llm = make_llm(default_model_dir, kv_cache_memory="24MiB", max_num_batched_tokens=64, max_num_seqs=32)
    prompts = mixed_prompts(32)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == reference_outputs[prompt], prompt
    assert_all_blocks_free(llm)

    hf = fp16_reference  # transformers, float32
    for out in outputs[::4]:  # every prompt equals its lone run above; a quarter of them (3 to 59 words) vs HF
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                              min_new_tokens=12, pad_token_id=2)
        assert out.outputs[0].token_ids == gen[0, ids.shape[1]:].tolist()


def test_shared_system_prompt_hits_prefix_cache(default_model_dir):
    system = " ".join(TEXT * 2)  # ~170 tokens shared by every request
    questions = ["Where did merchants go?", "What rose every spring?", "What were bridges made of?",
                 "Name a building in the cities."]
    conversations = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in questions]
    params = SamplingParams(temperature=0.0, max_tokens=8)

    cached = make_llm(default_model_dir, enable_prefix_caching=True)
    cached.chat(conversations[:1], params)  # warm the cache with the shared prefix
    before = cached.stats()
    second = cached.chat(conversations[1:], params)
    after = cached.stats()

    uncached = make_llm(default_model_dir, enable_prefix_caching=False)
    baseline = uncached.chat(conversations[1:], params)
    for a, b in zip(second, baseline):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids

    block = after["block_size"]
    system_ids = cached.tokenizer.encode_chat(conversations[0][:1], add_generation_prompt=False)
    shared_full_blocks = len(system_ids) // block
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    for out in second:
        assert out.num_cached_tokens >= shared_full_blocks * block
        # every full block of the prompt that the warm-up request also had is a hit
    assert hits >= shared_full_blocks * block * len(second)
    assert_all_blocks_free(cached)


def test_no_waste_and_no_leaks_when_stepping_and_aborting(default_model_dir):
    llm = make_llm(default_model_dir, kv_cache_memory="24MiB", max_num_batched_tokens=48)
    engine = llm.engine
    prompts = mixed_prompts(12)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt=prompt, params=SamplingParams(temperature=0.8, seed=i, max_tokens=10))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        block = engine.runner.layout.block_size
        in_flight = engine.tokens_in_flight  # a step launched ahead holds its tokens' slots
        for req in engine.scheduler.running_requests():
            held = engine.kv_manager.num_blocks_held(req.request_id) * block
            assert 0 <= held - (req.num_computed_tokens + in_flight.get(req.request_id, 0)) < block
        if steps == 5:
            engine.abort_request("r0")
            engine.abort_request("r5")
    assert_all_blocks_free(llm)
    assert not engine.groups


def test_seeded_sampling_is_reproducible_across_batches(default_model_dir):
    llm = make_llm(default_model_dir)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate("Write a story about a cat:", seeded)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=5 + i, ignore_eos=True) for i in range(6)]
    batch = llm.generate(["Write a story about a cat:"] + mixed_prompts(6), [seeded] + others)
    assert batch[0].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=16, ignore_eos=True)
    assert llm.generate("Write a story about a cat:", other_seed)[0].outputs[0].token_ids != alone


def test_n_samples_share_prompt_blocks(default_model_dir):
    llm = make_llm(default_model_dir)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    out = llm.generate(" ".join(TEXT), params)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 8 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1  # independent samples
    assert_all_blocks_free(llm)
