"""The read-cost model behind anchor decisions: what reading a blob costs, in bytes fetched plus decode work.

A full read of a step fetches and decodes, for every chunk, the blobs of its
reference chain: the anchor's intra blob, then each delta in turn.  The model
prices one blob (one chunk entry) as

    cost = length                                   (bytes fetched)
         + PER_BLOB                                 (fixed work per blob: its table entry, plan, range, checks)
         + INTRA_PER_BYTE * bytes it decodes to     (an intra blob, or a Zstd one: a full decode)
         + DENSE_PER_BYTE * bytes it decodes to     (a dense delta: a full decode against its reference)
         + APPLY_PER_BYTE * length                  (a SPARSE delta, applied in place to its reference's values)

and a step's read adds :data:`PER_READ` once (opening the step: its
document, table directory and the set-up of the read), priced on its chain's
anchor.  A SPARSE delta's work grows with the elements it changes, and so
does its length (positions and residuals), so its length stands for its
changes; a full decode's work grows with the chunk, whatever changed.  Costs
are integers in units of about one byte fetched from a warm local pack; the
weights are fixed numbers (the same input always gives the same anchors, so
the same blobs).

How the weights were measured (``python benchmarks/store.py --only depth``
prints the calibration of its run, on both bench trajectories; CPU time
throughout, since on a shared machine wall time moves with the load): the
unit is the time to read one byte from a warm local file (one large read of a
step's blobs, min of 3).  ``INTRA_PER_BYTE`` is one thread's intra decode of
a step's chunks (``decode_many``, min of 3) per byte out, and
``APPLY_PER_BYTE`` its SPARSE apply in place (``apply_sparse``) per blob
byte, each divided by the unit.  The fixed terms come from full reads of the
stored RL trajectory (one step per depth, each from a new ``ulstore.open``,
min of 5): what each read takes beyond its blobs' modelled byte work, fitted
by least squares as ``PER_READ + PER_BLOB x blobs read``.  ``DENSE_PER_BYTE``
comes from dense reads the same way, with that ``PER_BLOB``: the slope
against the bytes its dense deltas decode to (the read path's figure: it
decodes the anchor's chunk, then the delta against it; above the kernel's,
which the bench prints too).  The constants below are those figures, rounded,
from the runs recorded in docs/performance.md ("Any step, any depth");
re-measure them when the read path changes.  Under load the least-squares split
of the fixed terms moves; what decides is the ratio the model gives a chain's
end against the measured one, so the constants are checked against full reads
of the stored RL trajectory at every depth and set about 0.1x above them.

Wall time: a read runs on its decode threads (one plan per thread, a batch's
chains walked once: ``_column_plan.column_plan``), and on two free cores its
wall time is about the main thread's CPU (it walks the chain and takes a part,
the other thread the other part).  The main thread's CPU grows with depth no
faster than the whole read's (2026-12-08, RL depth 20 against its anchor: main
thread 15.8 ms against 7.6, 2.08x; process CPU 2.13x), so pricing CPU time
bounds the wall ratio as well; the model prices work, never a core count
(the same input gives the same anchors on any machine).

A step's cost is its parent's plus its own blobs' (an entry it shares with
its parent adds nothing; an anchor's cost is its own plus ``PER_READ``), so
it is kept in the step document (:class:`~._stepdoc.Anchoring`) and the next
commit decides anchor or delta without walking the chain.  :func:`own_cost`
recomputes what a step's blobs add from its stored tables (what delete and
verify check the stored figures against).
"""

from __future__ import annotations

import math

from ...codec import is_sparse_blob

__all__ = [
    "INTRA_PER_BYTE",
    "DENSE_PER_BYTE",
    "APPLY_PER_BYTE",
    "PER_BLOB",
    "PER_READ",
    "DEFAULT_ANCHOR_COST",
    "DEFAULT_ANCHOR_EVERY",
    "HEADER_BYTES",
    "INTRA",
    "DENSE",
    "SPARSE",
    "blob_cost",
    "cost_of",
    "own_cost",
    "own_blobs",
    "kind_of",
]

# Measured 2026-12-08 01:52-02:02 UTC (load average 5-7 on the 2 shared cores: no quieter moment came), main at
# 0357705 (a chain walked once per read), CPU time throughout: `python benchmarks/store.py --only depth --depth-reps 3
# --depth-rounds 3 --no-s3` (its calibration lines) and full reads of the same stored RL trajectory in one process
# (min of 7-9, 12 steps at depths 0-25, least squares of CPU on blobs and SPARSE bytes).  A byte read from a warm
# local file 0.09-0.12 ns (the unit, ~0.105); an intra decode 2.4-3.0 ns per byte out (23-30 units); a SPARSE apply
# 11.7-13.1 ns per blob byte in the reads' fit, 14.8-17.1 in the kernel alone (112-162 units); per blob 9.2-10.7 us
# (88 000-102 000 units); an anchor's read 12.6-14.3 ms (120M-136M units: PER_READ is the rest, 30M-45M); a dense
# delta's read path 44-95 units (65 kept: every dense step is an anchor for any value above ~37).  Chosen so that
# the model is about 0.1x above the measured CPU ratio at the RL chains' ends (2.28x modelled where 2.12-2.14x was
# measured, at this run's chain of 20 links): a margin for the read bound, in CPU and on the main thread's path.
# With them the depth bench (four runs, 02:13-02:43, load 3.3-7.2) measured the RL chains' ends at 1.83-1.92x
# their anchor's CPU where the model says 1.98x.
#: Work of a full intra decode (or a Zstd blob's) per byte of output, in bytes-fetched units.
INTRA_PER_BYTE = 24
#: Work of a dense delta's decode against its reference, per byte of output.
DENSE_PER_BYTE = 65
#: Work of applying a SPARSE blob in place, per byte of blob.
APPLY_PER_BYTE = 145
#: Fixed work per blob read (its table entry, the plan's bookkeeping, the range, the content check).
PER_BLOB = 90_000
#: Fixed work of a read of one step (its document, table directory, the read's set-up): on the anchor.
PER_READ = 38_000_000
#: The cost policy's default ``k``: a new anchor when reading the next step would cost more than k x reading
#: an anchor (2: the slowest full read of a chain stays within about 2x its anchor's).
DEFAULT_ANCHOR_COST = 2.0

