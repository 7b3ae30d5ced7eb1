"""ULPack as a numcodecs codec, and the golden blobs that pin every format version.

Golden blobs live in ``tests/fixtures/`` (see ``tests/fixtures/make_fixtures.py``):
``ulpack_v1`` (versions 1 and 2, frozen) and ``ulpack_v3`` (today's).  Each one
must still decode to its stored input on every backend, and encoding the stored
inputs of today's must still give the stored bytes: any change to the blob
format fails here.
"""

from __future__ import annotations

import array
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numcodecs
import numcodecs.tests.common as nc_common
import numpy as np
import pytest
from numcodecs.compat import ensure_bytes, ndarray_copy
from numcodecs.tests.common import (
    check_backwards_compatibility,
    check_config,
    check_encode_decode_array,
    check_repr,
)

import ulstore
from tests.helpers.bits import assert_bits_equal, uint
from ulstore import DtypeError, IntegrityError, ReferenceMismatchError, ULPack
from ulstore.codec._dtypes import FORMATS

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
GOLDEN_V1 = FIXTURES / "ulpack_v1"  # versions 1 and 2, frozen
GOLDEN = FIXTURES / "ulpack_v3"  # today's
NUMCODECS_FIXTURES = FIXTURES / "numcodecs"
DTYPES = {f.name: f.dtype for f in FORMATS}  # the six formats ULPack codes, by name
CODECS = [ULPack(), ULPack(econd=False)]


def _codec_arrays() -> list[np.ndarray]:
    """Float arrays of every supported dtype, several shapes, awkward values included."""
    rng = np.random.default_rng(17)
    out = [
        np.linspace(-1000, 1000, 1000, dtype=np.float32),
        np.linspace(-1, 1, 600, dtype=np.float64).reshape(20, 30),
        rng.standard_normal(2000).astype(np.float32).reshape(10, 20, 10),
        (rng.standard_normal(1000) * 1e-3).astype(np.float16),
        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 6e-8, -6e-8, 65504.0], dtype=np.float16),
        np.frombuffer(rng.bytes(4 * 257), dtype=np.float32).copy(),  # every NaN payload possible
        np.zeros(0, dtype=np.float32),
        np.ones((1,), dtype=np.float64),
    ]
    for dt in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2):
        out.append((rng.standard_normal(333) * 2).astype(np.float32).astype(dt))
    return out


ARRAYS = _codec_arrays()


def _ids(a):
    return f"{a.dtype.name}{list(a.shape)}"


# -- registry and config ----------------------------------------------------------------


def test_get_codec_in_fresh_interpreter():
    """The ``numcodecs.codecs`` entry point registers ULPack without importing ulstore first."""
    code = (
        "import sys, numcodecs, numpy as np\n"
        "assert 'ulstore' not in sys.modules, 'ulstore imported too early'\n"
        "c = numcodecs.get_codec({'id': 'ulpack'})\n"
        "c2 = numcodecs.get_codec({'id': 'ulpack', 'econd': False})\n"
        "x = np.linspace(-3, 3, 101, dtype=np.float32)\n"
        "y = c.decode(c.encode(x))\n"
        "assert y.dtype == x.dtype and (y.view(np.uint32) == x.view(np.uint32)).all()\n"
        "print(type(c).__module__, type(c).__name__, repr(c), repr(c2), c2.get_config()['econd'])\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(Path(__file__).resolve().parents[3]),
    )  # outside the source tree
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["ulstore.codec", "ULPack", "ULPack(econd=True)", "ULPack(econd=False)", "False"]


def test_registry_in_process():
    assert isinstance(numcodecs.get_codec({"id": "ulpack"}), ULPack)
    assert numcodecs.get_codec({"id": "ulpack"}) == ULPack()
    assert numcodecs.get_codec({"id": "ulpack", "econd": False}) == ULPack(econd=False)
    assert ULPack() != ULPack(econd=False)
    assert ULPack.codec_id == "ulpack"


@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_check_config(codec):
    check_config(codec)
    assert codec.get_config() == {"id": "ulpack", "econd": codec.econd}


