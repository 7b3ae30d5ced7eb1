"""The benchmark scripts run end to end at their smallest settings (their numbers are not checked:
tests never assert speed or size targets, the scripts print them)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # real multi-process jobs: the slow lane (CI=true, --slow)

ROOT = Path(__file__).resolve().parents[2]


def run_benchmark(script: str, *args, cache: Path) -> str:
    env = dict(os.environ, ULSTORE_BENCH_CACHE=str(cache))
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=cache,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("bench-cache")


def test_sync_benchmark_smoke(cache):
    out = run_benchmark("sync.py", "--preset", "tiny", "--steps", 2, cache=cache)
    for needle in (
        "ULPack (sparse, the default): <= 1/4 of TRL int32",
        "ULPack dense:",
        "objects per delta version <= 3",
        "GET requests per version: told the version and its step document, 1 (",  # one pack range
        "reading the branch head, 3 (",  # ref, step document, one pack range
        "download at 1 GB/s + apply <= TRL int32's, trusted",
        "scatter floor",
        "extrapolation on paper",
        "7B",
        "1T",
    ):
        assert needle in out, needle
    assert len([line for line in out.splitlines() if line.lstrip().startswith(("1 ", "2 "))]) == 2  # one row a version


def test_apply_ab_benchmark_smoke(cache):
    """Two copies of the kernel build in use, so the script's A and B are separate modules of one build."""
    import shutil

    from ulstore.codec._backend import kernels

    build = kernels().__file__
    a, b = cache / ("a" + Path(build).suffix), cache / ("b" + Path(build).suffix)
    shutil.copy(build, a)
    shutil.copy(build, b)
    out = run_benchmark(
        "apply_ab.py", a, b, "--preset", "tiny", "--steps", 2, "--rounds", 1, "--replicas", 1, cache=cache
    )
    assert "in-place apply job, 2 versions" in out and "B/A: mean" in out, out
    # A replaying the deltas coded with exponent contexts: the same calls
    out = run_benchmark(
        "apply_ab.py",
        a,
        b,
        "--preset",
        "tiny",
        "--steps",
        2,
        "--rounds",
        1,
        "--replicas",
        1,
        "--a-contexts",
        cache=cache,
    )
    sizes = re.search(r"blob bytes: A (\d+) \(exponent contexts\), B (\d+)", out)
    # (tiny deltas pool every context into one row: no larger there)
    assert sizes and 1 <= int(sizes[2]) / int(sizes[1]) < 1.1 and "B/A: mean" in out, out


def test_codec_benchmark_smoke(cache):
    out = run_benchmark(
        "codec.py", "--preset", "tiny", "--steps", 1, "--only", "rl-bf16", "--reps", 1, "--time-budget", 0, cache=cache
    )
    assert "rl-bf16" in out and "ZipNN" in out
    for needle in ("Table 4. Sparse deltas", "positions ideal, under e_r", "Table 4b.", "memcpy MB/s"):
        assert needle in out, needle


@pytest.mark.skipif(not (shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")), reason="needs a C compiler")
def test_band_floor_benchmark_smoke(cache):
    """The band-rank prototype builds, decodes every split bit for bit, keyed or not (it exits non-zero otherwise),
    and the keyed-bands table has a row per depth the run reaches."""
    args = ("--preset", "tiny", "--steps", 1, "--reps", 1, "--keyed-preset", "tiny", "--keyed-steps", 40)
    out = run_benchmark("band_floor.py", *args, cache=cache)
    floor, keyed = out.split("bands keyed to the anchor")
    assert "x scatter" in floor and "keyed apply" in floor and "memcpy" in floor, out
    assert len([line for line in floor.splitlines() if line.split()[:1] in (["1"], ["2"], ["4"], ["8"])]) == 4, out
    depths = [line.split()[0] for line in keyed.splitlines()[2:] if line.strip()]
    assert depths == ["1", "4", "16"], out  # 41 states: the anchor at 41 // 3 = 13, depths to 27 fit, 32 does not


def test_codec_benchmark_position_floor_is_the_best_band_split():
    """Table 4's K-band position floor is the minimum over every split into at most K bands (brute force)."""
    import itertools

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import codec as bench
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    rng = np.random.default_rng(3)
    count = np.zeros(16)
    count[[1, 2, 4, 5, 6, 9, 12]] = rng.integers(50, 500, size=7)
    changed = np.floor(count * rng.uniform(0, 0.5, size=16))
    occupied = np.flatnonzero(count)
    for k in (1, 2, 3):
        best = np.inf
        for cuts in itertools.combinations(range(1, len(occupied)), k - 1):
            edges = [0, *cuts, len(occupied)]
            bits = sum(
                bench._binary_entropy_bits(changed[occupied[a:b]].sum(), count[occupied[a:b]].sum())
                for a, b in zip(edges, edges[1:])
            )
            best = min(best, float(bits))
        assert abs(bench._banded_bits(count, changed, k) - best) < 1e-6 * best, k
    full = float(bench._binary_entropy_bits(changed, count).sum())
    assert bench._banded_bits(count, changed, len(occupied)) == pytest.approx(full)
    assert bench._banded_bits(count, changed, 1) > full


def test_store_benchmark_smoke(cache):
    out = run_benchmark("store.py", "--preset", "tiny", "--steps", 3, "--reps", 1, "--no-s3", cache=cache)
    for needle in ("traj.commit (delta, kept parent)", "traj.read of the anchor", "kept parent off: peak", "manifest:"):
        assert needle in out, needle


def test_the_cache_lives_in_the_user_cache_dir_and_clean_removes_it(tmp_path):
    """#38: the benchmarks left a 5.9 GB cache in the repository (``benchmarks/.cache``).  It is under
    ``$XDG_CACHE_HOME/ulstore/benchmarks`` (``~/.cache/...``; ``$ULSTORE_BENCH_CACHE`` overrides), each run says
    where, and ``--clean`` removes it."""
    env = {k: v for k, v in os.environ.items() if k != "ULSTORE_BENCH_CACHE"}
    env.update(XDG_CACHE_HOME=str(tmp_path / "xdg"), HOME=str(tmp_path / "home"))
    expected = tmp_path / "xdg" / "ulstore" / "benchmarks"
    legacy = ROOT / "benchmarks" / ".cache"
    legacy_before = legacy.exists()

    def bench(*args):
        return subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "codec.py"), *map(str, args)],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
            cwd=tmp_path,
        )

    p = bench("--preset", "tiny", "--steps", 1, "--only", "rl-bf16", "--reps", 1, "--time-budget", 0, "--no-speed")
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"benchmark cache: {expected}" in p.stderr and "--clean" in p.stderr, p.stderr[-2000:]
    assert list(expected.rglob("*.safetensors")) and (expected / "CACHEDIR.TAG").is_file()
    assert legacy.exists() == legacy_before  # nothing new in the repository
    p = bench("--clean")
    assert p.returncode == 0 and f"removed {expected}" in p.stdout, p.stdout + p.stderr
    assert not expected.exists()
    # without XDG_CACHE_HOME: ~/.cache; a directory that is not the cache is never removed
    del env["XDG_CACHE_HOME"]
    assert f"no benchmark cache at {tmp_path / 'home' / '.cache' / 'ulstore' / 'benchmarks'}" in bench("--clean").stdout
    precious = tmp_path / "precious"
    (precious / "sub").mkdir(parents=True)
    env["ULSTORE_BENCH_CACHE"] = str(precious)
    assert "not marked as the benchmark cache" in bench("--clean").stdout and (precious / "sub").is_dir()
