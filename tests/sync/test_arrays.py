"""A follower's own state: one arena, on huge pages where Linux offers them."""

import mmap
import re
import sys

import numpy as np
import pytest

from tests.helpers.bits import assert_bits_equal
from ulstore.sync import Follower, Publisher
from ulstore.sync._arrays import HUGE_PAGE, Spec, allocate, arena


def _specs():
    return [
        Spec("a", (3, 5), np.dtype("<f4")),
        Spec("scalar", (), np.dtype("<i8")),
        Spec("b", (700_000,), np.dtype("<u2")),
        Spec("empty", (0, 4), np.dtype("<f2")),
        Spec("c", (1,), np.dtype("u1")),
    ]


def test_allocate_gives_zeroed_separate_arrays_of_each_spec():
    out = allocate(_specs())
    assert list(out) == [s.name for s in _specs()]
    for spec in _specs():
        arr, binding = out[spec.name]
        assert arr.shape == spec.shape and arr.dtype == spec.dtype and arr.flags.writeable
        assert arr.ctypes.data % 64 == 0 or arr.size == 0  # each on a cache line of its own
        assert not arr.any()
        assert binding.mirror.shape == (arr.size,) and (arr.size == 0 or np.shares_memory(binding.mirror, arr))
    # writing every byte of one leaves every other as it was
    for spec in _specs():
        out[spec.name][0].reshape(-1).view(np.uint8)[:] = 0xFF
        for other in _specs():
            if other.name != spec.name:
                assert not out[other.name][0].any(), (spec.name, other.name)
        out[spec.name][0].reshape(-1).view(np.uint8)[:] = 0


def test_arena_sizes_and_alignment():
    for n in (0, 1, HUGE_PAGE - 1, HUGE_PAGE, 3 * HUGE_PAGE + 17):
        a = arena(n)
        assert a.shape == (n,) and a.dtype == np.uint8 and a.flags.writeable and not a.any()
        a[:] = 7  # every byte is ours to write
        assert a.ctypes.data % 64 == 0 or n == 0
        if n >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
            assert a.ctypes.data % HUGE_PAGE == 0


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding ``address`` (Linux /proc/self/smaps)."""
    with open("/proc/self/smaps") as f:
        entries = re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", f.read())
    for entry in entries:
        lo, hi = (int(x, 16) for x in entry.split()[0].split("-"))
        if lo <= address < hi:
            return re.search(r"VmFlags:(.*)", entry).group(1).split()
    raise AssertionError("no mapping holds the address")


@pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"), reason="Linux only")
def test_a_followers_state_is_one_mapping_advised_huge_pages(tmp_path):
    rng = np.random.default_rng(0)
    state = {f"t{i}": rng.standard_normal(300_000).astype(np.float32) for i in range(4)}
    pub = Publisher(str(tmp_path))
    pub.publish(0, state)
    pub.close()
    f = Follower(str(tmp_path))
    f.bootstrap()
    try:
        bases = {id(_root(a)) for a in f.state.values()}
        assert len(bases) == 1  # one arena
        assert "hg" in _vm_flags(next(iter(f.state.values())).ctypes.data)  # madvise(MADV_HUGEPAGE)
        for k, v in state.items():
            assert_bits_equal(f.state[k], v, k)
    finally:
        f.close()


def _root(a: np.ndarray):
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a.base
