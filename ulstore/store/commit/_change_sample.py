"""What a new step changed against its parent, from a sample: the measured retry of a delta after anchors by cost.

After an anchor by cost, the cost policy predicts the next step's delta with the estimate that made the parent
an anchor (``_commit_plan._next_delta``), so a dense run anchors every step without encoding a delta each time.
A run that turns sparse (the learning rate drops; RL after a warm-up) would keep anchoring on that stale
estimate.  Before it does, :func:`sampled_delta_cost` looks at the new step itself: one whole chunk (the middle
one) of each of its :data:`SAMPLE_TENSORS` largest float tensors, compared word by word with the parent's values
(words, not floats: a NaN that stays the same is unchanged, a -0.0 that was +0.0 is a change), and prices the
delta those changes would make with the read-cost model (``_read_cost.py``), extrapolated to the step's float
bytes.  The commit tries the delta (its probe encodes and prices it, and still anchors if its read breaks the
bound) only if that estimate fits.

Cost: the parent is an anchor, so a sampled chunk is the kept parent's values (a training loop's usual case: a
compare of a few chunks) or one intra decode through the reader, at most :data:`SAMPLE_TENSORS` of them, against
the intra encode of every chunk an anchor makes.  The sample is a fixed function of the values (tensors by size,
then name; each one's largest piece, its middle chunk) and the estimate integer arithmetic: the same input gives
the same decision, kept parent or not, on any number of threads.
"""

from __future__ import annotations

import math

import numpy as np

from ...codec import SPARSE_ALWAYS_UP_TO, SPARSE_MAX_FRACTION, header_bound
from ...errors import TensorNotFoundError
from ..format._chunkcodec import ULPACK, codec_for
from ..format._read_cost import DENSE, PER_BLOB, SPARSE, blob_cost

__all__ = ["SAMPLE_TENSORS", "sampled_delta_cost"]

#: Float tensors (the largest) of which one chunk each is compared: a few chunk reads at most, whatever the model.
SAMPLE_TENSORS = 4
#: Parent tables looked up to find them (a tensor new or reshaped since the parent has nothing to compare).
_LOOKUPS = 4 * SAMPLE_TENSORS


def sampled_delta_cost(reader, kept, parent: int, arrays: dict, chunk_bytes: int, sparse: bool) -> int | None:
    """What a delta of ``arrays`` on ``parent`` would add to a read of it, in the read-cost model, from a sample.

    ``reader``: the trajectory's chunk reader; ``kept``: its kept step if this thread holds it (else None);
    ``chunk_bytes``: the trajectory's (how many chunks the unsampled bytes make); ``sparse``: whether the delta
    codes SPARSE chunks.  A sampled chunk that did not change adds nothing (the parent's entry is reused), one
    with at most 1/``SPARSE_MAX_FRACTION`` of its elements changed a SPARSE blob of about one word and one
    position byte per change, any other a dense delta.  Extrapolated to every float tensor: the blobs in the
    share of chunks that changed, the work per byte of the sample.  None: no float tensor of ``arrays`` has the
    parent's dtype and shape (nothing to compare, and nothing a delta would save).
    """
    floats = sorted(
        ((a.nbytes, name) for name, a in arrays.items() if a.size and codec_for(a.dtype) == ULPACK),
        key=lambda t: (-t[0], t[1]),
    )
    sampled = changed_chunks = sampled_bytes = work = 0
    for _, name in floats[:_LOOKUPS]:
        got = _sample(reader, kept, parent, name, arrays[name])
        if got is None:
            continue
        changed, elements, nbytes, ndim = got
        sampled += 1
        sampled_bytes += nbytes
        if changed:
            changed_chunks += 1
            work += _work(changed, elements, nbytes, arrays[name].dtype.itemsize, ndim, sparse)
        if sampled == SAMPLE_TENSORS:
            break
    if not sampled or not sampled_bytes:
        return None
    total_bytes = sum(n for n, _ in floats)
    total_chunks = sum(max(1, -(-n // chunk_bytes)) for n, _ in floats)
    return (changed_chunks * total_chunks * PER_BLOB) // sampled + (work * total_bytes) // sampled_bytes


def _sample(reader, kept, parent: int, name: str, arr: np.ndarray) -> tuple[int, int, int, int] | None:
    """``(changed elements, elements, bytes, ndim)`` of the middle chunk of ``name``'s largest piece at ``parent``
    against ``arr`` over the same box; None if the parent holds no such tensor in ``arr``'s dtype and shape."""
    try:
        pt = reader.tensor(parent, name)
    except TensorNotFoundError:
        return None
    if pt.dtype != arr.dtype or pt.shape != tuple(arr.shape) or not pt.pieces:
        return None
    j = max(range(len(pt.pieces)), key=lambda j: math.prod(pt.pieces[j].shape))  # the first of the largest
    p = pt.pieces[j]
    if not p.n:
        return None
    i = p.n // 2
    coord = tuple(int(c) for c in np.unravel_index(i, p.grid)) if p.grid else ()
    lo, hi = p.box(coord)
    new = np.asarray(arr[tuple(slice(a, b) for a, b in zip(lo, hi))])
    kp = kept.piece(name, arr.dtype, pt.shape, p.layout) if kept is not None else None
    old = kp.get(i, p.content[i].tobytes()) if kp is not None else None
    if old is None:  # (the parent is an anchor: one intra decode)
        old = reader.chunk(parent, name, coord, j, cache=False)
    word = np.dtype(f"u{arr.dtype.itemsize}")
    changed = int(np.count_nonzero(new.view(word) != np.asarray(old).reshape(new.shape).view(word)))
    return changed, new.size, new.nbytes, new.ndim


def _work(changed: int, elements: int, nbytes: int, itemsize: int, ndim: int, sparse: bool) -> int:
    """The modelled work (cost less the fixed per-blob part) of the delta blob of a chunk of ``elements``
    (``nbytes``) of which ``changed`` changed: SPARSE as the codec chooses it (``ulstore.codec.encode``), else dense.
    A SPARSE blob's length is put at a word and a byte a change (the residual and its position, rounded up)."""
    if sparse and (changed * SPARSE_MAX_FRACTION <= elements or elements <= SPARSE_ALWAYS_UP_TO):
        return blob_cost(header_bound(ndim) + changed * (itemsize + 1), nbytes, SPARSE) - PER_BLOB
    return blob_cost(nbytes, nbytes, DENSE) - PER_BLOB
