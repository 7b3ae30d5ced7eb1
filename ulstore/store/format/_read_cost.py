"""The read-cost model behind anchor decisions: what reading a blob costs, in bytes fetched plus decode work.

A full read of a step fetches and decodes, for every chunk, the blobs of its
reference chain: the anchor's intra blob, then each delta in turn.  The model
prices one blob as

    cost = length                                  (bytes fetched)
         + DECODE_PER_BYTE * bytes it decodes to   (intra blobs, dense deltas, Zstd: a full decode)
         + APPLY_PER_BYTE * length                 (a SPARSE delta, applied in place to its reference's values)

A SPARSE delta's work grows with the elements it changes, and so does its
length (positions and residuals), so its length stands for its changes; a
full decode's work grows with the chunk, whatever changed.  Costs are
integers in units of about one byte fetched.

The weights were measured on the bench trajectories (``benchmarks/store.py
--only depth`` prints the calibration): one thread decodes an intra or dense
delta chunk at about 4-5x the time it takes to read as many bytes from a warm
local pack, and applies a SPARSE blob in about the time of a full decode of as
many bytes (see docs/performance.md).  On S3 fetches weigh more; the model
leans to the local case, where decode dominates a read.

A step's cost is its parent's plus its own new blobs' (an unchanged chunk
reuses the parent's entry and adds nothing; an anchor's cost is its own), so
it is kept in the step document (:class:`~._stepdoc.Anchoring`) and the next
commit decides anchor or delta without walking the chain.
"""

from __future__ import annotations

from ...codec import is_sparse_blob

__all__ = [
    "DECODE_PER_BYTE",
    "APPLY_PER_BYTE",
    "DEFAULT_ANCHOR_COST",
    "DEFAULT_ANCHOR_EVERY",
    "blob_cost",
    "cost_of",
]

#: Work of a full decode per byte of output, in bytes-fetched units.
DECODE_PER_BYTE = 4
#: Work of applying a SPARSE blob in place, per byte of blob.
APPLY_PER_BYTE = 4
#: The cost policy's default ``k``: a new anchor when reading the next step would cost more than k x reading
#: an anchor (2: the slowest full read of a chain stays within about 2x its anchor's).
DEFAULT_ANCHOR_COST = 2.0

#: Distance between anchors of the fixed-count policy (``anchor_every``) when none is given (trajectories made
#: before the cost policy store theirs), and the cost policy's fallback after a parent with no recorded cost.
DEFAULT_ANCHOR_EVERY = 16


def blob_cost(length: int, nbytes: int, sparse: bool) -> int:
    """The modelled cost of reading one blob of ``length`` bytes that decodes to ``nbytes`` (``sparse``: a SPARSE
    delta applied in place)."""
    return int(length) + (APPLY_PER_BYTE * int(length) if sparse else DECODE_PER_BYTE * int(nbytes))


def cost_of(blob, nbytes: int) -> int:
    """:func:`blob_cost` of the bytes of one blob (a SPARSE blob is recognised by its header)."""
    return blob_cost(len(memoryview(blob)), nbytes, is_sparse_blob(blob))
