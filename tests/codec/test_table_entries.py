"""Kernel ``table_entries`` (a table block's entry columns, read and checked in one pass) and its NumPy twin.

Both must give the offsets a plain loop gives (gaps undone per run of one pack,
in wrapping 64-bit sums) and the same status for every malformed column.
"""

from __future__ import annotations

import numpy as np
import pytest

import ulstore
from ulstore.codec._backend import kernels

BACKENDS = ulstore.available_backends()
MAX_DIM = 1 << 62


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


def run(backend, raw: bytes, total: int, n_packs: int = 4, pos: int = 5):
    out = np.full((4, total), -7, np.int64)
    return kernels(backend).table_entries(raw, pos, total, n_packs, MAX_DIM, out), out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("total", [0, 1, 2, 41, 1000])
def test_columns_and_offsets_are_what_a_plain_loop_reads(backend, total):
    rng = np.random.default_rng(total)
    ref = rng.integers(-1, 50, total)
    pack = np.sort(rng.integers(0, 4, total))  # runs of one pack, as a commit writes them
    gap = rng.integers(0, 3, total) * (rng.random(total) < 0.2)
    length = rng.integers(1, 1 << 20, total)
    status, out = run(backend, columns(ref, pack, gap, length), total)
    assert status == 0
    assert out[0].tolist() == ref.tolist() and out[1].tolist() == pack.tolist()
    assert out[2].tolist() == loop_offsets(pack.tolist(), gap.tolist(), length.tolist())
    assert out[3].tolist() == length.tolist()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("change", "status"),
    [
        (("ref", 1, -2), 1),
        (("pack", 2, 4), 1),  # n_packs is 4
        (("length", 0, MAX_DIM), 1),
        (("length", 1, (1 << 64) - 1), 1),
        (("gap", 0, -1), 2),  # a negative offset
        (("gap", 2, MAX_DIM - 10), 2),  # a blob that ends past MAX_DIM
        (("gap", 1, -(1 << 63)), 2),  # sums that wrap
        (("gap", 2, (1 << 63) - 1), 2),
        (("ref", 0, -2), 1),  # both: the entry's status wins, as the twin checks entries first
    ],
)
def test_every_malformed_column_has_the_same_status(backend, change, status):
    cols = {"ref": [0, 1, 2, 3], "pack": [0, 0, 1, 1], "gap": [0, 0, 5, 0], "length": [10, 20, 30, 40]}
    name, i, value = change
    cols[name][i] = value
    if change == ("ref", 0, -2):
        cols["gap"][1] = -100
    assert run(backend, columns(cols["ref"], cols["pack"], cols["gap"], cols["length"]), 4)[0] == status


@pytest.mark.parametrize("backend", BACKENDS)
def test_columns_past_the_end_of_the_bytes_are_refused(backend):
    raw = columns([0, 1], [0, 0], [0, 0], [3, 4])
    assert run(backend, raw, 2)[0] == 0
    assert run(backend, raw[:-1], 2)[0] == 3
    assert run(backend, raw, 3)[0] == 3
    assert run(backend, raw, 2, pos=6)[0] == 3
