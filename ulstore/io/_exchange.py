"""Bridges between checkpoint files and trajectory steps: import, export, size reports.

:mod:`ulstore.checkpoints` reads and writes the files (exactly, bit for bit);
:class:`~ulstore.Trajectory` stores the tensors.  This module joins the two and
keeps what a file holds besides its tensors, so that an export gives back what
was imported:

* file metadata (safetensors ``__metadata__``, a sharded index's ``metadata``),
* tied-tensor aliases (``lm_head.weight`` sharing ``embed_tokens.weight``'s
  storage in a torch state dict): the tensor is stored once, the alias by name,
* the tensors' order in the file, and the largest shard of a sharded checkpoint.

They travel in the step's metadata under the key ``"checkpoint"``
(:data:`CHECKPOINT_KEY`)::

    {"checkpoint": {"format": "safetensors" | "sharded" | "torch" | "npz",
                    "source": "step_001200.safetensors",
                    "metadata": {"format": "pt"},          # file metadata, str -> str
                    "aliases": {"lm_head.weight": "model.embed_tokens.weight"},
                    "order": ["b", "a"],                   # only when not sorted
                    "max_shard_bytes": 5000000000}}        # sharded imports only

Exports
    A step can be written as one ``.safetensors`` file, a sharded Hugging Face
    directory (``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json``),
    a torch state dict (``.pt``/``.pth``/``.bin``, tied tensors share storage
    again) or an ``.npz``; or handed over in memory as numpy arrays
    (:func:`to_numpy`) or torch tensors (:func:`to_torch`).  Tensor bytes are
    always identical to the imported ones.  safetensors cannot express shared
    storage, so an alias is written there as a copy (two names, equal bytes),
    as ``safetensors.torch.save_file`` would require.

Every export is atomic: a file is written under a hidden temporary name and
renamed; a directory is assembled under a hidden temporary name and renamed.
A failed export leaves nothing under the output name.

Examples
--------
>>> import tempfile, numpy as np, ulstore
>>> from ulstore import checkpoints, io
>>> tmp = tempfile.mkdtemp()
>>> checkpoints.save_safetensors({"w": np.arange(6, dtype=np.float32).reshape(2, 3)},
...                              f"{tmp}/step_000100.safetensors", {"format": "pt"})
>>> traj = ulstore.open(f"{tmp}/traj", mode="w")
>>> io.import_checkpoint(traj, f"{tmp}/step_000100.safetensors")
100
>>> out = io.export_checkpoint(traj, 100, f"{tmp}/out.safetensors")
>>> ck = checkpoints.load(f"{tmp}/out.safetensors")
>>> ck.metadata, ck.tensors["w"].tobytes() == np.arange(6, dtype=np.float32).tobytes()
({'format': 'pt'}, True)
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import secrets
import shutil
from pathlib import Path

import numpy as np

from . import checkpoints as _ck
from .errors import (
    CorruptManifestError,
    InvalidInputError,
    NotFoundError,
    StepExistsError,
)
from .store import HEAD

__all__ = [
    "CHECKPOINT_KEY",
    "FORMATS",
    "import_checkpoint",
    "read_checkpoint",
    "export_checkpoint",
    "to_numpy",
    "to_torch",
    "checkpoint_format",
    "output_format",
    "step_from_path",
    "storage_report",
]

#: Step-metadata key under which :func:`import_checkpoint` keeps what the file held besides tensors.
CHECKPOINT_KEY = "checkpoint"

#: Export formats: name -> what is written.
FORMATS = {
    "safetensors": "one .safetensors file",
    "sharded": "a directory of safetensors shards plus model.safetensors.index.json",
    "torch": "a torch state dict (.pt/.pth/.bin), tied tensors sharing storage",
    "npz": "an uncompressed .npz (bf16/fp8 as raw bits, see ulstore.checkpoints)",
}

_INDEX_NAME = "model.safetensors.index.json"
_TORCH_SUFFIXES = (".pt", ".pth", ".bin")
# File names that say nothing about the step: the step is in the directory name.
_GENERIC_NAMES = re.compile(
    r"^(model|pytorch_model|diffusion_pytorch_model|adapter_model|consolidated|weights?|checkpoint|state_dict)"
    r"(\.safetensors\.index\.json|\.bin\.index\.json|\.safetensors|\.bin|\.pt|\.pth|\.npz)$",
    re.IGNORECASE,
)
_STEP_WORD = re.compile(r"(?:global[-_]?step|step|checkpoint|ckpt|iteration|iter|it)[-_.]?(\d+)(?!.*\d)", re.IGNORECASE)
_TRAILING_NUMBER = re.compile(r"(\d+)$")


# ------------------------------------------------------------------------ names


def checkpoint_format(path) -> str:
    """The format of a checkpoint path: ``"safetensors"``, ``"sharded"``, ``"torch"`` or ``"npz"``.

    Parameters
    ----------
    path : str or os.PathLike
        A file or a Hugging Face model directory (which need not be sharded).

    Returns
    -------
    str

    Raises
    ------
    NotFoundError
        ``path`` does not exist.
    InvalidInputError
        The format cannot be told from the name.

    Examples
    --------
    >>> import tempfile
    >>> from ulstore import checkpoints
    >>> d = tempfile.mkdtemp()
    >>> checkpoints.save_npz({"w": np.ones(2, np.float32)}, f"{d}/step_10.npz")
    >>> checkpoint_format(f"{d}/step_10.npz")
    'npz'
    """
    p = Path(path)
    if p.is_dir():
        return "sharded" if (p / _INDEX_NAME).is_file() or any(p.glob("*.safetensors.index.json")) else "safetensors"
    if not p.exists():
        raise NotFoundError(f"{p}: no such checkpoint file or directory")
    name = p.name.lower()
    if name.endswith(".index.json"):
        return "sharded"
    kind = _file_kind(name)
    if kind:
        return kind
    raise InvalidInputError(
        f"{p}: cannot tell the checkpoint format from the name; expected .safetensors, "
        "a Hugging Face directory or its *.safetensors.index.json, .pt/.pth/.bin or .npz"
    )


def _file_kind(name: str) -> str | None:
    """The single-file checkpoint format a (lower-case) file name names, if any."""
    if name.endswith(".safetensors"):
        return "safetensors"
    if name.endswith(_TORCH_SUFFIXES):
        return "torch"
    if name.endswith(".npz"):
        return "npz"
    return None


def step_from_path(path) -> int | None:
    """The training step a checkpoint's name carries, or None.

    The number after ``step``, ``checkpoint``, ``ckpt``, ``iter`` or
    ``global_step`` wins; otherwise a number that ends the name.  Generic
    file names (``model.safetensors``, ``pytorch_model.bin``, an index) take
    the step from their directory.

    Examples
    --------
    >>> step_from_path("runs/step_001200.safetensors")
    1200
    >>> step_from_path("out/checkpoint-1200/")
    1200
    >>> step_from_path("out/checkpoint-1200/model.safetensors.index.json")
    1200
    >>> step_from_path("llama-7b-ckpt3000.pt"), step_from_path("model.safetensors")
    (3000, None)
    """
    p = Path(path)
    name = p.name
    if _GENERIC_NAMES.match(name) or re.match(r"^model-\d+-of-\d+\.safetensors$", name):
        name = p.parent.name
    stem = re.sub(r"(\.safetensors\.index\.json|\.index\.json|\.safetensors|\.pth?|\.bin|\.npz)$", "", name,
                  flags=re.IGNORECASE)
    for pattern in (_STEP_WORD, _TRAILING_NUMBER):
        m = pattern.search(stem)
        if m:
            return int(m.group(1))
    return None


def output_format(out, *, format: str | None = None, max_shard_size=None) -> str:
    """The export format for output path ``out`` (see :data:`FORMATS`).

    ``.safetensors`` -> ``"safetensors"``; ``.pt``/``.pth``/``.bin`` ->
    ``"torch"``; ``.npz`` -> ``"npz"``; an existing directory, a path ending
    in ``/`` or a name without a suffix -> ``"sharded"`` (a Hugging Face
    directory).  ``max_shard_size`` also means ``"sharded"``.

    Examples
    --------
    >>> output_format("m.safetensors"), output_format("export/checkpoint-7"), output_format("sd.pt")
    ('safetensors', 'sharded', 'torch')
    """
    if format is not None:
        if format not in FORMATS:
            raise InvalidInputError(f"unknown export format {format!r}; expected one of {sorted(FORMATS)}")
        if max_shard_size is not None and format != "sharded":
            raise InvalidInputError(f"a shard size only applies to sharded output, not {format!r}")
        return format
    text = os.fspath(out)
    p = Path(text)
    name = p.name.lower()
    if p.is_dir() or text.endswith(("/", os.sep)) or not p.suffix:
        return "sharded"
    if max_shard_size is not None:
        raise InvalidInputError(f"{p}: sharded output is a directory; give a directory name (no suffix)")
    kind = _file_kind(name)
    if kind:
        return kind
    raise InvalidInputError(
        f"{p}: cannot tell the export format from the suffix {p.suffix!r}; use .safetensors, .pt/.pth/.bin, "
        ".npz or a directory name"
    )


# ----------------------------------------------------------------------- import


def import_checkpoint(traj, path, step=None, *, parent=HEAD, branch=None, metadata=None, anchor=None) -> int:
    """Load a checkpoint file (or directory) and commit it as a new step.

    Parameters
    ----------
    traj : Trajectory
        Opened for writing.
    path : str or os.PathLike
        ``.safetensors``, a Hugging Face directory or its index, ``.pt``/``.pth``/``.bin``
        (needs PyTorch) or ``.npz``.
    step : int, optional
        Default: from the name (:func:`step_from_path`).
    parent, branch, anchor
        As for :meth:`Trajectory.commit`.
    metadata : dict, optional
        Extra step metadata; the key ``"checkpoint"`` is taken by this function.

    Returns
    -------
    int
        The step committed.

    Raises
    ------
    NotFoundError
        ``path`` does not exist.
    InvalidInputError
        The file is malformed or of an unknown format, the step cannot be told
        from the name, or ``metadata`` uses the key ``"checkpoint"``.
    DtypeError
        A tensor's dtype cannot be stored.
    StepExistsError
        ``step`` exists already (checked before the file is read).

    Examples
    --------
    >>> import tempfile, numpy as np, ulstore
    >>> from ulstore import checkpoints
    >>> d = tempfile.mkdtemp()
    >>> checkpoints.save_npz({"w": np.ones(3, np.float16)}, f"{d}/ckpt_5.npz")
    >>> traj = ulstore.open(f"{d}/traj", mode="w")
    >>> import_checkpoint(traj, f"{d}/ckpt_5.npz"), traj.info(5).metadata["checkpoint"]["format"]
    (5, 'npz')
    """
    fmt = checkpoint_format(path)
    if step is None:
        step = step_from_path(path)
        if step is None:
            raise InvalidInputError(f"{path}: cannot tell the step from the name; pass step= (CLI: --step N)")
    metadata = dict(metadata or {})
    if CHECKPOINT_KEY in metadata:
        raise InvalidInputError(f"the step metadata key {CHECKPOINT_KEY!r} is reserved for the file's own metadata")
    if step in traj:  # before reading a possibly large file
        raise StepExistsError("step already exists; steps are immutable (rm it first to replace it)", step=step)
    ck = _ck.load(path)
    info = {"format": fmt, "source": _source_name(path), "metadata": dict(ck.metadata), "aliases": dict(ck.aliases)}
    names = list(ck.tensors) + list(ck.aliases)
    if ck.aliases and fmt == "torch":
        names = _torch_key_order(path, names)
    if names != sorted(names):
        info["order"] = names
    if fmt == "sharded":
        shard = _max_shard_bytes(path, ck)
        if shard:
            info["max_shard_bytes"] = shard
    metadata[CHECKPOINT_KEY] = info
    return traj.commit(step, ck.tensors, parent=parent, branch=branch, metadata=metadata, anchor=anchor)


def _torch_key_order(path, fallback: list[str]) -> list[str]:
    """The state dict's own key order (where tied names sit), read again memory-mapped: no data is copied."""
    try:
        import torch

        keys = list(torch.load(path, weights_only=True, mmap=True, map_location="cpu"))
    except Exception:  # noqa: BLE001 -- the order is a nicety; the tensors were read already
        return fallback
    return keys if sorted(keys) == sorted(fallback) else fallback


