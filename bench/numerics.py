"""Which Triton kernel moves the logits: the engine's forward with Triton for one op kind at a time, against HF.

Run on the GPU machine: ``python3 bench/numerics.py [--out numerics.json] [--shape llama2-7b-4l]``.
Builds the random-weight model of tests/test_gpu_engine.py, scores four prompts plus 16 continuation tokens
with HF transformers in fp32 (the truth) and fp16 (what the GPU test compares with), then runs the engine's
own ``LlamaModel`` (fp16) over the same tokens twice per configuration: one prefill of every token
(``paged_attention``), and a prefill of the prompt followed by 16 batched decode steps
(``paged_decode_attention``), the way the engine generates. A configuration is a ``Backend`` whose
``triton_ops`` names the ops that run in Triton (the rest use kernels/reference.py), plus variants of the
attention kernels (``PRESCALE_Q``: the prefill kernel's old fp16 rounding of q * scale; ``P_SPLIT``: decode's
PV product with p split into two fp16 halves).
Reported per configuration and mode: max and mean |logits - HF fp32| over the 17 predicted positions of each
sequence, and the test's metric: the largest gap between HF fp16's top logit and HF fp16's logit at our argmax
(tests/test_gpu_engine.py allows 0.02 + 2 fp16 ulps, ~0.036 at logit 12). Prints a table last, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from test_gpu_engine import SHAPES, build_random_model, random_prompts

from engine.forward_batch import ForwardBatch
from engine.model_loader import load_model
from kernels import triton_ops
from kernels.ops import Backend
from kernels.triton import decode_attention as decode_mod
from kernels.triton import prefill_attention as prefill_mod

DEV = "cuda"
BLOCK = 16
NEW_TOKENS = 16
OPS = ["rms_norm", "silu_and_mul", "rotary_embedding", "reshape_and_cache", "paged_attention",
       "paged_decode_attention"]


def hf_logits(model_dir: Path, seqs: list[list[int]], dtype: torch.dtype) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(DEV).eval()
    with torch.no_grad():
        rows = [hf(torch.tensor([s], device=DEV)).logits[0].float() for s in seqs]
    del hf
    torch.cuda.empty_cache()
    return rows


class Runner:
    """The engine's LlamaModel over a private paged KV cache (each sequence owns a random set of blocks)."""

    def __init__(self, model, lens: list[int]):
        self.model = model
        cfg = model.config
        per_seq = [(n + BLOCK - 1) // BLOCK for n in lens]
        total = sum(per_seq) + 8
        shape = (total, BLOCK, cfg.num_kv_heads, cfg.head_dim)
        self.caches = [(torch.zeros(shape, dtype=torch.float16, device=DEV),
                        torch.zeros(shape, dtype=torch.float16, device=DEV)) for _ in range(cfg.num_layers)]
        model.bind_kv_caches(self.caches)
        order = torch.randperm(total, generator=torch.Generator().manual_seed(3)).tolist()
        width = max(per_seq)
        self.tables, used = [], 0
        for n in per_seq:
            self.tables.append(order[used:used + n] + [0] * (width - n))
            used += n

    def step(self, chunks: list[tuple[list[int], int]], all_logits: bool) -> torch.Tensor:
        """chunks: (new token ids, first position) per sequence. Returns logits of the last rows (or all)."""
        ids, pos, slots, starts, ctx = [], [], [], [0], []
        for i, (toks, p0) in enumerate(chunks):
            for j, t in enumerate(toks):
                p = p0 + j
                ids.append(t)
                pos.append(p)
                slots.append(self.tables[i][p // BLOCK] * BLOCK + p % BLOCK)
            starts.append(starts[-1] + len(toks))
            ctx.append(p0 + len(toks))
        rows = list(range(starts[-1])) if all_logits else [s - 1 for s in starts[1:]]
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, device=DEV), positions=torch.tensor(pos, device=DEV),
            slot_mapping=torch.tensor(slots, device=DEV),
            block_tables=torch.tensor(self.tables, dtype=torch.int32, device=DEV),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEV),
            context_lens=torch.tensor(ctx, dtype=torch.int32, device=DEV),
            logits_indices=torch.tensor(rows, device=DEV),
            is_decode=all(len(t) == 1 for t, _ in chunks))
        return self.model.forward(batch)


def engine_logits(model, prompts: list[list[int]], conts: list[list[int]], mode: str) -> list[torch.Tensor]:
    """Logits [NEW_TOKENS + 1, vocab] per sequence at positions len(prompt) - 1 .. end - 1."""
    seqs = [p + c for p, c in zip(prompts, conts)]
    runner = Runner(model, [len(s) for s in seqs])
    if mode == "prefill":
        out = runner.step([(s, 0) for s in seqs], all_logits=True)
        res, start = [], 0
        for p, s in zip(prompts, seqs):
            res.append(out[start + len(p) - 1:start + len(s)])
            start += len(s)
        return res
    rows = [[] for _ in seqs]
    first = runner.step([(p, 0) for p in prompts], all_logits=False)
    for i in range(len(seqs)):
        rows[i].append(first[i])
    for t in range(NEW_TOKENS):
        out = runner.step([([c[t]], len(p) + t) for p, c in zip(prompts, conts)], all_logits=False)
        for i in range(len(seqs)):
            rows[i].append(out[i])
    return [torch.stack(r) for r in rows]


