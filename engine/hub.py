"""Model downloads from the Hugging Face Hub into its standard cache, validated before any large transfer.

What a user gets, and why it is built this way:

- The standard cache (``HF_HUB_CACHE`` / ``HF_HOME``, layout ``models--org--name/{blobs,snapshots,refs}``) so
  models fetched by other tools are reused and ours are visible to them. ``HF_ENDPOINT``, ``HF_TOKEN`` and
  ``HF_HUB_OFFLINE`` are read when a ``HubDownloader`` is made (not when huggingface_hub was imported).
- Before any weight byte moves: the file list with sizes (``model_info(files_metadata=True)``), config.json
  (and an index / quantize_config.json / quant_config.json when present) through ``hf_hub_download``; missing, gated, no
  safetensors, unsupported architecture or quantization, and too little free disk are refused with a message.
- Only the files the engine reads: root-level safetensors (the shards the index names), configs, tokenizer
  and chat template. Never ``original/`` copies, ``.bin`` pickles or a duplicate ``consolidated.safetensors``.
- Resume: complete files are never fetched again, and a partial ``blobs/<etag>.incomplete`` continues with an
  HTTP Range request. huggingface_hub 2.x's ``hf_hub_download`` writes to a per-call temporary file and
  deletes it on failure, so partial files cannot survive a cancel or a crash there; the weights therefore go
  through huggingface_hub's ``get_hf_file_metadata`` (HEAD: etag, size, CDN location, Hub errors) and
  ``http_get`` (ranged GET, retries) into an ``.incomplete`` file this module owns, checked against the
  LFS sha256 and moved into the cache exactly where ``hf_hub_download`` puts it (same blob, same lock file).
- Progress (bytes, rate, ETA, current file) and cancel go through the file object handed to ``http_get``:
  every chunk written is counted, and a cancel raises there, leaving the partial file to resume from.
"""

from __future__ import annotations

import enum
import hashlib
import inspect
import json
import logging
import os
import re
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import urljoin, urlsplit

from filelock import FileLock, Timeout
from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_download, hf_hub_url, try_to_load_from_cache
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import http_get
from huggingface_hub.utils import build_hf_headers
from tqdm import tqdm

from engine.config import (
    QUANT_SIDE_FILES,
    ModelConfig,
    read_folder_quantization_config,
    read_quantization_config,
)
from engine.errors import EngineError
from engine.fit import QuantSpec, format_bytes

logger = logging.getLogger(__name__)

SIDE_FILES = frozenset({
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
    "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json",
    "vocab.json", "merges.txt", *QUANT_SIDE_FILES,  # the loader reads either quantization side file
})
TOKENIZER_SETS = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"))
WEIGHTS, INDEX = ".safetensors", ".safetensors.index.json"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class DownloadState(str, enum.Enum):
    QUEUED = "queued"
    DOWNLOADING = "downloading"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class DownloadProgress:
    """One snapshot of a download, given to callbacks and readable from ``DownloadHandle.progress``."""

    repo_id: str
    state: DownloadState
    bytes_done: int = 0
    bytes_total: int = 0
    rate_bytes_per_s: float = 0.0
    eta_s: float | None = None
    current_file: str | None = None
    files_done: int = 0
    files_total: int = 0
    error: str | None = None


class DownloadCancelled(EngineError):
    """The download was cancelled; what was fetched stays in the cache and the next start resumes it."""


