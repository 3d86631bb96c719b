"""The sampling draw as single kernels. A frame draws 11 times, and in torch each draw is ~15 kernels of filtering
(sort, softmax, scan, scatter, ...) and ~70 integer kernels building the noise.

- `sample` (cuda/sample.cu): top-p / top-k at temperature 1, the temperature softmax and the race, for up to 8192
  candidates (S2's main ids and every fast codebook; S1's main vocabulary is larger and keeps the torch path).
- `exponential_race` (cuda/exponential_race.cu): argmax(probs / q) with q the stream's counter-based Exp(1) noise
  (rng.py), bit-identical to the reference (integer hash, exact uniform, the same logf and division).
- `token_window_shift` (cuda/token_window.cu): the per-slot window of recent tokens the repetition-aware sampling
  reads, advanced by one step in place.
"""

from __future__ import annotations

import numpy as np
import torch

from rtts.kernels import _jit, reference
from rtts.kernels.common import check, i32, use_cuda

_THREADS = 256  # must match cuda/exponential_race.cu
_SAMPLE_THREADS, _SAMPLE_MAX_V, _SAMPLE_BINS = 1024, 8192, 4096  # must match cuda/sample.cu


def sample_smem_bytes(NP: int) -> int:
    """cuda/sample.cu's dynamic shared memory for rows of up to NP logits: the row (float), the histogram (count and
    mass per bin), the candidate keys (64-bit) and the ranked candidates."""
    return 4 * NP + 8 * _SAMPLE_BINS + 8 * NP + 8 * _SAMPLE_THREADS


_DRAW_MUL = 0x27D4EB2F  # rng.stream_keys: the draw id's multiplier


def _draw_mul(draw: int) -> np.uint32:
    """The draw id's term of the stream key, (draw * 0x27D4EB2F) mod 2^32, as the kernels take it."""
    return np.uint32(draw * _DRAW_MUL & 0xFFFFFFFF)


def exponential_race(probs: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor, draw: int,
                     ids: torch.Tensor) -> torch.Tensor:
    """probs [B, n] (bf16 or float32), seeds/counters int64 [B], ids int64 [n] -> [B] int64 indices into ids."""
    check(probs.dim() == 2 and ids.shape == (probs.shape[1],) and seeds.shape == counters.shape == (probs.shape[0],),
          lambda: f"exponential_race: probs [B, n], ids [n], seeds/counters [B]; got {tuple(probs.shape)}, "
                  f"{tuple(ids.shape)}, {tuple(seeds.shape)}, {tuple(counters.shape)}")
    check(ids.dtype == seeds.dtype == counters.dtype == torch.int64, "exponential_race: ids, seeds, counters int64")
    check(draw >= 0, lambda: f"exponential_race: draw id {draw} must be >= 0")
    if probs.dtype not in (torch.bfloat16, torch.float32) or not use_cuda(probs, seeds, counters, ids):
        return reference.exponential_race(probs, seeds, counters, draw, ids)
    check(probs.stride(1) == 1 and seeds.is_contiguous() and counters.is_contiguous() and ids.is_contiguous(),
          "exponential_race: probs rows and the index tensors must be contiguous")
    B, n = probs.shape
    out = torch.empty(B, dtype=torch.int64, device=probs.device)
    if B:
        kernel = "exponential_race_bf16" if probs.dtype == torch.bfloat16 else "exponential_race_f32"
        _jit.launch(_jit.function("exponential_race.cu", kernel), (B,), (_THREADS,),
                    (probs.data_ptr(), i32(probs.stride(0)), seeds.data_ptr(), counters.data_ptr(), ids.data_ptr(),
                     i32(n), _draw_mul(draw), out.data_ptr()))
    return out


_SAMPLE_KERNELS = {(torch.bfloat16, torch.bfloat16): "sample_bf16_bf16", (torch.bfloat16, torch.float32):
                   "sample_bf16_f32", (torch.float32, torch.float32): "sample_f32_f32"}


def sample_fast(logits: torch.Tensor, temperature: torch.Tensor) -> bool:
    """Whether `sample` runs its kernel for these (else the torch ops, identical math)."""
    return ((logits.dtype, temperature.dtype) in _SAMPLE_KERNELS and logits.dim() == 2
            and 0 < logits.shape[1] <= _SAMPLE_MAX_V and use_cuda(logits, temperature))


