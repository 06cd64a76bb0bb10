"""The engine on a CUDA GPU with the Triton kernels, against HF transformers on random-weight models of real shapes.

The GPU machine reaches no Hub or registry, so the models are built there with random weights (the work per
token is the same) and a small word-level tokenizer made in the test.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch

from engine import SamplingParams
from engine.memory import allocator_limit

pytestmark = pytest.mark.gpu

SHAPES = {
    # SmolLM2-135M: GQA 9/3 heads, tied embeddings
    "smollm2-135m": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                     "tie_word_embeddings": True, "rope_theta": 100000.0},
    # Llama-2-7B layer shape, 4 layers to keep the build fast
    "llama2-7b-4l": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 4,
                     "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
                     "tie_word_embeddings": False, "rope_theta": 10000.0},
}


def write_word_tokenizer(folder: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w2", bos_token="w1", unk_token="w0")
    fast.save_pretrained(folder)


def build_random_model(folder: Path, shape: dict, seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**shape, max_position_embeddings=4096, rms_norm_eps=1e-5, bos_token_id=1,
                         eos_token_id=2, initializer_range=0.05)
    model = LlamaForCausalLM(config).to(torch.float16)
    model.save_pretrained(folder, safe_serialization=True)
    write_word_tokenizer(folder, shape["vocab_size"])
    return folder


@pytest.fixture(scope="module", params=list(SHAPES))
def random_model(request, tmp_path_factory):
    return build_random_model(tmp_path_factory.mktemp(request.param), SHAPES[request.param])


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float16).cuda().eval()
    outs = []
    for ids in prompts:
        x = torch.tensor([ids], device="cuda")
        with torch.no_grad():
            gen = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new_tokens,
                              min_new_tokens=max_new_tokens, pad_token_id=0)
        outs.append(gen[0, len(ids):].tolist())
    del hf
    torch.cuda.empty_cache()
    return outs


def hf_logprobs_along(model_dir: Path, sequences: list[list[int]]) -> list[torch.Tensor]:
    """HF's next-token logits (float32 copies of the fp16 logits) at every position of each sequence."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float16).cuda().eval()
    with torch.no_grad():
        rows = [hf(torch.tensor([ids], device="cuda")).logits[0].float().cpu() for ids in sequences]
    del hf
    torch.cuda.empty_cache()
    return rows


def fp16_ulp(value: float) -> float:
    return 2.0 ** (math.floor(math.log2(max(abs(value), 2.0 ** -14))) - 10)


def random_prompts(model_dir: Path) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (7, 33, 130, 517)]


@pytest.mark.parametrize("kernels", ["triton-graphs", "triton-eager", "reference"])
def test_greedy_matches_transformers_on_gpu(random_model, kernels):
    """Every greedy token we pick is HF's greedy pick at that position, up to fp16 near-ties.

    Teacher forcing on our own output: HF scores prompt + our tokens in one forward; at each generated position
    our token's logit must be HF's largest or within 2 fp16 ulps (+0.02) of it (random-weight models have flat
    logits, and fp16
    through different kernels rounds differently, so exact near-ties can flip and the continuations diverge).
    Sequences that never meet a near-tie come out identical to HF's own greedy generation.
    """
    from engine import LLM

    prompts = random_prompts(random_model)
    # a 512-token step budget chunks the 517-token prompt, so steps mix prefill chunks with decodes
    llm = LLM(str(random_model), dtype="float16", device="cuda", gpu_memory_limit="16GiB", max_num_seqs=32,
              max_num_batched_tokens=512, force_reference_kernels=kernels == "reference",
              enforce_eager=kernels == "triton-eager")
    runner = llm.engine.runner
    assert runner.backend.use_triton == kernels.startswith("triton")
    assert (runner.graphs is not None) == (kernels == "triton-graphs")
    # different lengths: the decode batch shrinks 4 -> 3 -> 2 -> 1, so graphs of padded sizes replay too
    lengths = [16, 12, 9, 5]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths])
    generated = [o.outputs[0].token_ids for o in outs]
    assert [len(g) for g in generated] == lengths
    if kernels == "triton-graphs":  # prefill chunks and mixed steps replay ragged graphs, the rest decode ones
        assert runner.graphs.replays["ragged"] >= 2 and runner.graphs.replays["decode"] >= 10, runner.graphs.replays
    llm.engine.release()  # its memory and its share of the allocator limit back before transformers loads
    del llm, runner
    torch.cuda.empty_cache()
    rows = hf_logprobs_along(random_model, [p + g for p, g in zip(prompts, generated)])
    for prompt, tokens, logits in zip(prompts, generated, rows):
        for step, token in enumerate(tokens):
            row = logits[len(prompt) - 1 + step]
            top = float(row.max())
            gap = top - float(row[token])
            assert gap <= 0.02 + 2 * fp16_ulp(top), (step, token, int(row.argmax()), gap, top)
    expected = hf_greedy(random_model, prompts, 16)
    assert sum(g == e[:len(g)] for g, e in zip(generated, expected)) >= 1


