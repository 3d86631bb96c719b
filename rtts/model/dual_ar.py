"""The DualAR text-to-semantic model (inference only): a slow transformer over columns, a fast one over codebooks.

Every sequence position is a column of `num_codebooks + 1` ints: row 0 is a text or `<|semantic:k|>` token, rows 1..
are the codes c0..c9 of one audio frame. The slow transformer turns the column history into one hidden per position;
its head picks the next row-0 token (c0 = the semantic index). The fast transformer then runs a 10-position sequence
per frame — position 0 fed the slow hidden, position p fed `fast_embeddings[c_(p-1)]` — and its head at position p
gives c_p. The exact math (embedding scale, fused qkv, QK-norm, interleaved bf16 RoPE, GQA) is in docs/architecture.md.

Parameter names are the reference's internal names (`layers.N.attention.wqkv.weight`, `fast_layers.N...`), so a
checkpoint loads with a key remap only (see `loading.py`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from rtts import kernels
from rtts.kernels import norm_rope
from rtts.kernels.norm_rope import QuantizedRows
from rtts.model.config import DualARConfig
from rtts.model.layers import FeedForward, RMSNorm


class Attention(nn.Module):
    def __init__(
        self,
        dim: int,
        n_head: int,
        n_kv: int,
        head_dim: int,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        eps: float,
    ) -> None:
        super().__init__()
        self.n_head, self.n_kv, self.head_dim = n_head, n_kv, head_dim
        self.wqkv = nn.Linear(dim, (n_head + 2 * n_kv) * head_dim, bias=qkv_bias)
        self.wo = nn.Linear(n_head * head_dim, dim, bias=o_bias)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None

    def forward(
        self,
        x: torch.Tensor | QuantizedRows,  # [B, S, dim] (quantized when wqkv is an FP8 linear)
        rope: torch.Tensor,  # [B or 1, S, head_dim // 2, 2]
        k_cache: torch.Tensor,  # [rows, ctx, n_kv, head_dim]
        v_cache: torch.Tensor,  # [rows, ctx, n_kv, head_dim]
        rows: torch.Tensor,  # [B] int64: which cache row each batch row owns
        positions: torch.Tensor,  # [B, S] int64: absolute positions of the new tokens
        kv_len: int,  # attend over cache positions [0, kv_len); must exceed every position
        mask: torch.Tensor | None = None,  # grouped_causal_mask(positions, kv_len, n_head // n_kv), if made already
    ) -> torch.Tensor:
        B, S, _ = x.shape
        qs = self.n_head * self.head_dim
        # Split, QK-norm, RoPE, and the K/V of the new positions into the caches: one kernel on the GPU in bf16.
        qn = self.q_norm.weight if self.q_norm is not None else None
        kn = self.k_norm.weight if self.k_norm is not None else None
        eps = self.q_norm.eps if self.q_norm is not None else 0.0
        q = norm_rope.qkv_rope_store(self.wqkv(x), qn, kn, eps, rope, k_cache, v_cache, rows, positions, self.n_head)
        if S == 1 and kernels.decode_attention_fast(q, k_cache):
            # One query per stream: the decode-attention kernel reads each row's length on the device.
            out = kernels.decode_attention(q[:, 0], k_cache, v_cache, rows, positions[:, 0] + 1)
            return self.wo(out.reshape(B, 1, qs))

        keys = k_cache[:, :kv_len][rows].transpose(1, 2).to(q.dtype)  # [B, n_kv, L, hd]
        values = v_cache[:, :kv_len][rows].transpose(1, 2).to(q.dtype)
        # GQA without repeating K/V: the g query heads sharing a KV head become g*S query rows of that head
        # (query head h uses KV head h // g), so one K/V read serves the whole group.
        g = self.n_head // self.n_kv
        qg = q.view(B, S, self.n_kv, g, self.head_dim).permute(0, 2, 3, 1, 4).reshape(B, self.n_kv, g * S, -1)
        if mask is None:
            mask = grouped_causal_mask(positions, kv_len, g)
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=1.0 / math.sqrt(self.head_dim))
        out = out.view(B, self.n_kv, g, S, self.head_dim).permute(0, 3, 1, 2, 4)  # [B, S, n_kv, g, hd]
        return self.wo(out.reshape(B, S, qs))


def grouped_causal_mask(positions: torch.Tensor, kv_len: int, g: int) -> torch.Tensor:
    """[B, 1, g*S, kv_len] bool: key j is visible to the query at position p iff j <= p (causal over the row's whole
    history), repeated for the g query heads of a KV head (Attention's grouped layout). The same for every layer of a
    stack: forward_slow makes it once per prefill instead of once per layer (host time: prefill is launch-bound)."""
    B, S = positions.shape
    mask = torch.arange(kv_len, device=positions.device)[None, None, :] <= positions[:, :, None]  # [B, S, L]
    return mask[:, None, None].expand(B, 1, g, S, kv_len).reshape(B, 1, g * S, kv_len)


class Block(nn.Module):
    def __init__(self, dim: int, ffn: int, attention: Attention, eps: float) -> None:
        super().__init__()
        self.attention = attention
        self.feed_forward = FeedForward(dim, ffn)
        self.attention_norm = RMSNorm(dim, eps)
        self.ffn_norm = RMSNorm(dim, eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        rows: torch.Tensor,
        positions: torch.Tensor,
        kv_len: int,
        residual: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream; residual: the previous block's MLP output, not yet added to it (the add runs in
        this block's first norm kernel) -> (h, mlp_out), the stream before this block's MLP output and that output:
        the next block or the caller adds them."""
        an, fn = self.attention_norm, self.ffn_norm
        # FP8 blocks: the norm kernels quantize for the FP8 GEMMs themselves (no quantize kernel after them), except
        # for prefill-sized inputs (kernels.fp8_runs_dense), where the FP8 modules run dense GEMMs on bf16 rows.
        fp8 = self.fp8_inputs and not kernels.fp8_runs_dense(x)
        add_norm = norm_rope.add_rmsnorm_quant if fp8 else norm_rope.add_rmsnorm
        n: torch.Tensor | QuantizedRows
        if residual is not None:
            x, n = add_norm(x, residual, an.weight, an.eps)
        else:
            n = norm_rope.rmsnorm_quant(x, an.weight, an.eps) if fp8 else an(x)
        a = self.attention(n, rope, k_cache, v_cache, rows, positions, kv_len, mask)
        h, n2 = add_norm(x, a, fn.weight, fn.eps)  # h = x + a
        return h, self.feed_forward(n2)

    @property
    def fp8_inputs(self) -> bool:
        """Both consumers of a norm (wqkv, the MLP) are FP8 modules that take quantized rows."""
        return (getattr(self.attention.wqkv, "takes_quantized", False)
                and getattr(self.feed_forward, "takes_quantized", False))


class DualARTransformer(nn.Module):
    """Slow + fast transformers. Stateless: all caches are passed in (see kv_cache.py)."""

    def __init__(self, config: DualARConfig, semantic_begin_id: int, semantic_end_id: int) -> None:
        super().__init__()
        c = config
        self.config = c
        self.semantic_begin_id = semantic_begin_id
        self.semantic_end_id = semantic_end_id

        self.embeddings = nn.Embedding(c.vocab_size, c.dim)
        self.codebook_embeddings = nn.Embedding(c.codebook_size * c.num_codebooks, c.dim)
        self.layers = nn.ModuleList(
            Block(
                c.dim,
                c.intermediate_size,
                Attention(c.dim, c.n_head, c.n_local_heads, c.head_dim, c.attention_qkv_bias,
                          c.attention_o_bias, c.attention_qk_norm, c.norm_eps),
                c.norm_eps,
            )
            for _ in range(c.n_layer)
        )
        self.norm = RMSNorm(c.dim, c.norm_eps)
        self.output = None if c.tie_word_embeddings else nn.Linear(c.dim, c.vocab_size, bias=False)

        # Fast model: NOTE it inherits the slow rope_base and norm_eps (the reference ignores the fast config's own).
        self.fast_project_in = nn.Linear(c.dim, c.fast_dim) if c.fast_dim != c.dim else None
        self.fast_embeddings = nn.Embedding(c.codebook_size, c.fast_dim)
        self.fast_layers = nn.ModuleList(
            Block(
                c.fast_dim,
                c.fast_intermediate_size,
                Attention(c.fast_dim, c.fast_n_head, c.fast_n_local_heads, c.fast_head_dim,
                          c.fast_attention_qkv_bias, c.fast_attention_o_bias, c.fast_attention_qk_norm, c.norm_eps),
                c.norm_eps,
            )
            for _ in range(c.n_fast_layer)
        )
        self.fast_norm = RMSNorm(c.fast_dim, c.norm_eps)
        self.fast_output = nn.Linear(c.fast_dim, c.codebook_size, bias=False)

    # ------------------------------------------------------------------ slow model

    def embed(self, columns: torch.Tensor) -> torch.Tensor:
        """columns: [B, rows, S] int64 -> input embeddings [B, S, dim]."""
        c = self.config
        tok = columns[:, 0]  # [B, S]
        x = self.embeddings(tok)
        offsets = torch.arange(c.num_codebooks, device=columns.device)[None, :, None] * c.codebook_size
        # Codes on text positions are ignored below; clamp so a stray value cannot index out of the table.
        codes = columns[:, 1:].clamp(0, c.codebook_size - 1) + offsets  # [B, ncb, S]
        cb_sum = self.codebook_embeddings(codes).sum(dim=1)  # [B, S, dim]
        is_sem = ((tok >= self.semantic_begin_id) & (tok <= self.semantic_end_id))[..., None]
        sem = x + cb_sum
        if c.scale_codebook_embeddings:
            sem = sem / math.sqrt(c.num_codebooks + 1)
        return torch.where(is_sem, sem, x)

    def forward_slow(
        self,
        x: torch.Tensor,  # [B, S, dim] input embeddings
        rope: torch.Tensor,  # [B or 1, S, head_dim // 2, 2]
        k_cache: torch.Tensor,  # [n_layer, slots, ctx, n_kv, hd]
        v_cache: torch.Tensor,
        slots: torch.Tensor,  # [B]
        positions: torch.Tensor,  # [B, S]
        kv_len: int,
    ) -> torch.Tensor:
        """Runs the slow stack, writing K/V of the new positions; returns the pre-norm hidden [B, S, dim]."""
        r = None  # each block's MLP output is added to the stream by the next block's norm kernel
        c = self.config  # one mask for every layer (the decode path, one query per row, needs none)
        mask = grouped_causal_mask(positions, kv_len, c.n_head // c.n_local_heads) if x.shape[1] > 1 else None
        for i, layer in enumerate(self.layers):
            x, r = layer(x, rope, k_cache[i], v_cache[i], slots, positions, kv_len, residual=r, mask=mask)
        return x if r is None else x + r

    def head_weight(self) -> torch.Tensor:
        """[vocab, dim]: the tied embedding (S2) or the separate output head (S1)."""
        return self.embeddings.weight if self.output is None else self.output.weight

    def slow_head(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: [B, dim] pre-norm -> (normed [B, dim], fast input [B, fast_dim])."""
        normed = self.norm(hidden)
        fast_in = normed if self.config.norm_fastlayer_input else hidden
        if self.fast_project_in is not None:
            fast_in = self.fast_project_in(fast_in)
        return normed, fast_in

    # ------------------------------------------------------------------ fast model

    def forward_fast(
        self,
        x: torch.Tensor,  # [B, S, fast_dim]
        rope: torch.Tensor,  # [1, S, fast_head_dim // 2, 2]
        k_cache: torch.Tensor,  # [n_fast_layer, rows >= B, 10, n_kv, hd]
        v_cache: torch.Tensor,
        rows: torch.Tensor,  # [B] int64 (usually arange(B))
        positions: torch.Tensor,  # [B, S]
        kv_len: int,
    ) -> torch.Tensor:
        """One fast step over positions `positions` -> codebook logits [B, S, codebook_size]."""
        r = None
        for i, layer in enumerate(self.fast_layers):
            x, r = layer(x, rope, k_cache[i], v_cache[i], rows, positions, kv_len, residual=r)
        if r is None:
            return self.fast_output(self.fast_norm(x))
        _, normed = norm_rope.add_rmsnorm(x, r, self.fast_norm.weight, self.fast_norm.eps)
        return self.fast_output(normed)
