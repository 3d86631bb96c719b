"""Decode attention (cuda/decode_attention.cu): one query per stream over its slot of the KV cache, split over the
keys (split-KV) and merged by the last split or a second launch.

`plan_attention` picks the split (`attention_splits`, `attention_fuses`); `launch_attention` runs any plan (probes
build their own: bench/probes/attention_variants.py). The planner's constants were fitted on an H200; the figures are
in bench/results/traces/README.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import torch

from rtts.kernels import _jit, reference
from rtts.kernels.common import check, cuda_index, i32, sm_count, use_cuda
from rtts.kernels.gemm import streamk_scratch
from rtts.kernels.gemm_plan import SMS

_TILE = 64  # keys per pipeline stage; must match cuda/decode_attention.cu
STAGES = 2  # must match cuda/decode_attention.cu
CTAS_PER_SM = 2  # 64 KB of K/V tiles each (head dim 128); the kernels' launch bounds (decode_attention.cu)
# The merging CTA keeps every split's (max, sum) per query head in its pipeline memory: 2 x S x G floats, within the
# 32 KB of head dim 64 for G up to 8 at this many splits.
MAX_SPLITS = 256
# The last split merges (no second launch) from this many splits, when the grid is one wave (attention_fuses).
_FUSE_MIN_SPLITS = 4
# What each split adds to the merge, in 64-key tiles of one CTA's stream (attention_splits): fitted to forced-split
# timings, where the planner's many splits at one stream x 2048 keys were slower than fewer.
_MERGE_TILES_PER_SPLIT = 0.125


def attention_splits(B: int, n_kv: int, L: int, sms: int = SMS, ctas_per_sm: int = CTAS_PER_SM) -> tuple[int, int]:
    """(splits, keys per split) for a cache of L positions. CTAs run in waves of `ctas_per_sm` per SM, so a
    split count that leaves the last wave nearly empty costs a whole wave: pick the split minimizing
    waves x (64-key tiles per CTA + a fixed cost of about two tiles for the pipeline fill and the merge) plus the
    merge's reading of every split (_MERGE_TILES_PER_SPLIT each), with at most MAX_SPLITS splits."""
    slots = sms * ctas_per_sm
    best: tuple[float, int, int] | None = None
    for want in range(1, min(MAX_SPLITS, max(1, math.ceil(L / _TILE))) + 1):
        chunk = math.ceil(math.ceil(L / want) / _TILE) * _TILE
        S = math.ceil(L / chunk)
        cost = math.ceil(B * n_kv * S / slots) * (chunk / _TILE + 2) + S * _MERGE_TILES_PER_SPLIT
        if best is None or cost < best[0]:
            best = (cost, S, chunk)
    assert best is not None
    return best[1], best[2]


def attention_fuses(B: int, n_kv: int, S: int, sms: int = SMS, ctas_per_sm: int = CTAS_PER_SM) -> bool:
    """Whether the split CTAs merge their partials themselves (the `_fused` kernels) instead of a second launch: only
    for one wave of enough splits. Fused, the merging CTA holds its SM slot through dependent L2 round trips, which
    later waves wait for, while a second launch merges with memory idle; with few splits the second launch was faster
    too (bench/results/traces/README.md)."""
    return S >= _FUSE_MIN_SPLITS and B * n_kv * S <= sms * ctas_per_sm


def attention_smem_bytes(D: int, stages: int = STAGES) -> int:
    """Dynamic shared memory of one attention CTA: the K and V tiles of every pipeline stage."""
    return stages * 2 * _TILE * D * 2


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """How decode attention runs: `splits` CTAs per (stream, KV head), `chunk` keys each, merged by the last split
    (`fused`) or by a second launch, with `smem` bytes of dynamic shared memory per CTA."""

    splits: int
    chunk: int
    fused: bool
    smem: int


@functools.cache
def plan_attention(B: int, n_kv: int, L: int, D: int, sms: int) -> AttentionPlan:
    """The plan decode_attention launches for B streams of n_kv KV heads of dim D over caches of L positions."""
    S, chunk = attention_splits(B, n_kv, L, sms)
    return AttentionPlan(S, chunk, S > 1 and attention_fuses(B, n_kv, S, sms), attention_smem_bytes(D))


