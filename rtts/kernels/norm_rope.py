"""The transformer layer's small ops as single kernels (cuda/rmsnorm.cu, cuda/rope_store.cu): RMSNorm, residual add +
RMSNorm, and QK-norm + RoPE + KV-cache store. In torch each is 8-40 elementwise kernels, and a decode step runs them
for every layer of both transformers: at batch 1 the launches, not the bytes, are the cost.

The kernels serve bf16 tensors on the GPU; everything else (float32 runs, the CPU) takes the torch reference in
reference.py, the same math op for op.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from rtts.kernels import _jit, reference
from rtts.kernels.common import check, i32, use_cuda
from rtts.kernels.reference import FP8, pad4

_ROPE_WARPS = 8  # must match cuda/rope_store.cu
_NORM_THREADS = 256  # must match cuda/rmsnorm.cu


@dataclass
class QuantizedRows:
    """A normalized activation already quantized 1x128 for the FP8 GEMM it feeds (quantize_1x128's layout): the norm
    kernel writes it instead of bf16 rows, and FP8 linears take it in place of their input tensor."""

    q: torch.Tensor  # fp8 [M, K]
    scale: torch.Tensor  # fp32 [K/128, pad4(M)]
    shape: torch.Size  # of the activation it stands for, [..., K]
    dtype: torch.dtype  # of that activation (an FP8 linear returns its output in it)


def _bf16_cuda(*ts: torch.Tensor) -> bool:
    return all(t.dtype == torch.bfloat16 for t in ts) and use_cuda(*ts)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], w [D] -> rmsnorm(x) * w in x's dtype."""
    D = x.shape[-1]
    check(w.shape == (D,), lambda: f"rmsnorm: weight {tuple(w.shape)} for rows of {D}")
    if not _bf16_cuda(x, w):
        return reference.rmsnorm(x, w, eps)
    check(x.is_contiguous() and w.is_contiguous(), "rmsnorm: x and w must be contiguous")
    y = torch.empty_like(x)
    rows = x.numel() // D if D else 0
    if rows:
        _jit.launch(_jit.function("rmsnorm.cu", "rmsnorm_bf16"), (rows,), (_NORM_THREADS,),
                    (x.data_ptr(), i32(D), w.data_ptr(), y.data_ptr(), i32(D), np.float32(eps)), pdl=True)
    return y


def add_rmsnorm(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + r, both [..., D] -> (h, rmsnorm(h) * w): the residual add and the next norm in one pass."""
    D = x.shape[-1]
    check(r.shape == x.shape and w.shape == (D,),
          lambda: f"add_rmsnorm: x {tuple(x.shape)}, r {tuple(r.shape)}, w {tuple(w.shape)}")
    if not _bf16_cuda(x, r, w):
        return reference.add_rmsnorm(x, r, w, eps)
    check(x.is_contiguous() and r.is_contiguous() and w.is_contiguous(), "add_rmsnorm: tensors must be contiguous")
    h, y = torch.empty_like(x), torch.empty_like(x)
    rows = x.numel() // D if D else 0
    if rows:
        _jit.launch(_jit.function("rmsnorm.cu", "add_rmsnorm_bf16"), (rows,), (_NORM_THREADS,),
                    (x.data_ptr(), r.data_ptr(), w.data_ptr(), h.data_ptr(), y.data_ptr(), i32(D), np.float32(eps)),
                    pdl=True)
    return h, y


def rmsnorm_quant(x: torch.Tensor, w: torch.Tensor, eps: float) -> QuantizedRows:
    """rmsnorm(x) * w, as bf16 values, quantized 1x128 (what an FP8 linear would do to rmsnorm's output)."""
    D = x.shape[-1]
    check(w.shape == (D,) and D % 128 == 0,
          lambda: f"rmsnorm_quant: weight {tuple(w.shape)}, rows of {D} (a multiple of 128)")
    if not _bf16_cuda(x, w):
        q, s = reference.quantize_1x128(reference.rmsnorm(x, w, eps).to(torch.bfloat16).reshape(-1, D))
        return QuantizedRows(q, s, x.shape, x.dtype)
    check(x.is_contiguous() and w.is_contiguous(), "rmsnorm_quant: x and w must be contiguous")
    M = x.numel() // D
    q = torch.empty(M, D, dtype=FP8, device=x.device)
    s = torch.empty(D // 128, pad4(M), dtype=torch.float32, device=x.device)  # the kernel writes the padding too
    if M:
        _jit.launch(_jit.function("rmsnorm.cu", "rmsnorm_quant_bf16"), (M,), (_NORM_THREADS,),
                    (x.data_ptr(), w.data_ptr(), q.data_ptr(), s.data_ptr(), i32(M), i32(pad4(M)), i32(D),
                     np.float32(eps)), pdl=True)
    return QuantizedRows(q, s, x.shape, x.dtype)


def add_rmsnorm_quant(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, QuantizedRows]:
    """h = x + r -> (h, rmsnorm(h) * w quantized 1x128)."""
    D = x.shape[-1]
    check(r.shape == x.shape and w.shape == (D,) and D % 128 == 0,
          lambda: f"add_rmsnorm_quant: x {tuple(x.shape)}, r {tuple(r.shape)}, w {tuple(w.shape)} "
                  "(rows a multiple of 128)")
    if not _bf16_cuda(x, r, w):
        h, y = reference.add_rmsnorm(x, r, w, eps)
        q, s = reference.quantize_1x128(y.to(torch.bfloat16).reshape(-1, D))
        return h, QuantizedRows(q, s, x.shape, x.dtype)
    check(x.is_contiguous() and r.is_contiguous() and w.is_contiguous(),
          "add_rmsnorm_quant: tensors must be contiguous")
    M = x.numel() // D
    h = torch.empty_like(x)
    q = torch.empty(M, D, dtype=FP8, device=x.device)
    s = torch.empty(D // 128, pad4(M), dtype=torch.float32, device=x.device)
    if M:
        _jit.launch(_jit.function("rmsnorm.cu", "add_rmsnorm_quant_bf16"), (M,), (_NORM_THREADS,),
                    (x.data_ptr(), r.data_ptr(), w.data_ptr(), h.data_ptr(), q.data_ptr(), s.data_ptr(), i32(M),
                     i32(pad4(M)), i32(D), np.float32(eps)), pdl=True)
    return h, QuantizedRows(q, s, x.shape, x.dtype)


def qkv_rope_store(
    qkv: torch.Tensor,  # [B, S, (H + 2 * n_kv) * D]
    q_norm: torch.Tensor | None,  # [D] or None (no QK-norm)
    k_norm: torch.Tensor | None,
    eps: float,
    rope: torch.Tensor,  # [B or 1, S, D // 2, 2] (cos, sin)
    k_cache: torch.Tensor,  # [rows, ctx, n_kv, D]
    v_cache: torch.Tensor,
    rows: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B, S] int64, each in [0, ctx)
    n_head: int,
) -> torch.Tensor:
    """Split the QKV projection, QK-norm (both weights or neither) and rotate q and k, store k and v in the caches
    at (rows[b], positions[b, s]) -> q [B, S, n_head, D]."""
    check(qkv.dim() == 3 and k_cache.dim() == 4 and v_cache.shape == k_cache.shape,
          lambda: f"qkv_rope_store: want qkv [B, S, F], caches [rows, ctx, n_kv, D]; got {tuple(qkv.shape)}, "
                  f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    B, S, F = qkv.shape
    _, ctx, n_kv, D = k_cache.shape
    check(F == (n_head + 2 * n_kv) * D and D % 2 == 0,
          lambda: f"qkv_rope_store: {F} features for {n_head} + 2 x {n_kv} heads of {D}")
    check(rope.dim() == 4 and rope.shape[0] in (1, B) and tuple(rope.shape[1:]) == (S, D // 2, 2),
          lambda: f"qkv_rope_store: rope table {tuple(rope.shape)} for B={B}, S={S}, D={D}")
    check(rows.shape == (B,) and positions.shape == (B, S) and rows.dtype == positions.dtype == torch.int64,
          lambda: f"qkv_rope_store: rows int64 [{B}] and positions int64 [{B}, {S}]")
    check((q_norm is None) == (k_norm is None), "qkv_rope_store: QK-norm needs both weights")
    norms = [t for t in (q_norm, k_norm) if t is not None]
    check(all(t.shape == (D,) for t in norms), lambda: f"qkv_rope_store: norm weights must be [{D}]")
    if not _bf16_cuda(qkv, rope, k_cache, v_cache, *norms) or not use_cuda(rows, positions):
        return reference.qkv_rope_store(qkv, q_norm, k_norm, eps, rope, k_cache, v_cache, rows, positions, n_head)
    check(qkv.is_contiguous() and rope.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
          and rows.is_contiguous() and positions.is_contiguous() and all(t.is_contiguous() for t in norms),
          "qkv_rope_store: tensors must be contiguous")
    q = torch.empty(B, S, n_head, D, dtype=qkv.dtype, device=qkv.device)
    if B * S:
        heads = n_head + 2 * n_kv
        _jit.launch(_jit.function("rope_store.cu", "qkv_rope_store"), (B * S, math.ceil(heads / _ROPE_WARPS)),
                    (32 * _ROPE_WARPS,),
                    (qkv.data_ptr(), q_norm.data_ptr() if q_norm is not None else 0,
                     k_norm.data_ptr() if k_norm is not None else 0, np.float32(eps), rope.data_ptr(),
                     i32(rope.shape[0]), rows.data_ptr(), positions.data_ptr(), q.data_ptr(), k_cache.data_ptr(),
                     v_cache.data_ptr(), i32(S), i32(n_head), i32(n_kv), i32(D), i32(ctx),
                     i32(k_cache.shape[0])), pdl=True)
    return q


def warmup() -> None:
    for name in ("rmsnorm_bf16", "add_rmsnorm_bf16", "rmsnorm_quant_bf16", "add_rmsnorm_quant_bf16"):
        _jit.function("rmsnorm.cu", name)
    _jit.function("rope_store.cu", "qkv_rope_store")
