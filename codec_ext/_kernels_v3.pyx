# The kernels of _kernels.pyx, compiled a second time for x86-64-v3 (see setup.py).
# A separate file because each extension module needs its own generated C source.
include "_kernels.pyx"