def _source_name(path) -> str:
    """What ``ulstore log`` shows: the file or directory name, with its directory if the name is generic."""
    p = Path(path)
    if p.name.lower().endswith(".index.json"):
        p = p.parent
    if _GENERIC_NAMES.match(p.name) and p.parent.name:
        return f"{p.parent.name}/{p.name}"
    return p.name or str(p)


def _max_shard_bytes(path, ck) -> int | None:
    """Tensor bytes of the largest shard named by the index (to shard the same way on export)."""
    p = Path(path)
    index = p if p.is_file() else (p / _INDEX_NAME if (p / _INDEX_NAME).is_file() else None)
    if index is None:
        found = sorted(p.glob("*.safetensors.index.json")) if p.is_dir() else []
        index = found[0] if len(found) == 1 else None
    if index is None:
        return None
    try:
        wmap = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    sizes: dict[str, int] = {}
    for name, shard in wmap.items():
        if name in ck.tensors:
            sizes[shard] = sizes.get(shard, 0) + ck.tensors[name].nbytes
    return max(sizes.values()) if len(sizes) > 1 else None


# ----------------------------------------------------------------------- export


def read_checkpoint(traj, step) -> _ck.Checkpoint:
    """A step as a :class:`~ulstore.checkpoints.Checkpoint`: tensors in file order, metadata, aliases.

    Steps committed directly (not imported) have no file metadata or aliases,
    and their tensors come in name order.

    Examples
    --------
    >>> import numpy as np, ulstore
    >>> traj = ulstore.open("memory://doc-read-checkpoint", mode="w")
    >>> traj.commit(0, {"b": np.zeros(2, np.float32), "a": np.ones(2, np.float32)})
    0
    >>> list(read_checkpoint(traj, 0).tensors)
    ['a', 'b']
    """
    return _read(traj, step)[0]


