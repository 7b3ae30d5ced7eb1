"""Where everything lives under a trajectory's root, and which names are valid.

The physical layout (see ``docs/layout.md``)::

    zarr.json                      root group; attributes["ulstore"] = trajectory settings
    steps/zarr.json                group holding the steps
    steps/<step>/zarr.json         one step: a group whose attributes hold its manifest.
                                   Written LAST, by conditional create: a step exists
                                   iff this object exists.
    blobs/<h[:2]>/<h>              chunk blobs, named by the blake2b-256 of their bytes
    refs/<name>/<seq>.json         branch heads and tags: append-only logs of sealed entries,
                                   the highest <seq> is the value (see _refs.py)
    pending/                       commits and deletes in flight (see _pending.py)

Every key here is relative to the root and uses ``/``; :class:`~ulstore.core.objects.ObjectStore`
joins it to the fsspec root path.
"""

from __future__ import annotations

import math
import numbers
import re

from ..errors import InvalidInputError

__all__ = [
    "ROOT_META",
    "STEPS_META",
    "STEPS_DIR",
    "BLOBS_DIR",
    "REFS_DIR",
    "step_key",
    "blob_key",
    "ref_key",
    "check_step",
    "step_of",
    "check_ref_name",
    "check_tensor_names",
    "choose_chunks",
    "chunk_grid",
]

ROOT_META = "zarr.json"
STEPS_DIR = "steps"
STEPS_META = "steps/zarr.json"
BLOBS_DIR = "blobs"
REFS_DIR = "refs"

_REF_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9._-]{0,127}$")
_STEP_RE = re.compile(r"^(0|[1-9][0-9]*)$")


def step_key(step: int) -> str:
    """Key of the manifest of ``step`` (the step's group ``zarr.json``)."""
    return f"{STEPS_DIR}/{step}/zarr.json"


def blob_key(digest: str) -> str:
    """Key of the blob whose blake2b-256 hex digest is ``digest``.

    Two hex characters of fan-out keep local directories small; object stores
    do not care.
    """
    return f"{BLOBS_DIR}/{digest[:2]}/{digest}"


def ref_key(name: str) -> str:
    """Key of the ref (branch or tag) ``name``."""
    return f"{REFS_DIR}/{name}.json"


def check_step(step) -> int:
    """Return ``step`` as an int, or raise InvalidInputError.

    Steps are non-negative integers (training steps).  A name is a ref instead.
    """
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise InvalidInputError(f"a step is a non-negative integer, got {step!r}")
    step = int(step)
    if step < 0:
        raise InvalidInputError(f"a step is a non-negative integer, got {step}")
    return step


def step_of(name: str) -> int | None:
    """The step a directory name under ``steps/`` stands for, or None (only canonical ASCII decimals are steps)."""
    return int(name) if _STEP_RE.match(name) else None


def check_ref_name(name) -> str:
    """Return ``name`` if it is a valid ref name (a letter or ``_`` first, then ``[A-Za-z0-9._-]``)."""
    if not isinstance(name, str) or not _REF_RE.match(name) or name.endswith(".json"):
        raise InvalidInputError(
            f"ref names start with a letter or '_' and contain only letters, digits, '.', '_', '-': got {name!r}"
        )
    return name


def check_tensor_names(names) -> None:
    """Reject names that cannot be Zarr node paths under a step.

    ``/`` is allowed and makes nested groups; dots and unicode are fine.  Empty
    path components, ``.``/``..``, a leading ``__`` (reserved by Zarr v3),
    ``zarr.json``, and one tensor being the parent "directory" of another are not.
    """
    names = list(names)
    for name in names:
        if not isinstance(name, str) or not name:
            raise InvalidInputError(f"tensor names are non-empty strings, got {name!r}")
        for part in name.split("/"):
            if part in ("", ".", "..") or part.startswith("__") or part == "zarr.json":
                raise InvalidInputError(
                    f"tensor name {name!r} has an invalid path component {part!r} "
                    "(empty, '.', '..', 'zarr.json' or starting with '__')",
                    tensor=name,
                )
    prefixes: dict[str, str] = {}
    for name in names:
        parts = name.split("/")
        for i in range(1, len(parts)):
            prefixes.setdefault("/".join(parts[:i]), name)
    for name in names:
        if name in prefixes:
            raise InvalidInputError(
                f"tensor {name!r} would be both an array and the group holding {prefixes[name]!r}", tensor=name
            )


def choose_chunks(shape: tuple[int, ...], itemsize: int, chunk_bytes: int) -> tuple[int, ...]:
    """A regular chunk shape of at most ``chunk_bytes`` (at least one element).

    Chunks keep trailing axes whole and split leading ones: a chunk of a
    ``(out, in)`` weight is a band of whole rows, so a row slice touches one chunk
    and co-located chunks of consecutive steps hold the same weights.
    """
    chunks = [max(1, n) for n in shape]
    for axis in range(len(shape)):
        inner = math.prod(chunks[axis + 1 :]) * itemsize
        if chunks[axis] * inner <= chunk_bytes:
            break
        chunks[axis] = max(1, chunk_bytes // inner) if inner <= chunk_bytes else 1
        if inner <= chunk_bytes:
            break
    return tuple(chunks)


def chunk_grid(shape: tuple[int, ...], chunks: tuple[int, ...]) -> tuple[int, ...]:
    """Number of chunks along each axis (0 along an axis of length 0)."""
    return tuple(-(-n // c) for n, c in zip(shape, chunks))
