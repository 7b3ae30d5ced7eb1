"""A source tree without compiled kernels says so, once; choosing the NumPy backend on purpose is quiet."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

# Makes the compiled kernels unimportable, as in a source tree nobody built.
_UNBUILT = """
import importlib.abc, sys
class _Unbuilt(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name in ("ulstore.codec._kernels", "ulstore.codec._kernels_x86_64_v3"):
            raise ImportError(name + " is not built")
        return None
sys.meta_path.insert(0, _Unbuilt())
"""

_USE = """
import numpy as np
import ulstore
x = np.linspace(-1, 1, 1000, dtype=np.float32)
for _ in range(3):
    assert ulstore.decode(ulstore.encode(x)).tobytes() == x.tobytes()
print(ulstore.backend())
"""


def run(code: str, **env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("ULSTORE_BACKEND", "PYTHONWARNINGS")}
    full.update(env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full, timeout=120
    )


def test_unbuilt_tree_warns_once():
    p = run(_UNBUILT + _USE)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["numpy"]
    assert p.stderr.count("UserWarning") == 1, p.stderr
    assert "compiled ULPack kernels are not built" in p.stderr and "pip install -e ." in p.stderr


def test_numpy_backend_chosen_on_purpose_is_quiet():
    p = run(_UNBUILT + _USE, ULSTORE_BACKEND="numpy")
    assert p.returncode == 0 and p.stdout.split() == ["numpy"] and p.stderr == "", p.stderr
    p = run(_USE + "ulstore.set_backend('numpy'); ulstore.encode(x)", ULSTORE_BACKEND="numpy")
    assert p.returncode == 0 and p.stderr == "", p.stderr


def test_built_tree_is_quiet():
    p = run(_USE)
    assert p.returncode == 0 and p.stdout.split()[0].startswith("cython") and p.stderr == "", p.stderr
