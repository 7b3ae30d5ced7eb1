"""A batch of whole chunks whose reference chains are co-located SPARSE deltas, planned a table block at a time.

The general plan (:class:`~._decode_plan._Plan`) walks every chunk of every step of a
chain as a node of its own: table look-ups, a record, checks, a place in the waves.  On
a long chain of SPARSE deltas that fixed work per chunk and step cost several times the
apply itself (issue 35: ~2 ms a step of 30 chunks, the apply ~0.3 ms).  When every step
of the chain holds the batch's tensors in table blocks of one layout (the same tensor
headers: what a trajectory of one model writes), a chunk is the same column of each
block along its chain, so :func:`column_plan` walks the chain with the blocks' columns
(one NumPy gather per block and step, not one look-up per chunk) and the waves are the
chain's levels: the roots decoded whole (into the caller's arrays where they fit), then
each level's SPARSE deltas applied in place by one job per dtype.  The checks are the
general plan's: each blob's own (CRC, reference word sum, target checksum) in the
kernel, and the content hash of every chunk returned.

Anything else (a dense delta, a chain the step document does not list, another layout,
a kept step or cache to consult, damage) is the general plan's: :func:`column_plan`
returns it instead, with the blobs already fetched, so no request is made twice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ...codec import ApplyPlan, content_sum, is_sparse_blob, target_meta
from ...errors import CorruptBlobError
from ..format._chunkcodec import ULPACK, content_digest, decode_chunk
from ..format._layout import chunk_grid, pack_key

if TYPE_CHECKING:
    from ..format._table_block import Block
    from ._table_reader import TableReader

__all__ = ["ColumnPlan", "column_plan"]


class _Other(Exception):
    """The batch is not a chain of co-located SPARSE deltas: the general plan reads it."""


def _layout(block: Block) -> tuple:
    """What must match for a column to be the same chunk in two blocks: the tensors' headers, snapshot flags aside."""
    assert block.heads is not None
    return tuple(
        (name, dtype, codec, shape, tuple((o, s, c, a, b) for o, s, c, _, a, b in pieces))
        for name, dtype, codec, shape, pieces in block.heads.tensors
    )


class _Layout:
    """The layout of a chain's first block, which each ancestor's block must have (_Other if not)."""

    def __init__(self, block: Block) -> None:
        self.first = block
        self._key: tuple | None = None

    def block(self, reader: TableReader, entry) -> Block:
        """The block of the ancestor directory ``entry`` that holds the first block's tensors, checked."""
        assert self.first.heads is not None
        bi = entry.table_for(self.first.heads.tensors[0][0])
        block = reader.block_in(entry, bi) if bi is not None else None
        if block is None or block.heads is None:
            raise _Other
        if block.heads is not self.first.heads:  # (the same header bytes parse to the same object: mostly so)
            if self._key is None:
                self._key = _layout(self.first)
            if _layout(block) != self._key:
                raise _Other
        return block


def _word(dtype: np.dtype) -> np.dtype:
    """The unsigned words an apply job reads an array of ``dtype`` as."""
    return np.dtype(f"<u{dtype.itemsize}")


def _index(coord: tuple, grid: tuple) -> int | None:
    """Position of chunk ``coord`` in C order of ``grid`` (None: outside it)."""
    if len(coord) != len(grid):
        return None
    i = 0
    for c, n in zip(coord, grid):
        if not 0 <= c < n:
            return None
        i = i * n + c
    return i


