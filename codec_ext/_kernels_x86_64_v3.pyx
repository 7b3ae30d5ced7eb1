# The kernels of _kernels.pyx, compiled a second time for x86-64-v3 (see setup.py).
# A separate file because each extension module needs its own generated C source.
# Named after the ISA level it is built for (-march=x86-64-v3), not after AVX2 alone: the compiler may use
# any instruction of the level (AVX2, BMI2, LZCNT, MOVBE, FMA, F16C) anywhere, so the module runs only on a
# CPU with all of them, which is what ulstore.codec._backend checks before importing it.
include "_kernels.pyx"
