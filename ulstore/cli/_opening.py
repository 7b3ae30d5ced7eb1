"""The trajectory a command names: its storage options (``-o``, ``ULSTORE_STORAGE_OPTIONS``), opening it."""

from __future__ import annotations

import json
import os

from ._exit import UsageError

__all__: list[str] = []  # private to the commands: _storage_options, _open, _open_existing, _nbytes

_ENV_OPTIONS = "ULSTORE_STORAGE_OPTIONS"


def _storage_options(args) -> dict | None:
    options = {}
    env = os.environ.get(_ENV_OPTIONS)
    if env:
        try:
            options = json.loads(env)
        except ValueError as e:
            raise UsageError(f"{_ENV_OPTIONS} is not JSON: {e}") from None
        if not isinstance(options, dict):
            raise UsageError(f"{_ENV_OPTIONS} must be a JSON object")
    for item in getattr(args, "storage_options", None) or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"-o expects KEY=VALUE, got {item!r}")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options or None


def _open(args, mode: str, **settings):
    from ..store import open as open_trajectory

    settings = {k: v for k, v in settings.items() if v is not None}
    return open_trajectory(args.url, mode=mode, storage_options=_storage_options(args), **settings)


def _open_existing(args, mode: str = "r"):
    from ..errors import NotFoundError

    try:
        return _open(args, mode)
    except NotFoundError as e:
        if e.key != "zarr.json":  # not the root document (docs/layout.md) missing: a missing bucket, say
            raise
        raise NotFoundError(f"no trajectory at {args.url!r} (create one with `ulstore init {args.url}`)") from None


def _nbytes(shape, dtype) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * dtype.itemsize
