"""Single-stream latency: batch-1 decode tok/s, its fraction of the bandwidth roofline, and prefix-cache TTFT.

Run on the GPU machine: ``python3 bench/latency.py [--out bench/results/latency.json]`` (CPU check:
``--device cpu --shape tiny --output-len 16``). Models are random-weight builds of real shapes
(bench/random_model.py), cached in ``--models-dir``.

Decode rate: one request, a fresh random prompt of ``--prompt-len`` tokens, exactly ``--output-len`` generated
tokens (``ignore_eos``). The time of a 1-token generation (prefill + first token) is subtracted from the time
of the full one, so ``tok/s = (output_len - 1) / (t_full - t_first)`` is the decode loop alone; medians of
``--repeats`` runs, each on a new prompt (no prefix-cache hits), after a warm-up.

Roofline fraction: ``bytes_per_step / step_time / copy_bandwidth``, where ``bytes_per_step`` is what one
decode step must read, computed from config.json (not from the engine): every decoder linear in its
checkpoint format (AWQ: int4 codes + fp16 scales + 4-bit zeros per group; fp16: 2 bytes a weight), norms, the
LM head, one embedding row, and the K and V of the mean context length of the timed steps; the copy bandwidth
is measured in the same run (a device-to-device copy, bytes read + written).

Against llama.cpp: ``--llamacpp FILE`` takes the output of ``.peers/llamacpp_bench.sh`` (and of
bench/llamacpp_fp16.sh for the fp16 7B) from the same device run (llama-bench's tg128, batch-1 decode) as the
peer of the ratio targets; without it the recorded figures of bench/common.py stand in and the rows say so.

Kernels a decode step (GPU only): CUPTI's kernel records over a generation 16 tokens longer than another, per
token and per layer (issue 15 asks for launches per layer before and after the fused layer).

Streaming (section ``stream``, on the 7B AWQ model): after the offline engine is released, ``app.py serve``
starts on the same model with the same flags and one client at a time streams a completion of the same lengths
(SSE, as bench/serving.py sends it); its decode rate is ``(tokens - 1) / (E2E - TTFT)``, medians of
``--repeats`` after a warm-up, and the target is that rate over the offline one (issue 15: the server keeps
>= 95% of it).

Prefix caching: a warm engine, one request at a time, ``--prefix-len`` shared tokens + ``--suffix-len`` fresh
ones, 1 output token. TTFT on a miss (a prefix never seen) and on a hit (the same prefix again, a different
suffix); the target is ``median(miss) / median(hit) >= 5``.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    LLAMACPP,
    LLAMACPP_SAME_RUN,
    PEER_LLAMACPP_BS1,
    BenchRun,
    add_common_args,
    at_least,
    at_least_or_info,
    copy_bandwidth,
    engine_cli_flags,
    engine_kwargs,
    info,
    model_for,
    read_llamacpp_tg,
    shape_label,
    timed,
)


@dataclass(frozen=True)
class DecodeTiming:
    tokens_per_s: float
    step_s: float
    first_token_s: float


@dataclass(frozen=True)
class DecodeTarget:
    """Issue 15's batch-1 targets for one shape (None: reported, not judged) and llama.cpp's format there."""

    peer_quant: str
    tok_s: float | None = None
    roofline: float | None = None
    x_llamacpp: float | None = None


@dataclass(frozen=True)
class DecodeModel:
    """A model the bench times: its shape (bench/random_model.py), quantization and targets."""

    shape: str
    quant: str  # "awq" or "fp16"
    target: DecodeTarget
    prefix: bool = False  # the prefix-cache section runs on it
    streamed: float | None = None  # the target of its rate streamed through app.py serve / the offline one

    @property
    def quant_label(self) -> str:
        return "AWQ" if self.quant == "awq" else "fp16"


MODELS = {  # the --models names (llama.cpp's same-run figures are read under these names too)
    "smollm2-135m": DecodeModel("smollm2-135m", "awq", DecodeTarget("Q4_1", tok_s=1400, x_llamacpp=1.48)),
    "llama2-7b": DecodeModel("llama2-7b", "awq", DecodeTarget("Q4_0", roofline=0.50, x_llamacpp=1.6), prefix=True,
                             streamed=0.95),
    "llama2-7b-fp16": DecodeModel("llama2-7b", "fp16", DecodeTarget("F16", roofline=0.80)),
    "llama3-8b": DecodeModel("llama3-8b", "awq", DecodeTarget("Q4_0", x_llamacpp=1.5)),
    "qwen3-8b": DecodeModel("qwen3-8b", "awq", DecodeTarget("Q4_0")),  # issue 18: next to the Llama-3-8B shape
}


def model_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def weight_bytes_per_step(cfg: dict, dense_bytes: int, int8_head: bool = False) -> int:
    """Bytes of weights one decode step reads, in the checkpoint's format (see the module docstring); with
    ``int8_head`` (--lm-head-quantization int8) the head's as int8 rows with a scale each."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    linears = [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]  # (in, out)
    qcfg = cfg.get("quantization_config")
    per_layer = 0
    for k, n in linears:
        if qcfg:
            group = k if qcfg["group_size"] == -1 else qcfg["group_size"]
            groups = k // group
            per_layer += k * n // 2 + groups * n * 2 + groups * n // 2  # codes, fp16 scales, zeros
        else:
            per_layer += k * n * dense_bytes
    per_layer += 2 * h * dense_bytes  # the two RMSNorm weights
    head_row = h + dense_bytes if int8_head else h * dense_bytes  # a vocabulary row of the head (+ its scale)
    head = cfg["vocab_size"] * head_row + h * dense_bytes  # LM head (tied or not) + final norm
    return layers * per_layer + head + h * dense_bytes  # + the embedding row of the input token


