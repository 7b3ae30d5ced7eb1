"""An HTTP proxy on 127.0.0.1 that loses the answer to one request: the request reaches the server, its
response never reaches the client (the connection is closed instead), as on a flaky link.

Only for the tests' own moto server: requests go to ``upstream`` (an ``http://127.0.0.1:port`` URL).
"""

from __future__ import annotations

import http.client
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

__all__ = ["LossyProxy"]


class LossyProxy:
    """``with LossyProxy(upstream, drop=regex) as p:`` -- ``p.url`` to use; the first request whose
    ``"METHOD /path"`` matches ``drop`` is forwarded, and its answer dropped; :meth:`arm` sets another."""

    def __init__(self, upstream: str, drop: str | None = None):
        up = urlsplit(upstream)
        assert up.hostname in ("127.0.0.1", "localhost"), "the proxy only forwards to a local test server"
        self.upstream = (up.hostname, up.port)
        self.dropped = 0
        self._drop = re.compile(drop) if drop else None
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _forward(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                headers["Host"] = f"{proxy.upstream[0]}:{proxy.upstream[1]}"
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                if proxy._take(f"{self.command} {self.path}"):
                    conn.close()
                    self.close_connection = True
                    return  # the server did the work; the client hears nothing
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def arm(self, drop: str) -> None:
        """Drop the answer to the next request matching ``drop``."""
        with self._lock:
            self._drop = re.compile(drop)

    def _take(self, line: str) -> bool:
        with self._lock:
            if self._drop is not None and self._drop.search(line):
                self._drop = None
                self.dropped += 1
                return True
            return False

    def __enter__(self) -> LossyProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