def sample(
    logits: torch.Tensor,  # [B, V]
    temperature: torch.Tensor,  # [B] (param dtype)
    top_p: torch.Tensor,  # [B] (param dtype)
    top_k: torch.Tensor,  # [B] int64
    seeds: torch.Tensor,  # [B] int64
    counters: torch.Tensor,  # [B] int64
    draw: int,
    ids: torch.Tensor,  # [V] int64: the vocabulary id of each logit column (the noise is a function of it)
) -> torch.Tensor:
    """reference.filtered_probs + the exponential race with the default noise -> [B] int64 indices into ids."""
    check(logits.dim() == 2 and ids.shape == (logits.shape[1],),
          lambda: f"sample: logits [B, V] and ids [V]; got {tuple(logits.shape)}, {tuple(ids.shape)}")
    B = logits.shape[0]
    check(all(t.shape == (B,) for t in (temperature, top_p, top_k, seeds, counters)),
          lambda: f"sample: temperature, top_p, top_k, seeds, counters must be [{B}]")
    check(top_p.dtype == temperature.dtype and top_k.dtype == ids.dtype == seeds.dtype == counters.dtype
          == torch.int64, "sample: top_p in the temperature's dtype; top_k, seeds, counters, ids int64")
    check(draw >= 0, lambda: f"sample: draw id {draw} must be >= 0")
    if not sample_fast(logits, temperature) or not use_cuda(top_p, top_k, seeds, counters, ids):
        # (S1's main vocabulary, the CPU): the torch filter, then the race kernel where there is a GPU
        probs = reference.filtered_probs(logits, temperature, top_p, top_k)
        return exponential_race(probs, seeds, counters, draw, ids)
    check(logits.stride(1) == 1 and all(t.is_contiguous() for t in (temperature, top_p, top_k, seeds, counters, ids)),
          "sample: logits rows and the per-row tensors must be contiguous")
    V = logits.shape[1]
    NP = max(2, 1 << (V - 1).bit_length())
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B:
        fn = _jit.function("sample.cu", _SAMPLE_KERNELS[(logits.dtype, temperature.dtype)])
        _jit.set_dynamic_smem(fn, sample_smem_bytes(NP))
        _jit.launch(fn, (B,), (_SAMPLE_THREADS,),
                    (logits.data_ptr(), i32(logits.stride(0)), temperature.data_ptr(), top_p.data_ptr(),
                     top_k.data_ptr(), seeds.data_ptr(), counters.data_ptr(), ids.data_ptr(), i32(V), i32(NP),
                     _draw_mul(draw), out.data_ptr()), shared_mem=sample_smem_bytes(NP))
    return out


def token_window_shift(buf: torch.Tensor, slots: torch.Tensor, new: torch.Tensor, active: torch.Tensor) -> None:
    """In place: buf int32 [S, W, C]; for each row b with active[b], slot slots[b]'s window shifts left by one and
    new[b] (int32 [B, C]) becomes its last column. Graph-safe (no host reads)."""
    check(buf.dtype == torch.int32 and buf.dim() == 3 and buf.is_contiguous(),
          "token_window_shift: buf int32 [S, W, C]")
    B = slots.shape[0]
    check(new.dtype == torch.int32 and tuple(new.shape) == (B, buf.shape[2]) and new.is_contiguous(),
          lambda: f"token_window_shift: new must be int32 [{B}, {buf.shape[2]}]")
    check(slots.dtype == torch.int64 and active.dtype == torch.bool and active.shape == (B,),
          "token_window_shift: slots int64 [B], active bool [B]")
    W, C = buf.shape[1], buf.shape[2]
    check(W * C <= 1024, "token_window_shift: W * C must be <= 1024")
    if not use_cuda(buf, slots, new, active):
        reference.token_window_shift(buf, slots, new, active)
        return
    fn = _jit.function("token_window.cu", "token_window_shift")
    threads = max(32, (W * C + 31) // 32 * 32)
    _jit.launch(fn, (B,), (threads,), (buf.data_ptr(), slots.data_ptr(), new.data_ptr(), active.data_ptr(), i32(W),
                                       i32(C)))


def warmup() -> None:
    _jit.function("token_window.cu", "token_window_shift")
    for name in ("exponential_race_bf16", "exponential_race_f32"):
        _jit.function("exponential_race.cu", name)
    for name in _SAMPLE_KERNELS.values():
        _jit.set_dynamic_smem(_jit.function("sample.cu", name), sample_smem_bytes(_SAMPLE_MAX_V))
