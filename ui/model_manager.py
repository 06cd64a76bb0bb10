"""The Models tab's data: catalog + added models as rows (size, fit for the budget, on disk), downloads, adds.

Why here and not in the engine: these are the UI's views of the catalog (models.yaml), the Hub downloader and
the fit estimator, plus a small persisted list of models the user added (Hub repo ids and local folders) in
``$PAGODA_HOME/ui-models.json``. The engine only ever receives a catalog id or a validated local folder.

The UI follows the API's rules: on a server that listens on a network address without a key, only catalog
models already on this machine load, and nothing is downloaded, built or added (``allow_local_paths`` and
``allow_downloads`` off, as the server's settings say).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from engine import bundled
from engine.catalog import Catalog, CatalogEntry, bundled_dir, fetch
from engine.config import ModelConfig, parse_bytes, resolve_device, resolve_dtype
from engine.errors import EngineError
from engine.fit import GiB, MiB, check_fit, cpu_kv_cache_bytes, cuda_budget_bytes, format_bytes

log = logging.getLogger("pagoda.ui")

REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")
OPEN_SERVER = (" (as over the API): restart it with --api-key, or fetch models with `python app.py fetch <id>` "
               "on the server itself.")


class UIError(Exception):
    """A message for the page (a warning toast or an error line), never a traceback: unknown repo id, model
    not downloaded, empty chat message, a reply cut off by a model switch..."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class Budget:
    """The memory a model must fit in: the GPU budget, or on CPU free RAM plus the fixed KV cache size."""

    bytes: int
    kv_cache_bytes: int | None  # CPU: the KV cache is a fixed size (--kv-cache-memory)
    label: str


@dataclass(frozen=True)
class ModelRow:
    """One line of the models table."""

    id: str  # catalog id, "hub:owner/name" or the local folder
    name: str
    source: str  # bundled | hub | added hub | local
    quantization: str
    size_bytes: int | None
    context: int | None
    downloaded: bool
    loaded: bool
    fits: bool | None
    fit_label: str
    fit_message: str
    notes: str = ""


@dataclass
class AddedModel:
    """A model the user added from the Models tab (persisted)."""

    id: str
    name: str
    source: str  # "added hub" | "local"
    quantization: str
    size_bytes: int
    context: int | None
    repo: str | None = None
    revision: str = "main"
    path: str | None = None
    config: dict = field(default_factory=dict)


@dataclass
class JobStatus:
    """A download, bundled build or GGUF conversion as the progress bar shows it."""

    row_id: str
    kind: str  # download | build | convert
    state: str  # queued | running | done | failed | cancelled
    bytes_done: int = 0
    bytes_total: int = 0
    rate: float = 0.0
    eta_s: float | None = None
    message: str = ""
    cancellable: bool = False

    @property
    def finished(self) -> bool:
        return self.state in ("done", "failed", "cancelled")

    @property
    def fraction(self) -> float | None:
        return self.bytes_done / self.bytes_total if self.bytes_total else None


class _ThreadJob:
    """Work without byte progress (building a bundled quantized model, converting a GGUF) in a daemon thread."""

    def __init__(self, row_id: str, kind: str, work: Callable[[Callable[[str], None]], None]):
        self._lock = threading.Lock()
        self._status = JobStatus(row_id, kind, "running", message="starting …")
        self._thread = threading.Thread(target=self._run, args=(work,), daemon=True, name=f"pagoda-{kind}")
        self._thread.start()

    def _log(self, message: str) -> None:
        with self._lock:
            self._status = JobStatus(**{**asdict(self._status), "message": message.strip()[:200]})

    def _run(self, work) -> None:
        try:
            work(self._log)
            state, message = "done", "done"
        except EngineError as exc:
            state, message = "failed", exc.message
        except Exception as exc:  # report it on the page; the log keeps the details
            log.exception("%s of %s failed", self._status.kind, self._status.row_id)
            state, message = "failed", f"{type(exc).__name__}: {exc}"
        with self._lock:
            self._status = JobStatus(**{**asdict(self._status), "state": state, "message": message})

    def status(self) -> JobStatus:
        with self._lock:
            return self._status

    def cancel(self) -> bool:
        return False


