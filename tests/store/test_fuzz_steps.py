"""Crafted step documents and chunk tables: committed data or a named error, never anything else.

Issue 14 asks for a property test over manifests read from untrusted storage.  Each
example takes a real trajectory (a tiny model fine-tuned for real, bf16, several
chunks per tensor, an anchor and deltas), rewrites one to three steps as a crafted
store would (every checksum recomputed, so only the reader's own checks stand in
the way), then reads every step whole, lazily slices a tensor of each, lists the
log and runs ``verify``.  Every operation must either return exactly the committed
data or raise a :class:`~ulstore.errors.UlstoreError`; it must finish within a time
limit, allocate a bounded amount of memory, and open nothing outside the root.
"""

from __future__ import annotations

import os
import shutil
import struct
import sys
import threading
import tracemalloc

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import ulstore  # noqa: E402
from tests.helpers import lanes  # noqa: E402
from tests.helpers.bits import assert_bits_equal  # noqa: E402
from tests.helpers.store import CHUNK, rewrite_step, states_bf16  # noqa: E402
from ulstore.errors import UlstoreError  # noqa: E402

_STEPS = 4  # steps 0..3 with anchor_every=3: 0 and 3 are anchors, 1 and 2 deltas
_TIME_LIMIT = 60.0  # seconds for all the reads of one example (a hang fails, it does not stall)
_MEMORY_LIMIT = 64 << 20  # bytes: the committed trajectory is ~0.3 MB raw per step

# -- what a crafted store may hold -----------------------------------------------------------

_HUGE = st.sampled_from([2**31, 2**40, 2**62, 2**63 - 1])
_SMALL = st.integers(-3, 8)
_INT = st.one_of(_SMALL, _HUGE, st.sampled_from([-(2**63)]))


@st.composite
def _table_edit(draw):
    """One edit of a tensor's chunk table: a column entry, a shape, a piece layout or a snapshot."""
    what = draw(st.sampled_from(["ref", "pack", "off", "length", "content", "snap", "shape", "chunks", "dtype"]))
    return what, draw(st.integers(0, 10**6)), draw(_INT), draw(st.binary(min_size=16, max_size=16))


def _apply_table_edits(edits, steps):
    def mutate(tables, append):
        names = sorted(tables)
        for what, pick, value, raw in edits:
            t = tables[names[pick % len(names)]]
            p = t.pieces[pick % len(t.pieces)]
            i = pick % p.n if p.n else 0
            if what == "ref":  # a cycle, a future step, itself, a missing step, a huge number
                p.ref[i] = value if value not in (0, 1, 2, 3) else steps[value % len(steps)]
            elif what == "pack":
                p.pack[i] = value
            elif what == "off":
                p.off[i] = value
            elif what == "length":
                p.length[i] = value
            elif what == "content":
                p.content[i] = np.frombuffer(raw, np.uint8)
            elif what == "snap":  # point a snapshot at a blob: another chunk's, a fresh garbage one or nowhere
                snap = p.snap if p.snap is not None else np.full((p.n, 3), -1, np.int64)
                if value % 3 == 0:
                    snap[i] = (p.pack[(i + 1) % p.n], p.off[(i + 1) % p.n], p.length[(i + 1) % p.n])
                elif value % 3 == 1:
                    snap[i] = append(raw * 4)
                else:
                    snap[i] = (value, value, value)
                p.snap = snap
            elif what == "shape":
                dims = list(t.shape)
                if dims:
                    dims[pick % len(dims)] = value
                    t.shape = tuple(dims)
            elif what == "chunks":
                dims = list(p.chunks)
                if dims:
                    dims[pick % len(dims)] = value
                    p.chunks = tuple(dims)
            elif what == "dtype":
                t.dtype = np.dtype([np.float32, np.float16, np.int8, np.uint64][pick % 4])

    return mutate


_BODY_FIELDS = ["parent", "anchor_distance", "step", "packs", "tables", "files", "parent_content", "metadata"]


