"""The model catalog (models.yaml): schema check, lookup, and resolving an id or path to a local model folder."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from engine import bundled
from engine.errors import EngineError

CATALOG_PATH = Path(__file__).resolve().parent.parent / "models.yaml"
SOURCES = ("bundled", "hub")
QUANTIZATIONS = ("fp16", "bf16", "fp32", "awq", "gptq")


@dataclass(frozen=True)
class CatalogEntry:
    id: str
    name: str
    source: str
    quantization: str
    size_gb: float
    context: int
    notes: str = ""
    repo: str | None = None
    revision: str = "main"
    base: str | None = None
    method: str | None = None
    group_size: int | None = None  # builds of a Hub base: the quantizer's group size


_REQUIRED = {"id": str, "name": str, "source": str, "quantization": str, "size_gb": (int, float), "context": int}
_OPTIONAL = {"notes": str, "repo": str, "revision": str, "base": str, "method": str, "group_size": int}
# A build from a Hub base runs on a CUDA GPU; on a CPU only from bases this small (the SmolLM2 builds take a few
# minutes on two cores; a 3.8B base would take hours there).
CPU_BUILD_MAX_GB = 1.0


def _check_entry(index: int, raw: dict) -> CatalogEntry:
    where = f"models.yaml entry {index}"
    if not isinstance(raw, dict):
        raise EngineError(f"{where} must be a mapping")
    for key, kind in _REQUIRED.items():
        if key not in raw:
            raise EngineError(f"{where} ({raw.get('id', '?')}) is missing '{key}'")
        if not isinstance(raw[key], kind):
            raise EngineError(f"{where} ({raw.get('id', '?')}): '{key}' has the wrong type")
    unknown = set(raw) - set(_REQUIRED) - set(_OPTIONAL)
    if unknown:
        raise EngineError(f"{where} ({raw['id']}) has unknown field(s): {', '.join(sorted(unknown))}")
    if raw["source"] not in SOURCES:
        raise EngineError(f"{where} ({raw['id']}): source must be one of {SOURCES}")
    if raw["quantization"] not in QUANTIZATIONS:
        raise EngineError(f"{where} ({raw['id']}): quantization must be one of {QUANTIZATIONS}")
    if raw["source"] == "hub" and not raw.get("repo"):
        raise EngineError(f"{where} ({raw['id']}): hub entries need 'repo'")
    if raw["source"] == "bundled" and raw.get("base") and not raw.get("method"):
        raise EngineError(f"{where} ({raw['id']}): bundled quantized entries need 'method'")
    if raw.get("group_size") is not None and not raw.get("base"):
        raise EngineError(f"{where} ({raw['id']}): 'group_size' applies to builds (entries with a 'base')")
    return CatalogEntry(**{k: (str(v) if k == "revision" else v) for k, v in raw.items()})


class Catalog:
    """The entries of models.yaml, checked on load."""

    def __init__(self, entries: list[CatalogEntry]):
        self.entries = {e.id: e for e in entries}
        if len(self.entries) != len(entries):
            raise EngineError("models.yaml has duplicate ids")

    @staticmethod
    def load(path: Path = CATALOG_PATH) -> Catalog:
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise EngineError(f"{path} is not valid YAML: {exc}") from exc
        if not isinstance(data, dict) or not isinstance(data.get("models"), list):
            raise EngineError(f"{path} must have a top-level 'models' list")
        return Catalog([_check_entry(i, raw) for i, raw in enumerate(data["models"])])

    def get(self, model_id: str) -> CatalogEntry | None:
        return self.entries.get(model_id)

    def __iter__(self):
        return iter(self.entries.values())


def bundled_dir(entry: CatalogEntry) -> Path:
    return bundled.models_dir() / entry.id


def fetch(entry: CatalogEntry, catalog: Catalog, log: Callable[[str], None] = print) -> Path:
    """Make a catalog model available locally (build bundled ones, download hub ones) and return its folder."""
    if entry.source == "bundled" and entry.base is None:
        return bundled.fetch_default_model(log)
    if entry.source == "bundled":
        base = catalog.get(entry.base)
        if base is None:
            raise EngineError(f"catalog entry {entry.id} names an unknown base {entry.base!r}")
        target = bundled_dir(entry)
        if bundled.is_complete(target):
            return target
        from_hub = base.source == "hub"
        if from_hub:
            _check_build_device(entry, base)  # before a download of many GB
        base_dir = fetch(base, catalog, log)
        from engine.quant.quantizer import build_bundled_quantized, build_from_hub_base

        tmp = target.with_name(f".{entry.id}-building")
        if from_hub:
            build_from_hub_base(base_dir, tmp, entry.method, entry.group_size or 128, log=log)
        else:
            build_bundled_quantized(base_dir, tmp, entry.method, log=log)
        return bundled.publish(tmp, target)
    from engine.hub import HubDownloader

    return Path(HubDownloader().download(entry.repo, revision=entry.revision))


def builds_from_hub(entry: CatalogEntry, catalog: Catalog) -> bool:
    """A 4-bit build made on this machine from a Hub model (downloaded first: many GB)."""
    base = catalog.get(entry.base) if entry.source == "bundled" and entry.base else None
    return base is not None and base.source == "hub"


def _check_build_device(entry: CatalogEntry, base: CatalogEntry) -> None:
    import torch

    if not torch.cuda.is_available() and base.size_gb > CPU_BUILD_MAX_GB:
        raise EngineError(f"building {entry.id} quantizes {base.id} ({base.size_gb:g} GB): that needs a CUDA GPU "
                          f"(on this CPU it would take hours); download {base.id} to run it unquantized",
                          param="model")


def local_hub_snapshot(entry: CatalogEntry) -> Path | None:
    """The folder of an already downloaded hub model in the standard HF cache, or None."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(entry.repo, revision=entry.revision, local_files_only=True))
    except Exception:  # noqa: BLE001 -- whatever the hub library raises here, the model is not cached
        return None


def resolve_model(model: str, catalog: Catalog | None = None, auto_fetch_bundled: bool = True,
                  log: Callable[[str], None] = print) -> tuple[Path, str]:
    """A catalog id or a local folder -> (local folder, display name). Bundled models are built on demand;
    Hub models must have been fetched (``python app.py fetch <id>``) so serving never starts a big download."""
    catalog = catalog or Catalog.load()
    entry = catalog.get(model)
    if entry is not None:
        if entry.source == "bundled":
            from_hub = builds_from_hub(entry, catalog)  # serving never starts its base's download
            if (not auto_fetch_bundled or from_hub) and not bundled.is_complete(bundled_dir(entry)):
                raise EngineError(f"model {model!r} is not built yet: run `python app.py fetch {model}`"
                                  + (" or build it from the Models tab" if from_hub else ""), param="model")
            return fetch(entry, catalog, log), entry.id
        snapshot = local_hub_snapshot(entry)
        if snapshot is None:
            raise EngineError(f"model {model!r} is not downloaded yet: run `python app.py fetch {model}` "
                              "or download it from the Models tab", param="model")
        return snapshot, entry.id
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise EngineError(f"{path} has no config.json: not a model folder", param="model")
        return path.resolve(), path.name
    known = ", ".join(sorted(catalog.entries))
    raise EngineError(f"unknown model {model!r}: not a catalog id ({known}) nor a local folder", param="model")

