"""Two builds of the compiled kernels side by side in one process (the A/B benchmarks' loader)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys


def load_build(path: str, where: str, name: str):
    """The kernel module ``name`` (its full dotted name) built at ``path``, loaded from its own copy in the new
    directory ``where``: the dynamic loader hands back the module it already loaded for a path it has seen,
    and the module in use keeps its place in ``sys.modules``."""
    os.makedirs(where)
    copy = os.path.join(where, os.path.basename(path))
    shutil.copyfile(path, copy)
    saved = sys.modules.pop(name, None)
    try:
        spec = importlib.util.spec_from_file_location(name, copy)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if saved is not None:
            sys.modules[name] = saved
    return module