@st.composite
def _body_edit(draw):
    """One edit of a step document's fields (its checksum is recomputed afterwards)."""
    return draw(st.sampled_from(_BODY_FIELDS)), draw(_INT), draw(st.integers(0, 10**6))


def _apply_body_edits(edits, step):
    def body(b):
        for field, value, pick in edits:
            if field == "parent":  # itself, a child (a cycle), a missing step, a huge one, none
                b["parent"] = [step, step + 1, 99, value, None][pick % 5]
            elif field in ("anchor_distance", "step"):
                b[field] = value
            elif field == "packs" and b["packs"]:
                b["packs"] = [
                    b["packs"] + b["packs"][:1],  # a duplicate
                    ["../" * 4 + "secret"],
                    ["0" * 32],  # well-formed, absent
                    b["packs"][::-1],  # reordered: every index now names another pack
                ][pick % 4]
            elif field == "tables" and b["tables"]:
                entry = list(b["tables"][pick % len(b["tables"])])
                entry[2 + pick % 3] = value  # pack index, offset or length
                b["tables"][pick % len(b["tables"])] = entry
            elif field == "files":
                b["files"] = {["../x", "config.json", ""][pick % 3]: [0, value, 8, 8, "0" * 32]}
            elif field == "parent_content":
                b["parent_content"] = [None, "f" * 32, "x"][pick % 3]
            elif field == "metadata":
                b["metadata"] = {"nested": {"a": [value] * 3}}

    return body


# -- the trajectory every example starts from --------------------------------------------------


class _Pristine(tuple):
    """(directory, states); a short repr, for hypothesis's reports."""

    def __repr__(self) -> str:
        return f"<trajectory of {_STEPS} steps in {self[0]}>"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    base = tmp_path_factory.mktemp("fuzz-steps")
    states = states_bf16(_STEPS)[:_STEPS]
    traj = ulstore.open(str(base / "t"), mode="w", chunk_bytes=CHUNK, anchor_every=3)
    for s, state in enumerate(states):
        traj.commit(s, state)
    return _Pristine((base, states))


class _OutsideRoot:
    """An audit hook recording every file opened under ``watch`` but outside ``root`` (and any device)."""

    active: _OutsideRoot | None = None

    def __init__(self, watch: str, root: str):
        self.watch, self.root, self.seen = watch, root, []

    @classmethod
    def hook(cls, event, args):
        me = cls.active
        if me is None or event != "open" or not args or not isinstance(args[0], (str, bytes, os.PathLike)):
            return
        path = os.path.abspath(os.fsdecode(args[0]))
        if path.startswith("/dev/") or (path.startswith(me.watch) and not path.startswith(me.root + os.sep)):
            me.seen.append(path)


sys.addaudithook(_OutsideRoot.hook)


def _check(got, want, what):
    """``got`` is exactly ``want`` (dtype, shape and every bit), else fail naming ``what``."""
    assert_bits_equal(got, want, f"{what}: a wrong value was returned")


