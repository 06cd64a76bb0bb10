"""Layers import one way (README "Architecture"): read every module's imports from its syntax tree and check them.

kernels/ import no engine, ui or app; the model code and quantized-checkpoint loading import no runner, core,
serving or quantizer-building module; the engine core imports no serving; engine/serving imports no ui; the UI
reaches the engine only through its client object (the tabs import no engine module that runs requests and never
touch an ``.engine`` attribute); nothing imports app.py; the engine's errors come from engine/errors.py alone.
Function-level and TYPE_CHECKING imports count too. No dependency beyond the standard library.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "engine", "ui")

MODEL = ("engine.models", "engine.layers", "engine.model_loader", "engine.forward_batch",
         "engine.quant.formats", "engine.quant.awq", "engine.quant.gptq")  # model code, checkpoint loading
QUANT_BUILD = ("engine.quant.quantizer", "engine.quant.layers", "engine.quant.awq_search", "engine.quant.gptq_solver",
               "engine.quant.rtn", "engine.quant.checkpoint", "engine.quant.evaluate")  # calibration, search, writing
RUNNER = ("engine.model_runner", "engine.cuda_graph", "engine.sampler", "engine.memory", "engine.block_table",
          "engine.warmup")
CORE = ("engine.request", "engine.block_pool", "engine.kv_cache_manager", "engine.scheduler", "engine.detokenizer",
        "engine.llm_engine", "engine.llm", "engine.async_engine", "engine.engine_loop", "engine.streams",
        "engine.snapshot", "engine.metrics", "engine.admission")
SERVING = ("engine.serving",)
# What the UI may import of the engine: configuration, errors, plain data types and the model catalog/downloads.
UI_MAY_USE = ("engine.config", "engine.errors", "engine.request", "engine.snapshot", "engine.tokenizer", "engine.fit",
              "engine.catalog", "engine.hub", "engine.bundled",
              "engine.reasoning", "engine.serving.tools")  # the text parsers the chat shares with the API
UI_CLIENT = ("ui.client", "ui.model_manager")  # the client object and the model manager it owns
ERRORS = {"EngineError", "EngineUnavailableError", "ModelSwitchedError", "NoModelLoadedError", "EngineStepError"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def modules() -> dict[str, ast.Module]:
    found = {"app": ast.parse((ROOT / "app.py").read_text())}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[module_name(path)] = ast.parse(path.read_text(), filename=str(path))
    return found


def imports(tree: ast.Module) -> list[tuple[str, str | None, int]]:
    """(module, imported name or None, line) for every import in the file, nested ones included."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [(node.module, alias.name, node.lineno) for alias in node.names]
            # ``from engine import bundled`` imports the module engine.bundled
            found += [(f"{node.module}.{alias.name}", None, node.lineno) for alias in node.names]
    return found


def within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def existing(name: str) -> bool:
    return name in modules()


def violations(sources: tuple[str, ...], forbidden: tuple[str, ...], allowed: tuple[str, ...] = (),
               allowed_exactly: tuple[str, ...] = ()) -> list[str]:
    bad = []
    for mod, tree in modules().items():
        if not within(mod, sources):
            continue
        for target, _, line in imports(tree):
            if target in allowed_exactly:
                continue
            if existing(target) and within(target, forbidden) and not within(target, allowed):
                bad.append(f"{mod}:{line} imports {target}")
    return bad


def test_kernels_know_no_engine_ui_or_app():
    assert violations(("kernels",), ("engine", "ui", "app")) == []


def test_model_code_and_checkpoint_loading_import_no_runner_core_serving_or_quantizer():
    assert violations(MODEL, RUNNER + CORE + SERVING + QUANT_BUILD + ("ui", "app")) == []
    package = [t for t, _, _ in imports(modules()["engine.quant"]) if within(t, QUANT_BUILD)]
    assert package == []  # engine/quant/__init__.py is on the loading path (engine.model_loader imports it)


def test_the_runner_imports_no_serving_ui_or_app():
    assert violations(RUNNER, SERVING + ("ui", "app")) == []


def test_the_engine_core_imports_no_serving_ui_or_app():
    assert violations(CORE, SERVING + ("ui", "app")) == []
    assert violations(("engine",), ("ui", "app")) == []


def test_serving_imports_no_ui_or_app():
    assert violations(SERVING, ("ui", "app")) == []


def test_the_ui_reaches_the_engine_only_through_its_client():
    engine_modules = tuple(m for m in modules() if within(m, ("engine", "kernels")))
    # ``engine`` itself (its public names) but not, through it, every engine module
    assert violations(("ui",), engine_modules, allowed=UI_MAY_USE, allowed_exactly=("engine",)) == []
    assert violations(("ui",), ("app",)) == []
    touching = []
    for mod, tree in modules().items():
        if within(mod, ("ui",)) and not within(mod, UI_CLIENT):
            touching += [f"{mod}:{node.lineno} .engine" for node in ast.walk(tree)
                         if isinstance(node, ast.Attribute) and node.attr == "engine"]
    assert touching == []


def test_nothing_imports_app():
    assert [f"{mod}:{line}" for mod, tree in modules().items() if mod != "app"
            for target, _, line in imports(tree) if target == "app"] == []


def test_engine_errors_come_from_one_module():
    errors = modules()["engine.errors"]
    assert [t for t, _, _ in imports(errors) if within(t, PACKAGES)] == []  # importable by every layer
    defined = {node.name for node in ast.walk(errors) if isinstance(node, ast.ClassDef)}
    assert ERRORS <= defined
    elsewhere = [f"{mod}: class {node.name}" for mod, tree in modules().items() if mod != "engine.errors"
                 for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.name in ERRORS]
    assert elsewhere == []
    tests = {f"tests.{p.stem}": ast.parse(p.read_text()) for p in (ROOT / "tests").glob("*.py")}
    wrong = [f"{mod}:{line} takes {name} from {target}" for mod, tree in {**modules(), **tests}.items()
             for target, name, line in imports(tree) if name in ERRORS and target != "engine.errors"]
    assert wrong == []


@pytest.mark.parametrize("entry", ["engine.llm_engine", "engine.model_loader", "engine.quant"])
def test_loading_code_does_not_pull_in_the_quantizer(entry):
    """At run time too (lazy imports included): importing the loading path leaves the quantizer unimported."""
    code = (f"import sys, {entry}, engine.quant.formats, engine.quant.awq, engine.quant.gptq\n"
            f"print(sorted(m for m in sys.modules if m in {QUANT_BUILD!r}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