def decode_attention_fast(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether decode_attention would run its CUDA kernel for these tensors (callers keep their own reference
    attention otherwise, e.g. the float32 CPU path)."""
    H, D = q.shape[-2], q.shape[-1]
    n_kv = k_cache.shape[-2]
    return (q.dtype == k_cache.dtype == torch.bfloat16 and D in (64, 128) and H % n_kv == 0
            and H // n_kv in (1, 2, 4, 8) and use_cuda(q, k_cache))


def decode_attention(
    q: torch.Tensor,  # [B, H, D] bf16
    k_cache: torch.Tensor,  # [rows, L, n_kv, D] bf16
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [B] int64
    lens: torch.Tensor,  # [B] int64, each in [1, L]
) -> torch.Tensor:
    """Softmax attention of one query per stream over positions [0, lens) of its slot -> [B, H, D] bf16.
    Lengths are read on the device: one captured graph serves any lengths up to L."""
    check(q.dim() == 3 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape,
          lambda: f"decode_attention: want q [B, H, D], caches [rows, L, n_kv, D]; "
                  f"got {tuple(q.shape)}, {tuple(k_cache.shape)}")
    B, H, D = q.shape
    rows, L, n_kv, Dk = k_cache.shape
    check(D == Dk and H % n_kv == 0, lambda: f"decode_attention: head dims {D} vs {Dk}, heads {H} vs kv heads {n_kv}")
    check(q.dtype == k_cache.dtype == v_cache.dtype == torch.bfloat16, "decode_attention: bf16 tensors only")
    check(q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous(),
          "decode_attention: tensors must be contiguous")
    check(slots.dtype == torch.int64 and lens.dtype == torch.int64 and slots.shape == lens.shape == (B,),
          "decode_attention: slots and lens must be int64 [B]")
    G = H // n_kv
    if not use_cuda(q, k_cache, v_cache, slots, lens) or D not in (64, 128) or G not in (1, 2, 4, 8):
        return reference.decode_attention(q, k_cache, v_cache, slots, lens)
    plan = plan_attention(B, n_kv, L, D, sm_count(cuda_index(q.device)))
    return launch_attention(plan, q, k_cache, v_cache, slots, lens)


def launch_attention(plan: AttentionPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slots: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Run the decode-attention kernels with a given plan (decode_attention's, or a probe's) on tensors that
    decode_attention has checked."""
    B, H, D = q.shape
    _, L, n_kv, _ = k_cache.shape
    G = H // n_kv
    S, smem = plan.splits, plan.smem
    out = torch.empty_like(q)
    counters = out  # unused unless fused
    if S > 1:
        ws_o = torch.empty(B, n_kv, S, G, D, dtype=torch.float32, device=q.device)
        ws_ml = torch.empty(B, n_kv, S, G, 2, dtype=torch.float32, device=q.device)
        check(2 * S * G * 4 <= smem, lambda: f"decode_attention: {S} splits x {G} heads exceed the merge buffer")
    else:
        ws_o = ws_ml = out  # unused
    if plan.fused:
        # The last split of each (stream, KV head) merges them; its count lives in this stream's (or graph
        # family's) scratch, like the GEMM's tile counters, so concurrent streams never share one.
        counters = streamk_scratch(q.device).att_counters
        check(B * n_kv <= counters.numel(), lambda: f"decode_attention: {B} streams x {n_kv} KV heads exceed the "
                                                    "split counters")
    fn = _jit.function("decode_attention.cu", f"decode_attention_{'fused_' if plan.fused else ''}{D}_{G}")
    _jit.set_dynamic_smem(fn, smem)
    _jit.launch(fn, (S, n_kv, B), (128,), (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
                                           lens.data_ptr(), ws_o.data_ptr(), ws_ml.data_ptr(), out.data_ptr(),
                                           counters.data_ptr(), i32(n_kv), i32(L), i32(plan.chunk),
                                           np.float32(1.0 / math.sqrt(D))),
                shared_mem=smem)
    if S > 1 and not plan.fused:
        merge = _jit.function("decode_attention.cu", f"decode_attention_merge_{D}_{G}")
        _jit.launch(merge, (n_kv, B), (128,), (ws_o.data_ptr(), ws_ml.data_ptr(), out.data_ptr(), i32(n_kv),
                                               i32(S)), shared_mem=2 * S * G * 4)
    return out


def warmup() -> None:
    for d in (64, 128):
        for g in (1, 2, 4, 8):
            for kind in ("", "fused_"):
                _jit.set_dynamic_smem(_jit.function("decode_attention.cu", f"decode_attention_{kind}{d}_{g}"),
                                      attention_smem_bytes(d))
            _jit.function("decode_attention.cu", f"decode_attention_merge_{d}_{g}")  # <= 16 KB: the default limit
