"""The storage report: raw vs stored bytes of every step and every tensor."""

from __future__ import annotations

import math

__all__ = ["storage_report"]


def storage_report(traj) -> dict:
    """Raw vs stored bytes of every step and every tensor.

    A blob is charged to the first step whose tables name it, taking each
    step's parent before the step (then step order): the step whose commit
    wrote it, even when a child is numbered below its parent.  A chunk that
    reuses an earlier entry costs only its table entry.  Step documents and table blocks are charged to their
    step (``manifest_bytes``), and so are the step's files.

    Parameters
    ----------
    traj : Trajectory

    Returns
    -------
    dict
        ``steps``: list of dicts ``step, parent, raw_bytes, stored_bytes,
        blob_bytes, manifest_bytes, new_blobs, chunks, resharded_chunks,
        elements, bits_per_weight, ratio`` (``resharded_chunks``: chunks
        delta-coded against a parent that stores their tensor in other pieces,
        e.g. a distributed save at another world size); ``tensors``: list of dicts ``name, dtype,
        raw_bytes, stored_bytes, elements, bits_per_weight, ratio``;
        ``total``: the sums (``stored_bytes`` excludes unreferenced pack
        bytes, which ``unreferenced_bytes`` counts).

    Notes
    -----
    Built on :meth:`Trajectory.inventory`: every step document and table
    block is read and checked as for reading, the packs are listed; no blob
    is fetched.

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
    inv = traj.inventory()
    charged: set[str] = set()
    rows: dict[int, dict] = {}
    per_tensor: dict[str, dict] = {}
    for s in _parents_first(inv.manifests):
        m = inv.manifests[s]
        row = {
            "step": s,
            "parent": m.parent,
            "raw_bytes": 0,
            "blob_bytes": 0,
            "manifest_bytes": inv.manifest_bytes[s],
            "new_blobs": 0,
            "chunks": 0,
            "resharded_chunks": _resharded(traj, s, m.parent, inv),
            "elements": 0,
        }
        for name, t in m.tensors.items():
            n = math.prod(t.shape)
            tr = per_tensor.setdefault(
                name,
                {"name": name, "dtype": t.dtype.name, "raw_bytes": 0, "stored_bytes": 0, "elements": 0, "steps": 0},
            )
            tr["raw_bytes"] += n * t.dtype.itemsize
            tr["elements"] += n
            tr["steps"] += 1
            row["raw_bytes"] += n * t.dtype.itemsize
            row["elements"] += n
            for e in t.entries:
                row["chunks"] += 1
                for b in e.blobs:  # its blob and, if it has one, its snapshot
                    if b in charged:
                        continue
                    charged.add(b)
                    size = inv.blob_bytes.get(b, 0)
                    row["blob_bytes"] += size
                    row["new_blobs"] += 1
                    tr["stored_bytes"] += size
        for b in m.files:  # files kept with the step (config, tokenizer): charged to the step
            if b not in charged:
                charged.add(b)
                row["blob_bytes"] += inv.blob_bytes.get(b, 0)
        row["stored_bytes"] = row["blob_bytes"] + row["manifest_bytes"]
        _rates(row)
        rows[s] = row
    per_step = [rows[s] for s in inv.manifests]  # step order
    tensors = sorted(per_tensor.values(), key=lambda r: -r["stored_bytes"])
    for r in tensors:
        _rates(r)
    total = {
        k: sum(r[k] for r in per_step)
        for k in (
            "raw_bytes",
            "stored_bytes",
            "blob_bytes",
            "manifest_bytes",
            "new_blobs",
            "chunks",
            "resharded_chunks",
            "elements",
        )
    }
    total["steps"] = len(per_step)
    total["unreferenced_bytes"] = inv.unreferenced_bytes
    _rates(total)
    return {"steps": per_step, "tensors": tensors, "total": total}


def _parents_first(manifests: dict) -> list[int]:
    """The steps of ``manifests`` (in step order), each after its parent: the order their blobs were written."""
    out: list[int] = []
    done: set[int] = set()
    for s in manifests:
        chain: list[int] = []
        seen: set[int] = set()
        x = s
        while x is not None and x in manifests and x not in done and x not in seen:  # (seen: crafted loops)
            chain.append(x)
            seen.add(x)
            x = manifests[x].parent
        for y in reversed(chain):
            done.add(y)
            out.append(y)
    return out


def _resharded(traj, step: int, parent, inv) -> int:
    """Delta-coded chunks of ``step`` whose piece the parent does not have (references assembled from other pieces)."""
    if parent is None or parent not in inv.manifests:
        return 0
    pm = inv.manifests[parent]
    other = {}
    for name, t in inv.manifests[step].tensors.items():
        pt = pm.tensors.get(name)
        if pt is None or pt.shape != t.shape or pt.dtype != t.dtype:
            continue
        mine, theirs = traj.pieces(step, name), set(traj.pieces(parent, name))
        moved = {j for j, layout in enumerate(mine) if layout not in theirs}
        if moved:
            other[name] = moved
    if not other:
        return 0
    return sum(1 for c in traj.changes(step, names=list(other)) if c.kind == "delta" and c.piece in other[c.tensor])


def _rates(row: dict) -> None:
    row["bits_per_weight"] = 8 * row["stored_bytes"] / row["elements"] if row["elements"] else 0.0
    row["ratio"] = row["raw_bytes"] / row["stored_bytes"] if row["stored_bytes"] else None
