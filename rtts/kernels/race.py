"""The sampling draw as one kernel (cuda/exponential_race.cu): argmax(probs / q) with q the stream's counter-based
Exp(1) noise (rng.py), which torch builds with ~70 elementwise kernels per draw, and a frame draws 11 times.
Bit-identical to the reference (integer hash, exact uniform, the same logf and division)."""

from __future__ import annotations

import numpy as np
import torch

from rtts.kernels import _check, _i32, _use_cuda, reference

_THREADS = 256  # must match cuda/exponential_race.cu
_DRAW_MUL = 0x27D4EB2F  # rng.stream_keys: the draw id's multiplier


def exponential_race(probs: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor, draw: int,
                     ids: torch.Tensor) -> torch.Tensor:
    """probs [B, n] (bf16 or float32), seeds/counters int64 [B], ids int64 [n] -> [B] int64 indices into ids."""
    _check(probs.dim() == 2 and ids.shape == (probs.shape[1],) and seeds.shape == counters.shape == (probs.shape[0],),
           f"exponential_race: probs [B, n], ids [n], seeds/counters [B]; got {tuple(probs.shape)}, "
           f"{tuple(ids.shape)}, {tuple(seeds.shape)}, {tuple(counters.shape)}")
    _check(ids.dtype == seeds.dtype == counters.dtype == torch.int64, "exponential_race: ids, seeds, counters int64")
    _check(draw >= 0, f"exponential_race: draw id {draw} must be >= 0")
    if probs.dtype not in (torch.bfloat16, torch.float32) or not _use_cuda(probs, seeds, counters, ids):
        return reference.exponential_race(probs, seeds, counters, draw, ids)
    _check(probs.stride(1) == 1 and seeds.is_contiguous() and counters.is_contiguous() and ids.is_contiguous(),
           "exponential_race: probs rows and the index tensors must be contiguous")
    from rtts.kernels import _jit

    B, n = probs.shape
    out = torch.empty(B, dtype=torch.int64, device=probs.device)
    if B:
        kernel = "exponential_race_bf16" if probs.dtype == torch.bfloat16 else "exponential_race_f32"
        _jit.launch(_jit.function("exponential_race.cu", kernel), (B,), (_THREADS,),
                    (probs.data_ptr(), _i32(probs.stride(0)), seeds.data_ptr(), counters.data_ptr(), ids.data_ptr(),
                     _i32(n), np.uint32(draw * _DRAW_MUL & 0xFFFFFFFF), out.data_ptr()))
    return out


def warmup() -> None:
    from rtts.kernels import _jit

    for name in ("exponential_race_bf16", "exponential_race_f32"):
        _jit.function("exponential_race.cu", name)