class _HubJob:
    """A Hub download (engine.hub.DownloadHandle) seen as a JobStatus."""

    def __init__(self, row_id: str, handle):
        self.row_id, self.handle = row_id, handle

    def status(self) -> JobStatus:
        p = self.handle.progress
        state = {"queued": "queued", "downloading": "running"}.get(p.state.value, p.state.value)
        message = p.error or (f"{p.current_file} ({p.files_done}/{p.files_total} files)" if p.current_file
                              else state)
        return JobStatus(self.row_id, "download", state, p.bytes_done, p.bytes_total, p.rate_bytes_per_s,
                         p.eta_s, message, cancellable=not self.handle.done)

    def cancel(self) -> bool:
        self.handle.cancel()
        return True


def default_state_path() -> Path:
    return bundled.pagoda_home() / "ui-models.json"


class ModelManager:
    """Rows for the models table, the fit of each for the current budget, downloads and added models."""

    def __init__(self, engine, *, catalog: Catalog | None = None, downloader=None, state_path: Path | None = None,
                 allow_local_paths: bool = True, allow_downloads: bool = True):
        self.engine = engine
        self.catalog = catalog or Catalog.load()
        self._downloader = downloader
        self.state_path = state_path or default_state_path()
        self.allow_local_paths = allow_local_paths
        self.allow_downloads = allow_downloads
        self._lock = threading.Lock()
        self._jobs: dict[str, _ThreadJob | _HubJob] = {}
        self._added: dict[str, AddedModel] = self._read_state()

    @property
    def downloader(self):
        if self._downloader is None:
            from engine.hub import HubDownloader

            self._downloader = HubDownloader()
        return self._downloader

    def close(self) -> None:
        if self._downloader is not None:
            self._downloader.close(timeout=2.0)

    # ---- persisted added models -------------------------------------------------------------------------
    def _read_state(self) -> dict[str, AddedModel]:
        try:
            raw = json.loads(self.state_path.read_text())
            return {m["id"]: AddedModel(**m) for m in raw.get("models", [])}
        except FileNotFoundError:
            return {}
        except (ValueError, TypeError, KeyError) as exc:
            log.warning("ignoring unreadable %s: %s", self.state_path, exc)
            return {}

    def _write_state(self) -> None:
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"models": [asdict(m) for m in self._added.values()]}, indent=1))
        os.replace(tmp, self.state_path)

    # ---- budget and fit ---------------------------------------------------------------------------------
    def budget(self) -> Budget:
        args = self.engine.engine_args
        device = resolve_device(args.device)
        if device.type == "cuda":
            snapshot = self.engine.snapshot()
            props = torch.cuda.get_device_properties(device)
            limit = parse_bytes(args.gpu_memory_limit) if args.gpu_memory_limit else None
            budget = (snapshot.memory_budget if snapshot else None) or cuda_budget_bytes(args, device)
            how = (f"--gpu-memory-limit {args.gpu_memory_limit}" if limit
                   else f"{args.gpu_memory_utilization:.2f} × {format_bytes(props.total_memory)}")
            return Budget(budget, None, f"GPU budget {format_bytes(budget)} ({how}, {props.name})")
        import psutil

        kv = cpu_kv_cache_bytes(args)
        available = psutil.virtual_memory().available
        return Budget(available, kv, f"CPU: {format_bytes(kv)} KV cache per model, "
                                     f"{format_bytes(available)} RAM available")

    def _fit(self, config: ModelConfig | None, size_bytes: int | None, context: int | None,
             budget: Budget) -> tuple[bool | None, str, str]:
        """(fits, short label, full message) for the budget; from config.json when known, else from size."""
        args = self.engine.engine_args
        if config is None:
            if not size_bytes:
                return None, "? unknown", "size unknown until the model's config is fetched"
            need = size_bytes + (budget.kv_cache_bytes or 0) + 256 * MiB
            ok = need <= budget.bytes
            return ok, ("≈ fits" if ok else "✗ too big"), (
                f"estimated from the download size ({format_bytes(size_bytes)}) against {budget.label}")
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device, config.torch_dtype)
        max_len = min(args.max_model_len or context or config.max_position_embeddings,
                      context or config.max_position_embeddings)
        report = check_fit(config, dtype, budget.bytes, max_len, args.block_size,
                           max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                           kv_cache_bytes=budget.kv_cache_bytes, lm_head_quantization=args.lm_head_quantization)
        if report.fits:
            return True, "✓ fits", report.message
        if args.max_model_len is None and report.suggested_max_model_len:
            # the engine caps a default context to what the KV cache holds, so this still loads
            tokens = report.suggested_max_model_len
            return True, f"✓ fits (context ≤ {tokens:,})", (
                f"loads with its context capped to {tokens:,} tokens (what the KV cache holds); at the full "
                f"{max_len:,} tokens it would not: " + report.message.removeprefix("does not fit: "))
        return False, "✗ too big", report.message

    # ---- rows -------------------------------------------------------------------------------------------
    def rows(self) -> list[ModelRow]:
        budget = self.budget()
        rows = [self._catalog_row(entry, budget) for entry in self.catalog]
        rows += [self._added_row(added, budget) for added in list(self._added.values())]
        return rows

    def row(self, row_id: str) -> ModelRow:
        for row in self.rows():
            if row.id == row_id:
                return row
        raise UIError(f"unknown model {row_id!r}: pick one from the table")

    def _is_loaded(self, *refs: str | Path | None) -> bool:
        """Whether the engine serves this model (named by catalog id, or by a path to the same folder)."""
        if self.engine.model_name is None:
            return False
        served = str(self.engine.engine_args.model)
        served_path = Path(served).expanduser()
        for ref in refs:
            if ref is None:
                continue
            if served == str(ref) or (served_path.is_absolute() and Path(ref).is_absolute()
                                      and served_path.resolve() == Path(ref).resolve()):
                return True
        return False

    def _catalog_row(self, entry: CatalogEntry, budget: Budget) -> ModelRow:
        folder = self._catalog_folder(entry)
        config = _read_config(folder) if folder else self._cached_hub_config(entry)
        size = int(entry.size_gb * 1e9)
        fits, label, message = self._fit(config, size, entry.context, budget)
        return ModelRow(entry.id, entry.name, entry.source, entry.quantization, size, entry.context,
                        folder is not None, self._is_loaded(entry.id, folder), fits, label, message, entry.notes)

    def _added_row(self, m: AddedModel, budget: Budget) -> ModelRow:
        folder = self._added_folder(m)
        config = _config_or_none(m.config)
        fits, label, message = self._fit(config, m.size_bytes, m.context, budget)
        notes = f"Hub repo {m.repo}" if m.repo else f"local folder {m.path}"
        return ModelRow(m.id, m.name, m.source, m.quantization, m.size_bytes, m.context, folder is not None,
                        self._is_loaded(m.id, m.path, str(folder) if folder else None), fits, label, message, notes)

    def _catalog_folder(self, entry: CatalogEntry) -> Path | None:
        """The local folder of a catalog model if it is complete on this machine, else None."""
        if entry.source == "bundled":
            folder = bundled_dir(entry)
            return folder if bundled.is_complete(folder) else None
        return self._hub_folder(entry.repo, entry.revision)

    def _hub_folder(self, repo: str | None, revision: str) -> Path | None:
        from engine.hub import inspect_folder

        if not repo:
            return None
        try:
            snapshot = self.downloader.cached_snapshot(repo, revision)
            if snapshot is None:
                return None
            inspect_folder(snapshot)  # every weight shard present
            return snapshot
        except (EngineError, OSError, ValueError):
            return None

    def _cached_hub_config(self, entry: CatalogEntry) -> ModelConfig | None:
        if entry.source != "hub":
            return None  # a bundled build not made yet: estimated from its catalog size
        try:
            snapshot = self.downloader.cached_snapshot(entry.repo, entry.revision)
        except (OSError, ValueError):  # an unreadable cache or a malformed repo id
            return None
        return _read_config(snapshot) if snapshot else None

    def _added_folder(self, m: AddedModel) -> Path | None:
        if m.repo:
            return self._hub_folder(m.repo, m.revision)
        path = Path(m.path or "")
        return path if (path / "config.json").is_file() else None

    # ---- loading ----------------------------------------------------------------------------------------
    def load_reference(self, row_id: str) -> str:
        """What to hand to ``switch_model`` for a row: a catalog id or a local folder. UIError if absent."""
        entry = self.catalog.get(row_id)
        if entry is not None:
            if self._catalog_folder(entry) is None:
                verb = "built" if entry.source == "bundled" else "downloaded"
                raise UIError(f"{row_id} is not {verb} yet: select it and click Download first.")
            return row_id
        added = self._added.get(row_id)
        if added is None:
            raise UIError(f"unknown model {row_id!r}: pick one from the table")
        if not self.allow_local_paths:
            raise UIError(f"{added.name} is a folder on this machine outside the catalog: loading those is "
                          f"disabled on a server that listens on a network address without --api-key{OPEN_SERVER}")
        folder = self._added_folder(added)
        if folder is None:
            what = "downloaded yet: click Download first" if added.repo else f"found at {added.path} any more"
            raise UIError(f"{added.name} is not {what}.")
        return str(folder)

    # ---- downloads --------------------------------------------------------------------------------------
    def start_download(self, row_id: str, token: str | None = None) -> JobStatus:
        """Download a Hub model or build a bundled one; joining a running job returns its status."""
        if not self.allow_downloads:
            raise UIError("Downloads and builds are disabled on a server that listens on a network address "
                          f"without --api-key{OPEN_SERVER}")
        with self._lock:
            job = self._jobs.get(row_id)
            if job is not None and not job.status().finished:
                return job.status()
            entry = self.catalog.get(row_id)
            added = self._added.get(row_id)
            if entry is not None and entry.source == "bundled":
                job = _ThreadJob(row_id, "build", lambda log_fn: fetch(entry, self.catalog, log_fn) and None)
            elif entry is not None or (added is not None and added.repo):
                repo, revision = (entry.repo, entry.revision) if entry else (added.repo, added.revision)
                job = _HubJob(row_id, self.downloader.start(repo, revision, token or None))
            elif added is not None:
                raise UIError(f"{added.name} is a local folder: nothing to download.")
            else:
                raise UIError(f"unknown model {row_id!r}: pick one from the table")
            self._jobs[row_id] = job
        return job.status()

    def job(self, row_id: str) -> JobStatus | None:
        job = self._jobs.get(row_id)
        return job.status() if job is not None else None

    def cancel(self, row_id: str) -> bool:
        job = self._jobs.get(row_id)
        if job is None or job.status().finished:
            raise UIError(f"no download of {row_id} is running.")
        if not job.cancel():
            raise UIError(f"building {row_id} cannot be cancelled; it finishes on its own.")
        return True

    # ---- adding models ----------------------------------------------------------------------------------
    def add(self, reference: str, token: str | None = None) -> ModelRow:
        """Add a Hub repo id (validated on the Hub before any weight moves) or a local folder / GGUF file."""
        ref = (reference or "").strip()
        if not ref:
            raise UIError("Enter a Hugging Face repo id (owner/name) or the path of a local model folder "
                             "or .gguf file.")
        if ref.startswith(("/", "~", ".")) or ref.lower().endswith(".gguf") or "\\" in ref:
            return self._add_local(ref)
        if not self.allow_downloads:
            raise UIError(f"Adding Hub models is disabled on a server that listens on a network address without "
                          f"--api-key{OPEN_SERVER}")
        if not REPO_ID.match(ref):
            raise UIError(f"'{ref}' is not a Hub repo id: use owner/name, for example "
                             "Qwen/Qwen2.5-0.5B-Instruct-AWQ.")
        for entry in self.catalog:
            if entry.repo == ref:
                raise UIError(f"{ref} is already in the catalog as {entry.id}.")
        try:
            plan = self.downloader.inspect(ref, token=token or None)
        except EngineError as exc:
            raise UIError(exc.message) from exc
        config = plan.model_config
        added = AddedModel(f"hub:{ref}", ref.split("/")[-1], "added hub", plan.quantization, plan.bytes_total,
                           config.max_position_embeddings, repo=ref, revision=plan.revision, config=config.raw)
        return self._remember(added)

    def _add_local(self, ref: str) -> ModelRow:
        if not self.allow_local_paths:
            raise UIError("Adding local folders is disabled on a server that listens on a network address "
                             "without --api-key.")
        try:
            local = self.downloader.add_local(ref)
        except EngineError as exc:
            raise UIError(exc.message) from exc
        if local.kind == "gguf":
            return self._convert_gguf(local.path)
        config = local.model_config
        added = AddedModel(str(local.path), local.path.name, "local", local.quantization, local.size_bytes,
                           config.max_position_embeddings if config else None, path=str(local.path),
                           config=config.raw if config else {})
        return self._remember(added)

    def _convert_gguf(self, gguf: Path) -> ModelRow:
        """GGUF files are converted to fp16 safetensors (as the default model is) in a background job."""
        target = bundled.models_dir() / re.sub(r"[^a-z0-9._-]+", "-", gguf.stem.lower())
        added = AddedModel(str(target), gguf.stem, "local", "fp16 (from GGUF)", gguf.stat().st_size, None,
                           path=str(target))

        def work(log_fn: Callable[[str], None]) -> None:
            if bundled.is_complete(target):
                return
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
            try:
                bundled.convert_gguf(gguf, tmp, log=log_fn)
                bundled.publish(tmp, target)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            config = ModelConfig.from_path(target)
            with self._lock:
                added.config, added.context = config.raw, config.max_position_embeddings
                self._write_state()

        row = self._remember(added)
        with self._lock:
            self._jobs[added.id] = _ThreadJob(added.id, "convert", work)
        return row

    def _remember(self, added: AddedModel) -> ModelRow:
        with self._lock:
            self._added[added.id] = added
            self._write_state()
        return self._added_row(added, self.budget())

    def remove(self, row_id: str) -> None:
        if row_id in self.catalog.entries:
            raise UIError(f"{row_id} is part of the catalog (models.yaml) and cannot be removed here.")
        with self._lock:
            if self._added.pop(row_id, None) is None:
                raise UIError(f"unknown model {row_id!r}")
            self._write_state()


def _read_config(folder: Path | None) -> ModelConfig | None:
    if folder is None:
        return None
    try:
        return ModelConfig.from_path(folder)
    except (EngineError, OSError, ValueError):
        return None


def _config_or_none(raw: dict) -> ModelConfig | None:
    if not raw:
        return None
    try:
        return ModelConfig.from_dict(raw)
    except (EngineError, KeyError, ValueError, TypeError):
        return None


def format_size(size_bytes: int | None) -> str:
    if not size_bytes:
        return "—"
    return f"{size_bytes / GiB:.2f} GiB" if size_bytes >= GiB else f"{size_bytes / MiB:.0f} MiB"