def _read_everything(url, states):
    """Every read a user can make; each returns committed data or raises a named error."""
    outcomes = []

    def attempt(what, fn):
        try:
            fn()
            outcomes.append((what, "ok"))
        except UlstoreError as e:
            outcomes.append((what, type(e).__name__))

    def whole(s):
        got = ro.read(s)
        assert set(got) == set(states[s]), f"step {s}: wrong tensor names returned"
        for name, want in states[s].items():
            _check(got[name], np.asarray(want), f"read({s})[{name!r}]")

    def lazy(s):
        name = sorted(states[s])[s % len(states[s])]
        want = np.asarray(states[s][name])
        box = tuple(slice(n // 3, n // 3 + 5) for n in want.shape)
        _check(ro[s][name][box], want[box], f"traj[{s}][{name!r}][{box}]")

    try:
        ro = ulstore.open(url, mode="r")
    except UlstoreError as e:
        return [("open", type(e).__name__)]
    attempt("log", lambda: ro.log())
    for s in range(len(states)):
        attempt(f"read {s}", lambda s=s: whole(s))
        attempt(f"slice {s}", lambda s=s: lazy(s))
    attempt("verify", lambda: ro.verify())
    return outcomes


@settings(
    max_examples=lanes.examples(120),  # the slow lane's convention (tests/helpers/lanes.py): all of them in CI
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    crafted=st.lists(
        st.tuples(
            st.integers(0, _STEPS - 1),
            st.lists(_table_edit(), max_size=3),
            st.lists(_body_edit(), max_size=2),
        ),
        min_size=1,
        max_size=3,
    ),
)
@pytest.mark.slow
def test_crafted_steps_give_committed_data_or_a_named_error(pristine, tmp_path_factory, crafted):
    base, states = pristine
    work = tmp_path_factory.mktemp("example")
    root = work / "t"
    shutil.copytree(base / "t", root)
    (work / "secret").write_bytes(b"outside the root")
    traj = ulstore.open(str(root), mode="r+")
    steps = list(range(_STEPS))
    for step, table_edits, body_edits in crafted:
        try:
            rewrite_step(
                traj,
                step,
                _apply_table_edits(table_edits, steps) if table_edits else None,
                body=_apply_body_edits(body_edits, step) if body_edits else None,
            )
        except (ValueError, OverflowError, struct.error, UlstoreError):
            pass  # the edit itself cannot be encoded (e.g. a negative u64): the store is as before

    result: dict = {}
    spy = _OutsideRoot(str(work), str(root))

    def run():
        tracemalloc.start()
        try:
            result["outcomes"] = _read_everything(str(root), states)
        except BaseException as e:  # noqa: BLE001 -- handed back to the test
            result["error"] = e
        finally:
            result["peak"] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()

    _OutsideRoot.active = spy
    try:
        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(_TIME_LIMIT)
    finally:
        _OutsideRoot.active = None
    assert not t.is_alive(), f"reads did not finish within {_TIME_LIMIT} s: {crafted}"
    if "error" in result:
        raise result["error"]
    assert result["peak"] <= _MEMORY_LIMIT, f"reads allocated {result['peak']} bytes: {crafted}"
    assert not spy.seen, f"opened outside the root: {spy.seen}"
    shutil.rmtree(work)


def test_the_fuzz_edits_do_reach_the_reader(pristine, tmp_path):
    """The harness itself: an edit that is sure to damage a step gives a named error, not data."""
    base, states = pristine
    shutil.copytree(base / "t", tmp_path / "t")
    traj = ulstore.open(str(tmp_path / "t"), mode="r+")
    edit = _apply_table_edits([("content", 0, 0, b"\x00" * 16)], list(range(_STEPS)))
    rewrite_step(traj, 1, edit, recompute_content=True)  # only the chunk's own hash is wrong
    outcomes = dict(_read_everything(str(tmp_path / "t"), states))
    assert outcomes["read 1"] == outcomes["verify"] == "CorruptBlobError"
    report = ulstore.open(str(tmp_path / "t"), mode="r").verify(raise_on_error=False)
    assert not report.ok and any(e["step"] == 1 for e in report.errors)
    assert outcomes["read 0"] == "ok"


def test_a_chunk_longer_than_its_piece_is_clamped_on_write_and_refused_on_read(tmp_path):
    """Found by the fuzz test: a crafted chunk shape of 2**31 made the zarr view pad a chunk to 512 GiB."""
    from ulstore.store.format._chunk_tables import pieces_problem

    traj = ulstore.open(str(tmp_path / "t"), mode="w")
    w = traj.piece_writer(0)
    w.write("x", np.arange(10, dtype=np.float32), chunks=(1 << 40,))
    traj.finalize(0, w.close())
    t = traj._reader.tables(0)["x"]
    assert t.pieces[0].chunks == (10,)
    assert_bits_equal(traj[0]["x"][:], np.arange(10, dtype=np.float32))
    assert "outside" in pieces_problem((10,), [((0,), (10,), (11,))])
    assert pieces_problem((10,), [((0,), (10,), (10,))]) is None
    assert pieces_problem((0, 3), [((0, 0), (0, 3), (1, 3))]) is None  # an empty axis has chunks of 1
