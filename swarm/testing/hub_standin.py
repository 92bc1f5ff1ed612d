"""A stand-in for the Hugging Face hub's file endpoint on 127.0.0.1, for tests and benchmarks that cannot reach it.

It serves directories as repos under the URLs ``huggingface_hub`` asks for
(``{endpoint}/{repo_id}/resolve/{revision}/{filename}``, ``constants.HUGGINGFACE_CO_URL_TEMPLATE``), answering
HEAD and GET with the headers ``hf_hub_download`` reads (``X-Repo-Commit``, ``ETag``, ``Content-Length``), byte
ranges for resumed downloads (and, on request, a connection that drops mid-file), and the hub's errors as
``huggingface_hub`` recognises them (``X-Error-Code``: ``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``,
``GatedRepo``). It counts the bytes it sends per file, so a test can tell exactly what a process downloaded.

    with HubStandin() as hub:
        hub.add_repo("org/model", directory)          # branch main
        hub.add_repo("org/model", other, ref="v2")    # a second revision
        env = {"HF_ENDPOINT": hub.url, "HF_HOME": ...}
"""
from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional
from urllib.parse import unquote, urlsplit


@dataclass
class Repo:
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit
    commits: dict[str, Path] = field(default_factory=dict)  # commit -> directory of its files
    gated: bool = False


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]
    file: Optional[Path] = None


def commit_id(repo_id: str, ref: str) -> str:
    """A 40-hex commit id, as the hub's (huggingface_hub treats such a revision as a commit)."""
    return hashlib.sha1(f"{repo_id}@{ref}".encode()).hexdigest()


def error(status: int, code: str, message: str, commit: Optional[str] = None) -> Answer:
    headers = {"X-Error-Code": code, "X-Error-Message": message}
    if commit:
        headers["X-Repo-Commit"] = commit
    return Answer(status, headers)


