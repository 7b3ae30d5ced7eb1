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
        found = _checkpoints_at(args.url)
        if found is not None:  # the checkpoints themselves given where a trajectory goes: say how to import them
            raise NotFoundError(
                f"no trajectory at {args.url!r}: it is {found[0]}, not a trajectory; import into one with "
                f"`ulstore add --init runs/NAME {found[1]}`, then name runs/NAME here"
            ) from None
        raise NotFoundError(f"no trajectory at {args.url!r} (create one with `ulstore init {args.url}`)") from None


_CHECKPOINT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".npz")
_LOOKED_AT = 10_000  # entries of a directory looked at: a huge directory is not listed in full for a hint


def _checkpoints_at(url: str) -> tuple[str, str] | None:
    """(what ``url`` is, what to give ``ulstore add``) when it is a local checkpoint file, a Hugging Face
    model directory or a directory of checkpoints; None for anything else.

    Examples
    --------
    >>> import pathlib, tempfile
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> for n in ("step_100.safetensors", "step_200.safetensors", "notes.txt"):
    ...     _ = (d / n).write_bytes(b"")
    >>> _checkpoints_at(str(d))[1] == f"{d}/*.safetensors"
    True
    >>> _checkpoints_at(str(d / "step_100.safetensors"))[0]
    'a checkpoint file'
    >>> _checkpoints_at(str(d / "missing")) is None
    True
    """
    import itertools

    if "://" in url or "::" in url:
        return None
    path = url.rstrip("/") or "/"
    if os.path.isfile(path):
        return ("a checkpoint file", path) if path.lower().endswith(_CHECKPOINT_SUFFIXES) else None
    try:
        with os.scandir(path) as entries:
            names = {e.name: e.is_dir() for e in itertools.islice(entries, _LOOKED_AT)}
    except OSError:
        return None
    if any(n.startswith("checkpoint-") and is_dir for n, is_dir in names.items()):
        return "a directory of Trainer checkpoints", os.path.join(path, "checkpoint-*/")
    if "model.safetensors" in names or "model.safetensors.index.json" in names:
        return "a Hugging Face model directory (one checkpoint)", path + "/"
    suffixes = [s for n, is_dir in names.items() if not is_dir for s in _CHECKPOINT_SUFFIXES if n.lower().endswith(s)]
    if not suffixes:
        return None
    common = max(_CHECKPOINT_SUFFIXES, key=suffixes.count)
    return "a directory of checkpoint files", os.path.join(path, f"*{common}")


def _nbytes(shape, dtype) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * dtype.itemsize
