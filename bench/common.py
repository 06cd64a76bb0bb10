"""Shared helpers of the engine benchmarks: result rows and their JSON, copy bandwidth, flags, the table.

Every bench writes ``{"card", "date", "command", "results": [{"name", "value", "unit", "target", "pass",
"peer", "peer_value"}]}``. Rows with a target (``">= 1400"``) carry ``pass`` true/false; rows that only
inform (a peer's own rate, a time) have ``target: "info"`` and ``pass: null``. A section that crashed leaves
a row with ``value: null`` and ``pass: false`` and the rest still run; the JSON is rewritten after every
section so a run cut short by a time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.random_model import SHAPES, BuildSpec, build_model

DEFAULT_MODELS_DIR = "/tmp/pagoda-bench"
T = TypeVar("T")

# Recorded peer figures (shared/DESIGN.md, one H200, copy bandwidth 4.23 TB/s). Targets that are ratios take the
# same run's llama.cpp figures where the bench is given them (``read_llamacpp_tg``); these are the fallback.
LLAMACPP = "llama.cpp CUDA (recorded, same H200)"
LLAMACPP_SAME_RUN = "llama.cpp CUDA (same run)"
PEER_LLAMACPP_BS1 = {  # batch-1 decode (llama-bench tg128), tok/s, 2026-12-02
    "smollm2-135m": 916.7,  # Q4_1
    "llama2-7b": 348.5,  # Q4_0
    "llama3-8b": 340.1,  # Q4_0
    "llama2-7b-fp16": 220.5,  # F16, 2026-11-30 (../shared/peers/README.md)
}
LLAMACPP_BENCH_SHAPES = {"smol": "smollm2-135m", "l7b": "llama2-7b", "l8b": "llama3-8b",  # llamacpp_bench.sh's
                         "l7b-f16": "llama2-7b-fp16"}  # and bench/llamacpp_fp16.sh's headings
PEER_LLAMACPP_128 = {  # generated tok/s over the whole run, 128 x (128 + 128), Q4_0 (recorded, same H200)
    "llama2-7b": 3954.0,  # 2026-11-30 (decode-only S_TG: 5,946)
    "llama3-8b": 4280.0,  # 2026-12-01, llama-batched-bench b128
}
PEER_HF_7B_BS128 = 1329.0  # HF transformers fp16 Llama-2-7B, batch 128 (recorded; the bench measures its own)


def read_llamacpp_tg(path: Path) -> dict[str, float]:
    """Batch-1 decode tok/s per shape from ``llamacpp_bench.sh``'s output: each ``## <shape> (<quant>)`` heading
    followed by llama-bench's markdown table, whose ``tg128`` row gives ``t/s`` as ``mean ± sd``."""
    rates, shape = {}, None
    for line in Path(path).read_text().splitlines():
        if line.startswith("## "):  # the batched bench's table under its own heading has no tg rows
            shape = LLAMACPP_BENCH_SHAPES.get(line[3:].split()[0])
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if shape and len(cells) >= 2 and cells[-2].startswith("tg"):
            rates[shape] = float(cells[-1].split("±")[0])
    return rates


@dataclass
class Result:
    """One row of a bench's JSON; ``passed`` is None for information rows."""

    name: str
    value: float | None
    unit: str
    target: str
    passed: bool | None
    peer: str | None = None
    peer_value: float | None = None

    def row(self) -> dict:
        return {"name": self.name, "value": _finite(self.value), "unit": self.unit, "target": self.target,
                "pass": self.passed, "peer": self.peer, "peer_value": _finite(self.peer_value)}


def _finite(value: float | None) -> float | None:
    """JSON has no NaN/inf: such values become null."""
    if value is None or not math.isfinite(float(value)):
        return None
    return float(f"{float(value):.6g}")  # six significant digits


def at_least(name: str, value: float, unit: str, target: float, peer: str | None = None,
             peer_value: float | None = None) -> Result:
    return Result(name, value, unit, f">= {target:g}", bool(value >= target), peer, peer_value)


def at_most(name: str, value: float, unit: str, target: float, peer: str | None = None,
            peer_value: float | None = None) -> Result:
    return Result(name, value, unit, f"<= {target:g}", bool(value <= target), peer, peer_value)


def below(name: str, value: float, unit: str, target: float, peer: str | None = None,
          peer_value: float | None = None) -> Result:
    return Result(name, value, unit, f"< {target:g}", bool(value < target), peer, peer_value)


def info(name: str, value: float | None, unit: str, peer: str | None = None,
         peer_value: float | None = None) -> Result:
    return Result(name, value, unit, "info", None, peer, peer_value)