def compare(ours: list[torch.Tensor], hf32: list[torch.Tensor], hf16: list[torch.Tensor],
            prompts: list[list[int]]) -> dict:
    max_err, sum_err, count, gap = 0.0, 0.0, 0, 0.0
    for o, r32, r16, p in zip(ours, hf32, hf16, prompts):
        lo = len(p) - 1
        ref32 = r32[lo:lo + NEW_TOKENS + 1]
        ref16 = r16[lo:lo + NEW_TOKENS + 1]
        diff = (o - ref32).abs()
        max_err = max(max_err, float(diff.max()))
        sum_err += float(diff.sum())
        count += diff.numel()
        pick = o.argmax(dim=-1)
        gap = max(gap, float((ref16.max(dim=-1).values - ref16.gather(1, pick[:, None])[:, 0]).max()))
    return {"max_abs_vs_hf32": max_err, "mean_abs_vs_hf32": sum_err / count, "greedy_gap_vs_hf16": gap}


def configurations() -> list[tuple[str, frozenset | None, dict]]:
    """(name, Triton op set, attention variants)."""
    confs = [("reference (torch) everywhere", frozenset(), {}), ("triton everywhere", None, {})]
    confs += [(f"triton {op} only", frozenset({op}), {}) for op in OPS]
    confs += [
        ("triton everywhere, prefill PRESCALE_Q (old)", None, {"prefill": {"PRESCALE_Q": True}}),
        ("triton paged_attention only, PRESCALE_Q (old)", frozenset({"paged_attention"}),
         {"prefill": {"PRESCALE_Q": True}}),
        ("triton everywhere, decode P_SPLIT", None, {"decode": {"P_SPLIT": True}}),
        ("triton paged_decode_attention only, P_SPLIT", frozenset({"paged_decode_attention"}),
         {"decode": {"P_SPLIT": True}}),
    ]
    return confs


def patch_attention(variants: dict) -> dict:
    """Point triton_ops' attention entries at kernels with the given config overrides; returns the originals."""
    saved = {"paged_attention": triton_ops.paged_attention,
             "paged_decode_attention": triton_ops.paged_decode_attention}
    if "prefill" in variants:
        cfg = {**prefill_mod._config(128, torch.device(DEV)), **variants["prefill"]}
        triton_ops.paged_attention = partial(prefill_mod.prefill_attention, config=cfg)
    if "decode" in variants:
        cfg = {**decode_mod._config(BLOCK), **variants["decode"]}
        triton_ops.paged_decode_attention = partial(decode_mod.decode_attention, config=cfg)
    return saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama2-7b-4l", choices=list(SHAPES))
    parser.add_argument("--out", default="numerics.json")
    parser.add_argument("--only", default="", help="comma-separated words: run configurations whose name has one")
    parser.add_argument("--device", default="cuda", help="cpu: a plumbing check with the reference kernels")
    args = parser.parse_args()
    global DEV
    DEV = args.device
    folder = Path(tempfile.mkdtemp()) / args.shape
    model_dir = build_random_model(folder, SHAPES[args.shape])
    prompts = random_prompts(model_dir)
    gen = torch.Generator().manual_seed(2)
    vocab = SHAPES[args.shape]["vocab_size"]
    conts = [torch.randint(3, vocab, (NEW_TOKENS,), generator=gen).tolist() for _ in prompts]
    seqs = [p + c for p, c in zip(prompts, conts)]
    hf32 = hf_logits(model_dir, seqs, torch.float32)
    hf16 = hf_logits(model_dir, seqs, torch.float16)
    base = compare([r[len(p) - 1:len(p) + NEW_TOKENS].clone() for r, p in zip(hf16, prompts)], hf32, hf16, prompts)
    results = [{"config": "HF transformers fp16", "mode": "-", **base}]
    print(f"HF fp16 vs fp32: {base}", flush=True)
    model = load_model(model_dir, torch.device(DEV), torch.float16, Backend(use_triton=False), max_positions=4096)
    for name, ops, variants in configurations():
        if args.only and not any(word in name for word in args.only.split(",")):
            continue
        saved = patch_attention(variants)
        try:
            model.backend = Backend(use_triton=DEV == "cuda", triton_ops=ops)
            for mode in ("prefill", "decode"):
                row = {"config": name, "mode": mode, **compare(engine_logits(model, prompts, conts, mode),
                                                               hf32, hf16, prompts)}
                results.append(row)
                print(row, flush=True)
        finally:
            triton_ops.paged_attention = saved["paged_attention"]
            triton_ops.paged_decode_attention = saved["paged_decode_attention"]
        Path(args.out).write_text(json.dumps({"shape": args.shape, "results": results}, indent=1))
    print(f"\n{'configuration':<50} {'mode':<8} {'max|d| hf32':>11} {'mean|d|':>9} {'gap hf16':>9}")
    for r in results:
        print(f"{r['config']:<50} {r['mode']:<8} {r['max_abs_vs_hf32']:>11.4f} {r['mean_abs_vs_hf32']:>9.5f} "
              f"{r['greedy_gap_vs_hf16']:>9.4f}")


if __name__ == "__main__":
    main()
