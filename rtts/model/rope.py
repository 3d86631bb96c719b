"""Interleaved-pair rotary embedding with bf16-rounded tables (the convention of the DualAR LLM and the codec).

NOTE: this is not the HF `rotate_half` convention. Adjacent pairs (x[2j], x[2j+1]) are rotated by `pos * base^(-2j/d)`,
the cos/sin tables are computed in float32 and then rounded to bfloat16 (also in float32 runs), and the rotation itself
is done in float32. Getting any of the three wrong produces plausible-looking but wrong audio.
"""

from __future__ import annotations

import torch

from rtts.kernels.reference import apply_rope  # noqa: F401  (the rotation itself: the rope kernel's reference)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: any shape [...] int64 -> cos, sin: [..., head_dim // 2] bfloat16."""
    idx = torch.arange(0, head_dim, 2, device=positions.device)[: head_dim // 2].float()
    inv_freq = 1.0 / (base ** (idx / head_dim))
    angles = positions.float()[..., None] * inv_freq
    # NOTE: polar, not cos/sin: the reference builds its tables with torch.polar, whose float32 values differ from
    # torch.cos/sin in the last bit often enough to flip a few bf16 roundings.
    cis = torch.polar(torch.ones_like(angles), angles)
    return cis.real.to(torch.bfloat16), cis.imag.to(torch.bfloat16)


def rope_table(num_positions: int, head_dim: int, base: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """Table for positions 0..num_positions-1 -> [num_positions, head_dim // 2, 2] bfloat16 (cos, sin)."""
    cos, sin = rope_cos_sin(torch.arange(num_positions, device=device), head_dim, base)
    return torch.stack([cos, sin], dim=-1)
