"""A read-only HTTP server on 127.0.0.1 that answers byte ranges and demands basic auth (fsspec's ``http://``).

Used by the tests of URLs that carry credentials (``http://user:secret@host/...``): requests without the
right ``Authorization`` header get 401, so a test that reads through it proves the credentials still reach
the server while every message shows them redacted.
"""

from __future__ import annotations

import base64
import functools
import http.server
import os
import re
import threading

__all__ = ["AuthRangeServer"]


class _Handler(http.server.SimpleHTTPRequestHandler):
    expected_auth = ""

    def log_message(self, *args):  # quiet
        pass

    def _authorized(self) -> bool:
        if self.headers.get("Authorization") == self.expected_auth:
            return True
        self.send_response(401)
        self.send_header("WWW-Authenticate", 'Basic realm="ulstore-test"')
        self.send_header("Content-Length", "0")
        self.end_headers()
        return False

    def do_HEAD(self):
        if self._authorized():
            super().do_HEAD()

    def do_GET(self):
        if not self._authorized():
            return
        path = self.translate_path(self.path)
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if m is None or not os.path.isfile(path):
            super().do_GET()
            return
        with open(path, "rb") as f:
            data = f.read()
        start = int(m.group(1))
        end = min(int(m.group(2)) + 1 if m.group(2) else len(data), len(data))
        body = data[start:end]
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{max(start, end - 1)}/{len(data)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class AuthRangeServer:
    """Serve ``directory`` at ``self.url(user, password)`` (``http://user:password@127.0.0.1:port``)."""

    def __init__(self, directory, user: str, password: str):
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        handler = type("Handler", (_Handler,), {"expected_auth": f"Basic {token}"})
        self.server = http.server.ThreadingHTTPServer(
            ("127.0.0.1", 0), functools.partial(handler, directory=os.fspath(directory))
        )
        self.port = self.server.server_address[1]
        self.user, self.password = user, password
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True, name="auth-range-http")
        self._thread.start()

    def url(self, path: str = "") -> str:
        return f"http://{self.user}:{self.password}@127.0.0.1:{self.port}/{path}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join()
