"""Where everything lives under a trajectory's root, and which names are valid.

The physical layout of format 2 (see ``docs/layout.md``)::

    zarr.json                      root group; attributes["ulstore"] = trajectory settings
    steps/zarr.json                group holding the steps
    steps/<step>/zarr.json         one step: a group whose attributes hold its step document.
                                   Written LAST, by conditional create: a step exists
                                   iff this object exists.
    packs/<id>.pack                immutable packs of blobs and table blocks; id = 32
                                   lowercase hex (random), checked before any key is built
    refs/<name>/<seq>.json         branch heads and tags: append-only logs of sealed entries,
                                   the highest <seq> is the value (see _refs.py)
    pending/                       commits and deletes in flight (see _pending.py)
    .tmp/                          local disk only: staging for atomic writes

Every key here is relative to the root and uses ``/``; :class:`~ulstore.core.objects.ObjectStore`
joins it to the fsspec root path.
"""

from __future__ import annotations

import math
import numbers
import re
import uuid

from ...errors import InvalidInputError

__all__ = [
    "ROOT_META",
    "STEPS_META",
    "STEPS_DIR",
    "PACKS_DIR",
    "REFS_DIR",
    "step_key",
    "pack_key",
    "new_pack_id",
    "is_pack_id",
    "ref_key",
    "MAX_STEP",
    "check_step",
    "step_of",
    "check_ref_name",
    "check_tensor_names",
    "tensor_name_problem",
    "check_file_names",
    "choose_chunks",
    "chunk_grid",
]

ROOT_META = "zarr.json"
STEPS_DIR = "steps"
STEPS_META = "steps/zarr.json"
PACKS_DIR = "packs"
PACK_SUFFIX = ".pack"
REFS_DIR = "refs"
#: Steps are below this (exclusive): what a step document may hold (``_stepdoc.py``) and a commit accepts.
MAX_STEP = 1 << 62

_REF_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9._-]{0,127}\Z")
_PACK_ID_RE = re.compile(r"^[0-9a-f]{32}\Z")
_STEP_RE = re.compile(r"^(0|[1-9][0-9]*)\Z")
#: longest tensor or file name, in UTF-8 bytes
MAX_NAME_BYTES = 4096


def step_key(step: int) -> str:
    """Key of the manifest of ``step`` (the step's group ``zarr.json``)."""
    return f"{STEPS_DIR}/{step}/zarr.json"


def is_pack_id(pack_id) -> bool:
    """Whether ``pack_id`` is a well-formed pack id (32 lowercase hex digits)."""
    return isinstance(pack_id, str) and _PACK_ID_RE.match(pack_id) is not None


def pack_key(pack_id: str) -> str:
    """Key of pack ``pack_id``; a malformed id (from damaged or crafted storage) raises ValueError.

    No key is ever built from an unchecked name: a pack id is exactly 32
    lowercase hex digits, so the key cannot leave ``packs/``.
    """
    if not is_pack_id(pack_id):
        raise ValueError(f"malformed pack id {pack_id!r}")
    return f"{PACKS_DIR}/{pack_id}{PACK_SUFFIX}"


def new_pack_id() -> str:
    """A fresh random pack id: a retried or racing commit never reuses another's pack name."""
    return uuid.uuid4().hex


def ref_key(name: str) -> str:
    """Key of the ref (branch or tag) ``name``."""
    return f"{REFS_DIR}/{name}.json"


def check_step(step) -> int:
    """Return ``step`` as an int, or raise InvalidInputError.

    Steps are non-negative integers below :data:`MAX_STEP` (2**62: training steps, or a number made of a
    run and a step).  A name is a ref instead.
    """
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise InvalidInputError(f"a step is a non-negative integer below 2**62, got {step!r}")
    step = int(step)
    if not 0 <= step < MAX_STEP:
        raise InvalidInputError(f"a step is a non-negative integer below 2**62, got {step}")
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


def tensor_name_problem(name) -> str | None:
    """Why ``name`` cannot be a tensor name (a Zarr node path under a step), or None if it can."""
    if not isinstance(name, str) or not name:
        return f"tensor names are non-empty strings, got {name!r}"
    if "\\" in name or "\x00" in name:
        # zarr reads a backslash as a path separator: "a\\b" would open the tensor "a/b"
        return f"tensor name {name!r} contains a backslash or NUL, which zarr paths cannot hold faithfully"
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return f"tensor name {name!r} is not valid unicode (lone surrogate)"
    if size > MAX_NAME_BYTES:
        return f"tensor name {name[:40]!r}... is longer than {MAX_NAME_BYTES} bytes"
    for part in name.split("/"):
        if part in ("", ".", "..") or part.startswith("__") or part == "zarr.json":
            return (
                f"tensor name {name!r} has an invalid path component {part!r} "
                "(empty, '.', '..', 'zarr.json' or starting with '__')"
            )
    return None


def check_tensor_names(names) -> None:
    """Reject names that cannot be Zarr node paths under a step.

    ``/`` is allowed and makes nested groups; dots and unicode are fine.  Empty
    path components, ``.``/``..``, a leading ``__`` (reserved by Zarr v3),
    ``zarr.json``, a backslash (zarr reads it as ``/``), NUL, and one tensor
    being the parent "directory" of another are not.
    """
    names = list(names)
    for name in names:
        why = tensor_name_problem(name)
        if why is not None:
            raise InvalidInputError(why, tensor=name if isinstance(name, str) else None)
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


def check_file_names(names) -> None:
    """Reject file names that are not relative ``/``-separated paths (``config.json``, ``tokenizer/vocab.txt``)."""
    for name in names:
        if not isinstance(name, str) or not name:
            raise InvalidInputError(f"file names are non-empty strings, got {name!r}")
        try:
            size = len(name.encode("utf-8"))
        except UnicodeEncodeError:
            size = MAX_NAME_BYTES + 1
        if "\\" in name or "\x00" in name or size > MAX_NAME_BYTES:
            raise InvalidInputError(f"file name {name[:60]!r} contains a backslash or NUL, or is not valid or too long")
        if any(part in ("", ".", "..") for part in name.split("/")):
            raise InvalidInputError(f"file name {name!r} is not a relative path ('', '.' or '..' component)")


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
