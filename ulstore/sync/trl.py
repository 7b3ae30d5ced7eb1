"""Interop with TRL's ``sparse_weight_patch`` bucket layout: import into a sync store, export back.

The TRL layout (our reading of the format; see ``docs/sync.md``)::

    anchors/step_NNNNNN.safetensors   full weights: one tensor per parameter, under its name
    deltas/step_NNNNNN.safetensors    per changed parameter, its changed elements:
        <name>.indices  int32 flat C-order positions, ascending      } first version
        <name>.values   the new values (bf16)                        }
      or
        <name>.idx      positions, coded as header "encoding" says:  } later versions
                          "raw"       int32 positions
                          "gap_delta" gaps (see gap_encode), uint16, or uint32
                                      for a parameter whose largest gap needs it
        <name>.val      the new values

``NNNNNN`` is the step (zero-padded to at least 6 digits).  Header metadata
(all strings): ``format="sparse_weight_patch"``, ``version="1"``,
``model_version``, ``num_changed_params``, ``total_changed_elements``,
``total_elements``, ``sparsity``; later files add ``sparse`` (``"True"`` for
deltas) and ``encoding``, and the branch that checks what a replica rebuilt
adds (read from its ``PatchMetadata`` and checksum helper):

- ``changed_params``: a JSON list of the names of the parameters the file
  holds changes of (a delta: those with at least one changed element; an
  anchor: every parameter), in sorted order.  The branch's loader walks this
  list, not the tensor names, to find ``<name>.indices`` / ``<name>.values``.
- ``checksum_sha256``: the hex SHA-256 of the *whole* state once the file is
  applied (not of the file): the raw bytes of every parameter (C order, little
  endian, no name, shape or dtype), parameters in sorted name order.  A
  replica recomputes it after applying a delta, so it catches any wrong
  result (a missed or repeated delta, a wrong base, a bad scatter), which a
  checksum of the file alone cannot.  Also ``prev_model_version`` and
  ``anchor_step`` (the anchor the chain of deltas starts from).  A delta holds the changes since the previous step
present in the bucket.  Anchors written by early versions may omit parameters
that did not change; on import those keep their previous value.

Gap coding (``gap_delta``), precisely: for ascending positions
``i_0 < i_1 < ... < i_{n-1}``, ``gap_k = i_k - i_{k-1} - 1`` with
``i_{-1} = -1``; so ``gap_0 = i_0`` and consecutive positions give gap 0.
The gaps of one parameter are stored as ``uint16`` if all fit (<= 65535),
else as ``uint32``: the tensor's dtype is the width.  Decoding is
``i_k = (sum_{j<=k} (gap_j + 1)) - 1``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re

import numpy as np

from ..core.objects import ObjectStore
from ..core.safetensors import dumps, loads
from ..errors import InvalidInputError, NotFoundError
from . import _open
from ._arrays import words
from .publisher import DEFAULT_ANCHOR_EVERY, Publisher

__all__ = ["import_trl", "export_trl", "gap_encode", "gap_decode", "read_trl_file", "state_checksum", "INDEX_FORMATS"]

log = logging.getLogger("ulstore.sync")

FORMAT_NAME = "sparse_weight_patch"
#: Index layouts :func:`export_trl` writes: legacy int32 ``.indices``, ``.idx`` int32 ("raw"), ``.idx`` gaps.
INDEX_FORMATS = ("indices", "raw", "gap_delta")
_STEP_FILE = re.compile(r"^step_(\d{6,})\.safetensors\Z")
_INT32_MAX = (1 << 31) - 1


def gap_encode(positions) -> np.ndarray:
    """Gap-code ascending flat positions: ``gap_k = i_k - i_{k-1} - 1`` with ``i_{-1} = -1``.

    Returns ``uint16`` gaps when every gap fits, else ``uint32``.

    Examples
    --------
    >>> gap_encode([0, 1, 5, 70000]).tolist(), gap_encode([0, 1, 5]).dtype.name
    ([0, 0, 3, 69994], 'uint16')
    >>> gap_decode(gap_encode([3, 4, 100])).tolist()
    [3, 4, 100]
    """
    idx = np.asarray(positions, dtype=np.int64).reshape(-1)
    if idx.size and (idx[0] < 0 or (np.diff(idx) <= 0).any()):
        raise InvalidInputError("positions must be non-negative and strictly ascending")
    gaps = np.diff(idx, prepend=-1) - 1
    if gaps.size and gaps.max() > 0xFFFFFFFF:
        raise InvalidInputError("a gap exceeds uint32")
    return gaps.astype(np.uint16 if not gaps.size or gaps.max() <= 0xFFFF else np.uint32)


def state_checksum(state: dict) -> str:
    """The ``checksum_sha256`` of a TRL file: hex SHA-256 of every tensor's raw little-endian C-order bytes, in
    sorted name order, nothing else (the TRL branch's convention: names, shapes and dtypes are not hashed)."""
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(words(np.ascontiguousarray(state[name])).data)
    return h.hexdigest()


def gap_decode(gaps) -> np.ndarray:
    """Inverse of :func:`gap_encode`: ``i_k = cumsum(gap + 1)_k - 1`` (int64)."""
    g = np.asarray(gaps)
    if g.dtype not in (np.dtype("<u2"), np.dtype("<u4")):
        raise InvalidInputError(f"gap-coded indices must be uint16 or uint32, got {g.dtype}")
    return np.cumsum(g.astype(np.int64) + 1) - 1


# -- reading TRL files ----------------------------------------------------------------


def read_trl_file(raw, key: str) -> tuple[str, dict, dict]:
    """Parse one TRL file: ``("anchor", {name: array}, metadata)`` or ``("delta", {name: (positions, values)}, metadata)``.

    Positions are int64 flat indices, checked ascending and non-negative (the
    parameter's size is checked when applied).
    """
    tensors, meta = loads(raw, lambda why: InvalidInputError(f"not a valid safetensors file: {why}", key=key))
    if meta.get("format", FORMAT_NAME) != FORMAT_NAME:
        raise InvalidInputError(f"header format is {meta['format']!r}, not {FORMAT_NAME!r}", key=key)
    is_delta = key.startswith("deltas/")
    if not is_delta:
        return "anchor", dict(tensors), meta
    encoding = meta.get("encoding")
    if encoding not in (None, "raw", "gap_delta"):
        raise InvalidInputError(f"index encoding {encoding!r} is not supported (only raw and gap_delta)", key=key)
    out = {}
    for k in tensors:
        for idx_suffix, val_suffix in ((".indices", ".values"), (".idx", ".val")):
            if k.endswith(val_suffix):
                name = k[: -len(val_suffix)]
                if name + idx_suffix not in tensors:
                    raise InvalidInputError(f"{k!r} has no {idx_suffix!r} partner", key=key)
                if name in out:
                    raise InvalidInputError(f"parameter {name!r} appears twice", key=key)
                out[name] = (_positions(tensors[name + idx_suffix], idx_suffix, encoding, key, name), tensors[k])
    covered = {n + s for n in out for s in (".indices", ".values", ".idx", ".val") if n + s in tensors}
    if covered != set(tensors):
        raise InvalidInputError(f"tensors {sorted(set(tensors) - covered)[:5]} are not index/value pairs", key=key)
    for name, (pos, val) in out.items():
        if val.ndim != 1 or pos.size != val.size:
            raise InvalidInputError(f"{pos.size} positions but {val.size} values", tensor=name, key=key)
        if pos.size and (pos[0] < 0 or (np.diff(pos) <= 0).any()):
            raise InvalidInputError("positions are not strictly ascending", tensor=name, key=key)
    return "delta", out, meta


def _positions(idx: np.ndarray, suffix: str, encoding, key: str, name: str) -> np.ndarray:
    if idx.ndim != 1:
        raise InvalidInputError("index tensor is not 1-d", tensor=name, key=key)
    gap_coded = suffix == ".idx" and (encoding == "gap_delta" or (encoding is None and idx.dtype.kind == "u"))
    if gap_coded:
        return gap_decode(idx)
    if idx.dtype != np.dtype("<i4"):
        raise InvalidInputError(f"absolute indices must be int32, got {idx.dtype}", tensor=name, key=key)
    return idx.astype(np.int64)


def _list_steps(bucket: ObjectStore, directory: str) -> dict[int, str]:
    out = {}
    for key in bucket.list(directory):
        m = _STEP_FILE.match(key.rsplit("/", 1)[-1])
        if m:
            out[int(m.group(1))] = key
    return out


def _apply_patch(state: dict, patch: dict, key: str) -> None:
    for name, (pos, val) in patch.items():
        if name not in state:
            raise InvalidInputError("delta names a parameter no anchor defined", tensor=name, key=key)
        dst = state[name]
        if val.dtype != dst.dtype:
            raise InvalidInputError(f"values are {val.dtype} but the parameter is {dst.dtype}", tensor=name, key=key)
        if pos.size and pos[-1] >= dst.size:
            raise InvalidInputError(f"position {pos[-1]} is out of range for {dst.size} elements", tensor=name, key=key)
        words(dst)[pos] = words(val)  # bits, never float arithmetic


def import_trl(
    src_url,
    dest_url,
    *,
    storage_options: dict | None = None,
    dest_storage_options: dict | None = None,
    anchor_every: int = DEFAULT_ANCHOR_EVERY,
    threads: int | None = None,
) -> dict:
    """Import a TRL ``anchors/`` + ``deltas/`` bucket into a sync store (a trajectory), one version per step.

    Steps are replayed in order: an anchor replaces the parameters it holds
    (earlier ones may omit unchanged parameters), a delta writes its values at
    its positions.  Each resulting state is published with
    :class:`~ulstore.sync.Publisher` as version ``step`` with metadata
    ``{"model_version": ...}`` from the file header.

    Parameters
    ----------
    src_url, dest_url : str
        The TRL bucket prefix and the sync store.
    storage_options, dest_storage_options : dict, optional
        fsspec options of each (``dest_storage_options`` defaults to ``storage_options``).
    anchor_every : int
        Anchor spacing of the sync store (independent of the TRL anchors).

    Returns
    -------
    dict
        ``versions`` (imported, ascending), ``anchors`` and ``deltas`` (files
        read), ``mismatches`` (steps where a TRL anchor disagreed with the
        replayed deltas; the anchor wins).

    Raises
    ------
    InvalidInputError
        A file is malformed, the first step is a delta, or a delta names an
        unknown parameter or out-of-range position.
    """
    src = _open.objects(src_url, storage_options)
    anchors, deltas = _list_steps(src, "anchors"), _list_steps(src, "deltas")
    steps = sorted(set(anchors) | set(deltas))
    if not steps:
        raise NotFoundError(f"no anchors/step_*.safetensors or deltas/step_*.safetensors under {src_url!r}")
    report: dict = {"versions": [], "anchors": len(anchors), "deltas": len(deltas), "mismatches": []}
    state: dict[str, np.ndarray] | None = None
    opts = storage_options if dest_storage_options is None else dest_storage_options
    with Publisher(dest_url, anchor_every=anchor_every, storage_options=opts, threads=threads) as pub:
        for step in steps:
            meta: dict = {}
            if step in deltas:
                _, patch, meta = read_trl_file(src.get(deltas[step]), deltas[step])
                if state is None:
                    raise InvalidInputError(f"step {step} is a delta but no anchor precedes it", key=deltas[step])
                replayed = {k: v.copy() for k, v in state.items()}
                _apply_patch(replayed, patch, deltas[step])
            else:
                replayed = None
            if step in anchors:
                _, full, meta = read_trl_file(src.get(anchors[step]), anchors[step])
                new = {k: v.copy() for k, v in (state or {}).items()}
                for name, arr in full.items():
                    new[name] = np.array(arr, copy=True)
                if replayed is not None and not _same(new, replayed):
                    report["mismatches"].append(step)
                    log.warning("TRL anchor of step %d differs from the replayed deltas; using the anchor", step)
                state = new
            else:
                state = replayed
            model_version = _int_or(meta.get("model_version"), step)
            pub.publish(step, state, metadata={"model_version": model_version})
            report["versions"].append(step)
    return report


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and np.array_equal(words(a[k]), words(b[k])) for k in a
    )


