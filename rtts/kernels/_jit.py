"""The only module that imports CuPy: compile `cuda/*.cu` with NVRTC at run time, cache, and launch on torch's stream.

- Sources: the in-wheel copy (`rtts/_cuda`) if installed, else the repository's `cuda/`. `#include "x.cuh"` lines are
  inlined, so the compiled text (and every cache key) covers every byte of every header.
- Options: `-arch=sm_90a` on Hopper (wgmma/FP8 MMA need the `a` target; CuPy appends its own `-arch=sm_90`, which NVRTC
  lets the first one override), `--std=c++17`, and `-DRTTS_SRC_HASH=<sha256 prefix>` so CuPy's disk cache can never
  serve a stale binary.
- Modules are compiled once per process (functools.cache, keyed by the source hash, NVRTC version and options) and
  must be loaded before any CUDA-graph capture: `warmup()` does that.
- Launches read torch's current stream at every call (inside graph capture that is the capture stream), as the raw
  handle (`stream_handle`: no Stream object per launch; eager prefill launches hundreds of kernels, and the host time
  of each is on the turn's first-audio path).
- `tensor_map_2d(...)` encodes a TMA tensor map (the driver's cuTensorMapEncodeTiled, ctypes) that a kernel takes by
  value as a `__grid_constant__ TensorMap` parameter; launches carrying one go through cuLaunchKernelEx.
- `launch` goes straight to the driver's cuLaunchKernelEx (ctypes; CuPy's kernel call only where the driver lacks
  it): arguments are packed into a per-thread buffer laid out once per argument signature, the launch config is
  cached per shape, so a launch builds no Python or ctypes objects (eager prefill launches hundreds). With
  `pdl=True` it sets programmatic stream serialization, so the kernel may start while the previous one on the stream
  finishes; the kernel itself must `griddepcontrol.wait` before touching anything that kernel wrote (CUDA graphs keep
  the edge).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import re
import struct
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rtts import env


class KernelCompileError(RuntimeError):
    """NVRTC refused a kernel; the message names the source and carries the compiler log."""


def cuda_dir() -> Path:
    here = Path(__file__).resolve().parent.parent
    for d in (here / "_cuda", here.parent / "cuda"):
        if d.is_dir():
            return d
    raise FileNotFoundError("the cuda/ kernel sources are not installed")


def _inline(path: Path, seen: set[Path] | None = None) -> str:
    seen = seen if seen is not None else set()
    out = []
    for line in path.read_text().splitlines():
        m = re.match(r'\s*#include\s+"([^"]+)"', line)
        if m:
            inc = (path.parent / m.group(1)).resolve()
            if inc not in seen:
                seen.add(inc)
                out.append(_inline(inc, seen))
            continue
        if line.strip() == "#pragma once":
            continue
        out.append(line)
    return "\n".join(out)


def source(name: str) -> str:
    return _inline(cuda_dir() / name)


@functools.cache
def _cupy() -> Any:
    import cupy  # noqa: PLC0415  (the one place CuPy is imported)

    if env.kernel_cache_dir():
        import os  # noqa: PLC0415

        os.environ.setdefault("CUPY_CACHE_DIR", env.kernel_cache_dir() or "")
    return cupy


def available() -> bool:
    """CUDA kernels can run here (a GPU, CuPy, and no RTTS_REFERENCE_KERNELS)."""
    return not env.kernel_switches().reference_kernels and _gpu_and_cupy()


@functools.cache  # asked on every wrapper call; neither answer changes within a process
def _gpu_and_cupy() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        _cupy()
    except ImportError:
        return False
    return True


def stream_handle(device_index: int | None = None) -> int:
    """torch's current CUDA stream on `device_index` (default: the current device) as a raw handle."""
    idx = torch._C._cuda_getDevice() if device_index is None else device_index
    return int(torch._C._cuda_getCurrentRawStream(idx))


def arch_option() -> str:
    major, minor = torch.cuda.get_device_capability()
    return "-arch=sm_90a" if (major, minor) == (9, 0) else f"-arch=sm_{major}{minor}"


