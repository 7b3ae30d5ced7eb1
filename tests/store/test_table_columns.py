"""A table block's entry columns, read and checked by the store (``_table_block._entries``).

The offsets must be what a plain loop reads (gaps undone per run of one pack, in
wrapping 64-bit sums), and every malformed column a TableError saying what is wrong.
"""

from __future__ import annotations

import numpy as np
import pytest

from ulstore.store.format._table_block import _MAX_DIM, TableError, _entries

BAD_ENTRY = "an entry names a bad reference, pack or length"
BAD_OFFSET = "an entry has a bad offset"


def columns(ref, pack, gap, length, *, lead: bytes = b"\x07" * 5) -> bytes:
    """``lead`` bytes, then the four little-endian columns as a table block stores them."""
    return lead + b"".join(
        np.asarray(c, dtype).tobytes() for c, dtype in ((ref, "<i8"), (pack, "<u4"), (gap, "<i8"), (length, "<u8"))
    )


def loop_offsets(pack, gap, length) -> list[int]:
    """The oracle: one entry at a time, sums wrapped to int64."""
    out = []
    for i in range(len(pack)):
        off = gap[i] if i == 0 or pack[i] != pack[i - 1] else out[-1] + length[i - 1] + gap[i]
        out.append((off + (1 << 63)) % (1 << 64) - (1 << 63))
    return out


@pytest.mark.parametrize("total", [0, 1, 2, 41, 1000])
@pytest.mark.parametrize("runs", ["sorted", "interleaved"])
def test_columns_and_offsets_are_what_a_plain_loop_reads(total, runs):
    rng = np.random.default_rng(total)
    ref = rng.integers(-1, 50, total)
    pack = rng.integers(0, 4, total)
    if runs == "sorted":  # runs of one pack, as a commit writes them
        pack = np.sort(pack)
    gap = rng.integers(0, 3, total) * (rng.random(total) < 0.2)
    length = rng.integers(1, 1 << 20, total)
    got = _entries(columns(ref, pack, gap, length), 5, total, 4)
    assert [c.dtype for c in got] == [np.dtype(np.int64)] * 4
    assert got[0].tolist() == ref.tolist() and got[1].tolist() == pack.tolist()
    assert got[2].tolist() == loop_offsets(pack.tolist(), gap.tolist(), length.tolist())
    assert got[3].tolist() == length.tolist()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("ref", 1, -2), BAD_ENTRY),
        (("pack", 2, 4), BAD_ENTRY),  # n_packs is 4
        (("length", 0, _MAX_DIM), BAD_ENTRY),
        (("length", 1, (1 << 64) - 1), BAD_ENTRY),
        (("gap", 0, -1), BAD_OFFSET),  # a negative offset
        (("gap", 2, _MAX_DIM - 10), BAD_OFFSET),  # a blob that ends past _MAX_DIM
        (("gap", 1, -(1 << 63)), BAD_OFFSET),  # sums that wrap
        (("gap", 2, (1 << 63) - 1), BAD_OFFSET),
        (("ref", 0, -2), BAD_ENTRY),  # both: the entry is named first
    ],
)
def test_every_malformed_column_is_refused(change, message):
    cols = {"ref": [0, 1, 2, 3], "pack": [0, 0, 1, 1], "gap": [0, 0, 5, 0], "length": [10, 20, 30, 40]}
    name, i, value = change
    cols[name][i] = value
    if change == ("ref", 0, -2):
        cols["gap"][1] = -100
    raw = columns(cols["ref"], cols["pack"], cols["gap"], cols["length"])
    with pytest.raises(TableError, match=message):
        _entries(raw, 5, 4, 4)


def test_sound_columns_are_read():
    ref, pack, off, length = _entries(columns([0, 1, 2, 3], [0, 0, 1, 1], [0, 0, 5, 0], [10, 20, 30, 40]), 5, 4, 4)
    assert off.tolist() == [0, 10, 5, 35] and pack.tolist() == [0, 0, 1, 1]
