"""A local stand-in for the Hugging Face Hub's file API, enough for huggingface_hub's
`snapshot_download`, `hf_hub_download` and `HfApi.list_repo_files` (tests point HF_ENDPOINT at it;
nothing reaches a network).

Served, as the Hub serves them (huggingface_hub 2.x):
- ``GET /api/models/{repo}[/revision/{rev}]``: model info (``sha``, ``siblings``);
- ``GET /api/models/{repo}/tree/{rev}``: the file listing (one page, no Link header);
- ``HEAD`` / ``GET /{repo}/resolve/{rev}/{path}``: a file, with ``X-Repo-Commit``, ``ETag`` and
  ``Content-Length`` (no Xet headers, so the client downloads over plain HTTP).
Errors carry the ``X-Error-Code`` huggingface_hub maps to its exceptions: ``RepoNotFound`` (404),
``RevisionNotFound`` (404), ``EntryNotFound`` (404), ``GatedRepo`` (403, a gated repo).
Every request is recorded (`HubServer.requests`) so tests can check what was fetched.

A hostile mirror, for the tests that the cache holds against one: `HubServer.resolve_headers`
replaces headers of the ``/resolve/`` answers (``ETag``, ``X-Repo-Commit``, ``X-Linked-Etag``),
from the answer numbered `HubServer.hostile_from` on (0: every answer; 1: the first one is honest,
as a mirror that answers a checking HEAD well and the download's own HEAD badly);
`FakeRepo.info_sha` replaces the commit the model info names.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class FakeRepo:
    """A model repo: `commits` maps a commit sha to its files (path -> bytes); `refs` maps branch
    and tag names to commits ("main" is the default branch); `gated`: every request gets 403."""

    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    gated: bool = False
    info_sha: str | None = None

    def add_commit(self, files: dict[str, bytes], *, ref: str = "main") -> str:
        """Add a commit holding `files` and point `ref` at it; returns its (40-hex) sha."""
        listing = repr(sorted((name, hashlib.sha1(data).hexdigest()) for name, data in files.items()))
        sha = hashlib.sha1(f"{len(self.commits)}:{listing}".encode()).hexdigest()
        self.commits[sha] = dict(files)
        self.refs[ref] = sha
        return sha

    def commit(self, revision: str) -> str | None:
        return revision if revision in self.commits else self.refs.get(revision)


def folder_files(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` by its posix path relative to it (a checkpoint to serve)."""
    paths = sorted(p for p in folder.rglob("*") if p.is_file())
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in paths}


class HubServer:
    """The fake Hub on 127.0.0.1 (a free port), serving `repos` (repo id -> FakeRepo) from a
    thread; a context manager. `endpoint` is what HF_ENDPOINT should be set to."""

    def __init__(self, repos: dict[str, FakeRepo] | None = None) -> None:
        self.repos: dict[str, FakeRepo] = repos if repos is not None else {}
        self.requests: list[tuple[str, str]] = []
        self.resolve_headers: dict[str, str] = {}
        self.hostile_from = 0
        self._resolved = 0
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.02,), daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def downloads(self, repo_id: str | None = None) -> list[str]:
        """Paths of the files fetched by GET .../resolve/... (of `repo_id`, when given)."""
        out = []
        for method, path in self.requests:
            parts = [unquote(p) for p in urlsplit(path).path.strip("/").split("/")]
            if method == "GET" and len(parts) >= 5 and parts[2] == "resolve":
                if repo_id is None or f"{parts[0]}/{parts[1]}" == repo_id:
                    out.append("/".join(parts[4:]))
        return out

    def __enter__(self) -> HubServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def _handler(server: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the stdlib's name
            pass

        def do_HEAD(self) -> None:
            self._serve(head=True)

        def do_GET(self) -> None:
            self._serve(head=False)

        def _serve(self, *, head: bool) -> None:
            with server._lock:
                server.requests.append((self.command, self.path))
            parts = [unquote(p) for p in urlsplit(self.path).path.strip("/").split("/")]
            if parts[:2] == ["api", "models"] and len(parts) == 4:  # model info of the default branch
                self._api(f"{parts[2]}/{parts[3]}", "revision", "main")
            elif parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
                self._api(f"{parts[2]}/{parts[3]}", parts[4], parts[5])
            elif len(parts) >= 5 and parts[2] == "resolve":
                self._resolve(f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]), head=head)
            else:
                self._send(404, b"", {"X-Error-Code": "RepoNotFound"}, head=head)

        def _repo(self, repo_id: str, revision: str, *, head: bool) -> tuple[FakeRepo, str] | None:
            repo = server.repos.get(repo_id)
            if repo is None:
                body = b'{"error":"Repository not found"}'
                self._send(404, body, {"X-Error-Code": "RepoNotFound"}, head=head)
                return None
            if repo.gated:
                message = f"Access to model {repo_id} is restricted. You must have access to it."
                headers = {"X-Error-Code": "GatedRepo", "X-Error-Message": message}
                self._send(403, json.dumps({"error": message}).encode(), headers, head=head)
                return None
            commit = repo.commit(revision)
            if commit is None:
                headers = {"X-Error-Code": "RevisionNotFound", "X-Error-Message": "Invalid rev id"}
                self._send(404, b'{"error":"Invalid rev id"}', headers, head=head)
                return None
            return repo, commit

        def _api(self, repo_id: str, kind: str, revision: str) -> None:
            found = self._repo(repo_id, revision, head=False)
            if found is None:
                return
            repo, commit = found
            files = repo.commits[commit]
            if kind == "revision":
                body = {
                    "id": repo_id,
                    "modelId": repo_id,
                    "sha": commit if repo.info_sha is None else repo.info_sha,
                    "private": False,
                    "siblings": [{"rfilename": name} for name in sorted(files)],
                }
            else:
                body = [
                    {"type": "file", "oid": hashlib.sha1(data).hexdigest(), "size": len(data), "path": name}
                    for name, data in sorted(files.items())
                ]
            self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"}, head=False)

        def _resolve(self, repo_id: str, revision: str, filename: str, *, head: bool) -> None:
            found = self._repo(repo_id, revision, head=head)
            if found is None:
                return
            repo, commit = found
            data = repo.commits[commit].get(filename)
            if data is None:
                headers = {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": commit}
                self._send(404, b'{"error":"Entry not found"}', headers, head=head)
                return
            headers = {
                "X-Repo-Commit": commit,
                "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                "Content-Type": "application/octet-stream",
            }
            with server._lock:
                if server._resolved >= server.hostile_from:
                    headers.update(server.resolve_headers)
                server._resolved += 1
            self._send(200, data, headers, head=head)

        def _send(self, status: int, body: bytes, headers: dict[str, str], *, head: bool) -> None:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

    return Handler