def _read(traj, step, progress=None) -> tuple[_ck.Checkpoint, dict, dict[str, np.ndarray]]:
    """The step's Checkpoint, its ``"checkpoint"`` metadata, and every name (aliases too) in file order.

    ``progress(nbytes)``, if given, is called as groups of tensors are decoded.
    """
    info = traj.info(step)
    meta = info.metadata.get(CHECKPOINT_KEY) or {}
    if not isinstance(meta, dict):
        raise CorruptManifestError(f"step metadata {CHECKPOINT_KEY!r} is not an object", step=info.step)
    if progress is None:
        tensors = traj.read(info.step)
    else:
        tensors = {}
        for group in _groups(traj.tensors(info.step), _PROGRESS_BYTES):
            tensors.update(traj.read(info.step, group))
            progress(sum(tensors[n].nbytes for n in group))
    aliases = dict(meta.get("aliases") or {})
    for alias, canon in aliases.items():
        if canon not in tensors:
            raise CorruptManifestError(f"alias {alias!r} names tensor {canon!r}, which the step does not hold",
                                       step=info.step)
    order = list(meta.get("order") or sorted(list(tensors) + list(aliases)))
    order += sorted(set(tensors).union(aliases) - set(order))  # anything the list misses, by name
    every = {n: tensors[aliases.get(n, n)] for n in order if n in tensors or n in aliases}
    ck = _ck.Checkpoint({n: a for n, a in every.items() if n not in aliases},
                        {str(k): str(v) for k, v in (meta.get("metadata") or {}).items()}, aliases)
    return ck, meta, every


