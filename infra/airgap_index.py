"""A tiny PEP 503 package index for air-gapped image builds (started by ``infra/airgap.sh index``).

``torch`` is served from a local folder of wheels (the CPU build this host has), so the
Dockerfile's ``TORCH_INDEX`` need not reach download.pytorch.org; every other project is
redirected to the host's own index. Usage: ``python airgap_index.py PORT WHEEL_DIR UPSTREAM``.
"""

from __future__ import annotations

import hashlib
import html
import re
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote


def normalize(name: str) -> str:
    """A project name as PEP 503 spells it in URLs."""
    return re.sub(r"[-_.]+", "-", name).lower()


def make_handler(wheels: dict[str, Path], upstream: str) -> type[BaseHTTPRequestHandler]:
    """A request handler serving ``wheels`` (file name -> path) as project ``torch``."""
    digests = {name: hashlib.sha256(path.read_bytes()).hexdigest() for name, path in wheels.items()}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the http.server API)
            parts = [unquote(p) for p in self.path.split("?")[0].split("/") if p]
            if len(parts) == 2 and parts[0] == "simple":
                project = normalize(parts[1])
                if project != "torch":
                    self.send_response(302)
                    self.send_header("Location", f"{upstream.rstrip('/')}/{project}/")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                links = "".join(
                    f'<a href="/files/{html.escape(n)}#sha256={d}">{html.escape(n)}</a><br>' for n, d in digests.items()
                )
                self._send(links.encode(), "text/html")
            elif len(parts) == 2 and parts[0] == "files" and parts[1] in wheels:
                self._send(wheels[parts[1]].read_bytes(), "application/octet-stream")
            else:
                self.send_error(404)

        def _send(self, body: bytes, content_type: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the http.server API)
            pass

    return Handler


def main(argv: list[str]) -> int:
    port, folder, upstream = int(argv[0]), Path(argv[1]), argv[2]
    wheels = {p.name: p for p in sorted(folder.glob("torch-*.whl"))}
    ThreadingHTTPServer(("127.0.0.1", port), make_handler(wheels, upstream)).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
