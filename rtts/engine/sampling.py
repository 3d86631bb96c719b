"""Sampling math, batched with per-row parameters, on the device (no `.item()`, no host branching on values).

Both formats share `filtered_probs`: sort descending, cumulative softmax **at temperature 1**, cut ranks past top_p or
top_k (rank 0 always kept; the token whose mass crosses top_p is itself cut), then divide by temperature and softmax.
The draw is an exponential race `argmax(p / q)` with q ~ Exp(1) (see rtts/kernels/rng.py).

S2 (`fish_qwen3_omni`): the main token ranges over the semantic ids + `<|im_end|>` only; repetition-aware sampling
(RAS) draws a second candidate at T = 1.0 / top_p = 0.9 and takes it when the first is a semantic id already among the
last 10 main tokens. Temperature/top_p are rounded to the model dtype (bf16 in a bf16 run), as the reference does.

S1 (`dual_ar`): the main token ranges over the whole vocabulary; a repetition penalty over a 16-frame window replaces
RAS; the fast logits are cut to the first 1024 before the penalty; parameters stay float32.

Sort and softmax run in the logits dtype (bf16 in a bf16 run), again as the reference does; the cumulative sum adds
the rounded probabilities in float32 and rounds each partial sum (what torch's CPU cumsum does for bf16; its CUDA cumsum
adds in bf16 in a batch-size dependent tree, which would make the cut depend on the batch). `filtered_probs` and `race`
live in rtts/kernels/reference.py as the reference of the fused sampling kernel (kernels.sample).
"""

from __future__ import annotations

import torch

from rtts.kernels.reference import filtered_probs, race  # noqa: F401  (the draw's math; one kernel on the GPU)


def repetition_penalty(logits: torch.Tensor, ids: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """logits [B, V], ids [B, K] (duplicates count once), penalty [B] float32 -> penalized logits [B, V].

    Negative logits are multiplied by the penalty, positive ones divided. penalty 1.0 is an exact no-op.
    """
    score = torch.gather(logits, -1, ids).float()
    p = penalty.float()[:, None]
    score = torch.where(score < 0, score * p, score / p).to(logits.dtype)
    return logits.scatter(-1, ids, score)


def ras_choice(
    tok_normal: torch.Tensor,  # [B] int64 token ids
    tok_high: torch.Tensor,  # [B] int64 token ids
    window: torch.Tensor,  # [B, W] int64: last W main tokens (zeros before the first decode steps)
    semantic_begin: int,
    semantic_end: int,
    enabled: torch.Tensor,  # [B] bool: False on the prefill frame (and when RAS is switched off)
) -> torch.Tensor:
    is_sem = (tok_normal >= semantic_begin) & (tok_normal <= semantic_end)
    repeated = (window == tok_normal[:, None]).any(dim=-1)
    return torch.where(is_sem & repeated & enabled, tok_high, tok_normal)


def penalty_main_ids(ring: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """S1 main-token penalty ids: the 11 values of the window's OLDEST column.

    ring: [B, 16, rows] columns of decode frames 1.. written at slot (frame - 1) % 16, zeros where unwritten;
    n: [B] int64 decode frames already in the ring. While n < 16 the window is [frames 1..n, zero padding] so its
    oldest column is slot 0 (the zero column when n == 0); afterwards the oldest is frame f-16, at slot n % 16.
    -> [B, rows] int64.
    """
    W = ring.shape[1]
    idx = torch.where(n >= W, n % W, torch.zeros_like(n))
    return torch.gather(ring, 1, idx[:, None, None].expand(-1, 1, ring.shape[2])).squeeze(1)