def kv_bytes_per_token(cfg: dict, kv_bytes: int) -> int:
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * hd * kv_bytes


def random_tokens(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def generate_once(llm, prompt: list[int], max_tokens: int) -> list:
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True)
    return llm.generate({"prompt_token_ids": prompt}, params)


def decode_timing(llm, args, vocab: int, rng: random.Random) -> DecodeTiming:
    n = args.output_len
    generate_once(llm, random_tokens(rng, vocab, args.prompt_len), min(n, 32))  # warm-up (compile, autotune)
    firsts, fulls = [], []
    for _ in range(args.repeats):
        prompt = random_tokens(rng, vocab, args.prompt_len)
        firsts.append(timed(generate_once, args.device, llm, prompt, 1)[0])
        seconds, outs = timed(generate_once, args.device, llm, random_tokens(rng, vocab, args.prompt_len), n)
        fulls.append(seconds)
        got = len(outs[0].outputs[0].token_ids)
        if got != n:
            raise RuntimeError(f"asked for exactly {n} tokens (ignore_eos, min_tokens), got {got}")
    first, full = statistics.median(firsts), statistics.median(fulls)
    step = max(full - first, 1e-9) / (n - 1)
    return DecodeTiming(1.0 / step, step, first)


def kernels_per_step(llm, args, vocab: int, rng: random.Random, steps: int = 16) -> float:
    """GPU kernels a batch-1 decode step runs (issue 15: launches per layer, the fused layer's five against the
    unfused ten): kernels CUPTI records (those inside graph replays too) over a generation of ``steps`` more
    tokens than another's, per token; copies and memsets are not counted."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    def kernels(tokens: int) -> int:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            generate_once(llm, random_tokens(rng, vocab, args.prompt_len), tokens)
            torch.cuda.synchronize()
        return sum(1 for event in prof.events() if event.device_type == DeviceType.CUDA
                   and not event.name.startswith(("Memcpy", "Memset")))

    return (kernels(2 + steps) - kernels(2)) / steps


def llamacpp_peer(args, name: str) -> tuple[str, float | None]:
    """(label, batch-1 tok/s) of llama.cpp on this model: from ``--llamacpp`` (the same device run) when given,
    else the recorded figure."""
    if args.llamacpp:
        return LLAMACPP_SAME_RUN, read_llamacpp_tg(Path(args.llamacpp)).get(name)
    return LLAMACPP, PEER_LLAMACPP_BS1.get(name)


def decode_label(args, shape: str, model: DecodeModel) -> str:
    head = ", int8 head" if getattr(args, "lm_head_quantization", None) == "int8" else ""
    return f"{shape} {model.quant_label}{head} batch 1 (prompt {args.prompt_len}, {args.output_len} tokens)"


def bench_decode(run: BenchRun, llm, model_dir: Path, shape: str, name: str, copy_bw: float) -> float:
    """The batch-1 rows of model ``name``; returns its decode rate (tok/s)."""
    args = run.args
    cfg = model_config(model_dir)
    dense = 2 if args.device != "cpu" else 4
    timing = decode_timing(llm, args, cfg["vocab_size"], random.Random(args.seed))
    mean_context = args.prompt_len + args.output_len / 2
    weights = weight_bytes_per_step(cfg, dense, getattr(args, "lm_head_quantization", None) == "int8")
    step_bytes = weights + kv_bytes_per_token(cfg, dense) * mean_context
    fraction = step_bytes / timing.step_s / 1e9 / copy_bw
    model = MODELS[name]
    label = decode_label(args, shape, model)
    target = model.target
    peer, peer_rate = llamacpp_peer(args, name)
    if args.shape:  # another shape stands in (CPU checks): llama.cpp's figure is not for it
        peer_rate = None
    peer = f"{peer}, {target.peer_quant}"
    rate = timing.tokens_per_s
    run.add(at_least_or_info(f"{label}: decode", rate, "tok/s", target.tok_s, peer, peer_rate),
            at_least_or_info(f"{label}: fraction of bandwidth roofline", fraction, "x roofline", target.roofline))
    if peer_rate:
        run.add(at_least_or_info(f"{label}: decode / llama.cpp", rate / peer_rate, "x", target.x_llamacpp, peer,
                                 peer_rate))
    engine_weights = llm.engine.runner.weight_bytes
    run.add(info(f"{label}: roofline at measured copy BW", copy_bw * 1e9 / step_bytes, "tok/s"),
            info(f"{label}: bytes read per step (checkpoint format, weights + KV)", step_bytes / 1e9, "GB"),
            info(f"{label}: engine's resident weights (incl. embedding table)", engine_weights / 1e9, "GB"),
            info(f"{label}: prefill + first token", timing.first_token_s * 1e3, "ms"))
    return rate


def bench_kernel_count(run: BenchRun, llm, model_dir: Path, shape: str, name: str) -> None:
    args = run.args
    cfg = model_config(model_dir)
    per_step = kernels_per_step(llm, args, cfg["vocab_size"], random.Random(args.seed + 3))
    label = decode_label(args, shape, MODELS[name])
    run.add(info(f"{label}: GPU kernels a decode step", per_step, "kernels"),
            info(f"{label}: GPU kernels a decode step / layer", per_step / cfg["num_hidden_layers"], "kernels"))


def bench_streamed(run: BenchRun, model_dir: Path, shape: str, name: str, offline_rate: float) -> None:
    """One client at a time streams completions of the decode timing's lengths from ``app.py serve`` on the
    same model and flags (the offline engine released first); the target is the streamed rate / the offline."""
    from bench.serving import free_port, running_server, server_command

    args = run.args
    model = MODELS[name]
    vocab = model_config(model_dir)["vocab_size"]
    rng = random.Random(args.seed + 2)
    cmd = server_command(model_dir, free_port(), engine_cli_flags(engine_kwargs(args)))
    with running_server(cmd, timeout=600) as (url, _, _):
        rates = [streamed_rate(url, random_tokens(rng, vocab, args.prompt_len), args.output_len)
                 for _ in range(args.repeats + 1)][1:]  # the first is the warm-up
    rate = statistics.median(rates)
    label = f"{decode_label(args, shape, model)}, streamed through app.py serve"
    run.add(at_least_or_info(f"{label} / offline", rate / offline_rate, "x", model.streamed),
            info(f"{label}: decode", rate, "tok/s"))


def streamed_rate(url: str, prompt: list[int], output_len: int) -> float:
    """Decode tok/s of one streamed completion: (tokens - 1) / (E2E - time to the first text)."""
    import asyncio

    import httpx

    from bench.serving import one_request

    async def once():
        async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=60.0)) as client:
            return await one_request(client, url, prompt, output_len, None)

    result = asyncio.run(once())
    if not result.ok:
        raise RuntimeError(f"streamed completion failed: {result.error}")
    return (result.output_tokens - 1) / (result.e2e - result.ttft)


def bench_prefix(run: BenchRun, llm, model_dir: Path, shape: str) -> None:
    args = run.args
    vocab = model_config(model_dir)["vocab_size"]
    rng = random.Random(args.seed + 1)
    p, s = args.prefix_len, args.suffix_len
    for _ in range(2):  # warm-up: miss and hit paths at these lengths
        prefix = random_tokens(rng, vocab, p)
        generate_once(llm, prefix + random_tokens(rng, vocab, s), 1)
        generate_once(llm, prefix + random_tokens(rng, vocab, s), 1)
    misses, hits, cached = [], [], []
    for _ in range(args.prefix_trials):
        prefix = random_tokens(rng, vocab, p)
        misses.append(timed(generate_once, args.device, llm, prefix + random_tokens(rng, vocab, s), 1)[0])
        seconds, outs = timed(generate_once, args.device, llm, prefix + random_tokens(rng, vocab, s), 1)
        hits.append(seconds)
        cached.append(outs[0].num_cached_tokens)
    miss, hit = statistics.median(misses), statistics.median(hits)
    label = f"{shape} AWQ, {p}-token shared prefix + {s}-token suffix"
    run.add(at_least(f"{label}: TTFT miss / TTFT hit", miss / hit, "x", 5),
            info(f"{label}: TTFT on a miss", miss * 1e3, "ms"),
            info(f"{label}: TTFT on a hit", hit * 1e3, "ms"),
            info(f"{label}: prompt tokens served from the prefix cache on a hit", min(cached), "tokens"))


DEFAULT_MODELS = ("smollm2-135m", "llama2-7b", "llama2-7b-fp16")


def bench_model(run: BenchRun, name: str, copy_bw: float, sections: set[str]) -> None:
    """Load one model, run its sections on it; the streamed section after the offline engine is released."""
    from engine import LLM

    args = run.args
    model = MODELS[name]
    shape = shape_label(args, model.shape)
    llm, rate = None, None
    with run.section(f"{shape} {model.quant_label}: build and load"):
        model_dir = model_for(args, model.shape, model.quant)
        llm = LLM(str(model_dir), **engine_kwargs(args))
        config = model_config(model_dir)
        if model.quant == "awq":
            run.add(info(f"{shape} AWQ group size", config["quantization_config"]["group_size"], "weights"))
    if llm is None:
        return
    if "decode" in sections:
        with run.section(f"{shape} {model.quant_label}: batch-1 decode"):
            rate = bench_decode(run, llm, model_dir, shape, name, copy_bw)
        if torch.device(args.device).type == "cuda":  # (CUPTI's kernel records)
            with run.section(f"{shape} {model.quant_label}: kernels a decode step"):
                bench_kernel_count(run, llm, model_dir, shape, name)
    if model.prefix and "prefix" in sections:
        with run.section(f"{shape} {model.quant_label}: prefix cache TTFT"):
            bench_prefix(run, llm, model_dir, shape)
    llm.engine.release()
    del llm
    gc.collect()
    if torch.device(args.device).type == "cuda":
        torch.cuda.empty_cache()  # what the engine's last references held goes back before a server starts
    if model.streamed is not None and "stream" in sections and rate is not None:
        with run.section(f"{shape} {model.quant_label}: streamed through app.py serve"):
            bench_streamed(run, model_dir, shape, name, rate)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, "latency")
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"comma-separated of {', '.join(MODELS)}")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefix-len", type=int, default=2000)
    parser.add_argument("--suffix-len", type=int, default=16)
    parser.add_argument("--prefix-trials", type=int, default=5)
    parser.add_argument("--only", default="decode,prefix,stream",
                        help="comma-separated: decode, prefix, stream (needs decode)")
    parser.add_argument("--llamacpp", default=None,
                        help="output of .peers/llamacpp_bench.sh from the same device run (the ratio targets' peer)")
    parser.add_argument("--copy-bandwidth", type=float, default=None, help=argparse.SUPPRESS)  # from the parent
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    run = BenchRun("latency", args)
    copy_bw = args.copy_bandwidth
    if copy_bw is None:
        copy_bw = copy_bandwidth(args.device)
        run.add(info("copy bandwidth (device-to-device, read + write)", copy_bw, "GB/s"))
    models = args.models.split(",")
    if len(models) > 1 and not args.in_process:
        run.run_isolated("--models", models, "--copy-bandwidth", str(copy_bw))
    else:
        for name in models:
            bench_model(run, name, copy_bw, set(args.only.split(",")))
    run.finish()


if __name__ == "__main__":
    main()
