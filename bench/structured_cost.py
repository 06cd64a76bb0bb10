"""Per-token cost of grammar-constrained decoding (issue 17's target: < 10% at batch 1 and 32 on the GPU).

The same requests are generated twice offline, without and with a JSON-schema constraint, and the
wall time per generated token is compared. The schema asks for one string of at least 2,000 characters, so
every constrained request runs to ``--output-len`` (random weights would otherwise close the object at any
length) while the matcher does a JSON string's work on every token. The token masks need a real BPE
tokenizer (llguidance cannot read the word-level one of bench/random_model.py): ``--tokenizer`` names a folder
whose tokenizer files replace the random model's (SmolLM2's: vocabulary 49,152, the smollm2-135m shape's).
Run on the GPU machine:
``python3 bench/structured_cost.py --tokenizer .devcache/smollm2-tokenizer --out bench/results/structured_cost.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import BenchRun, add_common_args, at_most, engine_kwargs, info, model_for, shape_label
from bench.throughput import exact_params, make_requests, vocab_of

LONG_STRING_SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 2000}},
                      "required": ["text"]}


def with_tokenizer(model_dir: Path, tokenizer_dir: Path) -> Path:
    """A copy of the random model's folder (weights linked) with the real tokenizer's files."""
    out = model_dir.with_name(model_dir.name + "-bpe")
    out.mkdir(exist_ok=True)
    for path in model_dir.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            continue
        target = out / path.name
        if not target.exists():
            target.symlink_to(path)
    for path in tokenizer_dir.iterdir():
        shutil.copy2(path, out / path.name)
    return out


def seconds_per_token(llm, prompts: list[list[int]], params) -> float:
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    if tokens != len(prompts) * params.max_tokens:
        raise RuntimeError(f"generated {tokens} tokens, expected {len(prompts) * params.max_tokens}")
    return seconds / tokens


def bench(run: BenchRun) -> None:
    from engine import LLM
    from engine.structured_output import StructuredOutputsParams

    args = run.args
    model_dir = with_tokenizer(model_for(args, "smollm2-135m", "awq"), Path(args.tokenizer))
    label = f"{shape_label(args, 'smollm2-135m')} AWQ"
    llm = LLM(str(model_dir), **engine_kwargs(args))
    rng = random.Random(args.seed)
    vocab = min(vocab_of(model_dir), 49152)
    plain = exact_params(args.output_len)
    constrained = exact_params(args.output_len)
    constrained.structured_outputs = StructuredOutputsParams.from_schema(json.dumps(LONG_STRING_SCHEMA))
    constrained.ignore_eos = False  # the grammar is not complete before output_len: no early end
    for batch in (1, 32):
        prompts = [r.prompt for r in make_requests([(32, args.output_len)] * batch, vocab, rng)]
        seconds_per_token(llm, prompts, constrained)  # warm: the tokenizer's llguidance view, the grammar
        # plain and constrained runs alternate and the cost is the median of the pairs' ratios: run-to-run drift of
        # the machine (10-20% between runs of 3 x 128 tokens) otherwise swamps a cost of a few percent
        pairs = [(seconds_per_token(llm, prompts, plain), seconds_per_token(llm, prompts, constrained))
                 for _ in range(args.repeats)]
        for name, times in (("plain", [p for p, _ in pairs]), ("json schema", [c for _, c in pairs])):
            run.add(info(f"{label}, batch {batch}, {name}: time per generated token (median)",
                         statistics.median(times) * 1e3, "ms"))
        run.add(at_most(f"{label}, batch {batch}: constrained / plain time per token - 1 (median of {len(pairs)} pairs)",
                        statistics.median(c / p for p, c in pairs) - 1, "fraction", 0.10))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, "structured_cost")
    parser.add_argument("--tokenizer", required=True, help="folder with tokenizer.json (vocabulary <= 49,152)")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7, help="plain / constrained pairs per batch size")
    args = parser.parse_args()
    run = BenchRun("structured_cost", args)
    with run.section("structured outputs"):
        bench(run)
    run.finish()


if __name__ == "__main__":
    main()
