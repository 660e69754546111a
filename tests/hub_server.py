"""A local HTTP server that speaks the parts of the Hugging Face Hub protocol huggingface_hub uses to download a
snapshot (repo info, tree listing, resolve with X-Repo-Commit / ETag headers) and to push a folder (create repo,
model card check, preupload, commit with inline base64 files), for tests that run the real huggingface_hub client against it through
HF_ENDPOINT. Repositories are folders under ``root/<models|datasets>/<org>/<name>``; a repository named in
``gated`` answers 401 GatedRepo, and pushes need an ``Authorization: Bearer`` header."""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class HubServer:
    def __init__(self, root: Path, gated: tuple[str, ...] = ()):
        self.root = Path(root)
        self.gated = set(gated)
        self.requests: list[str] = []
        handler = type("Handler", (_Handler,), {"hub": self})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "HubServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def repo_dir(self, kind: str, repo: str) -> Path:
        return self.root / kind / repo


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer

    def log_message(self, *args) -> None:  # quiet
        pass

    # -- replies
    def _send(self, code: int, body: bytes = b"", headers: dict | None = None, head: bool = False) -> None:
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _json(self, obj, code: int = 200) -> None:
        self._send(code, json.dumps(obj).encode(), {"Content-Type": "application/json"})

    def _error(self, code: int, error_code: str, message: str, head: bool = False) -> None:
        self._send(code, json.dumps({"error": message}).encode(),
                   {"Content-Type": "application/json", "X-Error-Code": error_code, "X-Error-Message": message},
                   head=head)

    # -- helpers
    def _repo(self, kind: str, org: str, name: str, head: bool = False):
        repo = f"{org}/{name}"
        if repo in self.hub.gated and "authorization" not in {k.lower() for k in self.headers}:
            self._error(401, "GatedRepo", f"Access to model {repo} is restricted.", head)
            return None
        folder = self.hub.repo_dir(kind, repo)
        if not folder.is_dir():
            self._error(404, "RepoNotFound", "Repository not found", head)
            return None
        return folder

    @staticmethod
    def _files(folder: Path) -> list[Path]:
        return sorted(p for p in folder.rglob("*") if p.is_file())

    def _info(self, kind: str, repo: str, folder: Path) -> dict:
        return {"id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                "siblings": [{"rfilename": p.relative_to(folder).as_posix()} for p in self._files(folder)]}

    @staticmethod
    def _entry(folder: Path, p: Path) -> dict:
        data = p.read_bytes()
        return {"type": "file", "oid": hashlib.sha1(data).hexdigest(), "size": len(data),
                "path": p.relative_to(folder).as_posix()}

    # -- verbs
    def do_HEAD(self) -> None:
        self._get(head=True)

    def do_GET(self) -> None:
        self._get(head=False)

    def _get(self, head: bool) -> None:
        path = unquote(urlparse(self.path).path)
        self.hub.requests.append(f"{self.command} {path}")
        parts = [p for p in path.split("/") if p]
        if parts[:1] == ["api"] and len(parts) >= 4 and parts[1] in ("models", "datasets"):
            kind, org, name, rest = parts[1], parts[2], parts[3], parts[4:]
            folder = self._repo(kind, org, name, head)
            if folder is None:
                return
            if not rest or rest[0] == "revision":
                return self._json(self._info(kind, f"{org}/{name}", folder))
            if rest[0] == "tree":
                sub = folder.joinpath(*rest[2:]) if len(rest) > 2 else folder
                return self._json([self._entry(folder, p) for p in self._files(sub)])
            return self._error(404, "EntryNotFound", "unknown api route", head)
        kind = "models"
        if parts[:1] == ["datasets"]:
            kind, parts = "datasets", parts[1:]
        if len(parts) >= 5 and parts[2] == "resolve":
            folder = self._repo(kind, parts[0], parts[1], head)
            if folder is None:
                return
            f = folder.joinpath(*parts[4:])
            if not f.is_file():
                return self._error(404, "EntryNotFound", "Entry not found", head)
            data = f.read_bytes()
            return self._send(200, data, {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
                                          "Content-Type": "application/octet-stream"}, head=head)
        self._error(404, "NotFound", "not found", head)

    def do_POST(self) -> None:
        path = unquote(urlparse(self.path).path)
        self.hub.requests.append(f"POST {path}")
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if "authorization" not in {k.lower() for k in self.headers}:
            return self._error(401, "Unauthorized", "Invalid credentials in Authorization header")
        parts = [p for p in path.split("/") if p]
        if parts == ["api", "validate-yaml"]:  # the model card's metadata, checked before a commit
            return self._json({"errors": [], "warnings": []})
        if parts == ["api", "repos", "create"]:
            req = json.loads(body)
            repo = f"{req['organization']}/{req['name']}" if req.get("organization") else req["name"]
            kind = "datasets" if req.get("type") == "dataset" else "models"
            folder = self.hub.repo_dir(kind, repo)
            if folder.is_dir():
                return self._error(409, "RepoExists", "You already created this model repo")
            folder.mkdir(parents=True)
            return self._json({"url": f"{self.hub.url}/{repo}", "name": repo})
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "preupload":
            req = json.loads(body)
            return self._json({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                         for f in req.get("files", [])], "commitOid": COMMIT})
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "commit":
            folder = self.hub.repo_dir("models", f"{parts[2]}/{parts[3]}")
            for line in body.decode().splitlines():
                item = json.loads(line)
                if item.get("key") == "file":
                    v = item["value"]
                    dest = folder / v["path"]
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_bytes(base64.b64decode(v["content"]))
            return self._json({"commitUrl": f"{self.hub.url}/{parts[2]}/{parts[3]}/commit/{COMMIT}",
                               "commitOid": COMMIT, "pullRequestUrl": None})
        self._error(404, "NotFound", "not found")