class HubStandin:
    """A threaded HTTP server on 127.0.0.1 serving repos; ``served`` lists (repo_id, filename, bytes) per GET."""

    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.served: list[tuple[str, str, int]] = []
        self.break_once: dict[str, int] = {}  # file name -> bytes after which its next GET's connection drops
        self._etags: dict[Path, str] = {}
        self._lock = threading.Condition()
        self._sending = 0  # GETs whose bytes are being sent (recorded when the last byte is written)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> "HubStandin":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    # ----- what is served ------------------------------------------------------------------------------------
    def add_repo(self, repo_id: str, directory: Path, ref: str = "main", gated: bool = False) -> str:
        """Serve ``directory`` as ``ref`` of ``repo_id``; returns the commit id it is served as."""
        repo = self.repos.setdefault(repo_id, Repo())
        repo.gated = repo.gated or gated
        commit = commit_id(repo_id, ref)
        repo.refs[ref] = commit
        repo.commits[commit] = Path(directory)
        return commit

    def bytes_served(self, repo_id: Optional[str] = None, settle_s: float = 10.0) -> dict[str, int]:
        """Bytes sent per file name (of one repo, or of all), once no GET is still sending (up to ``settle_s``): a
        client can hold every byte of a reply before the handler thread that wrote them has recorded it."""
        totals: dict[str, int] = {}
        with self._lock:
            self._lock.wait_for(lambda: self._sending == 0, timeout=settle_s)
            for repo, filename, nbytes in self.served:
                if repo_id in (None, repo):
                    totals[filename] = totals.get(filename, 0) + nbytes
        return totals

    def take_break(self, filename: str) -> Optional[int]:
        """The byte count after which to drop this GET's connection, once per :attr:`break_once` entry."""
        with self._lock:
            return self.break_once.pop(filename, None)

    def reset_counts(self) -> None:
        with self._lock:
            self.served.clear()

    # ----- answering -----------------------------------------------------------------------------------------
    def answer(self, path: str) -> Answer:
        """What the hub would answer for ``/{org}/{name}/resolve/{revision}/{filename}``."""
        parts = [unquote(p) for p in urlsplit(path).path.split("/")[1:]]
        if len(parts) < 5 or parts[2] != "resolve":
            return Answer(404, {})
        repo_id, revision, filename = f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:])
        repo = self.repos.get(repo_id)
        if repo is None:
            return error(404, "RepoNotFound", "Repository not found")
        if repo.gated:
            return error(403, "GatedRepo", "Access to this model is restricted: accept its conditions")
        commit = repo.refs.get(revision, revision if revision in repo.commits else None)
        if commit is None:
            return error(404, "RevisionNotFound", "Invalid rev id: " + revision)
        file = repo.commits[commit] / filename
        if not file.is_file():
            return error(404, "EntryNotFound", f"{filename} does not exist on {revision!r}", commit)
        headers = {"X-Repo-Commit": commit, "ETag": f'"{self._etag(file)}"', "Accept-Ranges": "bytes"}
        return Answer(200, headers, file)

    def _etag(self, file: Path) -> str:
        with self._lock:
            if file not in self._etags:
                digest = hashlib.sha256()
                with open(file, "rb") as source:
                    for piece in iter(lambda: source.read(2**20), b""):
                        digest.update(piece)
                self._etags[file] = digest.hexdigest()
            return self._etags[file]

    def _begin_reply(self) -> None:
        """A GET starts sending bytes; :meth:`_end_reply` records them (``bytes_served`` waits for the pair)."""
        with self._lock:
            self._sending += 1

    def _end_reply(self, path: str, nbytes: int) -> None:
        parts = [unquote(p) for p in urlsplit(path).path.split("/")[1:]]
        with self._lock:
            self.served.append((f"{parts[0]}/{parts[1]}", "/".join(parts[4:]), nbytes))
            self._sending -= 1
            self._lock.notify_all()

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_HEAD(self) -> None:  # noqa: N802 (http.server's naming)
                self._reply(send_body=False)

            def do_GET(self) -> None:  # noqa: N802
                self._reply(send_body=True)

            def _reply(self, send_body: bool) -> None:
                answer = hub.answer(self.path)
                if answer.file is None:
                    self._send_headers(answer.status, answer.headers, 0)
                    return
                size = answer.file.stat().st_size
                start = self._range_start(size)
                headers = dict(answer.headers)
                if start:
                    headers["Content-Range"] = f"bytes {start}-{size - 1}/{size}"
                self._send_headers(206 if start else 200, headers, size - start)
                if not send_body:
                    return
                cut = hub.take_break(answer.file.name)  # a connection that drops mid-file, when asked for
                hub._begin_reply()
                sent = 0
                try:
                    sent = self._stream(answer.file, start, size if cut is None else min(size, start + cut))
                finally:
                    hub._end_reply(self.path, sent)
                if start + sent < size:
                    self.close_connection = True

            def _stream(self, file: Path, start: int, stop: int) -> int:
                """Send bytes start:stop of ``file`` in 1 MiB pieces (shards of real widths are GBs)."""
                sent = 0
                with open(file, "rb") as source:
                    source.seek(start)
                    while start + sent < stop:
                        piece = source.read(min(2**20, stop - start - sent))
                        self.wfile.write(piece)
                        sent += len(piece)
                return sent

            def _range_start(self, size: int) -> int:
                """Where a ``Range: bytes=N-`` request (a resumed download) starts; 0 without one."""
                spec = self.headers.get("Range", "")
                if not spec.startswith("bytes="):
                    return 0
                start = int(spec[len("bytes="):].split("-", 1)[0] or 0)
                return min(start, size)

            def _send_headers(self, status: int, headers: dict[str, str], length: int) -> None:
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(length))
                self.end_headers()

            def log_message(self, format: str, *args) -> None:  # quiet: tests read .served instead
                pass

        return Handler
