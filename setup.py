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
import platform
import sysconfig

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

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

setup(
    ext_modules=cythonize(
        extensions,
        language_level=3,
        compiler_directives={
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": False,
        },
    )
)
