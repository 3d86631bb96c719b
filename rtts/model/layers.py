"""Building blocks shared by the DualAR LLM and the codec transformers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rtts.kernels import norm_rope


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32, cast back, then scale (the reference's order; it matters in bf16): one kernel on the
        # GPU in bf16, the torch ops otherwise.
        # (the kernel reads whole rows: the codec normalizes a transposed view)
        return norm_rope.rmsnorm(x if x.is_contiguous() else x.contiguous(), self.weight, self.eps)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x), no biases."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