def at_least_or_info(name: str, value: float, unit: str, target: float | None, peer: str | None = None,
                     peer_value: float | None = None) -> Result:
    """A target row where a target is set, else an information row (benches whose targets differ by shape)."""
    if target is None:
        return info(name, value, unit, peer, peer_value)
    return at_least(name, value, unit, target, peer, peer_value)


# ---- device ------------------------------------------------------------------------------------------------
def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def card_name(device: str) -> str:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(torch.device(device))


def copy_bandwidth(device: str, nbytes: int | None = None) -> float:
    """GB/s of a device-to-device copy of a large buffer, bytes read plus written (as bench/kernels.py).

    CUDA: a 2 GiB copy timed by ``triton.testing.do_bench`` (median, after a settling run). CPU: a 256 MiB
    copy, median of 5 wall-clock timings.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        import triton.testing

        src = torch.randint(0, 255, (nbytes or 2 << 30,), dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
        ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
        del src, dst
        torch.cuda.empty_cache()
        return 2 * (nbytes or 2 << 30) / ms / 1e6
    src = torch.randint(0, 255, (nbytes or 256 << 20,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * src.numel() / statistics.median(times) / 1e9


# ---- flags -------------------------------------------------------------------------------------------------
def add_common_args(parser: argparse.ArgumentParser, bench: str) -> None:
    """--out, --device, --shape, --date, --models-dir, --seed and the engine flags every bench passes on."""
    parser.add_argument("--out", default=f"bench/results/{bench}.json", help="JSON results file")
    parser.add_argument("--device", default=default_device(), help="cuda or cpu (default: cuda when present)")
    parser.add_argument("--shape", default=None, choices=sorted(SHAPES),
                        help="run every target on this shape instead of its own (CPU checks: tiny)")
    parser.add_argument("--date", default=datetime.date.today().isoformat())
    parser.add_argument("--models-dir", default=DEFAULT_MODELS_DIR, help="cache of random-weight models")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--in-process", action="store_true",
                        help="run every part in this process (default: each in a fresh one, see run_isolated)")
    engine = parser.add_argument_group("engine flags (as app.py serve)")
    engine.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    engine.add_argument("--no-fused-decode", dest="fused_decode", action="store_false", default=None,
                        help="one-sequence decode through the unfused layer (for comparison)")
    engine.add_argument("--x16-rows", action=argparse.BooleanOptionalAction, default=None,
                        help="the fused layer's int4 GEMVs on the integer dot over x16 rows (the engine's default), "
                             "or with --no-x16-rows on the half2 dot over fp16 rows (for comparison)")
    engine.add_argument("--lm-head-quantization", default=None, choices=["none", "int8"],
                        help="int8: the LM head as int8 rows (the engine's default: none, the checkpoint's)")
    engine.add_argument("--gpu-memory-limit", default=None, help="absolute GPU budget, e.g. 24GiB")
    engine.add_argument("--gpu-memory-utilization", type=float, default=None)
    engine.add_argument("--max-num-seqs", type=int, default=None)
    engine.add_argument("--max-num-batched-tokens", type=int, default=None)
    engine.add_argument("--kv-cache-memory", default=None, help="explicit KV size (CPU default 256MiB)")
    engine.add_argument("--block-size", type=int, default=None)
    engine.add_argument("--tensor-parallel-size", type=int, default=None)


ENGINE_FLAGS = ("enforce_eager", "gpu_memory_limit", "gpu_memory_utilization", "max_num_seqs",
                "max_num_batched_tokens", "kv_cache_memory", "block_size", "tensor_parallel_size",
                "lm_head_quantization")


def engine_kwargs(args: argparse.Namespace, **overrides) -> dict:
    """EngineArgs overrides from the flags that were given (None: engine default), then ``overrides``."""
    kwargs = {"device": args.device, "dtype": bench_dtype(args.device), "seed": args.seed}
    for name in ENGINE_FLAGS:
        value = getattr(args, name, None)
        if value is not None and value is not False:
            kwargs[name] = value
    if getattr(args, "fused_decode", None) is False:
        kwargs["fused_decode"] = False
    if getattr(args, "x16_rows", None) is not None:
        kwargs["x16_rows"] = args.x16_rows
    kwargs.update({k: v for k, v in overrides.items() if v is not None})
    return kwargs


def engine_cli_flags(kwargs: dict) -> list[str]:
    """The same overrides as ``app.py serve`` flags (``--max-num-seqs 128``, ``--enforce-eager``)."""
    flags: list[str] = []
    for name, value in kwargs.items():
        if name == "seed":
            continue
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False and value is not None:
            flags += [flag, str(value)]
    return flags


def bench_dtype(device: str) -> str:
    """fp16 on the GPU (what the targets are about); fp32 on CPU, where fp16 matmuls are slow or missing."""
    return "float16" if torch.device(device).type == "cuda" else "float32"


def model_for(args: argparse.Namespace, shape: str, quant: str) -> Path:
    """The random-weight model of ``shape`` (or ``--shape``), built on the bench device into --models-dir."""
    name = args.shape or shape
    return build_model(args.models_dir, BuildSpec(name, quant, seed=args.seed), args.device)


def shape_label(args: argparse.Namespace, shape: str) -> str:
    """How a row names its model: the target's shape, or ``tiny (as llama2-7b)`` under --shape."""
    return shape if args.shape in (None, shape) else f"{args.shape} (as {shape})"