@functools.cache
def _module(name: str, name_expressions: tuple[str, ...], text: str, options: tuple[str, ...]) -> Any:
    cp = _cupy()
    try:
        mod = cp.RawModule(code=text, options=options, name_expressions=name_expressions or None)
        mod.compile()
    except cp.cuda.compiler.CompileException as e:
        raise KernelCompileError(f"cuda/{name}: NVRTC compile failed\n{e.get_message()}") from None
    return mod


def nvrtc_version() -> str:
    """The NVRTC version kernels are compiled with, e.g. "13.0"."""
    return ".".join(map(str, _cupy().cuda.nvrtc.getVersion()))


def module(name: str, name_expressions: tuple[str, ...] = ()) -> Any:
    text = source(name)
    src_hash = hashlib.sha256(f"{text}\0{nvrtc_version()}".encode()).hexdigest()[:16]
    options = (arch_option(), "--std=c++17", f"-DRTTS_SRC_HASH=0x{src_hash}")
    return _module(name, name_expressions, text, options)


@functools.cache
def function(name: str, kernel: str, name_expressions: tuple[str, ...] = ()) -> Any:
    mod = module(name, name_expressions)
    return mod.get_function(kernel)


_SMEM_SET: dict[int, int] = {}


def forget_compiled() -> None:
    """Drop every compiled module and function (probes that patch `source` in memory, then recompile)."""
    _module.cache_clear()
    function.cache_clear()
    _SMEM_SET.clear()


def set_dynamic_smem(fn: Any, nbytes: int) -> None:
    """Allow `nbytes` of dynamic shared memory (above the 48 KB default) for `fn`; once per function and size,
    and before any graph capture (warmup() does it for every instance)."""
    if _SMEM_SET.get(id(fn), 0) >= nbytes:
        return
    fn.max_dynamic_shared_size_bytes = nbytes  # cupy.RawKernel: CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    _SMEM_SET[id(fn)] = nbytes


@functools.cache
def external_stream(ptr: int) -> Any:
    """CuPy's stream over torch's raw handle `ptr` (launches where the driver lacks cuLaunchKernelEx; probes)."""
    # NOTE: ExternalStream wraps the exact handle torch uses, including 0 (the legacy default stream). CuPy 14
    # deprecates it in favour of Stream.from_external, which ran our kernels out of order with torch's eager ops in a
    # test (results read before they were written), so the deprecated, exact wrapper stays.
    import warnings  # noqa: PLC0415

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return _cupy().cuda.ExternalStream(ptr)


def launch(fn: Any, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...], shared_mem: int = 0,
           pdl: bool = False, cluster: int = 1) -> None:
    """Launch on torch's current stream (read now: inside a graph capture it is the capture stream).

    Pointer arguments are passed as Python ints (tensor.data_ptr(), 8 bytes); 32-bit ints and floats must be numpy
    scalars (np.int32 / np.float32) so they have the kernel's parameter size. `pdl`: programmatic dependent launch
    where the driver has it (module docstring). `cluster` > 1: thread-block clusters of that many CTAs along x (the
    grid must be a multiple of it).
    """
    if launch_kernel_ex() is not None:
        _launch_ex(fn, grid, block, args, shared_mem, pdl and pdl_available(), cluster)
        return
    if cluster > 1 or any(isinstance(a, TensorMap) for a in args):
        raise RuntimeError("cluster and tensor-map launches need the driver's cuLaunchKernelEx")
    with external_stream(stream_handle()):
        fn(grid, block, args, shared_mem=shared_mem)


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, 4 bytes of padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


@functools.cache
def _driver() -> Any:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


@functools.cache
def launch_kernel_ex() -> Any:
    """The driver's cuLaunchKernelEx, or None where the driver lacks it (then launches are plain)."""
    try:
        fn = _driver().cuLaunchKernelEx
    except AttributeError:
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return fn