def _int_or(value, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


# -- export -------------------------------------------------------------------------


def export_trl(
    src_url,
    dest_url,
    *,
    index_format: str = "gap_delta",
    start: int | None = None,
    stop: int | None = None,
    storage_options: dict | None = None,
    dest_storage_options: dict | None = None,
    branch: str = "main",
    threads: int | None = None,
) -> dict:
    """Write versions of a sync store (the steps of ``branch``) as a TRL ``anchors/`` + ``deltas/`` bucket.

    Every version in ``[start, stop]`` gets ``deltas/step_<v>.safetensors``
    (the elements that differ from the previous exported version; none for the
    first), and each version carrying a snapshot, plus the first exported
    version, gets ``anchors/step_<v>.safetensors`` with *every* parameter.
    ``<v>`` is the version number.  Every file's header carries
    ``changed_params`` and ``checksum_sha256`` as the TRL branch defines them
    (see the module docstring): a loader written to that convention applies
    the parameters listed, then checks the SHA-256 of its whole state.

    Parameters
    ----------
    index_format : {"gap_delta", "raw", "indices"}
        ``gap_delta``: ``<name>.idx`` uint16 (uint32 fallback) gaps + ``<name>.val``;
        ``raw``: ``<name>.idx`` int32 + ``<name>.val``; ``indices``: the first
        format, ``<name>.indices`` int32 + ``<name>.values``.
    start, stop : int, optional
        Version range to export (default: the whole branch).

    Returns
    -------
    dict
        ``versions`` written, ``anchors`` (versions with an anchor file), ``bytes`` written.
    """
    if index_format not in INDEX_FORMATS:
        raise InvalidInputError(f"index_format must be one of {INDEX_FORMATS}, got {index_format!r}")
    traj = _open.trajectory(_open.objects(src_url, storage_options), "r", threads=threads)
    dest = _open.objects(dest_url, storage_options if dest_storage_options is None else dest_storage_options)
    if traj.head(branch) is None:
        raise NotFoundError(f"nothing is published in {src_url!r} on {branch!r}")
    chain = [
        i for i in reversed(traj.log(branch)) if (start is None or i.step >= start) and (stop is None or i.step <= stop)
    ]
    report: dict = {"versions": [], "anchors": [], "bytes": 0}
    previous = previous_mv = anchor = None  # the state, model_version and anchor of the last version written
    for info in chain:
        v = info.step
        state = traj.read(v)  # fresh C-contiguous arrays (0-d stay 0-d)
        _check_int32(state)
        mv = _int_or(info.metadata.get("model_version"), v)
        total = int(sum(a.size for a in state.values()))
        checksum = state_checksum(state)
        if previous is None or info.anchor_distance == 0:
            anchor = v
            meta = _meta(mv, previous_mv, anchor, sorted(state), total, total, checksum, sparse=False)
            report["bytes"] += _put(dest, f"anchors/step_{v:06d}.safetensors", state, meta)
            report["anchors"].append(v)
        if previous is not None:
            tensors, names, n_changed = _delta_tensors(previous, state, index_format)
            encoding = None if index_format == "indices" else index_format
            meta = _meta(mv, previous_mv, anchor, names, n_changed, total, checksum, sparse=True, encoding=encoding)
            report["bytes"] += _put(dest, f"deltas/step_{v:06d}.safetensors", tensors, meta)
        report["versions"].append(v)
        previous, previous_mv = state, mv
    traj.close()
    return report


def _check_int32(state: dict) -> None:
    for name, arr in state.items():
        if arr.size > _INT32_MAX + 1:
            raise InvalidInputError(
                "TRL indices are int32: tensors above 2**31 elements cannot be exported", tensor=name
            )


def _delta_tensors(before: dict, after: dict, index_format: str) -> tuple[dict, list, int]:
    """A delta file's tensors, the names of the parameters it changes (sorted) and how many elements."""
    tensors = {}
    names: list[str] = []
    n_changed = 0
    for name in sorted(after):
        cur = after[name].reshape(-1)
        old = before.get(name)
        if old is None or old.shape != after[name].shape or old.dtype != cur.dtype:
            pos = np.arange(cur.size, dtype=np.int64)  # new or reshaped: every element is "changed"
        else:
            pos = np.flatnonzero(words(cur) != words(old.reshape(-1)))
        if not pos.size:
            continue
        names.append(name)
        n_changed += pos.size
        values = cur[pos]
        if index_format == "indices":
            tensors[name + ".indices"], tensors[name + ".values"] = pos.astype(np.int32), values
        elif index_format == "raw":
            tensors[name + ".idx"], tensors[name + ".val"] = pos.astype(np.int32), values
        else:
            tensors[name + ".idx"], tensors[name + ".val"] = gap_encode(pos), values
    return tensors, names, n_changed


def _meta(model_version, previous_mv, anchor_step, names, n_changed, total, checksum, *, sparse, encoding=None) -> dict:
    n_params = len(names)
    meta = {
        "format": FORMAT_NAME,
        "version": "1",
        "sparse": str(bool(sparse)),
        "model_version": str(model_version),
        "prev_model_version": str(-1 if previous_mv is None else previous_mv),
        "anchor_step": str(anchor_step),
        "num_changed_params": str(n_params),
        "total_changed_elements": str(n_changed),
        "total_elements": str(total),
        "sparsity": repr(1.0 - n_changed / total if total else 0.0),
        "changed_params": json.dumps(names),
        "checksum_sha256": checksum,
    }
    if encoding is not None:
        meta["encoding"] = encoding
    return meta


def _put(dest: ObjectStore, key: str, tensors: dict, meta: dict) -> int:
    raw = dumps(tensors, meta)
    dest.put(key, raw)
    return len(raw)
