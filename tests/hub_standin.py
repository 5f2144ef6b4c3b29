"""A stand-in for the Hugging Face Hub's HTTP endpoints on loopback (no hub is reachable here): the
routes ``huggingface_hub.snapshot_download`` uses, serving the files of local folders as repos.

- ``GET /api/models/<repo>/revision/<rev>``: the repo's commit and file list;
- ``GET /api/models/<repo>/tree/<commit>``: the files (path, size, blob id), one page;
- ``HEAD|GET /<repo>/resolve/<rev>/<file>``: a file (``X-Repo-Commit``, ``ETag``, length).

Also serves plain files under ``/assets/<name>`` (an Ultralytics-style release). Requests are
recorded, so a test can tell a download from a cache hit.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit


class HubStandIn:
    """``repos``: repo id -> folder whose files are the repo's; ``assets``: name -> bytes."""

    def __init__(self, repos: dict[str, Path], assets: dict[str, bytes] | None = None) -> None:
        self.repos, self.assets = repos, assets or {}
        self.commits = {repo: hashlib.sha1(repo.encode()).hexdigest() for repo in repos}
        self.requests: list[str] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_HEAD(self) -> None:
                stand_in.answer(self, body=False)

            def do_GET(self) -> None:
                stand_in.answer(self, body=True)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _files(self, repo: str) -> list[Path]:
        return sorted(p for p in self.repos[repo].rglob("*") if p.is_file())

    def _repo_and_rest(self, path: str, prefix: str, marker: str) -> tuple[str, str] | None:
        if not path.startswith(prefix) or marker not in path:
            return None
        repo, rest = path[len(prefix):].split(marker, 1)
        return (repo, rest) if repo in self.repos else None

    def answer(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(handler.path).path)
        self.requests.append(f"{handler.command} {path}")
        status, headers, data = self._route(path)
        handler.send_response(status)
        for key, value in headers.items():
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if body:
            handler.wfile.write(data)

    def _route(self, path: str) -> tuple[int, dict[str, str], bytes]:
        as_json = {"Content-Type": "application/json"}
        if path.startswith("/assets/") and path[len("/assets/"):] in self.assets:
            return 200, {"Content-Type": "application/octet-stream"}, self.assets[path[len("/assets/"):]]
        found = self._repo_and_rest(path, "/api/models/", "/revision/")
        if found:
            repo = found[0]
            info = {"id": repo, "sha": self.commits[repo], "private": False,
                    "siblings": [{"rfilename": str(p.relative_to(self.repos[repo]))} for p in self._files(repo)]}
            return 200, as_json, json.dumps(info).encode()
        found = self._repo_and_rest(path, "/api/models/", "/tree/")
        if found:
            repo = found[0]
            tree = [{"type": "file", "path": str(p.relative_to(self.repos[repo])), "size": p.stat().st_size,
                     "oid": hashlib.sha1(p.read_bytes()).hexdigest()} for p in self._files(repo)]
            return 200, as_json, json.dumps(tree).encode()
        found = self._repo_and_rest(path, "/", "/resolve/")
        if found:
            repo, rest = found
            name = rest.split("/", 1)[1] if "/" in rest else ""
            file = self.repos[repo] / name
            if name and file.is_file():
                data = file.read_bytes()
                return 200, {"X-Repo-Commit": self.commits[repo], "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
                             "Content-Type": "application/octet-stream"}, data
            return 404, {"X-Error-Code": "EntryNotFound", **as_json}, b'{"error": "Entry not found"}'
        return 404, {"X-Error-Code": "RepoNotFound", **as_json}, b'{"error": "Repository not found"}'
