"""A loopback stand-in for the Hugging Face Hub's HTTP routes that `huggingface_hub`'s create_repo, upload_folder
(preupload, the LFS batch API with basic transfer and verify, the NDJSON commit) and create_tag / list_repo_refs
call, for the real client pointed at it with HF_ENDPOINT (and HF_HUB_DISABLE_XET=1: the Xet CAS protocol is not
spoken here) and /api/validate-yaml (the card's metadata). Every write needs `Authorization: Bearer <token>`. Files land in `<root>/<repo_id>/` (the main
tree); `fail_commits(n)` answers the next n commits with 500 (an outage mid-upload)."""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import os
import shutil
import threading


class HubStandin:
    def __init__(self, root: str, token: str):
        self.root, self.token = root, token
        self.repos: dict[
            str, dict
        ] = {}  # repo_id -> {"private", "commits": [...], "tags": {name: oid}}
        self.requests: list[tuple[str, str]] = []
        self._failures = 0
        self._lock = threading.Lock()
        standin = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                standin._handle(self, "GET")

            def do_POST(self):
                standin._handle(self, "POST")

            def do_PUT(self):
                standin._handle(self, "PUT")

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> "HubStandin":
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def fail_commits(self, count: int) -> None:
        self._failures = count

    def commits(self, repo_id: str) -> list[dict]:
        return self.repos.get(repo_id, {}).get("commits", [])

    def tree(self, repo_id: str) -> str:
        return os.path.join(self.root, repo_id)

    # ------------------------------------------------------------------------------------------------ routes
    def _handle(self, request, method: str) -> None:
        length = int(request.headers.get("Content-Length") or 0)
        body = request.rfile.read(length) if length else b""
        path = request.path.split("?", 1)[0]
        self.requests.append((method, path))
        if path.startswith(
            "/_lfs/"
        ):  # a pre-signed storage URL (as on the Hub): the signature, not the token
            if request.path.partition("?sig=")[2] != self._signature(path.rsplit("/", 1)[1]):
                return self._reply(request, 403, {"error": "bad signature"})
        elif method != "GET" and request.headers.get("Authorization") != f"Bearer {self.token}":
            return self._reply(
                request, 401, {"error": "Invalid credentials in Authorization header"}
            )
        with self._lock:
            status, payload = self._route(method, path, body)
        self._reply(request, status, payload)

    def _signature(self, oid: str) -> str:
        return hashlib.sha256(f"{oid}:{self.token}".encode()).hexdigest()[:16]

    @staticmethod
    def _lfs(file: dict) -> bool:
        """As the Hub's default .gitattributes: weights and other binaries, and anything over 10 MB."""
        return (
            file["path"].endswith((".safetensors", ".bin", ".pt", ".pth", ".gguf"))
            or file["size"] > 10 << 20
        )

    def _signed(self, action: str, oid: str) -> str:
        return f"{self.url}/_lfs/{action}/{oid}?sig={self._signature(oid)}"

    def _reply(self, request, status: int, payload) -> None:
        data = json.dumps(payload).encode()
        request.send_response(status)
        request.send_header("Content-Type", "application/json")
        if isinstance(payload, dict) and "code" in payload:
            request.send_header(
                "X-Error-Code", payload["code"]
            )  # how the client tells the error kinds apart
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        request.wfile.write(data)

    def _route(self, method: str, path: str, body: bytes):
        if (
            method == "POST" and path == "/api/validate-yaml"
        ):  # upload_folder checks a README.md's metadata
            return self._validate_yaml(json.loads(body)["content"])
        if method == "POST" and path == "/api/repos/create":
            request = json.loads(body)
            repo_id = "/".join(
                part for part in (request.get("organization"), request["name"]) if part
            )
            if repo_id in self.repos:
                return 409, {
                    "error": "You already created this model repo",
                    "url": f"{self.url}/{repo_id}",
                }
            self.repos[repo_id] = {
                "private": request.get("visibility") == "private" or request.get("private"),
                "commits": [],
                "tags": {},
            }
            os.makedirs(self.tree(repo_id), exist_ok=True)
            return 200, {"url": f"{self.url}/{repo_id}", "name": repo_id}
        if method == "PUT" and path.startswith("/_lfs/upload/"):
            oid = path.rsplit("/", 1)[1]
            if hashlib.sha256(body).hexdigest() != oid:
                return 400, {"error": "sha256 mismatch"}
            os.makedirs(os.path.join(self.root, "_lfs"), exist_ok=True)
            with open(os.path.join(self.root, "_lfs", oid), "wb") as handle:
                handle.write(body)
            return 200, {}
        if method == "POST" and path.startswith("/_lfs/verify/"):
            request = json.loads(body)
            stored = os.path.join(self.root, "_lfs", request["oid"])
            ok = os.path.exists(stored) and os.path.getsize(stored) == request["size"]
            return (200, {}) if ok else (404, {"error": "object not uploaded"})
        if path.endswith(".git/info/lfs/objects/batch"):
            request = json.loads(body)
            return 200, {
                "transfer": "basic",
                "objects": [
                    {
                        "oid": item["oid"],
                        "size": item["size"],
                        "actions": {
                            "upload": {"href": self._signed("upload", item["oid"])},
                            "verify": {"href": self._signed("verify", item["oid"])},
                        },
                    }
                    for item in request["objects"]
                ],
            }
        parts = path.split("/")
        if len(parts) >= 6 and parts[1] == "api" and parts[2] == "models":
            repo_id, action, revision = (
                "/".join(parts[3:5]),
                parts[5],
                "/".join(parts[6:]) or "main",
            )
            if repo_id not in self.repos:
                return 404, {"error": f"Repository Not Found: {repo_id}", "code": "RepoNotFound"}
            repo = self.repos[repo_id]
            if action == "preupload":
                files = json.loads(body)["files"]
                return 200, {
                    "files": [
                        {
                            "path": f["path"],
                            "uploadMode": "lfs" if self._lfs(f) else "regular",
                            "shouldIgnore": False,
                        }
                        for f in files
                    ]
                }
            if action == "commit":
                if self._failures:
                    self._failures -= 1
                    return 500, {"error": "Internal Server Error"}
                return self._commit(repo_id, repo, body)
            if action == "tag":
                tag = json.loads(body)["tag"]
                if tag in repo["tags"]:
                    return 409, {"error": f"Tag {tag} already exists"}
                target = repo["commits"][-1]["oid"] if revision == "main" else revision
                repo["tags"][tag] = target
                return 200, {}
            if (
                action == "tree" and method == "GET"
            ):  # list_repo_files (upload_folder's delete_patterns)
                root = self.tree(repo_id)
                files = [
                    os.path.relpath(os.path.join(d, n), root)
                    for d, _, names in os.walk(root)
                    for n in names
                ]
                return 200, [
                    {
                        "type": "file",
                        "path": f,
                        "size": os.path.getsize(os.path.join(root, f)),
                        "oid": hashlib.sha1(open(os.path.join(root, f), "rb").read()).hexdigest(),
                    }
                    for f in sorted(files)
                ]
            if action == "refs" and method == "GET":
                head = repo["commits"][-1]["oid"] if repo["commits"] else None
                return 200, {
                    "branches": [{"name": "main", "ref": "refs/heads/main", "targetCommit": head}],
                    "tags": [
                        {"name": t, "ref": f"refs/tags/{t}", "targetCommit": oid}
                        for t, oid in repo["tags"].items()
                    ],
                    "converts": [],
                    "pullRequests": [],
                }
        return 404, {"error": f"no route {method} {path} in the Hub stand-in"}

    def _validate_yaml(self, content: str):
        import yaml

        if not content.startswith("---"):
            return 200, {
                "errors": [],
                "warnings": [{"message": "empty or missing yaml metadata in repo card"}],
            }
        try:
            metadata = yaml.safe_load(content.split("---", 2)[1]) or {}
        except yaml.YAMLError as err:
            return 400, {"errors": [{"message": f"YAML: {err}"}]}
        for entry in metadata.get("model-index", []):
            if "name" not in entry or not all(
                "task" in r and "metrics" in r for r in entry.get("results", [])
            ):
                return 400, {
                    "errors": [
                        {"message": "model-index: each entry needs name and results[task, metrics]"}
                    ]
                }
        return 200, {"errors": [], "warnings": []}

    def _commit(self, repo_id: str, repo: dict, body: bytes):
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        header = next(line["value"] for line in lines if line["key"] == "header")
        written = []
        for line in lines:
            value = line["value"]
            if line["key"] == "file":
                content = (
                    base64.b64decode(value["content"])
                    if value.get("encoding") == "base64"
                    else value["content"].encode()
                )
            elif line["key"] == "lfsFile":
                with open(os.path.join(self.root, "_lfs", value["oid"]), "rb") as handle:
                    content = handle.read()
            elif line["key"] in ("deletedFile", "deletedFolder"):
                target = os.path.join(self.tree(repo_id), value["path"])
                shutil.rmtree(target) if os.path.isdir(target) else os.remove(target)
                written.append({"path": value["path"], "deleted": True})
                continue
            else:
                continue
            target = os.path.join(self.tree(repo_id), value["path"])
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as handle:
                handle.write(content)
            written.append(
                {"path": value["path"], "lfs": line["key"] == "lfsFile", "deleted": False}
            )
        oid = hashlib.sha1(body).hexdigest()
        repo["commits"].append({"oid": oid, "summary": header.get("summary"), "files": written})
        return 200, {
            "commitUrl": f"{self.url}/{repo_id}/commit/{oid}",
            "commitOid": oid,
            "success": True,
        }
