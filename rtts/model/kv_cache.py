"""KV caches: static buffers indexed by row, [n_layer, rows, positions, n_kv_heads, head_dim] for K and for V.

Two uses:
- the slow transformer's cache has one row per slot (one slot = one live stream, for its whole life). Position p of
  slot s lives at `[:, s, p]`; what a stream may read is bounded by its own length (kept by the engine), so a reused
  slot needs no clearing: stale entries past the new stream's length are never attended. It is sized from the
  configured max context, never from the model's 32768 positions for every slot (that costs GBs and makes every step
  read empty slots);
- the fast (codebook) transformer's cache has one row per batch row and 10 positions: it is rewritten from position 0
  every frame, so it needs no per-slot persistence.

Why contiguous per slot rather than paged: a TTS stream's context is bounded and known up front (voice prompt of
~200-650 positions + turns), so a fixed per-slot budget wastes little; S2-Pro needs 147 KB per position in bf16, so
65 slots x 4097 positions = 39 GB, which fits an H200 beside the 9 GB of weights. In exchange the decode-attention
kernel reads each stream's K/V as one contiguous run per head with no page-table indirection (its figures are in
bench/results/attention/), every CUDA graph sees
static shapes, and reusing a slot needs no allocator. Paging would pay off for very long, rarely full contexts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVCache:
    k: torch.Tensor  # [n_layer, rows, positions, n_kv, head_dim]
    v: torch.Tensor  # [n_layer, rows, positions, n_kv, head_dim]

    @classmethod
    def allocate(
        cls,
        n_layer: int,
        rows: int,
        positions: int,
        n_kv: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> KVCache:
        shape = (n_layer, rows, positions, n_kv, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    @property
    def positions(self) -> int:
        return self.k.shape[2]

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()
