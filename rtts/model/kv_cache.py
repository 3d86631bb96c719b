"""Slot-indexed KV caches.

`SlotKVCache` holds the slow transformer's keys and values for every slot (one slot = one live stream):

    k, v: [n_layer, max_slots, max_ctx, n_kv_heads, head_dim]

A stream owns one slot for its whole life. Position p of slot s lives at `[:, s, p]`; what a stream may read is bounded
by its own length (kept by the engine), so a reused slot needs no clearing: stale entries past the new stream's length
are never attended. The cache is sized from the configured max context, never from the model's 32768 positions for
every slot (that costs GBs and makes every step read empty slots).

`FastKVCache` holds the fast (codebook) transformer's keys/values per batch row, [n_fast_layer, rows, 10, n_kv, hd]:
it is rewritten from position 0 every frame, so it needs no per-slot persistence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SlotKVCache:
    k: torch.Tensor  # [n_layer, max_slots, max_ctx, n_kv, head_dim]
    v: torch.Tensor  # [n_layer, max_slots, max_ctx, n_kv, head_dim]

    @classmethod
    def allocate(
        cls,
        n_layer: int,
        max_slots: int,
        max_ctx: int,
        n_kv: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> SlotKVCache:
        shape = (n_layer, max_slots, max_ctx, n_kv, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @property
    def max_slots(self) -> int:
        return self.k.shape[1]

    @property
    def max_ctx(self) -> int:
        return self.k.shape[2]

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


@dataclass
class FastKVCache:
    k: torch.Tensor  # [n_fast_layer, rows, positions, n_kv, head_dim]
    v: torch.Tensor

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
    ) -> FastKVCache:
        shape = (n_layer, rows, positions, n_kv, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
