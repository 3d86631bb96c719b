"""Hot GPU ops: CUDA C++ in `cuda/*.cu`, compiled at run time through CuPy, each with a pure-torch reference.

This package is the only place that may import CuPy (lazily, in `_jit.py`); everything else calls the typed ops here,
which fall back to the torch references when CUDA or CuPy is missing or `RTTS_REFERENCE_KERNELS=1`.
"""