@functools.cache  # one array per (pdl, cluster), kept alive here: launches only point at it
def attribute_array(pdl: bool, cluster: int) -> tuple[Any, Any, int]:
    """The launch attributes for (pdl, cluster) as the driver reads them: (pointer, the array it points into, count)."""
    attrs = _attributes(pdl, cluster)
    arr = (_LaunchAttribute * max(1, len(attrs)))(*attrs)
    return ctypes.cast(arr, ctypes.POINTER(_LaunchAttribute)), arr, len(attrs)


def _attributes(pdl: bool, cluster: int) -> list[_LaunchAttribute]:
    attrs = []
    if cluster > 1:
        a = _LaunchAttribute(id=_CLUSTER_DIMENSION)
        a.value[0], a.value[1], a.value[2] = cluster, 1, 1
        attrs.append(a)
    if pdl:
        a = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
        a.value[0] = 1  # programmaticStreamSerializationAllowed
        attrs.append(a)
    return attrs


def max_active_clusters(fn: Any, cluster: int, block: int, shared_mem: int) -> int:
    """How many clusters of `cluster` CTAs of `fn` (block threads, shared_mem dynamic bytes each) the GPU runs at
    once (cuOccupancyMaxActiveClusters); 0 where the driver cannot say."""
    drv = _driver()
    if drv is None or not hasattr(drv, "cuOccupancyMaxActiveClusters"):
        return 0
    attrs = _attributes(False, cluster)
    arr = (_LaunchAttribute * len(attrs))(*attrs)
    cfg = LaunchConfig((ctypes.c_uint * 3)(cluster, 1, 1), (ctypes.c_uint * 3)(block, 1, 1), shared_mem, None,
                        ctypes.cast(arr, ctypes.POINTER(_LaunchAttribute)), len(attrs))
    n = ctypes.c_int(0)
    rc = drv.cuOccupancyMaxActiveClusters(ctypes.byref(n), ctypes.c_void_p(fn.kernel.ptr), ctypes.byref(cfg))
    return int(n.value) if rc == 0 else 0


class TensorMap(ctypes.Structure):  # CUtensorMap: 128 opaque bytes, which the driver wants 64-byte aligned
    _pack_ = 8
    _fields_ = [("opaque", ctypes.c_uint64 * 16)]


def aligned_tensor_map() -> TensorMap:
    """A zeroed TensorMap at a 64-byte aligned host address (cuTensorMapEncodeTiled requires it; ctypes aligns the
    structure to 8 only). It views a larger buffer, which it keeps alive."""
    buf = (ctypes.c_ubyte * (ctypes.sizeof(TensorMap) + 64))()
    return TensorMap.from_buffer(buf, -ctypes.addressof(buf) % 64)


_U8, _SWIZZLE_128B, _L2_PROMOTE_128B = 0, 3, 2  # CU_TENSOR_MAP_DATA_TYPE_UINT8, ..._SWIZZLE_128B, ..._L2_PROMOTION_128B


def tensor_maps_available() -> bool:
    drv = _driver()
    return drv is not None and hasattr(drv, "cuTensorMapEncodeTiled") and launch_kernel_ex() is not None


@functools.lru_cache(maxsize=4096)  # pure in its arguments; a captured graph keeps its own copy of the parameter
def tensor_map_2d(ptr: int, rows: int, cols: int, box_rows: int, box_cols: int) -> TensorMap:
    """TMA map over a row-major byte matrix [rows, cols] at device address `ptr` (16-byte aligned, cols % 16 == 0):
    boxes of box_rows x box_cols bytes (box_cols <= 128) land in shared memory with the 128-byte swizzle the wgmma
    descriptors read (desc_sw128); rows past `rows` are filled with zeros."""
    if ptr % 16 or cols % 16 or rows < 1 or box_cols > 128 or not 1 <= box_rows <= 256:
        raise ValueError(f"tensor_map_2d: unsupported map {rows}x{cols} box {box_rows}x{box_cols} at {ptr:#x}")
    m = aligned_tensor_map()
    dims = (ctypes.c_uint64 * 2)(cols, rows)
    strides = (ctypes.c_uint64 * 1)(cols)
    box = (ctypes.c_uint32 * 2)(box_cols, box_rows)
    unit = (ctypes.c_uint32 * 2)(1, 1)
    rc = _driver().cuTensorMapEncodeTiled(ctypes.byref(m), _U8, 2, ctypes.c_void_p(ptr), dims, strides, box, unit, 0,
                                          _SWIZZLE_128B, _L2_PROMOTE_128B, 0)
    if rc != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {rc}")
    return m