def test_scheduling_ahead_changes_no_output_on_gpu(random_model):
    """--async-scheduling with CUDA graphs: a decode step launched ahead gathers its input ids on the device from
    the previous step's samples into the graph's static buffer. Every token and finish reason equals the
    step-by-step engine's (greedy, seeded, top-p requests ending on stop tokens), and steps did run ahead."""
    from test_async_scheduling import counting_steps_ahead, finished, mixed_requests

    from engine import LLM

    results = {}
    for async_scheduling in (False, True):
        llm = LLM(str(random_model), dtype="float16", device="cuda", gpu_memory_limit="16GiB", max_num_seqs=32,
                  async_scheduling=async_scheduling)
        prompts, params = mixed_requests(llm.engine.model_config.vocab_size, 24)
        steps_ahead = counting_steps_ahead(llm)
        results[async_scheduling] = finished(llm.generate(prompts, params))
        assert (steps_ahead[0] > 0) == async_scheduling, steps_ahead
        assert llm.engine.runner.graphs.replays["decode"] > 0
        llm.engine.release()
    assert results[True] == results[False]


@pytest.mark.parametrize("mode", ["graphs", "eager"])
def test_decode_speed_report(random_model, mode, capsys):
    """Not a target check (bench/latency.py owns those): prints batch-1 and batch-32 decode rates with and
    without CUDA graphs, so a regression of either shows in the GPU test log."""
    from engine import LLM

    llm = LLM(str(random_model), dtype="float16", device="cuda", gpu_memory_limit="16GiB", max_num_seqs=32,
              enforce_eager=mode == "eager")
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    llm.generate({"prompt_token_ids": [5] * 16}, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    for batch in (1, 32):
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": [5 + i] * 16} for i in range(batch)], params)
        torch.cuda.synchronize()
        rate = batch * 128 / (time.perf_counter() - start)
        with capsys.disabled():
            print(f"\n[decode-rate] {random_model.name} {mode} batch {batch}: {rate:.0f} tok/s")
    llm.engine.release()


def test_the_process_stays_within_its_memory_budget_as_the_driver_counts_it(random_model):
    """--gpu-memory-limit is what the device may hold for the process (torch's pool, the CUDA context, kernels):
    after start-up at the default max_num_seqs and a full batch of 256 decoding requests, the driver's count of
    the process is at or below it."""
    import gc

    from engine import LLM

    gc.collect()  # earlier tests' engines: their memory back to the driver, their peaks forgotten
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    llm = LLM(str(random_model), dtype="float16", device="cuda", gpu_memory_limit="6GiB")
    runner = llm.engine.runner
    budget = runner.memory_profile.budget
    assert runner.memory_profile.outside_torch > 0  # the CUDA context at least
    assert runner.memory_profile.torch_limit == budget  # the room outside torch left to fragmentation
    # runner.device is "cuda" without an index: torch's fraction functions need one (engine/memory.py resolves it)
    assert allocator_limit(runner.device) == pytest.approx(runner.memory_profile.torch_limit, abs=2**20)
    assert runner.driver_counted_bytes() <= budget
    prompts = [{"prompt_token_ids": p[:64]} for p in random_prompts(random_model)] * 64  # 256 requests
    llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True))
    device = runner.device
    peak = torch.cuda.max_memory_reserved(device) + (runner.driver_counted_bytes() - torch.cuda.memory_reserved(device))
    assert peak <= budget, (peak / 2**30, budget / 2**30)
    llm.engine.release()
    assert allocator_limit(device) == 0  # the engine gave its limit back