@pytest.mark.parametrize("stmt", ["ULPack(econd=True)", "ULPack(econd=False)"])
def test_check_repr(stmt, monkeypatch):
    # check_repr evals in numcodecs.tests.common's namespace, which only knows numcodecs' own codecs
    monkeypatch.setattr(nc_common, "ULPack", ULPack, raising=False)
    check_repr(stmt)


# -- encode / decode through the numcodecs interface -------------------------------------


@pytest.mark.parametrize("codec", CODECS, ids=repr)
@pytest.mark.parametrize("arr", ARRAYS, ids=_ids)
def test_encode_decode_typed(arr, codec):
    """numcodecs' check_encode_decode, minus untyped encode inputs (see test_untyped_buffers_rejected).

    The encoded blob is decoded from every buffer type the helper uses, and decoded
    into ``out=`` arrays and bytearrays; every comparison is bit-exact.
    """
    enc = codec.encode(arr)
    enc_bytes = ensure_bytes(enc)
    assert enc_bytes == ulstore.encode(arr, econd=codec.econd)
    for buf in (
        enc,
        enc_bytes,
        bytearray(enc_bytes),
        array.array("b", enc_bytes),
        np.frombuffer(enc_bytes, "u1"),
        memoryview(enc_bytes),
    ):
        dec = codec.decode(buf)
        assert isinstance(dec, np.ndarray) and dec.flags.c_contiguous
        assert_bits_equal(dec, arr)
    out = np.empty_like(arr)
    res = codec.decode(enc_bytes, out=out)
    assert res is out
    assert_bits_equal(out, arr)
    out = bytearray(arr.nbytes)
    codec.decode(enc_bytes, out=out)
    assert bytes(out) == arr.tobytes()
    # numcodecs' own array helper (value comparison, NaN-aware) on top
    if arr.dtype in (np.float16, np.float32, np.float64):
        check_encode_decode_array(arr, codec)


@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_untyped_buffers_rejected(codec):
    """ULPack needs a dtype: raw bytes are refused with DtypeError, never guessed.

    (This is why numcodecs' generic check_encode_decode, which also encodes
    ``arr.tobytes()``, bytearray and array.array, cannot be used as is.)
    """
    arr = np.linspace(0, 1, 16, dtype=np.float32)
    for buf in (arr.tobytes(), bytearray(arr.tobytes()), array.array("b", arr.tobytes()), memoryview(arr.tobytes())):
        with pytest.raises(DtypeError):
            codec.encode(buf)


@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_reference_through_codec(codec):
    rng = np.random.default_rng(1)
    r = rng.standard_normal((30, 7)).astype(np.float32)
    t = (r.view(np.uint32) + np.uint32(3)).view(np.float32)
    enc = codec.encode(t, reference=r)
    assert enc == ulstore.encode(t, r, econd=codec.econd)
    assert_bits_equal(codec.decode(enc, reference=r), t)
    out = np.empty_like(t)
    codec.decode(enc, out=out, reference=r)
    assert_bits_equal(out, t)
    with pytest.raises(ReferenceMismatchError):
        codec.decode(enc)
    with pytest.raises(ReferenceMismatchError):
        codec.decode(enc, reference=t)


@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_decode_corrupt_through_codec(codec):
    enc = bytearray(codec.encode(np.linspace(0, 1, 64, dtype=np.float32)))
    enc[20] ^= 1
    with pytest.raises(IntegrityError):
        codec.decode(bytes(enc))


def test_decode_out_wrong_size():
    codec = ULPack()
    enc = codec.encode(np.zeros(10, np.float32))
    with pytest.raises(ValueError):  # InvalidInputError is a ValueError
        codec.decode(enc, out=np.empty(11, np.float32))