#: Distance between anchors of the fixed-count policy (``anchor_every``) when none is given (trajectories made
#: before the cost policy store theirs), and the cost policy's fallback after a parent with no recorded cost.
DEFAULT_ANCHOR_EVERY = 16

#: Bytes of a blob's start that tell a SPARSE blob from a dense one (:func:`ulstore.codec.is_sparse_blob`).
HEADER_BYTES = 16

#: The kinds of blob the model prices apart.
INTRA, DENSE, SPARSE = "intra", "dense", "sparse"


def blob_cost(length: int, nbytes: int, kind: str) -> int:
    """The modelled cost of reading one blob of ``length`` bytes that decodes to ``nbytes``; ``kind``:
    :data:`INTRA` (no reference), :data:`DENSE` (a delta decoded whole) or :data:`SPARSE` (applied in place).

    An integer (a fixed function of its inputs)."""
    n, b = int(length), int(nbytes)  # integers throughout: the same blob always costs the same
    if kind == SPARSE:
        work = APPLY_PER_BYTE * n
    elif kind == DENSE:
        work = DENSE_PER_BYTE * b
    elif kind == INTRA:
        work = INTRA_PER_BYTE * b
    else:
        raise ValueError(f"unknown blob kind {kind!r}")
    return n + PER_BLOB + work


def kind_of(blob, delta: bool) -> str:
    """The kind of a blob (from its header's first :data:`HEADER_BYTES`; ``delta``: coded against a reference)."""
    if not delta:
        return INTRA
    return SPARSE if is_sparse_blob(blob) else DENSE


def cost_of(blob, nbytes: int, delta: bool) -> int:
    """:func:`blob_cost` of the bytes of one blob (a SPARSE blob is recognised by its header)."""
    return blob_cost(len(memoryview(blob)), nbytes, kind_of(blob, delta))


def own_cost(tables: dict, packs, parent_tables: dict | None, parent_packs, headers) -> int:
    """What a step's blobs add to its read, recomputed from its stored tables: :func:`blob_cost` of each of
    :func:`own_blobs`.  An anchor's does not include :data:`PER_READ` (its caller adds it)."""
    return sum(blob_cost(*b) for b in own_blobs(tables, packs, parent_tables, parent_packs, headers))


def own_blobs(tables: dict, packs, parent_tables: dict | None, parent_packs, headers) -> list[tuple[int, int, str]]:
    """``(length, nbytes, kind)`` of the blobs a step's read adds to its parent's, from its stored tables
    (``_chunk_tables.TensorTable`` by name, pack numbers indexing ``packs``), as a commit prices them: every
    entry of an anchor (``parent_tables`` None), else every entry not at the same place as its parent's entry
    of the same chunk (a changed chunk, a new or reshaped tensor; the parent's pack numbers index
    ``parent_packs``).

    ``headers(locations)`` returns the first bytes (at least :data:`HEADER_BYTES`, or the whole blob) of the
    blobs at ``(pack id, offset, length)`` locations, in order: the delta entries' kinds.
    """
    entries: list[tuple[int, int, bool]] = []  # (length, nbytes, delta) of the entries the step adds
    where: list[tuple[str, int, int]] = []
    for name in sorted(tables):
        t = tables[name]
        pt = parent_tables.get(name) if parent_tables is not None else None
        same = pt is not None and pt.dtype == t.dtype and pt.shape == t.shape
        item = t.dtype.itemsize
        for p in t.pieces:
            pj = pt.find_piece(p.layout) if same and pt is not None else None
            pp = pt.pieces[pj] if pj is not None and pt is not None else None
            for i, coord in enumerate(p.coords()):
                loc = (packs[int(p.pack[i])], int(p.off[i]), int(p.length[i]))
                if pp is not None and (parent_packs[int(pp.pack[i])], int(pp.off[i]), int(pp.length[i])) == loc:
                    continue  # the parent's entry: its cost is in the parent's
                entries.append((loc[2], math.prod(p.region_shape(coord)) * item, bool(p.ref[i] >= 0)))
                where.append(loc)
    deltas = [(pid, off, min(n, HEADER_BYTES)) for (pid, off, n), e in zip(where, entries) if e[2]]
    got = iter(headers(deltas) if deltas else ())
    return [(n, nbytes, kind_of(next(got), True) if delta else INTRA) for n, nbytes, delta in entries]
