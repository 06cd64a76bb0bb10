"""The grammar process (engine/grammar_worker.py): its masks and consume statuses equal llguidance's own run in
this process on the same tokens; a grammar that does not compile is refused with the compiler's message; a dead
process fails the step with a clear error instead of hanging it."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from engine.errors import EngineError
from engine.grammar_worker import STATUS_OK, STATUS_REJECTED, STATUS_STOPPED, GrammarProcess
from engine.structured_output import StructuredOutputsParams, _tokenizer_json

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "ok": {"type": "boolean"}}, "required": ["name", "ok"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from engine.tokenizer import Tokenizer

    return Tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def process(tokenizer):
    vocab = len(tokenizer.hf)
    process = GrammarProcess(_tokenizer_json(tokenizer.hf), vocab, (tokenizer.hf.eos_token_id,), max_rows=4)
    yield process
    process.close()


def allowed_ids(row: np.ndarray) -> np.ndarray:
    return np.nonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))[0]


def test_masks_and_statuses_equal_llguidance_in_process(process, tokenizer):
    import llguidance
    import llguidance.hf

    vocab = len(tokenizer.hf)
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer.hf, n_vocab=vocab, eos_token=tokenizer.hf.eos_token_id)
    source = StructuredOutputsParams.from_schema(SCHEMA).grammar_source()
    regex = StructuredOutputsParams(regex=r"(yes|no)[0-9]{2}").grammar_source()
    sources = {10: source, 11: source, 12: regex}  # slot -> grammar: two copies of one schema, one regex
    assert [process.add(slot, text) for slot, text in sources.items()] == [True, False, True]
    oracles = {slot: llguidance.LLMatcher(ll_tokenizer, text, log_level=0) for slot, text in sources.items()}
    rng = random.Random(0)
    slots, pending = list(sources), []  # pending: (slot, token) to consume in the next step
    for _ in range(30):
        rows = [(row, slot) for row, slot in enumerate(slots)]
        seq = process.post(pending, rows)
        statuses = process.wait(seq)
        for (slot, token), status in zip(pending, statuses):
            accepted = oracles[slot].consume_token(token)
            expected = STATUS_REJECTED if not accepted else STATUS_STOPPED if oracles[slot].is_stopped() else STATUS_OK
            assert status == expected
        pending = []
        for row, slot in rows:
            expected = allowed_ids(np.frombuffer(oracles[slot].compute_bitmask(), dtype=np.int32))
            got = allowed_ids(process.shared.bitmask[row].copy())
            assert np.array_equal(got, expected), (slot, len(got), len(expected))
            if oracles[slot].is_stopped():
                assert list(got) == [tokenizer.hf.eos_token_id]  # a complete grammar allows only EOS
            else:
                pending.append((slot, int(rng.choice(list(got)))))
    finished = [slot for slot in slots if oracles[slot].is_stopped()]
    assert finished, "no grammar completed in 30 random valid steps"
    # a token a grammar forbids is reported as rejected
    process.add(13, regex)
    oracle = llguidance.LLMatcher(ll_tokenizer, regex, log_level=0)
    bad = next(t for t in range(vocab) if not oracle.validate_tokens([t]))
    assert list(process.wait(process.post([(13, bad)], []))) == [STATUS_REJECTED]
    for slot in (*slots, 13):
        process.free(slot)


def test_a_grammar_that_does_not_compile_is_refused_with_the_reason(process):
    bad_schema = StructuredOutputsParams.from_schema({"type": "object", "properties": {"a": {"$ref": "#/nope"}}})
    with pytest.raises(EngineError, match="cannot be compiled"):
        process.add(20, bad_schema.grammar_source())
    assert process.add(21, StructuredOutputsParams(choice=("a", "b")).grammar_source())  # still serving
    process.free(21)


def test_a_dead_grammar_process_fails_the_step_with_a_clear_error(tokenizer):
    process = GrammarProcess(_tokenizer_json(tokenizer.hf), len(tokenizer.hf), (tokenizer.hf.eos_token_id,), 2)
    try:
        process.add(0, StructuredOutputsParams(regex="[a-z]+").grammar_source())
        process._process.kill()
        process._process.wait()
        seq = process.post([], [(0, 0)])
        with pytest.raises(EngineError, match="grammar process died"):
            process.wait(seq)
    finally:
        process.close()


def test_the_engine_ends_constrained_requests_whose_grammar_completes(default_model_dir):
    from engine import LLM, SamplingParams

    llm = LLM(str(default_model_dir), dtype="float32", device="cpu", max_num_seqs=4)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=64,
                            structured_outputs=StructuredOutputsParams.from_schema(SCHEMA))
    outputs = llm.generate([f"Describe person {i} as JSON." for i in range(6)], params)
    for output in outputs:
        sample = output.outputs[0]
        assert sample.finish_reason == "stop", sample.text
        assert set(json.loads(sample.text)) == {"name", "ok"}
    assert llm.engine.structured.num_requests == 0
    llm.engine.release()


def test_the_manager_starts_a_new_grammar_process_after_one_died(tokenizer):
    from types import SimpleNamespace

    from engine.structured_output import StructuredOutputManager

    manager = StructuredOutputManager(tokenizer, len(tokenizer.hf), (tokenizer.hf.eos_token_id,), max_rows=2)
    params = StructuredOutputsParams(choice=("yes", "no"))
    try:
        manager.add(["a"], params)
        first = manager._process
        first._process.kill()
        first._process.wait()
        request = SimpleNamespace(request_id="a", output_token_ids=[])
        with pytest.raises(EngineError):  # the dead process's matcher is gone: its request fails
            manager.token_masks([request])
        manager.free("a")  # freeing into a dead process is no error
        manager.add(["b"], params)  # a new request gets a new process
        assert manager._process is not first and manager._process.alive
        masks = manager.token_masks([SimpleNamespace(request_id="b", output_token_ids=[])])
        assert 0 < len(allowed_ids(masks.bitmask[0])) < 10  # the starts of "yes" and "no"
    finally:
        manager.close()