@pytest.mark.parametrize("layout", ["fortran", "strided-rows", "strided-columns"])
def test_decode_into_non_c_contiguous_out(layout):
    """``out=`` of another memory layout: filled the way numcodecs fills it, refused where numcodecs refuses.

    The expected content is numcodecs' own ``ndarray_copy`` of the decoded buffer into
    ``out``.  Leaving ``out`` untouched while returning it is never acceptable.
    """
    codec = ULPack()
    arr = np.arange(16, dtype=np.float32).reshape(4, 4) + 0.5
    enc = codec.encode(arr)
    if layout == "fortran":
        out = np.full((4, 4), -1, dtype=np.float32, order="F")
    elif layout == "strided-rows":
        out = np.full((8, 4), -1, dtype=np.float32)[::2]
    else:
        out = np.full((4, 8), -1, dtype=np.float32)[:, ::2]
    expected = np.full_like(out, -1)
    try:
        ndarray_copy(codec.decode(enc), expected)
    except ValueError:  # numcodecs itself cannot copy into this layout: ULPack must refuse too
        with pytest.raises(ValueError):  # InvalidInputError is a ValueError
            codec.decode(enc, out=out)
        return
    res = codec.decode(enc, out=out)
    assert res is out
    assert_bits_equal(out, expected, "out was not written")


def test_numcodecs_buffer_order_f_contiguous(tmp_path, monkeypatch):
    """numcodecs treats data as a buffer in memory order: an F-ordered array must come back as
    the same bytes (``arr.tobytes(order='A')``), which check_backwards_compatibility asserts."""
    codec = ULPack()
    arr = np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4))
    dec = codec.decode(codec.encode(arr))
    assert ensure_bytes(dec) == arr.tobytes(order="A")
    monkeypatch.chdir(tmp_path)
    check_backwards_compatibility("ulpack", [arr], [codec])


# -- golden blobs ------------------------------------------------------------------------


def _manifest(root: Path = GOLDEN) -> dict:
    return json.loads((root / "manifest.json").read_text())


CASES = {c["name"]: c for c in _manifest()["cases"]}
CASES_V1 = {c["name"]: c for c in _manifest(GOLDEN_V1)["cases"]}


def _load(case, role, root: Path = GOLDEN):
    dt = DTYPES[case["dtype"]]
    raw = (root / case[role]).read_bytes()
    assert hashlib.sha256(raw).hexdigest().startswith(Path(case[role]).stem), f"{case[role]} was modified"
    return np.frombuffer(raw, dtype=uint(dt)).view(dt).reshape(case["shape"]).copy()


def _inventory(cases: dict) -> dict[str, set]:
    by_dtype: dict[str, set] = {}
    for c in cases.values():
        kinds = by_dtype.setdefault(c["dtype"], set())
        kinds.add(("rans", c["delta"], c["econd"]) if c["mode"] == "rans" else (c["mode"], c["delta"]))
        if 0 in c["shape"]:
            kinds.add("empty")
        if c.get("lanes") == 32:
            kinds.add(("wide", c["mode"]))
    return by_dtype


def test_golden_fixture_inventory():
    """Every dtype has every mode in both generations; the fixture files are all referenced and small."""
    common = [
        ("rans", True, True),
        ("rans", True, False),
        ("raw", True),
        ("raw", False),
        ("same", True),
        ("same", False),
        ("sparse", True),
        "empty",
    ]
    needs = {
        GOLDEN_V1: common + [("rans", False, True)],
        GOLDEN: common + [("rans", False, True), ("intra", False), ("wide", "rans"), ("wide", "intra")],
    }
    for root, cases in ((GOLDEN_V1, CASES_V1), (GOLDEN, CASES)):
        by_dtype = _inventory(cases)
        for name in DTYPES:
            got = by_dtype.get(name, set())
            for need in needs[root]:
                assert need in got, (root.name, name, need)
        referenced = {"manifest.json"}
        for c in cases.values():
            referenced.update(c[k] for k in ("blob", "target", "reference") if k in c)
        files = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}
        assert files == referenced, files ^ referenced
    assert set(CASES_V1) < set(CASES), "every version-1 case is also a version-3 case"
    codec_fixtures = [GOLDEN_V1, GOLDEN, FIXTURES / "numcodecs"]  # (store_format1/ is the store's)
    total = sum(p.stat().st_size for d in codec_fixtures for p in d.rglob("*") if p.is_file() and p.suffix != ".py")
    assert total < 500_000, total  # two generations of blobs and their inputs
    assert _manifest(GOLDEN_V1)["format_version"] == 1
    assert _manifest()["format_version"] == 3


