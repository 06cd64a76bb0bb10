"""Issue 20: tensor parallelism (--tensor-parallel-size) on CPU: gloo between the engine process and workers.

The same code runs NCCL on GPUs; here every rank is a CPU process. What a user sees: greedy tokens at TP=N equal
TP=1 (offline, and through ``app.py serve`` with the openai client on the default model at TP=3), for dense and
AWQ weights; a split that does
not divide is refused with the numbers; a worker that dies ends the in-flight and later requests with an error
while the server keeps answering. The TP=2 model is a random-weight Llama written by transformers whose heads
(4 q, 2 kv) and MLP divide by 2, with biases on every projection (o and down: added once after the all-reduce)
and an odd vocabulary (255: the last rank's head slice is padded); the default model (9 q / 3 kv heads) runs at
TP=3.
"""

from __future__ import annotations

import http.client
import json
import time

import openai
import psutil
import pytest
import torch
from server_process import launch_server
from test_model_families import build_checkpoint, write_rtn_checkpoint

from engine import LLM, SamplingParams
from engine.errors import EngineError, EngineStepError
from engine.layers.linear import PackedInt4

GREEDY = SamplingParams(temperature=0, max_tokens=6)
TINY_PROMPTS = [[5, 9, 33, 70, 12], list(range(3, 40))]  # token ids of the word-level vocabulary


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("tp-llama"), "llama", attention_bias=True, mlp_bias=True,
                            vocab_size=255, hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="module")
def tiny_awq(tiny_llama, tmp_path_factory):
    """An AWQ (GEMM) checkpoint of the tiny model, groups of 32: its o and down shards are 64 and 128 rows (whole
    64-row blocks of the packed layout, two groups each)."""
    return write_rtn_checkpoint(tiny_llama, tmp_path_factory.mktemp("tp-awq") / "awq", group_size=32)


def greedy_tokens(model_dir, prompts: list[list[int]], **engine_args) -> list[list[int]]:
    llm = LLM(str(model_dir), device="cpu", dtype="float32", **engine_args)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        return [o.outputs[0].token_ids for o in outputs]
    finally:
        llm.engine.release()


def worker_processes(root: psutil.Process) -> list[psutil.Process]:
    """Spawned multiprocessing children under ``root`` (the TP workers; not the resource tracker)."""
    return [p for p in root.children(recursive=True) if "spawn_main" in " ".join(p.cmdline())]


def test_tp2_greedy_equals_tp1_and_a_killed_worker_fails_the_next_step(tiny_llama):
    expected = greedy_tokens(tiny_llama, TINY_PROMPTS)
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", tensor_parallel_size=2)
    try:
        assert llm.engine.runner.config.num_heads == 2 and llm.engine.runner.config.num_kv_heads == 1
        outputs = llm.generate([{"prompt_token_ids": p} for p in TINY_PROMPTS], GREEDY)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        (worker,) = llm.engine.runner.workers.processes
        worker.kill()
        worker.join(10)
        started = time.monotonic()
        with pytest.raises(EngineStepError, match="rank 1"):
            llm.generate([{"prompt_token_ids": TINY_PROMPTS[0]}], GREEDY)
        with pytest.raises(EngineStepError, match="rank 1"):  # later requests too, without waiting
            llm.generate([{"prompt_token_ids": TINY_PROMPTS[1]}], GREEDY)
        assert time.monotonic() - started < 10
    finally:
        llm.engine.release()
    assert not worker_processes(psutil.Process())


def test_tp2_splits_phi3_fused_projections_block_by_block(tmp_path):
    """Phi-3 stores qkv_proj and gate_up_proj as one matrix each: every rank takes its slice of q, k, v (and of
    gate, up) from within it."""
    phi3 = build_checkpoint(tmp_path / "phi3", "phi3")
    assert greedy_tokens(phi3, TINY_PROMPTS, tensor_parallel_size=2) == greedy_tokens(phi3, TINY_PROMPTS)


def test_tp2_awq_greedy_equals_tp1(tiny_awq):
    assert greedy_tokens(tiny_awq, TINY_PROMPTS, tensor_parallel_size=2) == greedy_tokens(tiny_awq, TINY_PROMPTS)


DEFAULT_PROMPTS = [[1, 9690, 198, 2683, 359, 253, 5356, 5646], [1, 9690, 198, 2683]]  # ids of the real vocabulary


