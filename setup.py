"""Builds the Cython kernels in codec_ext/ as ulstore._kernels (metadata lives in pyproject.toml)."""
import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

extensions = [
    Extension(
        "ulstore._kernels",
        ["codec_ext/kernels.pyx"],
        include_dirs=[numpy.get_include(), "codec_ext"],
        extra_compile_args=["-O3"],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )
]

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