def _reencode(case, target, reference, backend=None) -> bytes:
    """Encode a case as make_fixtures.py does (32-lane sections forced where the manifest says so)."""
    from ulstore.codec import _one_stream

    saved = _one_stream.WIDE_BITS
    if case.get("lanes") == 32:
        _one_stream.WIDE_BITS = 0
    try:
        return ulstore.encode(target, reference, econd=case["econd"], sparse=case["mode"] == "sparse", backend=backend)
    finally:
        _one_stream.WIDE_BITS = saved


@pytest.mark.parametrize("backend", ulstore.available_backends())
@pytest.mark.parametrize("name", list(CASES))
def test_golden_blob_decodes_and_reencodes(name, backend):
    case = CASES[name]
    blob = (GOLDEN / case["blob"]).read_bytes()
    assert hashlib.sha256(blob).hexdigest() == case["blob_sha256"], "golden blob file was modified"
    target = _load(case, "target")
    reference = _load(case, "reference") if "reference" in case else None
    info = ulstore.inspect_blob(blob)
    sparse = case["mode"] == "sparse"
    assert info["version"] == (4 if sparse else 3)  # SPARSE blobs are version 4 (Elias-Fano positions)
    assert info["dtype"] == case["dtype"]
    assert info["shape"] == tuple(case["shape"])
    assert info["mode"] == case["mode"]
    assert info["delta"] == case["delta"]
    assert info["econd"] == case["econd"]
    # (a) the stored blob decodes to the stored expected values
    out = ulstore.decode(blob, reference, backend=backend)
    assert isinstance(out, np.ndarray) and out.flags.c_contiguous
    assert_bits_equal(out, target)
    # (b) today's encoder writes exactly the stored bytes
    again = _reencode(case, target, reference, backend=backend)
    assert again == blob, f"{name}: the encoder no longer writes the same bytes ({len(again)} vs {len(blob)})"
    if case.get("lanes") == 32:
        assert blob != _reencode({**case, "lanes": None}, target, reference), "the 32 lanes were not forced"
        return
    # and through the numcodecs interface
    codec = ULPack(econd=case["econd"], sparse=sparse)
    assert ensure_bytes(codec.encode(target, reference=reference)) == blob
    assert_bits_equal(codec.decode(blob, reference=reference), target)


@pytest.mark.parametrize("backend", ulstore.available_backends())
@pytest.mark.parametrize("name", list(CASES_V1))
def test_golden_v1_blob_decodes(name, backend):
    """Blobs of versions 1 and 2 keep decoding, bit-exact, on every backend; today's encoder
    codes the same inputs as version 3 (SPARSE: version 4), which decode to the same values."""
    case = CASES_V1[name]
    blob = (GOLDEN_V1 / case["blob"]).read_bytes()
    assert hashlib.sha256(blob).hexdigest() == case["blob_sha256"], "golden blob file was modified"
    target = _load(case, "target", GOLDEN_V1)
    reference = _load(case, "reference", GOLDEN_V1) if "reference" in case else None
    info = ulstore.inspect_blob(blob)
    sparse = case["mode"] == "sparse"
    assert info["version"] == (2 if sparse else 1)
    assert (info["dtype"], info["shape"], info["mode"]) == (case["dtype"], tuple(case["shape"]), case["mode"])
    assert (info["delta"], info["econd"]) == (case["delta"], case["econd"])
    assert_bits_equal(ulstore.decode(blob, reference, backend=backend), target)
    codec = ULPack(econd=case["econd"], sparse=sparse)
    assert_bits_equal(codec.decode(blob, reference=reference), target)
    today = ulstore.encode(target, reference, econd=case["econd"], sparse=sparse, backend=backend)
    assert today != blob and ulstore.inspect_blob(today)["version"] == (4 if sparse else 3), name
    assert_bits_equal(ulstore.decode(today, reference, backend=backend), target)
    if case["mode"] not in ("raw", "same", "sparse"):  # RAW and SAME only lost header bytes
        assert len(today) <= len(blob) + 4, (name, len(today), len(blob))
    if sparse:  # Elias-Fano positions instead of the entropy-coded gaps: a few bytes more, or fewer
        assert len(today) <= len(blob) * 1.15, (name, len(today), len(blob))