def pdl_available() -> bool:
    return not env.kernel_switches().no_pdl and launch_kernel_ex() is not None


# Kernel argument packing, by exact Python type: (struct code, alignment). Device pointers are Python ints (8 bytes);
# 32-bit values must be numpy scalars; a TensorMap travels by value (128 bytes, 64-byte aligned).
_PACK: dict[type, tuple[str, int]] = {int: ("Q", 8), np.int32: ("i", 4), np.uint32: ("I", 4), np.float32: ("f", 4)}


@dataclasses.dataclass
class _ArgBlock:
    """The packed arguments of one signature on one thread: `packer` writes them into `buf` at `offset` (64-byte
    aligned), where `params` (the driver's void** kernelParams) already points. The driver copies the values during
    the launch call, so the next launch on this thread may overwrite them."""

    packer: struct.Struct
    buf: Any  # ctypes char array
    offset: int
    params: Any  # ctypes c_void_p array
    maps: tuple[int, ...]  # argument positions holding a TensorMap (packed as its bytes)


_TLS = threading.local()  # per thread: {signature: _ArgBlock} and {launch shape: LaunchConfig}


def _arg_block(sig: tuple[type, ...]) -> _ArgBlock:
    blocks: dict[tuple[type, ...], _ArgBlock] = _TLS.__dict__.setdefault("blocks", {})
    blk = blocks.get(sig)
    if blk is not None:
        return blk
    fmt, offsets, off = ["<"], [], 0
    for t in sig:
        code, align = ("128s", 64) if t is TensorMap else _PACK.get(t, ("", 0))
        if not code:
            raise TypeError(f"unsupported kernel argument type {t.__name__}")
        if off % align:
            fmt.append(f"{align - off % align}x")
            off += align - off % align
        offsets.append(off)
        fmt.append(code)
        off += struct.calcsize(code)
    packer = struct.Struct("".join(fmt))
    buf = ctypes.create_string_buffer(packer.size + 64)
    base = -ctypes.addressof(buf) % 64
    params = (ctypes.c_void_p * max(1, len(sig)))(*[ctypes.addressof(buf) + base + o for o in offsets])
    blk = _ArgBlock(packer, buf, base, params, tuple(i for i, t in enumerate(sig) if t is TensorMap))
    blocks[sig] = blk
    return blk


def _launch_config(grid: tuple[int, ...], block: tuple[int, ...], shared_mem: int, pdl: bool,
                   cluster: int) -> LaunchConfig:
    """This thread's launch config for a shape (the stream is set per launch)."""
    configs: dict[tuple[Any, ...], LaunchConfig] = _TLS.__dict__.setdefault("configs", {})
    key = (grid, block, shared_mem, pdl, cluster)
    cfg = configs.get(key)
    if cfg is None:
        attr_ptr, _, n_attrs = attribute_array(pdl, cluster)
        g, b = (tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3]
        cfg = LaunchConfig((ctypes.c_uint * 3)(*g), (ctypes.c_uint * 3)(*b), shared_mem, None, attr_ptr, n_attrs)
        configs[key] = cfg
    return cfg


def _launch_ex(fn: Any, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...], shared_mem: int,
               pdl: bool, cluster: int) -> None:
    blk = _arg_block(tuple(map(type, args)))
    if blk.maps:
        args = tuple(bytes(a) if i in blk.maps else a for i, a in enumerate(args))
    blk.packer.pack_into(blk.buf, blk.offset, *args)
    cfg = _launch_config(grid, block, shared_mem, pdl, cluster)
    cfg.stream = stream_handle()
    rc = launch_kernel_ex()(ctypes.byref(cfg), fn.kernel.ptr, blk.params, None)
    if rc != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {rc}")
