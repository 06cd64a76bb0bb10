"""Per-token cost of grammar-constrained decoding (issue 17's target: < 10% at batch 1 and 32 on the GPU).

Each constrained run is paired with a plain twin: the same prompts, the same sampling (temperature 1), and each
request made to generate exactly as many tokens as its constrained run did (``min_tokens = max_tokens``,
``ignore_eos``), so both sides decode the same number of tokens at the same batch occupancy. The cost is the
median over ``--repeats`` pairs of (constrained time per token / plain time per token - 1); the two runs of a
pair are adjacent, so drift of the machine between runs (10-20% on this card) mostly cancels.

Schemas: ``nested`` (the target) is what a tool-calling agent asks for: an object with strings, an integer, an
enum, an array of strings and a nested object, no length bounds, so random weights fill it with random valid
JSON up to ``--output-len`` tokens. ``long-string`` (informational) asks for one string of at least 2,000
characters: a counting lexer state that never repeats, so llguidance builds a new state at every token, the
worst case of its lexer (~0.6 ms of mask and as much of consume for 32 rows on two CPU cores).

The token masks need a real BPE tokenizer (llguidance cannot read the word-level one of
bench/random_model.py): ``--tokenizer`` names a folder whose tokenizer files replace the random model's
(SmolLM2's: vocabulary 49,152, the smollm2-135m shape's). Run on the GPU machine:
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

from bench.common import (
    BenchRun,
    add_common_args,
    at_least,
    at_most,
    engine_kwargs,
    info,
    model_for,
    shape_label,
)
from bench.throughput import make_requests, vocab_of

NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
                    "required": ["street", "city"]},
    },
    "required": ["name", "age", "role", "tags", "address"],
}
LONG_STRING_SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 2000}},
                      "required": ["text"]}
SCHEMAS = {"nested": (NESTED_SCHEMA, True), "long-string": (LONG_STRING_SCHEMA, False)}  # name -> (schema, target)


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


def timed_generate(llm, prompts: list[list[int]], params, checked: list | None = None) -> tuple[float, list[int]]:
    """Wall seconds per generated token and each request's number of tokens; ``checked`` (constrained runs)
    gets, per request that ended on its own, whether its text parses as one JSON document."""
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    seconds = time.perf_counter() - start
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    if checked is not None:
        checked += [parses_as_json(o.outputs[0].text) for o in outputs if o.outputs[0].finish_reason == "stop"]
    return seconds / sum(lengths), lengths


def parses_as_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def constrained_params(schema: dict, output_len: int):
    from engine import SamplingParams
    from engine.structured_output import StructuredOutputsParams

    params = SamplingParams(temperature=1.0, max_tokens=output_len)
    params.structured_outputs = StructuredOutputsParams.from_schema(json.dumps(schema))
    return params


def twin_params(lengths: list[int]):
    """Plain sampling at temperature 1 that makes each request exactly as long as its constrained run."""
    from engine import SamplingParams

    return [SamplingParams(temperature=1.0, max_tokens=n, min_tokens=n, ignore_eos=True) for n in lengths]


def cost_pairs(llm, prompts: list[list[int]], params, repeats: int, checked: list) -> list[tuple[float, float]]:
    """(plain, constrained) seconds per token of ``repeats`` pairs: each constrained run, then its twin."""
    pairs = []
    for _ in range(repeats):
        constrained, lengths = timed_generate(llm, prompts, params, checked)
        plain, _ = timed_generate(llm, prompts, twin_params(lengths))
        pairs.append((plain, constrained))
    return pairs


def bench(run: BenchRun) -> None:
    from engine import LLM

    args = run.args
    model_dir = with_tokenizer(model_for(args, "smollm2-135m", "awq"), Path(args.tokenizer))
    label = f"{shape_label(args, 'smollm2-135m')} AWQ"
    llm = LLM(str(model_dir), **engine_kwargs(args))
    rng = random.Random(args.seed)
    vocab = min(vocab_of(model_dir), 49152)
    for name, (schema, is_target) in SCHEMAS.items():
        params = constrained_params(schema, args.output_len)
        for batch in (1, 32):
            prompts = [r.prompt for r in make_requests([(32, args.output_len)] * batch, vocab, rng)]
            timed_generate(llm, prompts, params)  # warm: the tokenizer's llguidance view, the grammar, graphs
            checked: list[bool] = []
            pairs = cost_pairs(llm, prompts, params, args.repeats, checked)
            what = f"{label}, {name} schema, batch {batch}"
            if checked:  # outputs the grammar ended (not cut by max_tokens) must be whole JSON documents
                run.add(at_least(f"{what}: outputs that ended on their own and parse as JSON ({len(checked)})",
                                 sum(checked) / len(checked), "fraction", 1.0))
            for side, times in (("plain twin", [p for p, _ in pairs]), ("constrained", [c for _, c in pairs])):
                run.add(info(f"{what}, {side}: time per generated token (median)", statistics.median(times) * 1e3,
                             "ms"))
            cost = statistics.median(c / p for p, c in pairs) - 1
            name_cost = f"{what}: constrained / plain time per token - 1 (median of {len(pairs)} pairs)"
            run.add(at_most(name_cost, cost, "fraction", 0.10) if is_target else info(name_cost, cost, "fraction"))


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
