"""A differentiable whole-sequence forward of the server's `DualARTransformer`, for training.

The serving forward runs through KV caches and fused kernels. This one uses the same parameters and the same math in
plain torch (the kernels' reference functions: RMSNorm normalizing in float32, QK-norm before the interleaved RoPE with
bf16-rounded tables, GQA, SwiGLU, the 1/sqrt(K+1) codebook-embedding scale of `embed`), so what is trained is what is
served; tests/test_train.py checks the logits against the engine's. It also returns the attention probabilities of
the heads the guided-attention loss pulls onto the text diagonal.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rtts.kernels.reference import apply_rope, rmsnorm
from rtts.model.dual_ar import Attention, Block, DualARTransformer
from rtts.model.rope import rope_cos_sin


def rope(positions: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [S] -> cos, sin [1, S, 1, head_dim/2] (bf16 tables, as served)."""
    cos, sin = rope_cos_sin(positions, head_dim, base)
    return cos[None, :, None], sin[None, :, None]


SHORT = 16  # sequences up to this long attend by explicit products (the fast transformer's: one per codebook)


def causal_probs(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) over causal positions, [..., S, S], in float32 with autocast off (under bf16 autocast
    the product would come back in bf16 and the scaling round it again; flash keeps its scores in float32)."""
    S = q.shape[-2]
    causal = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
    with torch.autocast(q.device.type, enabled=False):
        scores = (q.float() @ k.float().transpose(-1, -2)) * scale
        return torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)


def attention(attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, guided: int
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [B, S, dim] -> (out [B, S, dim], causal attention probabilities of the first `guided` heads [B, g, S, S])."""
    B, S, _ = x.shape
    H, KV, D = attn.n_head, attn.n_kv, attn.head_dim
    q, k, v = attn.wqkv(x).split([H * D, KV * D, KV * D], dim=-1)
    q, k, v = q.view(B, S, H, D), k.view(B, S, KV, D), v.view(B, S, KV, D)
    if attn.q_norm is not None and attn.k_norm is not None:
        q, k = rmsnorm(q, attn.q_norm.weight, attn.q_norm.eps), rmsnorm(k, attn.k_norm.weight, attn.k_norm.eps)
    q, k = apply_rope(q, cos, sin).transpose(1, 2), apply_rope(k, cos, sin).transpose(1, 2)  # [B, H|KV, S, D]
    v = v.transpose(1, 2)
    k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)  # query head h reads kv h // g
    scale = 1.0 / math.sqrt(D)
    if S <= SHORT:  # the fast transformer's codebook sequences: flash kernels spend a CTA on each (row, head)
        out = causal_probs(q, k, scale).to(v.dtype) @ v
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    probs = causal_probs(q[:, :guided], k[:, :guided], scale) if guided else None
    return attn.wo(out.transpose(1, 2).reshape(B, S, H * D)), probs


def block(layer: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, guided: int, dropout: float = 0.0
          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One pre-norm block; `dropout` (training only) applies to each residual branch's output."""
    an, fn = layer.attention_norm, layer.ffn_norm
    a, probs = attention(layer.attention, rmsnorm(x, an.weight, an.eps), cos, sin, guided)
    h = x + (F.dropout(a, dropout) if dropout > 0 else a)  # (a branch, not training=: compiles as one graph)
    f = layer.feed_forward(rmsnorm(h, fn.weight, fn.eps))
    return h + (F.dropout(f, dropout) if dropout > 0 else f), probs


BlockFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


@functools.cache
def block_fn(compiled: bool) -> BlockFn:
    """`block`, or one torch.compile of it shared by every layer (dynamic shapes: batch and length vary per step)."""
    return torch.compile(block, dynamic=True) if compiled else block


@dataclass
class SlowOutput:
    normed: torch.Tensor  # [B, S, dim] final-normed hidden (the head's input)
    fast_in: torch.Tensor  # [B, S, fast_dim] what the fast transformer's position 0 is fed
    guided_probs: list[torch.Tensor]  # per guided layer [B, 1, S, S]


def slow(model: DualARTransformer, columns: torch.Tensor, guided_layers: tuple[int, ...] = (),
         dropout: float = 0.0, compiled: bool = False) -> SlowOutput:
    """columns [B, rows, S] (from position 0) -> the slow transformer's outputs at every position."""
    c = model.config
    S = columns.shape[-1]
    cos, sin = rope(torch.arange(S, device=columns.device), c.head_dim, c.rope_base)
    x = model.embed(columns)
    probs = []
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, Block)
        x, p = block_fn(compiled)(layer, x, cos, sin, 1 if i in guided_layers else 0, dropout)
        if p is not None:
            probs.append(p)
    normed = rmsnorm(x, model.norm.weight, model.norm.eps)
    fast_in = normed if c.norm_fastlayer_input else x
    if model.fast_project_in is not None:
        fast_in = model.fast_project_in(fast_in)
    return SlowOutput(normed, fast_in, probs)


def main_logits(model: DualARTransformer, normed: torch.Tensor, main_ids: torch.Tensor) -> torch.Tensor:
    """Logits over the ids the server samples the main token from (S2: semantic ids + <|im_end|>)."""
    return normed @ model.head_weight()[main_ids].T


def fast(model: DualARTransformer, fast_in: torch.Tensor, codes: torch.Tensor, dropout: float = 0.0,
         compiled: bool = False) -> torch.Tensor:
    """fast_in [M, fast_dim] (the slow output that predicted each frame), codes [M, K] of those frames -> logits
    [M, K, codebook_size]: position 0 is fed fast_in, position p the embedding of c_(p-1); output p predicts c_p."""
    c = model.config
    K = codes.shape[1]
    x = torch.cat([fast_in[:, None], model.fast_embeddings(codes[:, :-1])], dim=1)
    cos, sin = rope(torch.arange(K, device=codes.device), c.fast_head_dim, c.rope_base)
    for layer in model.fast_layers:
        assert isinstance(layer, Block)
        x, _ = block_fn(compiled)(layer, x, cos, sin, 0, dropout)
    return model.fast_output(rmsnorm(x, model.fast_norm.weight, model.fast_norm.eps))


def init_weights(model: DualARTransformer, seed: int = 0, std: float = 0.02) -> None:
    """Normal(0, std) weights, unit norms, zero biases; residual output projections scaled by 1/sqrt(2 * layers)."""
    gen = torch.Generator().manual_seed(seed)
    c = model.config
    for name, p in model.named_parameters():
        with torch.no_grad():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                s = std
                if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
                    s = std / math.sqrt(2 * (c.n_fast_layer if name.startswith("fast_") else c.n_layer))
                p.copy_(torch.randn(p.shape, generator=gen) * s)
