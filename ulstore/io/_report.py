"""The storage report: raw vs stored bytes of every step and every tensor."""

from __future__ import annotations

import math

__all__ = ["storage_report"]


def storage_report(traj) -> dict:
    """Raw vs stored bytes of every step and every tensor.

    A blob is charged to the first step (in step order) whose manifest names
    it, and to that tensor; a chunk that reuses an earlier entry costs only
    its manifest line.  Manifests are charged to their step.

    Parameters
    ----------
    traj : Trajectory

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
    Built on :meth:`Trajectory.inventory`: every manifest is read and checked
    (canonical form and checksum) as for reading, the blobs are listed; no blob
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
    per_step: list[dict] = []
    per_tensor: dict[str, dict] = {}
    for s, m in inv.manifests.items():
        row = {
            "step": s,
            "parent": m.parent,
            "raw_bytes": 0,
            "blob_bytes": 0,
            "manifest_bytes": inv.manifest_bytes[s],
            "new_blobs": 0,
            "chunks": 0,
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
                if e.blob in charged:
                    continue
                charged.add(e.blob)
                size = inv.blob_bytes.get(e.blob, 0)
                row["blob_bytes"] += size
                row["new_blobs"] += 1
                tr["stored_bytes"] += size
        row["stored_bytes"] = row["blob_bytes"] + row["manifest_bytes"]
        _rates(row)
        per_step.append(row)
    tensors = sorted(per_tensor.values(), key=lambda r: -r["stored_bytes"])
    for r in tensors:
        _rates(r)
    total = {
        k: sum(r[k] for r in per_step)
        for k in ("raw_bytes", "stored_bytes", "blob_bytes", "manifest_bytes", "new_blobs", "chunks", "elements")
    }
    total["steps"] = len(per_step)
    total["unreferenced_bytes"] = sum(size for b, size in inv.blob_bytes.items() if b not in charged)
    _rates(total)
    return {"steps": per_step, "tensors": tensors, "total": total}


def _rates(row: dict) -> None:
    row["bits_per_weight"] = 8 * row["stored_bytes"] / row["elements"] if row["elements"] else 0.0
    row["ratio"] = row["raw_bytes"] / row["stored_bytes"] if row["stored_bytes"] else None