@pytest.mark.parametrize("prefix", [None, "v3"])
def test_numcodecs_backwards_compatibility(monkeypatch, prefix):
    """numcodecs' own fixture check over the committed ``fixtures/numcodecs`` data: the
    version-1 encodings (top level) and today's (``v3/``)."""
    root = NUMCODECS_FIXTURES / "fixture" / "ulpack"
    if prefix:
        root = root / prefix
    arrays = sorted(root.glob("array.*.npy"))
    assert len(arrays) >= 4, "numcodecs fixtures missing: run tests/fixtures/make_fixtures.py"
    for j in range(len(CODECS)):
        assert (root / f"codec.{j:02d}" / "config.json").is_file()
        for a in arrays:
            i = a.name.split(".")[1]
            assert (root / f"codec.{j:02d}" / f"encoded.{i}.dat").is_file()
    loaded = [np.load(a) for a in arrays]
    before = {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}
    monkeypatch.chdir(NUMCODECS_FIXTURES)
    check_backwards_compatibility("ulpack", loaded, CODECS, prefix=prefix)
    after = {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}
    assert before == after, "check_backwards_compatibility wrote fixture files: they were incomplete"
    for j, codec in enumerate(CODECS):
        for a, arr in zip(arrays, loaded):
            i = a.name.split(".")[1]
            stored = (root / f"codec.{j:02d}" / f"encoded.{i}.dat").read_bytes()
            assert_bits_equal(codec.decode(stored), arr)
            if prefix:  # today's encodings are today's bytes, bit for bit
                assert ensure_bytes(codec.encode(arr)) == stored


def test_fixture_generator_is_importable_without_side_effects():
    """make_fixtures.py only writes when run as a script (pytest imports it for doctests)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_ulpack_make_fixtures", FIXTURES / "make_fixtures.py")
    mod = importlib.util.module_from_spec(spec)
    before = sorted((p, p.stat().st_mtime_ns) for p in FIXTURES.rglob("*") if p.is_file())
    spec.loader.exec_module(mod)
    after = sorted((p, p.stat().st_mtime_ns) for p in FIXTURES.rglob("*") if p.is_file())
    assert before == after
    names = [c[0] for c in mod.cases()]
    assert sorted(names) == sorted(CASES), "make_fixtures.py and the committed manifest disagree"
    assert sorted(c[0] for c in mod._cases_v1()) == sorted(CASES_V1), "the version-1 cases changed"
    assert os.path.basename(mod.__file__) == "make_fixtures.py"


def test_dtype_setting_reads_untyped_buffers():
    """With ``dtype=``, raw bytes (no float dtype) are read as that format, exactly."""
    import ml_dtypes

    x = np.linspace(-3, 3, 37, dtype=np.float32).astype(ml_dtypes.bfloat16)
    codec = ULPack(dtype="bfloat16")
    assert codec.get_config() == {"id": "ulpack", "econd": True, "dtype": "bfloat16"}
    assert numcodecs.get_codec(codec.get_config()) == codec
    out = codec.decode(codec.encode(x.tobytes()))
    assert_bits_equal(out, x)
    with pytest.raises(ulstore.DtypeError):
        ULPack().encode(x.tobytes())  # no dtype: bytes alone cannot be coded


def test_fortran_order_round_trips_memory_bytes():
    a = np.asfortranarray(np.arange(24, dtype=np.float16).reshape(4, 6))
    codec = ULPack()
    assert codec.decode(codec.encode(a)).tobytes() == a.tobytes(order="A")
