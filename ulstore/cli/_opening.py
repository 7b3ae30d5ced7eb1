"""What the commands share: exit statuses, usage errors found after parsing, opening the trajectory."""

from __future__ import annotations

import json
import os

from ..errors import InvalidInputError

__all__ = ["EXIT_OK", "EXIT_ERROR", "EXIT_USAGE", "UsageError"]

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2
_ENV_OPTIONS = "ULSTORE_STORAGE_OPTIONS"


class UsageError(InvalidInputError):
    """A usage error only found after parsing (``-o``, ``ULSTORE_STORAGE_OPTIONS``): exit status 2, like argparse's."""


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