@dataclass(frozen=True)
class HubSettings:
    """Where and how to talk to the Hub, resolved from the environment when the downloader is made."""

    endpoint: str
    cache_dir: Path
    token: str | None = field(default=None, repr=False)
    offline: bool = False

    @staticmethod
    def from_env(cache_dir: str | Path | None = None, endpoint: str | None = None, token: str | None = None,
                 offline: bool | None = None) -> HubSettings:
        env = os.environ
        hf_home = Path(env.get("HF_HOME") or Path(env.get("XDG_CACHE_HOME") or "~/.cache") / "huggingface")
        cache = cache_dir or env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or hf_home / "hub"
        token_file = Path(env.get("HF_TOKEN_PATH") or hf_home / "token").expanduser()
        stored = token_file.read_text().strip() if token_file.is_file() else None
        if offline is None:
            offline = env.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}
        return HubSettings(endpoint=(endpoint or env.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/"),
                           cache_dir=Path(cache).expanduser(),
                           token=token or env.get("HF_TOKEN") or env.get("HUGGING_FACE_HUB_TOKEN") or stored,
                           offline=offline)


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int
    etag: str  # LFS sha256 or git blob id: the name of its blob in the cache


@dataclass(frozen=True)
class RepoPlan:
    """What ``start`` will fetch, known before any weight transfer (the UI shows it, fit.py sizes it)."""

    repo_id: str
    revision: str
    commit: str
    storage: Path  # <cache>/models--org--name
    files: tuple[RemoteFile, ...]
    model_config: ModelConfig
    quantization: str

    @property
    def snapshot(self) -> Path:
        return self.storage / "snapshots" / self.commit

    @property
    def bytes_total(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class LocalModel:
    """A model on disk: a safetensors folder (validated) or a single GGUF file (converted elsewhere)."""

    path: Path
    kind: str  # "safetensors" | "gguf"
    model_config: ModelConfig | None
    size_bytes: int
    quantization: str


def check_quantization(mc: ModelConfig) -> str:
    """A label ('fp16', 'AWQ 4-bit (group 128)') for what the engine loads; EngineError for anything else."""
    spec = QuantSpec.from_config(mc.quantization_config)
    if spec is None:
        dtype = (mc.torch_dtype or "float16").removeprefix("torch.")
        if dtype not in ("float16", "bfloat16", "float32"):
            raise EngineError(f"unsupported weight dtype {dtype!r}; Pagoda loads float16/bfloat16/float32, "
                              "AWQ 4-bit and GPTQ 4/8-bit checkpoints", param="model")
        return dtype
    ok = (spec.method == "awq" and spec.bits == 4 and spec.fmt == "gemm") or (
        spec.method == "gptq" and spec.bits in (4, 8) and spec.fmt in (None, "gptq", "gptq_v2"))
    if not ok:
        fmt = f", format {spec.fmt}" if spec.fmt else ""
        raise EngineError(f"unsupported quantization: {spec.method} {spec.bits}-bit{fmt}; Pagoda loads AWQ "
                          "(GEMM, 4-bit), GPTQ (4- or 8-bit) and float16/bfloat16/float32 checkpoints",
                          param="model")
    return spec.describe()


def inspect_folder(folder: str | Path) -> LocalModel:
    """Validate a model folder (config, quantization, every safetensors shard, a tokenizer)."""
    folder = Path(folder)
    mc = ModelConfig.from_path(folder)
    mc = _with_quantization(mc, read_folder_quantization_config(folder, mc.raw))
    quant = check_quantization(mc)
    names = {p.name for p in folder.iterdir() if p.is_file()}
    index = next((n for n in sorted(names) if n.endswith(INDEX)), None)
    shards = _index_shards(json.loads((folder / index).read_text())) if index else _pick_weights(names)
    if not shards:
        raise EngineError(f"no .safetensors weights in {folder}{_weights_hint(names)}", param="model")
    missing = [s for s in shards if s not in names]
    if missing:
        raise EngineError(f"{folder} is incomplete: missing {', '.join(missing)}", param="model")
    if not any(all(n in names for n in group) for group in TOKENIZER_SETS):
        raise EngineError(f"no tokenizer in {folder} (tokenizer.json, tokenizer.model or vocab.json+merges.txt)",
                          param="model")
    size = sum((folder / s).stat().st_size for s in shards)
    return LocalModel(folder, "safetensors", mc, size, quant)


def _with_quantization(mc: ModelConfig, qc: dict | None) -> ModelConfig:
    """``mc`` with the quantization the loader will read (engine.config.read_quantization_config): older
    AutoGPTQ/AutoAWQ repos keep it in quantize_config.json / quant_config.json instead of config.json."""
    if qc is None or mc.quantization_config == qc:
        return mc
    return ModelConfig.from_dict({**mc.raw, "quantization_config": qc})


def _index_shards(index: dict) -> list[str]:
    return sorted(set((index.get("weight_map") or {}).values()))


def _pick_weights(names: set[str] | list[str]) -> list[str]:
    """Without an index: model.safetensors if present, else every root safetensors (single-file GPTQ/AWQ)."""
    weights = sorted(n for n in names if n.endswith(WEIGHTS) and "/" not in n)
    return ["model.safetensors"] if "model.safetensors" in weights else weights


def _weights_hint(names: set[str] | list[str]) -> str:
    if any(n.endswith(".gguf") for n in names):
        return " (it has .gguf files: download one and add it as a local GGUF model to convert it)"
    if any(n.endswith((".bin", ".pt", ".pth")) for n in names):
        return " (only PyTorch pickle weights, which Pagoda does not load; pick a repo with safetensors)"
    return ""


class _QuietTqdm(tqdm):
    """huggingface_hub's own progress bars would print to the server's stderr; progress is ours."""

    def __init__(self, *args, **kwargs):
        kwargs.pop("name", None)
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)


def _quiet(func: Callable) -> dict:
    return {"tqdm_class": _QuietTqdm} if "tqdm_class" in inspect.signature(func).parameters else {}


class _CountingFile:
    """The file handed to ``http_get``: counts bytes, hashes them, and is where a cancel takes effect."""

    def __init__(self, raw, hasher, on_bytes: Callable[[int], None], cancel: threading.Event):
        self.raw, self.hasher, self.on_bytes, self.cancel = raw, hasher, on_bytes, cancel

    def write(self, data: bytes) -> int:
        written = self.raw.write(data)
        if self.hasher is not None:
            self.hasher.update(data)
        self.on_bytes(len(data))
        if self.cancel.is_set():
            raise DownloadCancelled("download cancelled")
        return written

    def truncate(self, size: int | None = None) -> int:
        """The server ignored our Range and restarts from 0 (http_get rewinds): forget the dropped bytes."""
        old = os.fstat(self.raw.fileno()).st_size
        new = self.raw.truncate(size)
        if self.hasher is not None:
            self.hasher = _hash_prefix(Path(self.raw.name), new)
        self.on_bytes(new - old)
        return new

    def __getattr__(self, name: str):  # tell, seek, flush, fileno, name...
        return getattr(self.raw, name)


def _hash_prefix(path: Path, length: int):
    hasher = hashlib.sha256()
    with open(path, "rb") as f:
        while length > 0 and (chunk := f.read(min(length, 1 << 20))):
            hasher.update(chunk)
            length -= len(chunk)
    return hasher


class DownloadHandle:
    """A download running in a background thread: progress, cancel, wait."""

    RATE_WINDOW_S = 5.0

    def __init__(self, repo_id: str, revision: str):
        self.repo_id, self.revision = repo_id, revision
        self.plan: RepoPlan | None = None
        self.path: Path | None = None
        self._cancel = threading.Event()
        self._finished = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[DownloadProgress], None]] = []
        self._progress = DownloadProgress(repo_id, DownloadState.QUEUED)
        self._samples: deque[tuple[float, int]] = deque()
        self._transferred = 0
        self.thread: threading.Thread | None = None

    @property
    def progress(self) -> DownloadProgress:
        with self._lock:
            return self._progress

    @property
    def model_config(self) -> ModelConfig | None:
        return self.plan.model_config if self.plan else None

    @property
    def done(self) -> bool:
        return self._finished.is_set()

    def subscribe(self, callback: Callable[[DownloadProgress], None]) -> None:
        with self._lock:
            self._callbacks.append(callback)

    def cancel(self) -> None:
        """Stop at the next chunk; complete files and the partial one stay in the cache for a resume."""
        self._cancel.set()

    def wait(self, timeout: float | None = None) -> Path:
        """The snapshot folder; EngineError (DownloadCancelled) if the download failed (was cancelled)."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"download of {self.repo_id} still running after {timeout} s")
        progress = self.progress
        if progress.state == DownloadState.CANCELLED:
            raise DownloadCancelled(f"download of {self.repo_id} was cancelled", param="model")
        if progress.state == DownloadState.FAILED:
            raise EngineError(progress.error or "download failed", param="model")
        assert self.path is not None
        return self.path

    # --- worker side ---------------------------------------------------------------------------------------
    def _update(self, **changes) -> None:
        with self._lock:
            self._progress = replace(self._progress, **changes)
            progress, callbacks = self._progress, list(self._callbacks)
        for callback in callbacks:
            try:
                callback(progress)
            except Exception:  # a broken UI callback must not kill the download
                logger.exception("download progress callback failed")

    def _start_transfer(self, plan: RepoPlan, bytes_done: int, files_done: int) -> None:
        self.plan = plan
        self._samples.append((time.monotonic(), 0))
        self._update(state=DownloadState.DOWNLOADING, bytes_total=plan.bytes_total, bytes_done=bytes_done,
                     files_done=files_done, files_total=len(plan.files))

    def _advance(self, delta: int, current_file: str) -> None:
        now = time.monotonic()
        self._transferred += delta
        self._samples.append((now, self._transferred))
        while len(self._samples) > 2 and now - self._samples[1][0] > self.RATE_WINDOW_S:
            self._samples.popleft()
        (t0, b0), (t1, b1) = self._samples[0], self._samples[-1]
        rate = (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0
        p = self.progress
        remaining = p.bytes_total - p.bytes_done - delta
        self._update(bytes_done=p.bytes_done + delta, current_file=current_file, rate_bytes_per_s=rate,
                     eta_s=remaining / rate if rate > 0 else None)

    def _finish(self, state: DownloadState, path: Path | None = None, error: str | None = None) -> None:
        self.path = path
        extra = {"eta_s": 0.0, "current_file": None} if state == DownloadState.DONE else {}
        self._update(state=state, error=error, **extra)
        self._finished.set()


class HubDownloader:
    """Starts, tracks and validates Hub downloads; also validates local folders and GGUF files."""

    def __init__(self, cache_dir: str | Path | None = None, endpoint: str | None = None, token: str | None = None,
                 offline: bool | None = None, max_concurrent: int = 1,
                 disk_usage: Callable[[str], tuple] = shutil.disk_usage):
        self.settings = HubSettings.from_env(cache_dir, endpoint, token, offline)
        self._disk_usage = disk_usage
        self._slots = threading.Semaphore(max_concurrent)
        self._lock = threading.Lock()
        self._active: dict[tuple[str, str], DownloadHandle] = {}

    # --- public API ----------------------------------------------------------------------------------------
    def start(self, repo_id: str, revision: str | None = None, token: str | None = None,
              callback: Callable[[DownloadProgress], None] | None = None) -> DownloadHandle:
        """Start (or join) the download of a repo in a background thread."""
        key = (repo_id, revision or "main")
        with self._lock:
            handle = self._active.get(key)
            if handle is None or handle.done:
                handle = DownloadHandle(repo_id, key[1])
                handle.thread = threading.Thread(target=self._run, args=(handle, token), daemon=True,
                                                 name=f"hub-download-{repo_id}")
                self._active[key] = handle
                fresh = True
            else:
                fresh = False
        if callback is not None:
            handle.subscribe(callback)
            callback(handle.progress)
        if fresh:
            handle.thread.start()
        return handle

    def download(self, repo_id: str, revision: str | None = None, token: str | None = None,
                 callback: Callable[[DownloadProgress], None] | None = None) -> Path:
        """Blocking download; returns the snapshot folder (``.../snapshots/<commit>``)."""
        return self.start(repo_id, revision, token, callback).wait()

    def inspect(self, repo_id: str, revision: str | None = None, token: str | None = None) -> RepoPlan:
        """Everything known before the weights move: files, sizes, config, quantization (EngineError if not)."""
        if self.settings.offline:
            raise EngineError(f"HF_HUB_OFFLINE is set: cannot list {repo_id} on the Hub", param="model")
        try:
            return self._plan(repo_id, revision or "main", self._token(token))
        except EngineError:
            raise
        except Exception as exc:
            raise EngineError(self._explain(exc, repo_id, revision or "main"), param="model") from exc

    def cached_snapshot(self, repo_id: str, revision: str | None = None) -> Path | None:
        """The cached snapshot folder of a repo revision if it has a config.json, else None."""
        found = try_to_load_from_cache(repo_id, "config.json", cache_dir=str(self.settings.cache_dir),
                                       revision=revision or "main")
        return Path(found).parent if isinstance(found, str) else None

    def add_local(self, path: str | Path) -> LocalModel:
        """A local safetensors folder (validated like a Hub repo) or a single .gguf file."""
        p = Path(path).expanduser()
        if p.suffix.lower() == ".gguf" or p.is_file():
            if p.suffix.lower() != ".gguf":
                raise EngineError(f"{p} is a file but not a .gguf; add a model folder or a .gguf file",
                                  param="model")
            if not p.is_file():
                raise EngineError(f"no such GGUF file: {p}", param="model")
            with open(p, "rb") as f:
                if f.read(4) != b"GGUF":
                    raise EngineError(f"{p} is not a GGUF file (bad magic bytes)", param="model")
            return LocalModel(p.resolve(), "gguf", None, p.stat().st_size, "gguf")
        if not p.is_dir():
            raise EngineError(f"no such model folder: {p}", param="model")
        return inspect_folder(p)

    def active(self) -> list[DownloadHandle]:
        with self._lock:
            return [h for h in self._active.values() if not h.done]

    def close(self, timeout: float = 10.0) -> None:
        """Cancel running downloads and wait for their threads (their partial files stay resumable)."""
        handles = self.active()
        for handle in handles:
            handle.cancel()
        for handle in handles:
            if handle.thread is not None and handle.thread.ident is not None:
                handle.thread.join(timeout)

    # --- the worker ----------------------------------------------------------------------------------------
    def _run(self, handle: DownloadHandle, token: str | None) -> None:
        repo_id, revision = handle.repo_id, handle.revision
        try:
            if self.settings.offline:
                local = self._from_cache(repo_id, revision)
                handle._update(bytes_total=local.size_bytes, bytes_done=local.size_bytes)
                return handle._finish(DownloadState.DONE, local.path)
            plan = self._plan(repo_id, revision, self._token(token))
            with self._slot(handle):
                self._transfer_all(plan, handle, self._token(token))
            handle._finish(DownloadState.DONE, plan.snapshot)
        except DownloadCancelled:
            handle._finish(DownloadState.CANCELLED)
        except EngineError as exc:
            handle._finish(DownloadState.FAILED, error=exc.message)
        except Exception as exc:
            logger.debug("download of %s failed", repo_id, exc_info=True)
            handle._finish(DownloadState.FAILED, error=self._explain(exc, repo_id, revision))

    def _token(self, token: str | None) -> str | bool:
        """False (not None) when there is none: huggingface_hub would otherwise read a token file itself."""
        return token or self.settings.token or False

    def _api_kwargs(self, token: str | bool) -> dict:
        return {"cache_dir": str(self.settings.cache_dir), "endpoint": self.settings.endpoint, "token": token}

    def _plan(self, repo_id: str, revision: str, token: str | bool) -> RepoPlan:
        info = HfApi(endpoint=self.settings.endpoint, token=token).model_info(
            repo_id, revision=revision, files_metadata=True)
        siblings = {s.rfilename: s for s in info.siblings or []}
        names = set(siblings)
        if not _pick_weights(names):
            raise EngineError(f"{repo_id} has no .safetensors weights{_weights_hint(names)}", param="model")
        commit = info.sha or revision

        def fetch(name: str) -> Path:  # small files, through huggingface_hub's own cache logic
            return Path(hf_hub_download(repo_id, name, revision=commit, **self._api_kwargs(token),
                                        **_quiet(hf_hub_download)))

        try:
            mc = ModelConfig.from_dict(json.loads(fetch("config.json").read_text()))
        except EngineError as exc:
            raise EngineError(f"{repo_id}: {exc.message}", param="model") from exc
        mc = _with_quantization(mc, read_quantization_config(
            mc.raw, lambda name: json.loads(fetch(name).read_text()) if name in names else None))
        quant = check_quantization(mc)
        index = "model.safetensors.index.json" if "model.safetensors.index.json" in names else next(
            (n for n in sorted(names) if n.endswith(INDEX) and "/" not in n), None)
        shards = _index_shards(json.loads(fetch(index).read_text())) if index else _pick_weights(names)
        missing = [s for s in shards if s not in names]
        if missing:
            raise EngineError(f"{repo_id}: the weight index names files the repo lacks: {', '.join(missing)}",
                              param="model")
        if not any(all(n in names for n in group) for group in TOKENIZER_SETS):
            raise EngineError(f"{repo_id} has no tokenizer (tokenizer.json, tokenizer.model or vocab.json + "
                              "merges.txt)", param="model")
        wanted = sorted(n for n in names if n in SIDE_FILES or n == index) + shards
        files = tuple(RemoteFile(n, int(siblings[n].size or 0),
                                 siblings[n].lfs.sha256 if siblings[n].lfs else siblings[n].blob_id or "")
                      for n in wanted)
        storage = self.settings.cache_dir / f"models--{repo_id.replace('/', '--')}"
        return RepoPlan(repo_id, revision, commit, storage, files, mc, quant)

    def _from_cache(self, repo_id: str, revision: str) -> LocalModel:
        snapshot = self.cached_snapshot(repo_id, revision)
        if snapshot is None:
            raise EngineError(f"HF_HUB_OFFLINE is set and {repo_id} ({revision}) is not in the Hugging Face cache "
                              f"at {self.settings.cache_dir}: unset HF_HUB_OFFLINE to download it, or add a local "
                              "model folder", param="model")
        return inspect_folder(snapshot)

    @contextmanager
    def _slot(self, handle: DownloadHandle) -> Iterator[None]:
        """At most ``max_concurrent`` transfers; the others stay QUEUED (and can be cancelled there)."""
        while not self._slots.acquire(timeout=0.2):
            if handle._cancel.is_set():
                raise DownloadCancelled("download cancelled")
        try:
            yield
        finally:
            self._slots.release()

    def _transfer_all(self, plan: RepoPlan, handle: DownloadHandle, token: str | bool) -> None:
        cached = {f.name: self._cached_bytes(plan, f) for f in plan.files}
        self._check_disk(plan, sum(f.size - cached[f.name] for f in plan.files))
        handle._start_transfer(plan, sum(cached.values()),
                               sum(1 for f in plan.files if (plan.snapshot / f.name).exists()))
        for f in plan.files:
            if handle._cancel.is_set():
                raise DownloadCancelled("download cancelled")
            if not (plan.snapshot / f.name).exists():
                self._fetch(plan, f, handle, token, already=cached[f.name])
                handle._update(files_done=handle.progress.files_done + 1)
        if plan.revision != plan.commit:  # like hf_hub_download: refs/<branch> -> commit, once complete
            ref = plan.storage / "refs" / plan.revision
            ref.parent.mkdir(parents=True, exist_ok=True)
            ref.write_text(plan.commit)
        inspect_folder(plan.snapshot)

    def _cached_bytes(self, plan: RepoPlan, f: RemoteFile) -> int:
        """Bytes of this file already on disk: all of it (snapshot or blob) or a partial download."""
        blob = plan.storage / "blobs" / f.etag
        if (plan.snapshot / f.name).exists() or (f.etag and blob.exists()):
            return f.size
        partial = blob.with_name(blob.name + ".incomplete")
        return min(partial.stat().st_size, f.size) if f.etag and partial.exists() else 0

    def _check_disk(self, plan: RepoPlan, needed: int) -> None:
        where = self.settings.cache_dir
        while not where.exists() and where != where.parent:
            where = where.parent
        free = self._disk_usage(str(where))[2]
        if needed > free:
            raise EngineError(f"not enough disk space for {plan.repo_id}: {format_bytes(needed)} to download "
                              f"into {self.settings.cache_dir}, {format_bytes(free)} free", param="model")

    def _fetch(self, plan: RepoPlan, f: RemoteFile, handle: DownloadHandle, token: str | bool,
               already: int) -> None:
        """One file into blobs/<etag> (resuming a partial one), then its snapshot symlink."""
        url = hf_hub_url(plan.repo_id, f.name, revision=plan.commit, endpoint=self.settings.endpoint)
        meta = get_hf_file_metadata(url, token=token)
        etag, size = meta.etag or f.etag, meta.size if meta.size is not None else f.size
        location = urljoin(url, meta.location or url)
        blob = plan.storage / "blobs" / etag
        if already and etag != f.etag:  # counted a partial under another name: the HEAD is authoritative
            handle._advance(-already, f.name)
            already = 0
        lock = self.settings.cache_dir / ".locks" / plan.storage.name / f"{etag}.lock"
        with _file_lock(lock, handle._cancel):
            if not blob.exists():
                headers = build_hf_headers(token=token)
                if urlsplit(location)[:2] != urlsplit(url)[:2]:  # a CDN: the token stays on the Hub
                    headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
                self._transfer(location, headers, blob, etag, size, f.name, handle, already)
            elif not already:
                handle._advance(size, f.name)
        _link(blob, plan.snapshot / f.name)

    def _transfer(self, url: str, headers: dict, blob: Path, etag: str, size: int, name: str,
                  handle: DownloadHandle, already: int) -> None:
        partial = blob.with_name(blob.name + ".incomplete")
        partial.parent.mkdir(parents=True, exist_ok=True)
        if partial.exists() and partial.stat().st_size > size:
            partial.unlink()  # longer than the file: not ours to resume
        resume = partial.stat().st_size if partial.exists() else 0
        if resume != already:
            handle._advance(resume - already, name)
        hasher = _hash_prefix(partial, resume) if _SHA256.match(etag) and resume else (
            hashlib.sha256() if _SHA256.match(etag) else None)
        with open(partial, "ab") as raw:
            sink = _CountingFile(raw, hasher, lambda n: handle._advance(n, name), handle._cancel)
            http_get(url, sink, resume_size=resume, headers=headers, expected_size=size, **_quiet(http_get))
            hasher = sink.hasher
        got = partial.stat().st_size
        if got != size or (hasher is not None and hasher.hexdigest() != etag):
            partial.unlink()
            handle._advance(-got, name)
            raise EngineError(f"{name} arrived corrupted ({got} of {size} bytes, checksum "
                              f"{'ok' if hasher is None or hasher.hexdigest() == etag else 'mismatch'}); "
                              "start the download again", param="model")
        os.replace(partial, blob)

    def _explain(self, exc: Exception, repo_id: str, revision: str) -> str:
        """A message a user can act on for whatever huggingface_hub or the network raised."""
        page = f"{self.settings.endpoint}/{repo_id}"
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if isinstance(exc, GatedRepoError):
            why = "your token has not been granted access yet" if status == 403 else "no valid token was sent"
            return (f"{repo_id} is a gated model and {why}: accept its license at {page} while logged in, then "
                    "set HF_TOKEN (or enter a token) with read access and try again")
        if isinstance(exc, RepositoryNotFoundError):
            return (f"model repo {repo_id!r} was not found on {self.settings.endpoint}: check the name "
                    "(owner/name); if it is private, set HF_TOKEN to a token that can read it")
        if isinstance(exc, HfHubHTTPError) and status in (401, 403):
            return (f"the Hub refused access to {repo_id} (HTTP {status}): check that HF_TOKEN (or the token "
                    f"entered) is valid and has read access, and that you accepted the license at {page}")
        if isinstance(exc, RevisionNotFoundError):
            return f"revision {revision!r} does not exist in {repo_id}"
        if isinstance(exc, EntryNotFoundError) and not isinstance(exc, LocalEntryNotFoundError):
            return f"{repo_id}: a file listed by the Hub could not be found ({exc}); try again later"
        if isinstance(exc, (OfflineModeIsEnabled, LocalEntryNotFoundError)):
            return (f"{repo_id} is not in the Hugging Face cache and the Hub cannot be used (offline mode or no "
                    f"connection to {self.settings.endpoint})")
        if isinstance(exc, HfHubHTTPError):
            return f"the Hub answered HTTP {status} for {repo_id}; try again later ({str(exc).splitlines()[0]})"
        if isinstance(exc, OSError) and getattr(exc, "errno", None) == 28:
            return f"the disk holding {self.settings.cache_dir} is full; free space and start again to resume"
        return f"download of {repo_id} failed: cannot reach {self.settings.endpoint} or read its answer ({exc})"


@contextmanager
def _file_lock(path: Path, cancel: threading.Event) -> Iterator[None]:
    """huggingface_hub's per-blob lock file, so another process fetching the same blob waits for us."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path))
    while True:
        try:
            lock.acquire(timeout=0.5)
            break
        except Timeout:
            if cancel.is_set():
                raise DownloadCancelled("download cancelled") from None
    try:
        yield
    finally:
        lock.release()


def _link(blob: Path, pointer: Path) -> None:
    """snapshots/<commit>/<file> -> ../../blobs/<etag>, as huggingface_hub lays it out (a move without symlinks)."""
    if pointer.exists():
        return
    pointer.parent.mkdir(parents=True, exist_ok=True)
    if pointer.is_symlink():
        pointer.unlink()  # dangling
    try:
        os.symlink(os.path.relpath(blob, pointer.parent), pointer)
    except OSError:
        os.replace(blob, pointer)
