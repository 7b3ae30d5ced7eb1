#!/usr/bin/env bash
# A new user's first hour, replayed from the outside (issue 38): a fresh virtual environment, a clone of the
# committed tree, the README's quickstart exactly as written, then what the first-hour review reached for,
# through the CLI and Python.  Every check prints one line; the first surprise stops the script (non-zero).
#
#   bash tests/smoke/newcomer.sh            # needs Python 3.11+, a C compiler, the package registry
#
# S3 errors (point 4) need a server and credentials: tests/cli/test_cli_errors.py covers them on moto.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
say() { printf '== %s\n' "$*"; }
fail() { printf 'FAILED: %s\n' "$*" >&2; exit 1; }

say "a fresh clone and a fresh venv in $work"
git clone -q "$repo" "$work/ulstore"
python3 -m venv "$work/venv"
# shellcheck disable=SC1091
. "$work/venv/bin/activate"
cd "$work/ulstore"

quickstart=$(sed -n '/^```sh$/,/^```$/p' README.md | sed -n 2p)
case "$quickstart" in "pip install -e . && ulstore demo") ;; *) fail "README quickstart changed: $quickstart" ;; esac
say "README: $quickstart"
start=$(date +%s)
eval "$quickstart" > "$work/demo.txt"
say "install and demo took $(( $(date +%s) - start )) s"
grep -q "ulstore-demo" "$work/demo.txt" || fail "the demo does not say where the data lives"
run=ulstore-demo

say "10: a bare ulstore prints help; python -m ulstore works"
ulstore > "$work/help.txt" || fail "bare ulstore exited $?"
grep -q "usage" "$work/help.txt" || fail "bare ulstore printed no usage"
python -m ulstore --help > /dev/null

say "15: ulstore log shows a size per step and the total"
ulstore log "$run" > "$work/log.txt"
grep -qE "^[0-9]+ steps?: raw .* stored " "$work/log.txt" || fail "no total in ulstore log"
grep -qE "[0-9.]+ ?(B|kB|KB|MB|KiB|MiB)" "$work/log.txt" || fail "no sizes in ulstore log"

say "16: ulstore diff between two steps"
read -r first last < <(python -c "import ulstore; s = ulstore.open('$run').steps; print(s[0], s[-1])")
ulstore diff "$run" "$first" "$last" > "$work/diff.txt"
grep -q "weight" "$work/diff.txt" || fail "ulstore diff names no tensor"

say "9, 11, 6, 7, 5: Python, as a newcomer types it"
python - "$run" <<'EOF'
import sys

import numpy as np

import ulstore

run = sys.argv[1]
traj = ulstore.open(run)
steps = list(traj)  # 9
assert steps == traj.steps and len(steps) > 2, steps
assert [s for s in traj] == steps
assert traj[-1].attrs.asdict() == traj[steps[-1]].attrs.asdict()  # the newest step
assert hasattr(ulstore, "sync")  # 11: subpackages are attributes
try:  # 6: a mistyped step names the ones that exist
    traj.read(steps[-1] + 12345)
except ulstore.errors.StepNotFoundError as e:
    assert str(steps[-1]) in str(e), e
else:
    raise AssertionError("a missing step read")
name = sorted(traj.tensors(steps[-1]))[0]
try:  # 6: a mistyped tensor name names the closest one
    traj.read(steps[-1], names=[name[:-1] + "x"])
except KeyError as e:
    assert name in str(e), e
else:
    raise AssertionError("a missing tensor read")
scratch = ulstore.open("memory://newcomer", mode="w")  # 7: NumPy scalars straight from a training loop
scratch.commit(0, {"w": np.ones(4, np.float32)}, metadata={"loss": np.float32(1.5), "step": np.int64(0)})
assert scratch.info(0).metadata == {"loss": 1.5, "step": 0}
try:  # 5: writing through a read cache says how to write
    ulstore.open(f"simplecache::{run}", mode="a").commit(10**6, {"w": np.ones(4, np.float32)})
except ulstore.errors.UlstoreError as e:
    assert "read" in str(e).lower(), e
else:
    raise AssertionError("a write through simplecache:: went through")
print("python checks passed")
EOF

say "8: without torch, the hint names a command that works for this install"
python - <<'EOF'
import ulstore
from ulstore.io import to_torch

traj = ulstore.open("ulstore-demo")
try:
    to_torch(traj, traj.steps[-1])
except Exception as e:
    text = str(e)
    assert "pip install -e" in text and "[torch]" in text, text
else:
    raise AssertionError("to_torch worked without torch")
print("install hint:", text.split("pip install", 1)[1][:80])
EOF

say "12, 13: with torch, a lazy bf16 slice goes straight to torch; complex64 round-trips"
pip install -q "torch==2.13.0"
python - <<'EOF'
import numpy as np
import torch

import ulstore
from ulstore.io import to_torch

traj = ulstore.open("ulstore-demo")
step = traj.steps[-1]
name = next(n for n, (shape, dtype) in traj.tensors(step).items() if len(shape) == 2)
lazy = traj[step][name][:2, :4]
t = to_torch(lazy)
assert t.dtype == torch.bfloat16 and t.shape == (2, 4)
assert np.array_equal(t.view(torch.int16).numpy().view(np.uint16), np.asarray(lazy).view(np.uint16))
c = ulstore.open("memory://newcomer-c64", mode="w")
z = (np.arange(6, dtype=np.float32) + 1j).astype(np.complex64)
c.commit(0, {"z": z})
assert torch.equal(to_torch(c, 0)["z"], torch.from_numpy(z))
print("torch checks passed")
EOF
say "the first hour holds"
