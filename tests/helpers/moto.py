"""A moto S3 server on 127.0.0.1, for the tests that need a real S3 API (``moto_s3`` in tests/conftest.py)."""

from __future__ import annotations

import logging
import threading
import uuid

__all__ = ["MotoS3"]


def _atomic_conditions(app):
    """Wrap moto's WSGI app so that conditional requests run one at a time.

    moto checks ``If-None-Match`` / ``If-Match`` and then writes, without a
    lock, on a threaded server: two racing conditional PUTs can both pass the
    check.  S3 evaluates the condition and the write atomically; so must the
    server the racing-writer tests run against.
    """
    lock = threading.Lock()

    def wrapped(environ, start_response):
        if "HTTP_IF_NONE_MATCH" in environ or "HTTP_IF_MATCH" in environ:
            with lock:
                return list(app(environ, start_response))
        return app(environ, start_response)

    return wrapped


class MotoS3:
    """A moto S3 server on 127.0.0.1 (moto, boto3 and s3fs are test dependencies: missing, they fail)."""

    def __init__(self):
        from moto.moto_server import threaded_moto_server
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        if not getattr(threaded_moto_server, "_ulstore_atomic", False):
            make = threaded_moto_server.make_server
            threaded_moto_server.make_server = lambda host, port, app, *a, **k: make(
                host, port, _atomic_conditions(app), *a, **k
            )
            threaded_moto_server._ulstore_atomic = True
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.options = {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
        }

    def bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh name unless given) and return its name."""
        import boto3

        name = name or f"sync-{uuid.uuid4().hex[:12]}"
        boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        ).create_bucket(Bucket=name)
        return name

    def stop(self):
        self.server.stop()
