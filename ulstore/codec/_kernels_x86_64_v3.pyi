# The same source as _kernels, built for x86-64-v3 (see codec_ext/_kernels_x86_64_v3.pyx): the same names.
from ._kernels import *  # noqa: F403
