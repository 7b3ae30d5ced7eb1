"""The trajectory store: checkpoints as immutable, delta-coded, content-addressed Zarr steps.

:func:`open` returns a :class:`Trajectory`.  The tree, one way only::

    trajectory.py       open, settings; Trajectory: owns a reader, a committer, gc, delete, integrity
    _base.py            state, steps and refs every job stands on
    _pending.py         commits and deletes in flight (markers a delete and a commit both respect)

    format/             the on-storage format
      _layout.py        keys, names, chunk shapes
      _stepdoc.py       the step document (sealed JSON, the commit point)
      _chunk_tables.py  chunk tables: pieces, tensor tables, layouts; the content checksum
      _table_block.py   chunk tables as binary table blocks
      _packs.py         pack streams (writing) and coalesced range reads
      _chunkcodec.py    one chunk <-> one blob (ULPack or Zstd), BLAKE3-128 hashes
      _refs.py          refs (branches, tags) as append-only logs of sealed entries, moved by CAS

    commit/             the commit path
      _commit.py        commit, piece_writer, finalize: one piece writer + the finalizer
      _commit_input.py  checking what a commit is given (arrays, metadata, files); HEAD
      _commit_plan.py   parent, branch move, anchor or delta, the retry of an interrupted commit
      _piece_writer.py  the piece writer: hash, reuse, encode in a bounded window, append to packs
      _piece_columns.py a piece's columns as the writer fills them; PieceRecord
      _finalize.py      the finalizer: records -> tables, step document, ref

    read/               the read path
      _step_reader.py   reading: lazy zarr groups, whole tensors, boxes, files, info, log
      _chunk_reader.py  ChunkReader: chunks, boxes, whole tensors of any step, through decode plans
      _decode_plan.py   one request: the reference walk, then a job: fetch, decode (SPARSE chains in place), check
      _table_reader.py  TableReader: step documents, table blocks, files, bytes; their caches
      _lru.py           the byte-bounded LRU of the reader's caches
      _kept.py          the kept step (one materialised step, overwritten in place)
      _logical.py       read-only zarr Store presenting steps as plain arrays
      _missing.py       a tensor a reader names that the step lacks, with the closest names
      _change_feed.py   the change feed of a step against its parent
      _diff.py          diff: per tensor, what changed between two steps (only b's changed chunks decoded)

    maintenance/        gc, delete, integrity, upgrade
      _integrity.py     verify, inventory, stats
      _delete.py        delete (re-encoding dependants, re-parenting children)
      _gc.py            gc (drop and repack packs)
      _relocate.py      a step document with its bytes at new places (delete and gc)
      _upgrade.py       format 1 -> format 2 (``ulstore upgrade``), with a small legacy reader

Objects go through :class:`ulstore.core.objects.ObjectStore`.  The store
imports :mod:`ulstore.codec` and :mod:`ulstore.core`, never io, sync or the CLI.
"""

from ._base import MAIN
from .commit._piece_columns import PieceRecord
from .commit._piece_writer import PieceWriter
from .format._chunkcodec import codec_for, content_digest, decode_chunk
from .format._layout import check_ref_name, choose_chunks, tensor_name_problem
from .maintenance._integrity import Inventory
from .maintenance._upgrade import upgrade
from .read._change_feed import ChangeColumns, ChunkChange, FeedLayout
from .read._diff import TensorDiff
from .read._logical import LogicalStore
from .trajectory import HEAD, StepInfo, Trajectory, VerifyReport, open

__all__ = [
    "open",
    "upgrade",
    "Trajectory",
    "StepInfo",
    "VerifyReport",
    "Inventory",
    "TensorDiff",
    "HEAD",
    "PieceWriter",
    "PieceRecord",
    "ChunkChange",
    "ChangeColumns",
    "FeedLayout",
    "tensor_name_problem",
    "LogicalStore",
    # the door for the layers above (sync, dcp, io): the default branch, names, chunking, one chunk's codec
    "MAIN",
    "check_ref_name",
    "choose_chunks",
    "codec_for",
    "content_digest",
    "decode_chunk",
]
