"""Interleaved-pair rotary embedding with bf16-rounded tables (the DualAR convention).

NOTE: this is not the HF `rotate_half` convention. Adjacent pairs (x[2j], x[2j+1]) are rotated, the cos/sin tables are
computed in float32 and then rounded to bfloat16 (also in float32 runs), and the rotation itself is done in float32.
Getting any of the three wrong produces plausible-looking but wrong audio.
"""

from __future__ import annotations

import torch


def rope_table(num_positions: int, head_dim: int, base: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """cos/sin table for positions 0..num_positions-1 -> [num_positions, head_dim // 2, 2] bfloat16."""
    # Same op order as the reference (float32 pow, outer product, polar) so the bf16 rounding lands identically.
    idx = torch.arange(0, head_dim, 2, device=device)[: head_dim // 2].float()
    freqs = 1.0 / (base ** (idx / head_dim))
    t = torch.arange(num_positions, device=device)
    angles = torch.outer(t, freqs)
    cis = torch.polar(torch.ones_like(angles), angles)
    return torch.stack([cis.real, cis.imag], dim=-1).to(torch.bfloat16)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of the last dim.

    x: [B, S, H, D]; table: [B, S, D // 2, 2] (or broadcastable, e.g. [1, S, D // 2, 2]) -> [B, S, H, D], x.dtype.
    """
    xs = x.float().reshape(*x.shape[:-1], -1, 2)  # [B, S, H, D/2, 2]
    t = table.float().unsqueeze(2)  # [B, S, 1, D/2, 2]
    cos, sin = t[..., 0], t[..., 1]
    out = torch.stack(
        [xs[..., 0] * cos - xs[..., 1] * sin, xs[..., 1] * cos + xs[..., 0] * sin],
        dim=-1,
    )
    return out.flatten(-2).type_as(x)