class ColumnPlan:
    """One batch of whole chunks (materialize targets), each chain a column of its blocks; what
    :class:`~._decode_plan._Job` runs (the protocol of :class:`~._decode_plan._Plan`: ``start``, then per
    wave ``begin_wave``, ``door_args``/``took`` or ``one_by_one``, ``apply_plans``/``applied_wave``)."""

    def __init__(self, reader: TableReader, batch: list) -> None:
        self.r = reader
        self.batch = batch
        n = len(batch)
        self.step = [0] * n
        self.name = [""] * n
        self.dtype: list = [None] * n
        self.codec = [ULPACK] * n
        self.shape: list = [()] * n
        self.content = [b""] * n
        self.chain: list[list] = [[] for _ in range(n)]  # locations: the chunk's own first, its root last
        self.blobs: list[list] = []
        self.values: list = [None] * n
        self.sums: list = [None] * n
        self.out: list = [None] * n  # the caller's array a chunk decodes into, when it fits
        self.words: list = [None] * n  # a chain's value as the apply job's words (a view of it)
        self.metas: list = [None] * n
        self._level = 0

    def part(self, members: list[int]) -> ColumnPlan:
        """A plan of chunks ``members`` of this one's batch, walked and fetched (their chains, blobs and targets):
        what one thread runs while others run the other parts."""
        p = ColumnPlan(self.r, [self.batch[g] for g in members])
        for name in ("step", "name", "dtype", "codec", "shape", "content", "chain", "blobs", "out"):
            whole = getattr(self, name)
            setattr(p, name, [whole[g] for g in members])
        return p

    # -- the walk, over the blocks' columns --

    def walk(self) -> None:
        """Each chunk's chain of locations, a block per step: _Other if the general plan must read the batch."""
        groups: dict[tuple, list[int]] = {}
        for g, (node, dest, region, kp, _) in enumerate(self.batch):
            if dest is None or kp is not None:
                raise _Other
            step, name = node[0], node[1]
            self.step[g], self.name[g] = step, name
            view = dest[region] if region else dest
            self.shape[g] = view.shape
            if view.flags.c_contiguous and view.flags.writeable:
                self.out[g] = view
            groups.setdefault((step, self.r.doc(step).table_for(name)), []).append(g)
        for step in {s for s, _ in groups}:  # the chains' table blocks in one batch (cached: nothing read)
            self.r.prefetch(step, sorted({self.name[g] for (s, _), gs in groups.items() if s == step for g in gs}))
        for (step, bi), members in groups.items():
            if bi is None:
                raise _Other
            self._walk_block(step, bi, members)

    def _walk_block(self, step: int, bi: int, members: list[int]) -> None:
        """The chains of ``members`` (chunks of table block ``bi`` of ``step``), a level at a time."""
        d = self.r.doc(step)
        block = self.r.block_in(d, bi)
        cols, ulpack = self._columns(block, members)
        positions = d.chain_positions
        who = np.array(members, np.int64)
        layout = _Layout(block)
        # step by step up the chain (position 0 is the step itself): the chunks that reach a step from any
        # later one are one gather there
        pending: dict[int, list] = {0: [d, block, [np.arange(len(members))]]}
        while pending:
            here = min(pending)
            dd, b, parts = pending.pop(here)
            idx = parts[0] if len(parts) == 1 else np.concatenate(parts)
            refs = self._level_locations(dd, b, cols[idx], who[idx])
            more = refs >= 0
            if not more.any():
                continue
            if not ulpack[idx[more]].all():
                raise _Other  # a zstd chunk naming a reference: the general plan's error
            steps = set(refs[more].tolist())
            for ref in steps:
                hit = positions.get(ref)
                if hit is None or hit[0] <= here:  # beyond a cut chain, or damage: the general plan
                    raise _Other
                k, entry = hit
                if k not in pending:
                    pending[k] = [entry, layout.block(self.r, entry), []]
                pending[k][2].append(idx[more] if len(steps) == 1 else idx[more & (refs == ref)])

    def _columns(self, block: Block, members: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The column of each of ``members`` in ``block`` and whether it is a ULPack chunk; their dtypes, codecs
        and content hashes noted."""
        if block.heads is None:
            raise _Other
        tensors = {t[0]: t for t in block.heads.tensors}
        cols = np.empty(len(members), np.int64)
        ulpack = np.empty(len(members), bool)
        for k, g in enumerate(members):
            node = self.batch[g][0]
            t = tensors.get(self.name[g])
            if t is None or not 0 <= node[2] < len(t[4]):
                raise _Other  # no such tensor or piece: the general plan's error
            _, dtype, codec, _, pieces = t
            _, shape, chunks, _, first, end = pieces[node[2]]
            i = _index(node[3], chunk_grid(shape, chunks))
            if i is None or not 0 <= first + i < end:
                raise _Other
            cols[k], ulpack[k] = first + i, codec == ULPACK
            self.dtype[g], self.codec[g] = dtype, codec
            self.content[g] = block.content[first + i].tobytes()
        return cols, ulpack

    def _level_locations(self, d, block: Block, cols: np.ndarray, who: np.ndarray) -> np.ndarray:
        """Append each chunk's blob at this step to its chain (a snapshot, where there is one, ends it); the
        steps they are coded against (-1: the chain ends here)."""
        pack, off, length, refs = block.pack[cols], block.off[cols], block.length[cols], block.ref[cols]
        if block.snap is not None:
            snap = block.snap[cols]
            has = snap[:, 0] >= 0
            if has.any():
                pack, off, length = (np.where(has, snap[:, k], x) for k, x in enumerate((pack, off, length)))
                refs = np.where(has, -1, refs)
        packs = d.packs
        for g, p, o, n in zip(who.tolist(), pack.tolist(), off.tolist(), length.tolist()):
            self.chain[g].append((packs[p], o, n))
        return refs

    # -- the run (what _Job.run calls) --

    def fetch(self) -> list:
        """Every blob of every chain, in one coalesced fetch; the locations and bytes, in order."""
        locs = [loc for chain in self.chain for loc in chain]
        got = self.r.fetch(locs)
        at = 0
        for chain in self.chain:
            self.blobs.append(got[at : at + len(chain)])
            at += len(chain)
        return list(zip(locs, got))

    def sparse_chains(self) -> bool:
        """Whether every delta of every chain is a SPARSE blob (what is applied in place)."""
        return all(is_sparse_blob(b) for blobs in self.blobs for b in blobs[:-1])

    def start(self) -> list[list[int]]:
        """The waves: every root, then each level of deltas above them (the deepest chains' first)."""
        depth = [len(c) - 1 for c in self.chain]
        most = max(depth, default=0)
        return [list(range(len(self.chain)))] + [[g for g, n in enumerate(depth) if n >= k] for k in range(1, most + 1)]

    def begin_wave(self, wave: list[int]) -> tuple[list[int], list[int]]:
        """``(roots to decode whole, deltas to apply in place)``; Zstd chunks are decoded here."""
        level, self._level = self._level, self._level + 1
        if level:
            return [], wave
        whole = []
        for g in wave:
            if self.codec[g] == ULPACK:
                whole.append(g)
            else:
                self._root(g, self.out[g])
        return whole, []

    def _root_out(self, g: int) -> np.ndarray:
        return self.out[g] if self.out[g] is not None else np.empty(self.shape[g], self.dtype[g])

    def door_args(self, nodes: list[int]) -> tuple[list, list, list, list]:
        """``(blobs, references, outs, shapes)`` of the roots ``nodes`` for :func:`~ulstore.codec.decode_blobs`."""
        return (
            [self.blobs[g][-1] for g in nodes],
            [None] * len(nodes),
            [self._root_out(g) for g in nodes],
            [self.shape[g] for g in nodes],
        )

    def took(self, nodes: list[int], outs: list, sums: list) -> None:
        """The roots :func:`~ulstore.codec.decode_blobs` decoded: a chain's start, or a value to check."""
        for g, value, s in zip(nodes, outs, sums):
            self._have(g, value, s)

    def one_by_one(self, nodes: list[int]) -> None:
        """Decode the roots ``nodes`` one at a time (:func:`decode_chunk`: the error names the blob's pack)."""
        for g in nodes:
            self._root(g, self.out[g])

    def _root(self, g: int, out) -> None:
        loc = self.chain[g][-1]
        value = decode_chunk(
            self.blobs[g][-1], None, self.codec[g], self.dtype[g], self.shape[g], key=pack_key(loc[0]), out=out
        )
        self._have(g, value, None)

    def _have(self, g: int, value: np.ndarray, s) -> None:
        if len(self.chain[g]) == 1:
            self._check(g, value)
        else:  # a chain goes on from here, in place: what its first SPARSE delta checks
            if not (value.flags.c_contiguous and value.flags.writeable):
                value = value.copy()
            s = content_sum(value) if s is None else s
        self.values[g], self.sums[g] = value, s
        if len(self.chain[g]) > 1:  # what each level's apply job is given: the words, the blobs' target shape
            self.words[g] = value.reshape(-1).view(_word(value.dtype))
            self.metas[g] = target_meta(value.dtype, self.shape[g])

    def _blob(self, g: int):
        """The delta of chunk ``g`` at the current level (its chain's, counted from the root)."""
        return self.blobs[g][len(self.chain[g]) - self._level]

    def apply_plans(self, nodes: list[int]) -> list[ApplyPlan]:
        """One :class:`~ulstore.codec.ApplyPlan` per dtype (``nodes`` put in the plans' order)."""
        by_dtype: dict = {}
        for g in nodes:
            by_dtype.setdefault(self.dtype[g], []).append(g)
        nodes[:] = [g for grp in by_dtype.values() for g in grp]
        words, sums, metas = self.words, self.sums, self.metas
        return [
            ApplyPlan.of(
                dtype,
                [self._blob(g) for g in grp],
                [words[g] for g in grp],
                [sums[g] for g in grp],
                metas=[metas[g] for g in grp],
            )
            for dtype, grp in by_dtype.items()
        ]

    def applied_wave(self, nodes: list[int], done: list | None) -> None:
        """What :func:`~ulstore.codec.apply_sparse` did (None: nothing; then each delta is decoded whole, for
        the precise error); the chains ending at this level checked."""
        level = self._level - 1
        for k, g in enumerate(nodes):
            value = self.values[g]
            if done is None:
                loc = self.chain[g][len(self.chain[g]) - 1 - level]
                value[...] = decode_chunk(
                    self._blob(g), value, ULPACK, self.dtype[g], self.shape[g], key=pack_key(loc[0])
                )
                self.sums[g] = content_sum(value)
            else:
                self.sums[g] = done[k].content_sum
            if len(self.chain[g]) - 1 == level:
                self._check(g, value)

    def _check(self, g: int, value: np.ndarray) -> None:
        """The chunk's content hash: a wrong value is never returned."""
        if content_digest(value) != self.content[g]:
            pid, at, _ = self.chain[g][0]
            chain = " (the end of a chain of SPARSE deltas applied in place)" if len(self.chain[g]) > 1 else ""
            raise CorruptBlobError(
                f"chunk at byte {at} decodes to values that fail its content hash{chain}",
                step=self.step[g],
                tensor=self.name[g],
                key=pack_key(pid),
            )

    def place(self) -> None:
        """The values where the targets want them (those not decoded there)."""
        for g, (_, dest, region, _, _) in enumerate(self.batch):
            value = self.values[g]
            if value is self.out[g]:
                continue
            if region:
                dest[region] = value
            else:
                dest[...] = value


def column_plan(reader: TableReader, batch: list, general, cut=None) -> list:
    """The plans of a materialize ``batch``, one per part of ``cut(batch)`` (the batch's targets cut into lists,
    in order: one plan per decode thread; default: one part): :class:`ColumnPlan` parts when its chains are
    co-located SPARSE deltas (walked and fetched once for the whole batch), else ``general(part)`` for each
    (handed the blobs fetched already, if any)."""
    parts = [batch] if cut is None else cut(batch)
    plan = ColumnPlan(reader, batch)
    try:
        plan.walk()
    except _Other:
        return [general(part) for part in parts]
    got = plan.fetch()
    if plan.sparse_chains():
        if len(parts) == 1:
            return [plan]
        at = {id(t): g for g, t in enumerate(batch)}
        return [plan.part([at[id(t)] for t in part]) for part in parts]
    have = dict(got)
    others = [general(part) for part in parts]
    for other in others:
        other.have = have  # (read only: shared by the parts)
    return others
