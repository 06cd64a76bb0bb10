"""Scheduling a decode step before the previous step's tokens are back (``--async-scheduling``) changes no output.

The engine launches step N + 1 while step N computes, reading N's sampled tokens on the device, and fills the
host's placeholders once N's tokens arrive. Users must see exactly what the step-by-step engine gives them:
the same tokens, finish reasons and stop handling, under KV pressure with preemption, and no block left held.
"""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams


def make_llm(model_dir, async_scheduling: bool, **kwargs) -> LLM:
    args = {"dtype": "float32", "device": "cpu", "kv_cache_memory": "10MiB", "max_num_batched_tokens": 64,
            "max_num_seqs": 8, "async_scheduling": async_scheduling}
    args.update(kwargs)
    return LLM(str(model_dir), **args)


def mixed_requests(vocab: int, count: int, seed: int = 0) -> tuple[list[dict], list[SamplingParams]]:
    """Prompts of 20-60 random tokens; greedy, seeded, and top-p requests that stop on common tokens."""
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(20, 60))]}
               for _ in range(count)]
    params = []
    for i in range(count):
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 12), ignore_eos=True))
        elif i % 3 == 1:
            params.append(SamplingParams(temperature=1.0, seed=i, max_tokens=rng.randint(1, 12), ignore_eos=True))
        else:  # ends on whichever of many tokens comes first: requests stop while a step runs ahead of them
            params.append(SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=16,
                                         stop_token_ids=list(range(3, vocab, 7))))
    return prompts, params


def counting_steps_ahead(llm: LLM) -> list[int]:
    """Wrap the engine's decision so the test sees how many steps were scheduled ahead."""
    engine, count = llm.engine, [0]
    decide = engine._can_schedule_ahead

    def counted(step):
        ahead = decide(step)
        count[0] += ahead
        return ahead

    engine._can_schedule_ahead = counted
    return count


def finished(outputs) -> list[tuple[list[int], str | None]]:
    return [(out.outputs[0].token_ids, out.outputs[0].finish_reason) for out in outputs]


def test_outputs_equal_the_step_by_step_engine_under_preemption(default_model_dir):
    plain, ahead = make_llm(default_model_dir, False), make_llm(default_model_dir, True)
    vocab = plain.engine.model_config.vocab_size
    prompts, params = mixed_requests(vocab, 12)
    expected = finished(plain.generate(prompts, params))
    steps_ahead = counting_steps_ahead(ahead)
    got = finished(ahead.generate(prompts, params))
    assert got == expected
    assert ahead.stats()["num_preemptions"] > 0  # the KV cache ran out: preemption happened around steps ahead
    assert steps_ahead[0] > 0
    assert any(reason == "stop" for _, reason in got)  # some request stopped on a sampled stop token
    stats = ahead.stats()
    assert stats["num_free_blocks"] + stats["num_cached_blocks"] == stats["num_total_blocks"]


def test_a_stop_string_ends_the_request_as_without_scheduling_ahead(default_model_dir):
    """Stop strings are found in the text one step late, while a step runs ahead: the ahead step's token is
    dropped and the text ends where it ends without async scheduling."""
    plain, ahead = make_llm(default_model_dir, False), make_llm(default_model_dir, True)
    probe = plain.generate("Once upon a time", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    text = probe[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    params = SamplingParams(temperature=0.0, max_tokens=12, stop=[stop], ignore_eos=True)
    expected = plain.generate("Once upon a time", params)[0].outputs[0]
    steps_ahead = counting_steps_ahead(ahead)
    got = ahead.generate("Once upon a time", params)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason) == (expected.text, expected.token_ids,
                                                            expected.finish_reason)
    assert got.finish_reason == "stop" and stop not in got.text
    assert steps_ahead[0] > 0


@pytest.mark.parametrize("abort_after", [1, 4])
def test_aborting_while_a_step_runs_ahead_frees_everything(default_model_dir, abort_after):
    llm = make_llm(default_model_dir, True, kv_cache_memory="64MiB")  # room for all four: no preemption
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    prompts, _ = mixed_requests(vocab, 4, seed=abort_after)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt_token_ids=prompt["prompt_token_ids"],
                           params=SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    for _ in range(40):
        if engine.tokens_in_flight and all(r.num_output_tokens >= abort_after
                                                 for r in engine.scheduler.running):
            break  # decoding, the next step launched ahead
        engine.step()
    assert len(engine.tokens_in_flight) == 4 and len(engine.scheduler.running) == 4
    engine.abort_request("r0")
    engine.abort_request("r2")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    done = {out.request_id: out for out in outputs if out.finished}
    assert set(done) == {"r1", "r3"}
    alone = make_llm(default_model_dir, False, kv_cache_memory="64MiB").generate(
        [prompts[1], prompts[3]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert [done["r1"].outputs[0].token_ids, done["r3"].outputs[0].token_ids] == [o.outputs[0].token_ids
                                                                                for o in alone]
    stats = llm.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_free_blocks"] + stats["num_cached_blocks"] == stats["num_total_blocks"]