_PROGRESS_BYTES = 256 << 20  # decode this much between progress reports (big enough to keep threads busy)


def _groups(shapes: dict, budget: int) -> list[list[str]]:
    """Tensor names in groups of about ``budget`` raw bytes, in name order."""
    groups, current, used = [], [], 0
    for name, (shape, dtype) in shapes.items():
        n = math.prod(shape) * dtype.itemsize
        if current and used + n > budget:
            groups.append(current)
            current, used = [], 0
        current.append(name)
        used += n
    if current:
        groups.append(current)
    return groups


def to_numpy(traj, step) -> dict[str, np.ndarray]:
    """A step as ``{name: numpy array}``, tied names included (the very same array object).

    Examples
    --------
    >>> import numpy as np, ulstore
    >>> traj = ulstore.open("memory://doc-to-numpy", mode="w")
    >>> traj.commit(3, {"w": np.arange(4, dtype=np.float32)})
    3
    >>> to_numpy(traj, 3)["w"]
    array([0., 1., 2., 3.], dtype=float32)
    """
    return _read(traj, step)[2]


def to_torch(traj, step) -> dict:
    """A step as a torch state dict; tied names share one tensor again (needs PyTorch).

    bf16/fp8 come back as ``torch.bfloat16``/``torch.float8_*``, bit for bit.

    Examples
    --------
    >>> import pytest; torch = pytest.importorskip("torch")
    >>> import numpy as np, ulstore
    >>> traj = ulstore.open("memory://doc-to-torch", mode="w")
    >>> traj.commit(0, {"w": torch.ones(2, 2, dtype=torch.bfloat16)})
    0
    >>> to_torch(traj, 0)["w"].dtype
    torch.bfloat16
    """
    ck, _, every = _read(traj, step)
    return _ck.to_torch(every, ck.aliases)


