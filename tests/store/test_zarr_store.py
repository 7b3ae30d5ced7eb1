"""The logical store as a zarr citizen: zarr's StoreTests, pickling, dask workers, xarray, caching URLs."""

from __future__ import annotations

import json
import pickle

import ml_dtypes
import numpy as np
import pytest
import zarr
from zarr.core.buffer import cpu, default_buffer_prototype
from zarr.core.sync import _collect_aiterator
from zarr.testing.store import StoreTests

import ulstore
from ulstore.errors import ReadOnlyError
from ulstore.store.read._logical import LogicalStore

from ..helpers.store import assert_state_equal

STEP = 1
NO_WRITES = "the logical store is read-only: steps are immutable, a new step is a commit (Trajectory.commit)"
NO_PLANTED_BYTES = (
    "needs arbitrary bytes at arbitrary keys; the logical store serves only what steps hold "
    "(covered by the read tests of this class over a real step)"
)


def _state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "emb.weight": rng.standard_normal((40, 16)).astype(np.float32),
        "blocks/0/w": rng.standard_normal((24, 8)).astype(ml_dtypes.bfloat16),
        "blocks/0/b": rng.standard_normal(9).astype(np.float16),
        "scale": np.float32(seed),
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A local trajectory of two steps (step 1 delta-coded against step 0), small chunks."""
    path = str(tmp_path_factory.mktemp("zarr-store") / "traj")
    traj = ulstore.open(path, mode="w", chunk_bytes=256)
    states = {}
    for step in (0, STEP):
        states[step] = _state(0) if step == 0 else {k: v + v.dtype.type(0.5) for k, v in _state(0).items()}
        traj.commit(step, states[step])
    return path, states


def _proto():
    return default_buffer_prototype()


class TestLogicalStore(StoreTests[LogicalStore, cpu.Buffer]):
    """zarr's own store tests, against a store rooted at a real step.

    Tests that plant bytes at keys of their choosing (through the class's ``set``
    helper, ``store.set`` or ``store._set_many``) cannot apply to a read-only store
    that synthesizes its keys: they are skipped with the reason, and the read
    behaviour they check is tested below over the step's real keys.
    """

    store_cls = LogicalStore
    buffer_cls = cpu.Buffer

    async def set(self, store, key, value):
        pytest.skip(NO_PLANTED_BYTES)

    async def get(self, store, key):
        pytest.skip(NO_PLANTED_BYTES)

    @pytest.fixture
    def store_kwargs(self, saved):
        return {"source": ulstore.open(saved[0], mode="r")._reader, "step": STEP}

    # -- the abstract ones ------------------------------------------------------

    def test_store_repr(self, store):
        assert repr(store) == f"LogicalStore({store.reader.io.url!r}, step={STEP})"

    def test_store_supports_writes(self, store):
        assert not store.supports_writes and not store.supports_deletes

    def test_store_supports_listing(self, store):
        assert store.supports_listing

    # -- read-only versions of tests that assume a writable store ------------------

    def test_store_read_only(self, store):
        assert store.read_only
        with pytest.raises(AttributeError):
            store.read_only = False

    @pytest.mark.parametrize("read_only", [True, False])
    async def test_store_open_read_only(self, open_kwargs, read_only):
        if not read_only:
            with pytest.raises(ValueError, match="read-only"):
                await self.store_cls.open(**{**open_kwargs, "read_only": False})
            return
        store = await self.store_cls.open(**{**open_kwargs, "read_only": True})
        assert store._is_open and store.read_only

    async def test_serializable_store(self, store, saved):
        new = pickle.loads(pickle.dumps(store))
        assert new == store and new.read_only == store.read_only
        assert new.reader is not store.reader  # the location travels, not the caches
        for key in ("zarr.json", "emb.weight/zarr.json", "emb.weight/c/1/0", "blocks/0/w/c/0/0"):
            got = await new.get(key, prototype=_proto())
            assert got is not None and got.to_bytes() == (await store.get(key, prototype=_proto())).to_bytes()

    async def test_with_read_only_store(self, open_kwargs):
        await super().test_with_read_only_store(open_kwargs)  # with_read_only(False): NotImplementedError
        store = await self.store_cls.open(**open_kwargs)
        copy = store.with_read_only(read_only=True)
        assert copy == store and copy.read_only and not copy._is_open

    @pytest.mark.parametrize("key", ["zarr.json", "emb.weight/zarr.json", "emb.weight/c/2/0", "scale/c"])
    @pytest.mark.parametrize("byte_range", [None, (1, 4), 1, -1])
    async def test_get(self, store, key, byte_range, saved):
        from zarr.abc.store import OffsetByteRequest, RangeByteRequest, SuffixByteRequest

        whole = (await store.get(key, prototype=_proto())).to_bytes()
        request = {
            type(None): lambda r: None,
            tuple: lambda r: RangeByteRequest(*r),
            int: lambda r: OffsetByteRequest(r) if r > 0 else SuffixByteRequest(-r),
        }[type(byte_range)](byte_range)
        got = (await store.get(key, prototype=_proto(), byte_range=request)).to_bytes()
        want = {
            type(None): lambda: whole,
            tuple: lambda: whole[1:4],
            int: lambda: whole[1:] if byte_range == 1 else whole[-1:],
        }[type(byte_range)]()
        assert got == want
        if key.startswith("emb.weight/c/"):  # a chunk is the step's values, padded to the chunk shape
            meta = json.loads((await store.get("emb.weight/zarr.json", prototype=_proto())).to_bytes())
            rows = meta["chunk_grid"]["configuration"]["chunk_shape"][0]
            want_rows = saved[1][STEP]["emb.weight"][2 * rows : 3 * rows]
            values = np.frombuffer(whole, np.float32).reshape(rows, 16)[: len(want_rows)]
            np.testing.assert_array_equal(values, want_rows)

    async def test_get_not_open(self, store_not_open):
        assert not store_not_open._is_open
        assert (await store_not_open.get("emb.weight/zarr.json", prototype=_proto())) is not None

    async def test_get_raises(self, store):
        with pytest.raises((ValueError, TypeError), match=r"Unexpected byte_range, got.*"):
            await store.get("emb.weight/c/0/0", prototype=_proto(), byte_range=(0, 2))

    async def test_get_many(self, store):
        keys = ("zarr.json", "emb.weight/c/0/0", "blocks/0/b/c/0", "nope/zarr.json")
        got = dict(await _collect_aiterator(store._get_many(zip(keys, (_proto(),) * 4, (None,) * 4))))
        for k in keys[:3]:
            assert got[k].to_bytes() == (await store.get(k, prototype=_proto())).to_bytes()
        assert got["nope/zarr.json"] is None

    @pytest.mark.parametrize("key", ["zarr.json", "emb.weight/c/0/0", "scale/c"])
    async def test_getsize(self, store, key):
        assert await store.getsize(key) == len((await store.get(key, prototype=_proto())).to_bytes())

    async def test_getsize_prefix(self, store):
        keys = [k for k in await _collect_aiterator(store.list_prefix("emb.weight/c/"))]
        sizes = [await store.getsize(k) for k in keys]
        assert len(keys) > 1 and await store.getsize_prefix("emb.weight/c") == sum(sizes)

    async def test_get_partial_values(self, store):
        from zarr.abc.store import RangeByteRequest, SuffixByteRequest

        ranges = [("zarr.json", RangeByteRequest(0, 2)), ("emb.weight/c/0/0", SuffixByteRequest(4)), ("scale/c", None)]
        got = await store.get_partial_values(prototype=_proto(), key_ranges=ranges)
        for (key, r), g in zip(ranges, got):
            assert g.to_bytes() == (await store.get(key, prototype=_proto(), byte_range=r)).to_bytes()

    async def test_exists(self, store):
        assert await store.exists("zarr.json") and await store.exists("blocks/zarr.json")
        assert await store.exists("emb.weight/c/2/0") and await store.exists("scale/c")
        for missing in ("foo", "foo/zarr.json", "emb.weight/c/99/0", "emb.weight/c/0", "emb.weight/c/00/0"):
            assert not await store.exists(missing), missing

    async def test_is_empty(self, store):
        assert not await store.is_empty("") and not await store.is_empty("emb.weight")
        assert not await store.is_empty("blocks/")
        assert await store.is_empty("spam/") and await store.is_empty("em")

    async def test_list(self, store, saved):
        keys = sorted(await _collect_aiterator(store.list()))
        assert keys == sorted(set(keys)) and "zarr.json" in keys and "blocks/zarr.json" in keys
        arrays = {k[: -len("/zarr.json")] for k in keys if k.endswith("/zarr.json")} - {"blocks", "blocks/0"}
        assert arrays == set(saved[1][STEP])
        assert [k for k in keys if k.startswith("scale/")] == ["scale/c", "scale/zarr.json"]

    async def test_list_prefix(self, store):
        every = await _collect_aiterator(store.list())
        for prefix in ("", "blocks/", "blocks/0/w/", "emb.weight/c/1/", "nope/"):
            got = sorted(await _collect_aiterator(store.list_prefix(prefix)))
            assert got == sorted(k for k in every if k.startswith(prefix)), prefix

    async def test_list_dir(self, store):
        async def ls(p):
            return sorted(await _collect_aiterator(store.list_dir(p)))

        assert await ls("") == ["blocks", "emb.weight", "scale", "zarr.json"]
        assert await ls("blocks/") == await ls("blocks") == ["0", "zarr.json"]
        assert await ls("emb.weight") == ["c", "zarr.json"]
        rows = len(await ls("emb.weight/c"))
        assert rows > 1 and await ls("emb.weight/c") == sorted(str(i) for i in range(rows))  # chunk prefixes list
        assert await ls("emb.weight/c/0") == ["0"]
        assert await ls("emb.weight/c/0/0") == [] and await ls("emb.weight/c/00") == [] and await ls("nope") == []

    async def test_get_bytes(self, store):
        assert json.loads(await store._get_bytes("zarr.json", prototype=_proto()))["node_type"] == "group"
        with pytest.raises(FileNotFoundError):
            await store._get_bytes("nonexistent_key", prototype=_proto())

    def test_get_bytes_sync(self, store):
        assert json.loads(store._get_bytes_sync("zarr.json", prototype=_proto()))["node_type"] == "group"

    async def test_get_json(self, store):
        meta = await store._get_json("emb.weight/zarr.json", prototype=_proto())
        assert meta["dimension_names"] == ["emb.weight.dim_0", "emb.weight.dim_1"]

    def test_get_json_sync(self, store):
        meta = store._get_json_sync("blocks/0/w/zarr.json", prototype=_proto())
        assert meta["data_type"] == "bfloat16" and meta["dimension_names"] == ["blocks/0/w.dim_0", "blocks/0/w.dim_1"]

    # -- writes: skipped (with zarr's ValueError checked in test_read_only_store_raises) ----

    @pytest.mark.skip(reason=NO_WRITES)
    def test_set(self): ...

    @pytest.mark.skip(reason=NO_WRITES)
    def test_set_not_open(self): ...

    @pytest.mark.skip(reason=NO_WRITES)
    def test_set_many(self): ...

    @pytest.mark.skip(reason=NO_WRITES)
    def test_set_if_not_exists(self): ...

    @pytest.mark.skip(reason=NO_WRITES)
    def test_clear(self): ...

    @pytest.mark.skip(reason=NO_WRITES)
    def test_list_empty_path(self): ...


# -- keys: one key per object ------------------------------------------------------


def test_leading_zeros_are_not_aliases(saved):
    traj = ulstore.open(saved[0], mode="r")
    whole, step = traj.zarr_store(), traj.zarr_store(STEP)
    assert zarr.core.sync.sync(whole.get("1/zarr.json", _proto())) is not None
    for store, key in ((whole, "01/zarr.json"), (whole, "00/zarr.json"), (step, "emb.weight/c/00/0")):
        assert zarr.core.sync.sync(store.get(key, _proto())) is None, key
        assert not zarr.core.sync.sync(store.exists(key)), key
    assert "01" not in zarr.core.sync.sync(_collect_aiterator(whole.list_dir("")))


def test_writes_raise_zarrs_value_error_and_read_only_error(saved):
    traj = ulstore.open(saved[0], mode="r")
    arr = traj[STEP]["emb.weight"]
    for error in (ValueError, ReadOnlyError):
        with pytest.raises(error, match="read-only"):
            arr[0, 0] = 1
    with pytest.raises(ValueError, match="read-only"):
        zarr.open_array(traj.zarr_store(STEP), path="emb.weight", mode="r+")[0, 0] = 1


# -- pickling and dask ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["emb.weight", "blocks/0/w"])  # fp32 and bf16
def test_arrays_and_stores_pickle(saved, name):
    path, states = saved
    traj = ulstore.open(path, mode="r")
    for arr in (traj[STEP][name], zarr.open_group(traj.zarr_store(STEP), mode="r")[name]):
        back = pickle.loads(pickle.dumps(arr))
        assert back.dtype == states[STEP][name].dtype
        assert_state_equal({name: back[:]}, {name: states[STEP][name]})
    store = pickle.loads(pickle.dumps(traj.zarr_store()))
    assert store == traj.zarr_store() and store != traj.zarr_store(STEP)


@pytest.mark.slow
def test_dask_distributed_processes_over_a_steps_tensors(saved):
    da = pytest.importorskip("dask.array")
    distributed = pytest.importorskip("distributed")
    path, states = saved
    group = ulstore.open(path, mode="r")[STEP]
    names = ["emb.weight", "blocks/0/w", "blocks/0/b"]
    with (
        distributed.LocalCluster(processes=True, n_workers=2, threads_per_worker=1, dashboard_address=None) as cluster,
        distributed.Client(cluster) as client,
    ):
        arrays = [da.from_zarr(group[n]) for n in names]
        assert all(a.npartitions > 1 for a in arrays[:2])
        sums = client.compute([a.astype(np.float64).sum() for a in arrays], sync=True)
        copies = client.compute(arrays, sync=True)  # the values themselves, bit for bit, bf16 included
    for n, s, c in zip(names, sums, copies):
        assert s == pytest.approx(states[STEP][n].astype(np.float64).sum())
        assert_state_equal({n: c}, {n: states[STEP][n]})


# -- xarray ----------------------------------------------------------------------------


def test_xarray_opens_a_step(saved):
    xr = pytest.importorskip("xarray")
    path, states = saved
    traj = ulstore.open(path, mode="r")
    ds = xr.open_zarr(traj.zarr_store(STEP), consolidated=False)
    assert ds["emb.weight"].dims == ("emb.weight.dim_0", "emb.weight.dim_1")
    np.testing.assert_array_equal(ds["emb.weight"].values, states[STEP]["emb.weight"])
    assert float(ds["scale"]) == float(states[STEP]["scale"]) and ds.attrs["ulstore"]["step"] == STEP
    tree = xr.open_datatree(traj.zarr_store(STEP), engine="zarr", consolidated=False)
    w = tree["blocks/0/w"]
    assert w.dtype == ml_dtypes.bfloat16 and w.dims == ("blocks/0/w.dim_0", "blocks/0/w.dim_1")
    assert_state_equal({"w": w.values}, {"w": states[STEP]["blocks/0/w"]})
    # the whole trajectory: one group per step
    assert float(xr.open_zarr(traj.zarr_store(), group="0", consolidated=False)["scale"]) == 0.0


# -- caching URLs ---------------------------------------------------------------------


@pytest.mark.parametrize("cache", ["filecache", "blockcache", "simplecache"])
def test_caching_urls_with_default_threads(tmp_path, cache):
    rng = np.random.default_rng(1)
    path = str(tmp_path / "t")
    traj = ulstore.open(path, mode="w", chunk_bytes=1 << 12, pack_bytes=1 << 13)  # many packs: many files to cache
    base = {f"t{i}": rng.standard_normal((64, 64)).astype(np.float32) for i in range(12)}
    states = [{k: v + np.float32(s * 1e-3) for k, v in base.items()} for s in range(3)]
    for s, state in enumerate(states):
        traj.commit(s, state)
    assert len(traj._io.find("packs")) > 20
    for attempt in range(3):  # fsspec re-reads its cache metadata on every call with cache_check=0
        options = {cache: {"cache_storage": str(tmp_path / f"cache-{attempt}"), "cache_check": 0}}
        cached = ulstore.open(f"{cache}::{path}", mode="r", storage_options=options)
        assert cached._threads > 1
        assert_state_equal(cached.read(2), states[2])
        again = ulstore.open(f"{cache}::{path}", mode="r", storage_options=options)  # served from the cache
        assert_state_equal({"t3": again[2]["t3"][:]}, {"t3": states[2]["t3"]})


# -- opening like zarr: a filesystem, a mapper, a relative path --------------------------


def test_open_accepts_a_filesystem_or_a_mapper(tmp_path, monkeypatch):
    fsspec = pytest.importorskip("fsspec")
    monkeypatch.chdir(tmp_path)
    state = _state(3)
    local = fsspec.filesystem("file")
    traj = ulstore.open("runs/rel", mode="w", fs=local)
    traj.commit(0, state)
    assert traj.url == "runs/rel" and (tmp_path / "runs" / "rel" / "zarr.json").exists()
    assert ulstore.open("runs/rel", mode="r").url == "runs/rel"  # a relative path stays relative
    assert_state_equal(ulstore.open(local.get_mapper("runs/rel"), mode="r").read(0), state)
    memory = fsspec.filesystem("memory")
    traj = ulstore.open("/fs-kw/t", mode="w", fs=memory)
    traj.commit(0, state)
    assert_state_equal(ulstore.open("memory://fs-kw/t", mode="r").read(0), state)
    got = ulstore.open(memory.get_mapper("/fs-kw/t"), mode="r")[0]["emb.weight"][:]
    assert_state_equal({"w": got}, {"w": state["emb.weight"]})
    with pytest.raises(ulstore.InvalidInputError, match="storage_options"):
        ulstore.open("/fs-kw/t", fs=memory, storage_options={"x": 1})
    with pytest.raises(ulstore.InvalidInputError, match="fsspec filesystem"):
        ulstore.open("/fs-kw/t", fs=object())


# -- a zarr write into the physical hierarchy ------------------------------------------


def test_a_zarr_write_to_a_step_document_is_named(tmp_path):
    path = str(tmp_path / "t")
    traj = ulstore.open(path, mode="w", anchor_every=16)  # a chain (the cost policy anchors unrelated states)
    for step in range(3):
        traj.commit(step, _state(step))
    zarr.open_group(path, mode="r+")["steps/1"].attrs["note"] = "best so far"
    ro = ulstore.open(path, mode="r")
    assert_state_equal(ro.read(0), _state(0))  # other steps' documents are untouched
    # a descendant's own document names step 1's table blocks (its chain): it reads without step 1's document
    assert_state_equal(ro.read(2), _state(2))
    with pytest.raises(ulstore.CorruptManifestError, match="plain zarr write") as e:
        ro.read(1)
    assert e.value.key == "steps/1/zarr.json" and "'note'" in str(e.value) and "intact" in str(e.value)
    report = ro.verify(raise_on_error=False)
    assert [(err["key"], err["error"]) for err in report.errors] == [("steps/1/zarr.json", "CorruptManifestError")]
    assert "plain zarr write" in report.errors[0]["message"] and "'note'" in report.errors[0]["message"]
    # a rewrite that changed ulstore's own fields says so; bytes that are not a step document are damage
    doc_path = tmp_path / "t" / "steps" / "0" / "zarr.json"
    doc = json.loads(doc_path.read_bytes())
    doc["attributes"]["ulstore"]["metadata"] = {"loss": 0.1}
    doc_path.write_text(json.dumps(doc, indent=2))
    with pytest.raises(ulstore.CorruptManifestError, match="sealed fields changed too"):
        ulstore.open(path, mode="r").read(0)
    doc_path.write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}, indent=2))
    with pytest.raises(ulstore.CorruptManifestError, match="^step document is not in canonical form"):
        ulstore.open(path, mode="r").read(0)


@pytest.mark.parametrize("cache", ["simplecache", "filecache", "blockcache"])
def test_writing_through_a_caching_url_says_caches_are_read_only(tmp_path, cache):
    """#38: a commit through ``simplecache::`` / ``filecache::`` was a raw FileNotFoundError (of a pending
    marker the cache never wrote).  Now a ReadOnlyError (a PermissionError) that says caches are read-only
    and names the URL to open for writing; reading through the cache works as before, mode "a" included."""
    from ulstore.errors import ReadOnlyError

    path = tmp_path / "t"
    state = _state(0)
    ulstore.open(path, mode="w").commit(0, state)
    url = f"{cache}::{path}"
    options = {cache: {"cache_storage": str(tmp_path / "cache")}}
    fix = f"open the underlying URL 'file://{path}' to write"
    for mode in ("r+", "w", "w-"):
        with pytest.raises(ReadOnlyError, match="caches are read-only") as e:
            ulstore.open(url, mode=mode, storage_options=options)
        assert fix in str(e.value) and isinstance(e.value, PermissionError)
    with pytest.raises(ReadOnlyError, match="caches are read-only"):  # nothing there: nothing to create
        ulstore.open(f"{cache}::{tmp_path / 'new'}", storage_options=options)
    traj = ulstore.open(url, storage_options=options)  # mode "a": reads work, writes say why they cannot
    assert traj.read_only
    assert_state_equal(traj.read(0), state)
    for write in (
        lambda: traj.commit(1, state),
        lambda: traj.set_ref("best", 0),
        lambda: traj.delete(0),
        lambda: traj.gc(),
    ):
        with pytest.raises(ReadOnlyError, match="caches are read-only") as e:
            write()
        assert fix in str(e.value)
    assert ulstore.open(path, mode="r").steps == [0]  # nothing was written
    assert not (tmp_path / "new").exists()