@pytest.fixture(scope="module")
def default_tp1(default_model_dir):
    """The default model's greedy tokens and text for DEFAULT_PROMPTS on one rank."""
    llm = LLM(str(default_model_dir), device="cpu", dtype="float32")
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in DEFAULT_PROMPTS], GREEDY)
        return [o.outputs[0].token_ids for o in outputs], [o.outputs[0].text for o in outputs]
    finally:
        llm.engine.release()


def test_tp3_on_the_default_model_equals_tp1(default_model_dir, default_tp1):
    # the default model's 9 q / 3 kv heads split 3 ways (not 2: refused below)
    assert greedy_tokens(default_model_dir, DEFAULT_PROMPTS, tensor_parallel_size=3) == default_tp1[0]


def test_a_split_that_does_not_divide_is_refused_with_the_numbers(default_model_dir, tmp_path):
    with pytest.raises(EngineError, match=r"num_attention_heads \(9\)") as info:
        LLM(str(default_model_dir), device="cpu", tensor_parallel_size=2)
    assert info.value.param == "tensor_parallel_size"
    # three groups of 128 over down_proj's 384 input features: a TP=2 shard of 192 rows splits one (found loading)
    dense = build_checkpoint(tmp_path / "wide", "llama", hidden_size=256, intermediate_size=384)
    coarse = write_rtn_checkpoint(dense, tmp_path / "awq128", group_size=128)
    with pytest.raises(EngineError, match="down_proj: a shard of 192 of its 384 input features .* groups of 128"):
        LLM(str(coarse), device="cpu", tensor_parallel_size=2)
    assert not worker_processes(psutil.Process())  # the workers of the failed load were stopped


def test_act_order_and_split_blocks_are_refused_by_the_row_shard():
    qweight = torch.zeros(128 // 8, 16, dtype=torch.int32)  # K = 128, N = 16
    groups = torch.ones(128 // 32, 16)
    weight = PackedInt4(qweight, groups, groups, 32, perm=torch.randperm(128))
    with pytest.raises(EngineError, match="act-order"):
        weight.rows(0, 64, "down_proj")
    plain = PackedInt4(qweight, groups, groups, 32)
    assert plain.rows(64, 128, "down_proj").in_features == 64
    with pytest.raises(EngineError, match="down_proj: a shard of 32 of its 128 input features .* 64-row blocks"):
        plain.rows(32, 64, "down_proj")
    coarse = PackedInt4(torch.zeros(256 // 8, 16, dtype=torch.int32), torch.ones(2, 16), torch.ones(2, 16), 128)
    with pytest.raises(EngineError, match="groups of 128"):  # whole blocks, half a group
        coarse.rows(0, 64, "down_proj")


def test_serve_tp3_matches_offline_and_survives_a_dead_worker(default_model_dir, default_tp1):
    # the default model through app.py serve and the openai client, split over three ranks
    with launch_server(default_model_dir, "--tensor-parallel-size", "3", ui=False) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60, max_retries=0)
        model = client.models.list().data[0].id
        reply = client.completions.create(model=model, prompt=DEFAULT_PROMPTS[0], max_tokens=6, temperature=0)
        assert reply.choices[0].text == default_tp1[1][0]
        workers = [p for p in worker_processes(psutil.Process()) if "app.py" in " ".join(p.parent().cmdline())]
        assert len(workers) == 2
        worker = workers[0]
        stream = client.completions.create(model=model, prompt=DEFAULT_PROMPTS[1], max_tokens=400, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        with pytest.raises(openai.APIError, match="tensor-parallel"):
            for index, _chunk in enumerate(stream):
                if index == 0:
                    worker.kill()  # mid-stream: the request in flight must end with an error
        with pytest.raises(openai.InternalServerError, match="tensor-parallel"):
            client.completions.create(model=model, prompt=DEFAULT_PROMPTS[0], max_tokens=6, temperature=0)
        # a failed request is an OpenAI-shaped 500 on a connection that stays open for the next request
        host, port = url.removeprefix("http://").split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=30)
        body = json.dumps({"model": model, "prompt": DEFAULT_PROMPTS[0], "max_tokens": 6})
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        failed = connection.getresponse()
        assert failed.status == 500 and json.loads(failed.read())["error"]["code"] == "engine_error"
        sock = connection.sock
        connection.request("GET", "/health")
        assert connection.getresponse().status == 200 and connection.sock is sock  # the same connection