def export_checkpoint(traj, step, out, *, format: str | None = None, max_shard_size=None,
                      overwrite: bool = False, progress=None) -> dict:
    """Write a step as a checkpoint file or directory, atomically.

    Parameters
    ----------
    traj : Trajectory
    step : int or str
        A step or a ref name.
    out : str or os.PathLike
        Output path; the format follows from it (see :func:`output_format`).
    format : {"safetensors", "sharded", "torch", "npz"}, optional
        Overrides the suffix.
    max_shard_size : int or str, optional
        Shard limit for ``"sharded"`` (e.g. ``"5GB"``).  Default: the largest
        shard of the imported checkpoint if it was sharded; otherwise one
        ``model.safetensors`` in the directory.
    overwrite : bool, default False
        Replace an existing ``out`` (only once the new one is complete).
    progress : callable, optional
        Called with a byte count as groups of tensors are decoded (e.g. ``tqdm.update``).

    Returns
    -------
    dict
        ``format``, ``path`` and ``files`` (paths written), ``bytes`` (their total size),
        ``tensors`` (names written, aliases included).

    Raises
    ------
    StepNotFoundError
        No such step.
    InvalidInputError
        ``out`` exists (without ``overwrite``) or has an unknown suffix.
    """
    fmt = output_format(out, format=format, max_shard_size=max_shard_size)
    out = Path(out)
    if out.exists() and not overwrite and not (out.is_dir() and fmt == "sharded" and not any(out.iterdir())):
        raise InvalidInputError(f"{out}: already exists; choose another name or overwrite it (CLI: --force)")
    ck, meta, tensors = _read(traj, step, progress)
    file_meta = dict(ck.metadata)
    if meta.get("format") == "sharded" and fmt != "sharded":
        file_meta.pop("total_size", None)  # the index's, not a file's
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors":
        _replace_file(out, overwrite, lambda p: _ck.save_safetensors(tensors, p, file_meta))
    elif fmt == "torch":
        _replace_file(out, overwrite, lambda p: _ck.save_torch(tensors, p, aliases=ck.aliases))
    elif fmt == "npz":
        _replace_file(out, overwrite, lambda p: _ck.save_npz(tensors, p))
    else:
        shard = max_shard_size if max_shard_size is not None else meta.get("max_shard_bytes")
        with _staging_dir(out, overwrite) as tmp:
            if shard is None:
                _ck.save_safetensors(tensors, tmp / "model.safetensors", file_meta)
            else:
                _ck.save_safetensors(tensors, tmp, file_meta, max_shard_size=shard)
    files = sorted(str(f) for f in out.iterdir()) if out.is_dir() else [str(out)]
    return {"format": fmt, "path": str(out), "files": files, "bytes": sum(os.path.getsize(f) for f in files),
            "tensors": list(tensors)}


def _replace_file(out: Path, overwrite: bool, write) -> None:
    if out.is_dir():
        raise InvalidInputError(f"{out}: is a directory; give a file name")
    # checkpoints' writers are atomic themselves (hidden temporary + os.replace)
    write(out)


@contextlib.contextmanager
def _staging_dir(out: Path, overwrite: bool):
    """Yield a hidden sibling directory; move it to ``out`` only once everything is written."""
    tmp = out.parent / f".{out.name}.{secrets.token_hex(6)}.tmp"
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            if out.is_dir() and not any(out.iterdir()):
                out.rmdir()
            elif overwrite:
                old = out.parent / f".{out.name}.{secrets.token_hex(6)}.old"
                os.rename(out, old)
                os.rename(tmp, out)
                shutil.rmtree(old) if old.is_dir() else old.unlink()
                return
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ---------------------------------------------------------------------- reports


