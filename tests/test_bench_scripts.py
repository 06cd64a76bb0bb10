"""The engine benchmarks (bench/*.py) run end to end on CPU with the tiny shape and write well-formed JSON.

The figures on CPU mean nothing for the targets; what a GPU run needs is that every script starts, drives the
engine (offline, HF baseline, server and its streaming API), and writes one row per target with the schema
``{"card", "date", "command", "results": [{"name", "value", "unit", "target", "pass", "peer",
"peer_value"}]}``.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.random_model import BuildSpec, build_model

DATE = "2001-02-03"
ROW_KEYS = {"name", "value", "unit", "target", "pass", "peer", "peer_value"}


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("bench-models")
    for quant in ("awq", "fp16"):
        build_model(cache, BuildSpec("tiny", quant), "cpu")
    return cache


def run_bench(script: str, models_dir: Path, out: Path, *flags: str, timeout: float = 120) -> dict:
    cmd = [sys.executable, str(ROOT / "bench" / f"{script}.py"), "--device", "cpu", "--shape", "tiny",
           "--models-dir", str(models_dir), "--out", str(out), "--date", DATE, *flags]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "targets met" in proc.stdout.splitlines()[-1]  # the table comes last
    return json.loads(out.read_text())


def check_schema(doc: dict, script: str) -> list[dict]:
    """Exact keys, typed rows, pass set exactly on target rows; returns the target rows."""
    assert set(doc) == {"card", "date", "command", "results"}
    assert doc["date"] == DATE and doc["card"].startswith("CPU")
    assert doc["command"].startswith(f"python3 bench/{script}.py ")
    for row in doc["results"]:
        assert set(row) == ROW_KEYS, row
        assert isinstance(row["name"], str) and isinstance(row["unit"], str)
        assert not row["name"].endswith("FAILED"), row
        assert row["value"] is not None and math.isfinite(row["value"]), row
        if row["target"] == "info":
            assert row["pass"] is None
        else:
            assert isinstance(row["pass"], bool)
            op, _, bound = row["target"].partition(" ")
            assert op in (">=", "<=", "<") and float(bound) > 0, row
            expected = {">=": row["value"] >= float(bound), "<=": row["value"] <= float(bound),
                        "<": row["value"] < float(bound)}[op]
            assert row["pass"] == expected, row
    return [row for row in doc["results"] if row["pass"] is not None]


def find(rows: list[dict], *words: str) -> dict:
    matches = [row for row in rows if all(w in row["name"] for w in words)]
    assert len(matches) == 1, (words, [row["name"] for row in rows])
    return matches[0]


def test_random_model_builds_are_cached_and_complete(models_dir):
    folder = build_model(models_dir, BuildSpec("tiny", "awq"), "cpu")
    stamp = (folder / "bench-model.json").stat().st_mtime_ns
    assert build_model(models_dir, BuildSpec("tiny", "awq"), "cpu") == folder
    assert (folder / "bench-model.json").stat().st_mtime_ns == stamp  # reused, not rebuilt
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "awq"
    assert config["quantization_config"]["group_size"] == 32  # 64 % 128 != 0
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert "model.layers.1.mlp.down_proj.qweight" in index["weight_map"]
    assert all((folder / name).is_file() for name in set(index["weight_map"].values()))


def test_latency_bench_writes_its_targets(models_dir, tmp_path):
    doc = run_bench("latency", models_dir, tmp_path / "latency.json", "--output-len", "12", "--repeats", "1",
                    "--prefix-len", "512", "--prefix-trials", "1", "--in-process", timeout=240)
    targets = check_schema(doc, "latency")
    assert len(targets) == 5
    assert find(targets, "smollm2-135m", "decode")["unit"] == "tok/s"
    assert 0 < find(targets, "llama2-7b) AWQ", "roofline")["value"] < 2
    assert 0 < find(targets, "llama2-7b) fp16", "roofline")["value"] < 2
    assert find(targets, "TTFT miss / TTFT hit")["value"] > 0
    streamed = find(targets, "streamed through app.py serve / offline")  # a server on the same model, streaming
    assert streamed["target"] == ">= 0.95" and streamed["value"] > 0
    # the hit really came from the prefix cache: every full 16-token block of the 512-token prefix
    assert find(doc["results"], "served from the prefix cache")["value"] >= 512 - 16


def test_throughput_bench_writes_its_targets(models_dir, tmp_path):
    """Each section in its own process (the default), rows merged into one file."""
    doc = run_bench("throughput", models_dir, tmp_path / "throughput.json", "--concurrent", "6",
                    "--input-len", "16", "--output-len", "6", "--repeats", "1", "--num-requests", "12",
                    "--hf-requests", "4", "--hf-batch-size", "4", "--memory-requests", "12",
                    "--prompt-cap", "48", "--output-cap", "10")
    targets = check_schema(doc, "throughput")
    assert len(targets) == 4
    assert find(targets, "AWQ, 6 requests", "generated tok/s")["value"] > 0
    ratio = find(targets, "Pagoda / HF")
    assert ratio["peer_value"] > 0 and "first 4" in ratio["name"]  # HF timed on a whole batch of the mix
    assert 0 < find(targets, "KV pool /")["value"] <= 1.0
    assert 0 <= find(targets, "unused KV slots")["value"] < 100
    assert find(doc["results"], "slot samples taken")["value"] >= 1


def test_serving_bench_streams_from_a_started_server(models_dir, tmp_path):
    doc = run_bench("serving", models_dir, tmp_path / "serving.json", "--num-prompts", "6", "--request-rate",
                    "50", "--warmup-requests", "1", "--prompt-cap", "48", "--output-cap", "6")
    (completed,) = check_schema(doc, "serving")
    assert completed["value"] == 6 and completed["pass"] is True
    rows = doc["results"]
    p50, p90, p99 = (find(rows, f"p{q} TTFT")["value"] for q in (50, 90, 99))
    assert 0 < p50 <= p90 <= p99
    assert find(rows, "output token throughput")["value"] > 0


def test_startup_bench_times_a_server_start(models_dir, tmp_path):
    doc = run_bench("startup", models_dir, tmp_path / "startup.json", "--modes", "server", "--repeats", "1",
                    "--warmup-starts", "0")
    (ready,) = check_schema(doc, "startup")
    assert ready["unit"] == "s" and ready["value"] > 0 and ready["target"] == "<= 5"


def test_llamacpp_rates_are_read_from_the_peer_script_output(tmp_path):
    """The ratio targets' peer comes from llamacpp_bench.sh's output: each shape's tg128 row (mean ± sd)."""
    from bench.common import read_llamacpp_tg

    rows = ["| model | size | params | backend | ngl | test | t/s |", "| --- | ---: | ---: | --- | --: | ---: | ---: |"]
    out = tmp_path / "llamacpp.txt"
    out.write_text("\n".join([
        "## smol (Q4_1)", *rows,
        "| llama 256M Q4_1 | 108.98 MiB | 162.83 M | CUDA | 99 | pp512 | 43920.09 ± 19455.21 |",
        "| llama 256M Q4_1 | 108.98 MiB | 162.83 M | CUDA | 99 | tg128 | 916.71 ± 20.58 |",
        "## l8b (Q4_0)", *rows,
        "| llama 3B Q4_0 | 3.92 GiB | 7.38 B | CUDA | 99 | tg128 | 340.11 ± 2.06 |",
        "## l8b batched (128 prompt + 128 generated per sequence)",
        "|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |",
        "|   128 |    128 |    1 |    256 |    0.037 |  3484.04 |    0.378 |   338.35 |    0.415 |   616.80 |",
    ]) + "\n")
    assert read_llamacpp_tg(out) == {"smollm2-135m": 916.71, "llama3-8b": 340.11}