def command_line(script: str) -> str:
    return shlex.join(["python3", f"bench/{script}.py", *sys.argv[1:]])


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), ``q`` in 0..100; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


# ---- the run -----------------------------------------------------------------------------------------------
class BenchRun:
    """Collects a bench's rows, runs its sections (a crash: a failed row), rewrites the JSON each time."""

    def __init__(self, script: str, args: argparse.Namespace):
        self.script, self.args = script, args
        self.results: list[Result] = []
        self.card = card_name(args.device)
        self.num_failed_sections = 0

    def add(self, *results: Result) -> None:
        for result in results:
            self.results.append(result)
            value = "-" if result.value is None else f"{result.value:.4g}"
            print(f"  [{self.script}] {result.name}: {value} {result.unit} ({result.target})", flush=True)

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        print(f"[{self.script}] {name} ...", flush=True)
        try:
            yield
        except Exception as exc:  # noqa: BLE001 (report the section as failed, run the rest)
            traceback.print_exc()
            self.num_failed_sections += 1
            self.results.append(Result(f"{name}: FAILED ({type(exc).__name__}: {str(exc)[:160]})", None, "",
                                       "runs", False))
        finally:
            self.save()
            if torch.device(self.args.device).type == "cuda":
                torch.cuda.empty_cache()
            print(f"[{self.script}] {name} done in {time.perf_counter() - start:.1f} s", flush=True)

    def run_isolated(self, flag: str, parts: list[str], *extra: str) -> None:
        """Each part (``<flag> <part>``) in a fresh Python running this script with the same arguments.

        A part gets a clean device: memory that a released engine or HF model failed to give back, or a CUDA
        error that poisons the context, stays in its own process. The child's rows are appended here.
        """
        script = ROOT / "bench" / f"{self.script}.py"
        for part in parts:
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "part.json"
                cmd = [sys.executable, str(script), *sys.argv[1:], flag, part, "--out", str(out), "--in-process",
                       *extra]
                code = subprocess.run(cmd, cwd=ROOT, check=False).returncode
                rows = json.loads(out.read_text())["results"] if out.is_file() else []
            self.results += [Result(r["name"], r["value"], r["unit"], r["target"], r["pass"], r["peer"],
                                    r["peer_value"]) for r in rows]
            if code != 0:
                self.num_failed_sections += 1
                if not any(r["value"] is None for r in rows):
                    self.results.append(Result(f"{part}: FAILED (exit code {code})", None, "", "runs", False))
            self.save()

    def save(self) -> None:
        doc = {"card": self.card, "date": self.args.date, "command": command_line(self.script),
               "results": [r.row() for r in self.results]}
        path = Path(self.args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1) + "\n")

    def finish(self) -> None:
        """Write the JSON, print the table; exit 1 if a section crashed (unmet targets are not errors)."""
        self.save()
        print_table(self.results, f"{self.script} on {self.card}, {self.args.date}")
        if self.num_failed_sections:
            print(f"{self.num_failed_sections} section(s) failed: see the tracebacks above", flush=True)
            sys.exit(1)


def print_table(results: list[Result], title: str) -> None:
    """Targets last, one line each: name, value, unit, target, pass, peer figure."""
    width = min(max((len(r.name) for r in results), default=20), 96)
    print(f"\n{title}")
    print(f"{'name':<{width}} {'value':>11} {'unit':<11} {'target':<9} {'pass':<5} peer")
    for r in sorted(results, key=lambda r: r.passed is not None):
        value = "-" if r.value is None else f"{r.value:.4g}"
        peer = "" if r.peer_value is None else f"{r.peer_value:.4g} ({r.peer})"
        flag = "" if r.passed is None else str(r.passed)
        print(f"{r.name[:width]:<{width}} {value:>11} {r.unit:<11} {r.target:<9} {flag:<5} {peer}")
    targets = [r for r in results if r.passed is not None]
    print(f"{sum(bool(r.passed) for r in targets)}/{len(targets)} targets met", flush=True)


def timed(fn: Callable[..., T], device: str, *args) -> tuple[float, T]:
    """(wall-clock seconds, result) of ``fn(*args)`` with the device synchronised before and after."""
    sync(device)
    start = time.perf_counter()
    result = fn(*args)
    sync(device)
    return time.perf_counter() - start, result
