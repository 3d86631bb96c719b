"""Host time of one kernel launch, by launch path: a probe, not a benchmark.

    python bench/probes/launch_host.py      # on the GPU machine, from the repository root

Times (no synchronization inside the loop, like prefill_host.py) the rtts quantize wrapper and a bare launch of its
kernel three ways: `_jit.launch` as shipped (cuLaunchKernelEx, packed per-thread argument block, cached config),
CuPy's kernel call on an ExternalStream (the plain-launch path before), and cuLaunchKernelEx with ctypes objects built
per call (the PDL path before); next to torch ops, whose host time moves with the machine.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from rtts import kernels
from rtts.kernels import _jit


def host_us(fn: Callable[[], Any], n: int = 2000) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, time.perf_counter() - t)
        torch.cuda.synchronize()
    return 1e6 * best / n


def main() -> None:
    dev = torch.device("cuda")
    kernels.warmup(dev)
    x = torch.randn(40, 2560, device=dev, dtype=torch.bfloat16)
    xq, sx = kernels.quantize_1x128(x)
    fn = _jit.function("fp8_quant.cu", "quantize_1x128")
    M, K = x.shape
    args = (x.data_ptr(), np.int32(x.stride(0)), xq.data_ptr(), sx.data_ptr(), np.int32(M), np.int32(K),
            np.int32(sx.shape[1]))
    grid, block = ((M * (K // 128) + 7) // 8,), (256,)  # as kernels.quantize_1x128 launches it

    def cupy_call() -> None:
        with _jit.external_stream(_jit.stream_handle()):
            fn(grid, block, args)

    conv = {int: ctypes.c_uint64, np.int32: lambda a: ctypes.c_int32(int(a)), np.float32: lambda a: ctypes.c_float(a)}

    def ctypes_per_call() -> None:
        vals = [conv[type(a)](a) for a in args]
        params = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
        attr_ptr, _, n_attrs = _jit.attribute_array(True, 1)
        g, b = (grid + (1, 1))[:3], (block + (1, 1))[:3]
        cfg = _jit.LaunchConfig((ctypes.c_uint * 3)(*g), (ctypes.c_uint * 3)(*b), 0, _jit.stream_handle(), attr_ptr,
                                 n_attrs)
        _jit.launch_kernel_ex()(ctypes.byref(cfg), fn.kernel.ptr, params, None)

    calls: dict[str, Callable[[], Any]] = {
        "torch.empty": lambda: torch.empty(40, 2560, device=dev, dtype=torch.bfloat16),
        "torch rms_norm": lambda: torch.nn.functional.rms_norm(x, (2560,), None, 1e-6),
        "torch add": lambda: torch.add(x, x),
        "kernels.quantize_1x128 (wrapper)": lambda: kernels.quantize_1x128(x),
        "launch: _jit.launch, PDL (shipped)": lambda: _jit.launch(fn, grid, block, args, pdl=True),
        "launch: _jit.launch, plain (shipped)": lambda: _jit.launch(fn, grid, block, args),
        "launch: CuPy call on ExternalStream (plain, before)": cupy_call,
        "launch: cuLaunchKernelEx, ctypes per call (PDL, before)": ctypes_per_call,
    }
    for name, f in calls.items():
        print(f"host {name:45s} {host_us(f):6.2f} us", flush=True)


if __name__ == "__main__":
    main()
