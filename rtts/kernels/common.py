"""What every kernel wrapper shares: whether a call runs its CUDA kernel, strict argument checks, launch argument
types, and facts about the device (cached: they never change within a process)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch

from rtts.kernels import _jit


def use_cuda(*ts: torch.Tensor) -> bool:
    """Whether a wrapper runs its CUDA kernel on these tensors: all on the GPU, and kernels available here (a GPU,
    CuPy, no RTTS_REFERENCE_KERNELS); else it runs the reference."""
    if not all(t.is_cuda for t in ts):
        return False
    return _jit.available()


def check(cond: bool, msg: str | Callable[[], str]) -> None:
    """Raise ValueError(msg) unless cond. A message that formats shapes is passed as a lambda: these checks run on
    every launch of an eager prefill, where formatting them anyway cost microseconds per call."""
    if not cond:
        raise ValueError(msg if isinstance(msg, str) else msg())


def i32(v: int) -> np.int32:
    """A 32-bit kernel argument (_jit.launch packs by the Python type)."""
    return np.int32(v)


def cuda_index(device: torch.device) -> int:
    """The CUDA device index of `device` (the current device for a bare "cuda")."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def sm_count(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


@functools.cache
def is_sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)