def storage_report(traj, storage_options: dict | None = None) -> dict:
    """Raw vs stored bytes of every step and every tensor.

    A blob is charged to the first step (in step order) whose manifest names
    it, and to that tensor; a chunk that reuses an earlier entry costs only
    its manifest line.  Manifests are charged to their step.

    Parameters
    ----------
    traj : Trajectory
    storage_options : dict, optional
        The ones ``traj`` was opened with (needed for remote stores).

    Returns
    -------
    dict
        ``steps``: list of dicts ``step, parent, raw_bytes, stored_bytes,
        blob_bytes, manifest_bytes, new_blobs, chunks, elements,
        bits_per_weight, ratio``; ``tensors``: list of dicts ``name, dtype,
        raw_bytes, stored_bytes, elements, bits_per_weight, ratio``;
        ``total``: the sums (``stored_bytes`` excludes unreferenced blobs,
        which ``unreferenced_bytes`` counts).

    Notes
    -----
    Reads each step manifest and lists the blobs, following the documented
    layout (``docs/layout.md``); no blob is fetched.

    Examples
    --------
    >>> import numpy as np, ulstore
    >>> traj = ulstore.open("memory://doc-report", mode="w")
    >>> w = np.zeros((64, 64), np.float32)
    >>> traj.commit(0, {"w": w}), traj.commit(1, {"w": w})
    (0, 1)
    >>> r = storage_report(traj)
    >>> [s["raw_bytes"] for s in r["steps"]], r["steps"][1]["blob_bytes"]
    ([16384, 16384], 0)
    """
    import fsspec

    options = dict(storage_options or {})
    fs, root = fsspec.core.url_to_fs(os.fspath(traj.url), **options)
    root = root.rstrip("/")
    try:
        listing = fs.find(f"{root}/blobs", detail=True)
    except FileNotFoundError:
        listing = {}
    blob_size = {k.rsplit("/", 1)[-1]: int(v.get("size") or 0) for k, v in listing.items()}
    steps = traj.steps
    paths = [f"{root}/steps/{s}/zarr.json" for s in steps]
    raw_manifests = fs.cat(paths) if paths else {}
    if not isinstance(raw_manifests, dict):  # a single path returns bytes
        raw_manifests = {paths[0]: raw_manifests}
    charged: set[str] = set()
    per_step, per_tensor = [], {}
    for s, path in zip(steps, paths):
        raw = raw_manifests.get(path) or raw_manifests.get(_strip_protocol(fs, path))
        if raw is None:
            raise NotFoundError("step manifest vanished while reading", step=s)
        doc = _manifest_doc(raw, s)
        row = {"step": s, "parent": doc.get("parent"), "raw_bytes": 0, "blob_bytes": 0, "manifest_bytes": len(raw),
               "new_blobs": 0, "chunks": 0, "elements": 0}
        for name, t in doc["tensors"].items():
            dtype = _dtype(t["dtype"])
            n = math.prod(t["shape"])
            tr = per_tensor.setdefault(name, {"name": name, "dtype": dtype.name, "raw_bytes": 0, "stored_bytes": 0,
                                              "elements": 0, "steps": 0})
            tr["raw_bytes"] += n * dtype.itemsize
            tr["elements"] += n
            tr["steps"] += 1
            row["raw_bytes"] += n * dtype.itemsize
            row["elements"] += n
            for blob, _ref, _content in t["entries"]:
                row["chunks"] += 1
                if blob in charged:
                    continue
                charged.add(blob)
                size = blob_size.get(blob, 0)
                row["blob_bytes"] += size
                row["new_blobs"] += 1
                tr["stored_bytes"] += size
        row["stored_bytes"] = row["blob_bytes"] + row["manifest_bytes"]
        _rates(row)
        per_step.append(row)
    tensors = sorted(per_tensor.values(), key=lambda r: -r["stored_bytes"])
    for r in tensors:
        _rates(r)
    total = {k: sum(r[k] for r in per_step) for k in ("raw_bytes", "stored_bytes", "blob_bytes", "manifest_bytes",
                                                      "new_blobs", "chunks", "elements")}
    total["steps"] = len(per_step)
    total["unreferenced_bytes"] = sum(size for b, size in blob_size.items() if b not in charged)
    _rates(total)
    return {"steps": per_step, "tensors": tensors, "total": total}


def _strip_protocol(fs, path: str) -> str:
    return fs._strip_protocol(path)


def _rates(row: dict) -> None:
    row["bits_per_weight"] = 8 * row["stored_bytes"] / row["elements"] if row["elements"] else 0.0
    row["ratio"] = row["raw_bytes"] / row["stored_bytes"] if row["stored_bytes"] else None


def _dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes  # bfloat16, float8_*: not numpy names

        return np.dtype(getattr(ml_dtypes, name))


def _manifest_doc(raw: bytes, step: int) -> dict:
    try:
        doc = json.loads(raw)["attributes"]["ulstore"]
        if not isinstance(doc["tensors"], dict):
            raise TypeError("tensors is not an object")
        return doc
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptManifestError(f"step manifest is not readable: {e}", step=step) from None