def test_engines_add_their_shares_of_the_allocator_limit_and_give_them_back():
    """Two engines alive in one process (a switch that keeps the old model serving) each keep their room."""
    import gc

    from engine.memory import TorchPoolLimit

    gc.collect()  # earlier tests' engines give their shares back when collected
    device = torch.device("cuda")  # no index: the current device, as the engine's own
    assert allocator_limit(device) == 0
    first, second = TorchPoolLimit(device), TorchPoolLimit(device)
    try:
        first.hold(8 * 2**30)
        second.hold(4 * 2**30)
        assert allocator_limit(device) == pytest.approx(12 * 2**30, abs=2**20)
        first.hold(6 * 2**30)  # the trial's measure tightens a share
        assert allocator_limit(device) == pytest.approx(10 * 2**30, abs=2**20)
        first.release()
        assert allocator_limit(device) == pytest.approx(4 * 2**30, abs=2**20)
    finally:
        first.release()
        second.release()
    assert allocator_limit(device) == 0


def test_under_its_limit_the_allocator_reuses_memory_instead_of_growing():
    """Blocks of ever larger sizes, one alive at a time: unlimited, the caching allocator keeps every freed
    segment and its pool grows by their sum; under a limit it hands its cached segments back and stays there."""
    import gc

    from engine.memory import TorchPoolLimit

    gc.collect()
    device = torch.device("cuda")
    assert allocator_limit(device) == 0  # no engine's share: the limit is this test's
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved(device)
    sizes = [(256 + 64 * i) * 2**20 for i in range(8)]  # 256..704 MiB: 3.8 GiB in all, 0.7 GiB at once

    def grow() -> int:
        torch.cuda.reset_peak_memory_stats(device)
        for size in sizes:
            block = torch.empty(size, dtype=torch.uint8, device=device)
            del block
        peak = torch.cuda.max_memory_reserved(device) - base
        torch.cuda.empty_cache()
        return peak

    assert grow() > 3 * 2**30  # the growth the limit exists for
    limit = TorchPoolLimit(device)
    try:
        limit.hold(base + 2**30)
        assert grow() <= 2**30
        with pytest.raises(torch.OutOfMemoryError):  # live tensors beyond the limit are refused, not granted
            torch.empty(2 * 2**30, dtype=torch.uint8, device=device)
    finally:
        limit.release()


def test_a_served_engine_stays_within_its_budget_as_the_driver_counts_it(random_model):
    """As ``app.py serve`` runs it: built on this thread, warmed up and stepped on its loop thread (which gets
    a cuBLAS handle and workspace of its own after the KV pool is sized); 256 concurrent requests with longer
    prompts than the pool holds at once, so rows fill and requests are preempted. The device's used memory is
    read every millisecond throughout, and its peak stays within the budget: the engine counts everything
    outside torch's pool as its own (the CUDA context, what earlier tests left), so no baseline is taken off."""
    import asyncio
    import gc

    from bench.memory_budget import UsedMemorySampler
    from engine.async_engine import AsyncEngine
    from engine.config import EngineArgs

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    sampler = UsedMemorySampler(torch.device("cuda"))
    sampler.start()
    weights = sum(f.stat().st_size for f in random_model.glob("*.safetensors"))
    limit = f"{(weights + 2.5 * 2**30) / 2**30:.2f}GiB"  # about 1 GiB of KV: fewer tokens than the load asks
    engine = AsyncEngine(EngineArgs(model=str(random_model), dtype="float16", device="cuda",
                                    gpu_memory_limit=limit, max_model_len=2048))
    try:
        profile = engine.llm_engine.runner.memory_profile
        prompts = [(p * 64)[:384] for p in random_prompts(random_model)] * 64  # 256 prompts of 384 tokens
        params = SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True)

        async def one(prompt: list[int]) -> int:
            async for output in engine.generate(prompt_token_ids=prompt, params=params):
                count = len(output.outputs[0].token_ids)
            return count

        async def load() -> list[int]:
            return await asyncio.gather(*(one(p) for p in prompts))

        assert asyncio.run(load()) == [64] * len(prompts)
        torch.cuda.synchronize()
        peak = sampler.take_peak()
    finally:
        sampler.stop()
        engine.shutdown()
    assert peak <= profile.budget, (peak / 2**20, profile.budget / 2**20)
