"""Builds the Cython kernels of codec_ext/ into ulstore.codec (metadata lives in pyproject.toml).

The sources live outside the package (the design card's layout: ``codec_ext/`` holds the compiled
codec, ``ulstore/`` the Python); the modules they build are still ``ulstore.codec._kernels*``.

Two builds of the same source on x86-64: ``ulstore.codec._kernels`` for any x86-64 CPU
and ``ulstore.codec._kernels_x86_64_v3`` for x86-64-v3 (AVX2, BMI2, LZCNT: 2013 onwards), which
vectorises the element-wise passes twice as wide and shifts without penalties.
``ulstore.codec._backend`` picks the v3 build at import when the CPU has it.  Both give
byte-identical blobs (the tests hold them to it).
"""

import glob
import hashlib
import os
import platform
import sys
import sysconfig
from pathlib import Path

import Cython
import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SOURCES = "codec_ext"  # outside the package: the built modules go into ulstore.codec, the sources stay here
# every file the modules include (.pxi, .h) or include again (_kernels.pyx): a change to one rebuilds them
INCLUDED = sorted(glob.glob(f"{SOURCES}/*.pxi") + glob.glob(f"{SOURCES}/*.h") + [f"{SOURCES}/_kernels.pyx"])


def kernels(name, source, flags=()):
    return Extension(
        name,
        [f"{SOURCES}/{source}"],
        include_dirs=[numpy.get_include(), SOURCES],
        depends=INCLUDED,
        extra_compile_args=["-O3", *flags],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )


extensions = [kernels("ulstore.codec._kernels", "_kernels.pyx")]
gnu_like = sysconfig.get_config_var("CC") not in (None, "") and "cl.exe" not in str(sysconfig.get_config_var("CC"))
if platform.machine().lower() in ("x86_64", "amd64") and gnu_like:
    extensions.append(kernels("ulstore.codec._kernels_x86_64_v3", "_kernels_x86_64_v3.pyx", ["-march=x86-64-v3"]))

HERE = Path(__file__).resolve().parent
# An editable install (`pip install -e .`) builds the kernels into the checkout.  Installing it again, with
# an extra (`pip install -e ".[test]"`, the README's second command), would compile them all over again
# (minutes on 2 cores) from the same sources; instead it reuses them when a stamp beside each module says
# they were built from exactly these sources, this setup.py, Cython, numpy, Python and compiler settings, and
# the module is still the file that build wrote.  Anything else (a wheel, `build_ext --inplace`) builds.
EDITABLE = "editable_wheel" in sys.argv
METADATA_ONLY = bool({"egg_info", "dist_info"} & set(sys.argv)) and not (
    {"build", "build_ext", "bdist_wheel"} & set(sys.argv)
)


def _in_tree(ext) -> Path:
    return HERE.joinpath(*ext.name.split(".")).with_name(
        ext.name.rsplit(".", 1)[1] + sysconfig.get_config_var("EXT_SUFFIX")
    )


def _stamp(ext) -> Path:
    return _in_tree(ext).with_suffix(".build-stamp")


def _digest(ext) -> str | None:
    """What the in-tree module of ``ext`` was built from, and its own bytes; None if it is not there."""
    module = _in_tree(ext)
    if not module.is_file():
        return None
    h = hashlib.sha256()
    inputs = sorted(glob.glob(f"{SOURCES}/*.pyx") + glob.glob(f"{SOURCES}/*.pxi") + glob.glob(f"{SOURCES}/*.h"))
    for name in [*inputs, "setup.py"]:
        h.update(name.encode() + b"\0" + (HERE / name).read_bytes() + b"\0")
    env = [os.environ.get(k, "") for k in ("CC", "CFLAGS", "CPPFLAGS", "LDFLAGS", "LDSHARED")]
    for part in (Cython.__version__, numpy.__version__, sys.version, platform.machine(), *env):
        h.update(part.encode() + b"\0")
    h.update(module.read_bytes())
    return h.hexdigest()


def _reusable(ext) -> bool:
    stamp = _stamp(ext)
    return stamp.is_file() and stamp.read_text().strip() == _digest(ext)


class BuildKernels(build_ext):
    """One compiler per core: the kernels are two large C files, built side by side (half the wait on 2 cores)."""

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:  # not asked for (-j N)
            self.parallel = min(len(self.extensions or ()), os.cpu_count() or 1) or None


reuse = (EDITABLE or METADATA_ONLY) and all(_reusable(ext) for ext in extensions)
if reuse and EDITABLE:
    print("ulstore: reusing the kernels already built in this checkout from the same sources (ulstore/codec/*.so)")
setup(
    cmdclass={"build_ext": BuildKernels},
    ext_modules=[]
    if reuse
    else cythonize(
        extensions,
        language_level=3,
        compiler_directives={
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": False,
        },
    ),
)
if EDITABLE and not reuse:  # built into the checkout just now: stamp them for the next editable install
    for ext in extensions:
        digest = _digest(ext)
        if digest is not None:
            _stamp(ext).write_text(digest + "\n")
