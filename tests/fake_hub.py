"""A fake Hugging Face Hub on 127.0.0.1: the HTTP endpoints huggingface_hub calls to list and download a model.

Why a real server and not mocks: the download code must be exercised through huggingface_hub's own HTTP
client, header parsing and error mapping, exactly as against https://huggingface.co. What it speaks:

- ``GET /api/models/{repo}`` and ``/api/models/{repo}/revision/{rev}`` (``HfApi.model_info``): id, sha,
  gated, siblings with size / blobId / lfs (the ``?blobs=true`` form).
- ``HEAD``/``GET /{repo}/resolve/{rev}/{file}``: small files answer directly with ``ETag`` (git blob sha1),
  ``X-Repo-Commit`` and ``Content-Length``; LFS files (``*.safetensors`` ...) answer ``302`` with
  ``X-Linked-Etag`` (sha256) / ``X-Linked-Size`` and a ``Location`` on another origin
  (``http://localhost:{port}/cdn/...``), like the Hub's CDN, so clients must not forward the token there.
- ``GET /cdn/{sha256}`` with ``Range: bytes=N-`` support (``206`` + ``Content-Range``).
- Errors with the ``X-Error-Code`` header huggingface_hub maps to its exceptions: ``RepoNotFound`` (404),
  ``RevisionNotFound`` (404), ``EntryNotFound`` (404), ``GatedRepo`` (401 without a token, 403 with a token
  that has not been granted access).

No ``X-Xet-Hash`` header is ever sent, so huggingface_hub uses plain HTTP. Faults for resume tests: a file
can be cut after N bytes (connection closed mid-body) and then refused with a status a few times. Counters
record per (repo, file) HEADs, GETs, body bytes served and the Range headers received.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a file, what the Hub sends as ETag for non-LFS files."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class FakeRepo:
    repo_id: str
    files: dict[str, bytes]
    gated: bool = False
    allowed_tokens: frozenset[str] = frozenset()
    commit: str = ""

    def __post_init__(self) -> None:
        if not self.commit:
            digest = hashlib.sha1(self.repo_id.encode())
            for name in sorted(self.files):
                digest.update(name.encode() + hashlib.sha256(self.files[name]).digest())
            self.commit = digest.hexdigest()

    def is_lfs(self, filename: str) -> bool:
        return filename.endswith(LFS_SUFFIXES)

    def sibling(self, filename: str) -> dict:
        data = self.files[filename]
        entry = {"rfilename": filename, "size": len(data), "blobId": git_blob_sha1(data)}
        if self.is_lfs(filename):
            entry["lfs"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pointerSize": 134}
        return entry


@dataclass
class FileStats:
    heads: int = 0
    gets: int = 0
    bytes_served: int = 0
    ranges: list[str] = field(default_factory=list)
    auth_seen_on_cdn: int = 0


@dataclass
class Fault:
    cut_after: int | None  # close the connection after this many body bytes (once)
    then_status: int | None  # afterwards answer this status ...
    then_times: int  # ... this many times


class FakeHub:
    """Owns the server thread, the repos and the counters. Use as a context manager or call start/stop."""

    def __init__(self) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.stats: dict[tuple[str, str], FileStats] = defaultdict(FileStats)
        self.faults: dict[tuple[str, str], Fault] = {}
        self.lock = threading.Lock()
        self.requests = 0  # every request of any kind
        self.ignore_range = False  # answer 200 + the whole file to Range requests, like some proxies/CDNs
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.cdn = f"http://localhost:{self.port}"  # another origin: the token must not be sent there
        self._thread: threading.Thread | None = None

    def start(self) -> FakeHub:
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), name="fake-hub",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self):  # -> FakeHub
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def add_repo(self, repo_id: str, files: dict[str, bytes], gated: bool = False,
                 allowed_tokens: tuple[str, ...] = ()) -> FakeRepo:
        repo = FakeRepo(repo_id, dict(files), gated=gated, allowed_tokens=frozenset(allowed_tokens))
        with self.lock:
            self.repos[repo_id] = repo
        return repo

    def cut_once(self, repo_id: str, filename: str, after_bytes: int, then_status: int | None = None,
                 then_times: int = 0) -> None:
        """Close the next GET of this file after ``after_bytes`` body bytes, then answer ``then_status``."""
        with self.lock:
            self.faults[(repo_id, filename)] = Fault(after_bytes, then_status, then_times)

    def file_stats(self, repo_id: str, filename: str) -> FileStats:
        with self.lock:
            s = self.stats[(repo_id, filename)]
            return FileStats(s.heads, s.gets, s.bytes_served, list(s.ranges), s.auth_seen_on_cdn)

    def total_body_bytes(self, repo_id: str) -> int:
        with self.lock:
            return sum(s.bytes_served for (repo, _), s in self.stats.items() if repo == repo_id)

    def reset_stats(self) -> None:
        with self.lock:
            self.stats.clear()

    # --- lookups used by the handler -------------------------------------------------------------------
    def find_lfs(self, sha256: str) -> tuple[FakeRepo, str] | None:
        with self.lock:
            for repo in self.repos.values():
                for name, data in repo.files.items():
                    if repo.is_lfs(name) and hashlib.sha256(data).hexdigest() == sha256:
                        return repo, name
        return None

    def take_fault(self, key: tuple[str, str]) -> tuple[int | None, int | None]:
        """(cut_after, status) for this request, consuming the fault."""
        with self.lock:
            fault = self.faults.get(key)
            if fault is None:
                return None, None
            if fault.cut_after is not None:
                cut, fault.cut_after = fault.cut_after, None
                if not fault.then_times:
                    del self.faults[key]
                return cut, None
            fault.then_times -= 1
            if fault.then_times <= 0:
                del self.faults[key]
            return None, fault.then_status


_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")
_API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+?)(?:/revision/(?P<rev>[^/]+))?/?$")
_CDN = re.compile(r"^/cdn/(?P<sha>[0-9a-f]{64})$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


def _make_handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # keep test output quiet
            pass

        def do_HEAD(self) -> None:
            self._route(head=True)

        def do_GET(self) -> None:
            self._route(head=False)

        # --- routing -----------------------------------------------------------------------------------
        def _route(self, head: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            with hub.lock:
                hub.requests += 1
            if m := _API.match(path):
                return self._api(m["repo"], m["rev"] or "main")
            if m := _RESOLVE.match(path):
                return self._resolve(m["repo"], m["rev"], m["file"], head)
            if m := _CDN.match(path):
                return self._cdn(m["sha"], head)
            self._error(404, "EntryNotFound", "no such route")

        def _repo(self, repo_id: str, rev: str) -> FakeRepo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound", "Repository not found")
                return None
            if rev not in ("main", repo.commit):
                self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
                return None
            return repo

        def _api(self, repo_id: str, rev: str) -> None:
            repo = self._repo(repo_id, rev)
            if repo is None:
                return
            body = {"id": repo.repo_id, "modelId": repo.repo_id, "sha": repo.commit, "private": False,
                    "gated": "manual" if repo.gated else False, "disabled": False, "tags": [],
                    "siblings": [repo.sibling(name) for name in sorted(repo.files)]}
            self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"}, head=False)

        def _resolve(self, repo_id: str, rev: str, filename: str, head: bool) -> None:
            repo = self._repo(repo_id, rev)
            if repo is None:
                return
            key = (repo_id, filename)
            with hub.lock:
                stats = hub.stats[key]
                if head:
                    stats.heads += 1
            if repo.gated and not self._authorized(repo):
                return
            if filename not in repo.files:
                return self._error(404, "EntryNotFound", "Entry not found", commit=repo.commit)
            data = repo.files[filename]
            headers = {"X-Repo-Commit": repo.commit, "Accept-Ranges": "bytes"}
            if repo.is_lfs(filename):
                sha = hashlib.sha256(data).hexdigest()
                headers.update({"X-Linked-Etag": f'"{sha}"', "X-Linked-Size": str(len(data)),
                                "ETag": f'"{git_blob_sha1(data)}"', "Location": f"{hub.cdn}/cdn/{sha}"})
                return self._send(302, b"", headers, head=True)
            headers["ETag"] = f'"{git_blob_sha1(data)}"'
            self._send_file(key, data, headers, head)

        def _cdn(self, sha: str, head: bool) -> None:
            found = hub.find_lfs(sha)
            if found is None:
                return self._error(404, None, "no such object")
            repo, filename = found
            if self.headers.get("Authorization"):
                with hub.lock:
                    hub.stats[(repo.repo_id, filename)].auth_seen_on_cdn += 1
            self._send_file((repo.repo_id, filename), repo.files[filename], {"Accept-Ranges": "bytes"}, head)

        def _authorized(self, repo: FakeRepo) -> bool:
            auth = self.headers.get("Authorization", "")
            token = auth[len("Bearer "):] if auth.startswith("Bearer ") else ""
            if token in repo.allowed_tokens:
                return True
            if not token:
                self._error(401, "GatedRepo", f"Access to model {repo.repo_id} is restricted. You must have "
                            "access to it and be authenticated to access it. Please log in.")
            else:
                self._error(403, "GatedRepo", f"Access to model {repo.repo_id} is restricted and you are not "
                            "in the authorized list. Visit the model page to ask for access.")
            return False

        # --- bodies --------------------------------------------------------------------------------------
        def _send_file(self, key: tuple[str, str], data: bytes, headers: dict, head: bool) -> None:
            if head:
                return self._send(200, data, headers, head=True)
            with hub.lock:
                stats = hub.stats[key]
                stats.gets += 1
                if "Range" in self.headers:
                    stats.ranges.append(self.headers["Range"])
            cut, status = hub.take_fault(key)
            if status is not None:
                return self._error(status, None, "injected failure")
            start, end, code = 0, len(data), 200
            if (rng := self.headers.get("Range")) and not hub.ignore_range:
                m = _RANGE.match(rng.strip())
                if m is None or int(m[1]) >= len(data):
                    return self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"}, head=False)
                start = int(m[1])
                end = min(int(m[2]) + 1, len(data)) if m[2] else len(data)
                code = 206
                headers = {**headers, "Content-Range": f"bytes {start}-{end - 1}/{len(data)}"}
            body = data[start:end]
            if cut is not None:
                return self._send_cut(code, body, headers, key, cut)
            self._send(code, body, headers, head=False)
            with hub.lock:
                hub.stats[key].bytes_served += len(body)

        def _send_cut(self, code: int, body: bytes, headers: dict, key: tuple[str, str], cut: int) -> None:
            """Announce the whole body, send ``cut`` bytes, drop the connection: a network failure mid-file."""
            self.send_response(code)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[:cut])
            self.wfile.flush()
            with hub.lock:
                hub.stats[key].bytes_served += min(cut, len(body))
            self.close_connection = True

        def _send(self, code: int, body: bytes, headers: dict, head: bool) -> None:
            self.send_response(code)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head and body:
                self.wfile.write(body)

        def _error(self, code: int, error_code: str | None, message: str, commit: str | None = None) -> None:
            headers = {"Content-Type": "application/json", "X-Error-Message": message}
            if error_code:
                headers["X-Error-Code"] = error_code
            if commit:
                headers["X-Repo-Commit"] = commit
            body = json.dumps({"error": message}).encode()
            self._send(code, body, headers, head=self.command == "HEAD")

    return Handler
