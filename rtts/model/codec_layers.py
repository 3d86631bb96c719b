"""Building blocks of the ModifiedDAC codec (docs/architecture.md, the model), inference only.

Module and attribute names follow the release `codec.pth` key layout (`...block.1.conv.weight`,
`...layers.0.attention.wqkv.weight`), so a fused state dict loads with `load_state_dict(strict=True)`.
Weight norm is fused at load time (`codec.py`): every conv here is a plain conv.

The convolutions, Snake and the residual unit, and how every decode-path module streams (`forward` / `step(x, tails)`),
are in `codec_conv.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rtts.model.codec_conv import (
    CausalConv1d,
    CausalConvTranspose1d,
    ResidualUnit,
    Snake1d,
    Tails,
    step_sequence,
)
from rtts.model.layers import FeedForward, RMSNorm
from rtts.model.rope import apply_rope, rope_cos_sin


@dataclass(frozen=True)
class CodecTransformerConfig:
    """Sizes of one codec transformer (encoder transformer, quantizer pre/post module)."""

    n_layer: int
    dim: int
    n_head: int
    head_dim: int
    intermediate_size: int
    window_size: int
    rope_base: float = 10000.0
    norm_eps: float = 1e-5


# ---------------------------------------------------------------------------------------------------
# Quantizer down/upsampler block
# ---------------------------------------------------------------------------------------------------


class ConvNeXtBlock(nn.Module):
    """Causal depthwise conv k7 -> LayerNorm (channels-last, eps 1e-6) -> Linear x4 -> exact GELU ->
    Linear -> * gamma, plus the input (quantizer down/upsampler)."""

    def __init__(self, dim: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, 7, groups=dim, weight_norm=False)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, mlp_ratio * dim)
        self.pwconv2 = nn.Linear(mlp_ratio * dim, dim)
        self.gamma = nn.Parameter(torch.ones(dim))

    def _pointwise(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        # x, h: [B, C, L] (block input, depthwise conv output)
        h = h.transpose(1, 2)
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._pointwise(x, self.dwconv(x))

    def step(self, x: torch.Tensor, tails: Tails) -> torch.Tensor:
        return self._pointwise(x, self.dwconv.step(x, tails))


# ---------------------------------------------------------------------------------------------------
# Windowed causal transformer (encoder transformer, quantizer pre/post module)
# ---------------------------------------------------------------------------------------------------


def rope_tables(positions: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [B, T] int64 -> cos, sin: [B, 1, T, head_dim/2] bfloat16, computed per slot position so a stream
    continues at any position without a table limit."""
    cos, sin = rope_cos_sin(positions, head_dim, base)
    return cos[:, None], sin[:, None]


class LayerScale(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class Attention(nn.Module):
    def __init__(self, cfg: CodecTransformerConfig) -> None:
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        width = cfg.n_head * cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, 3 * width, bias=False)
        self.wo = nn.Linear(width, cfg.dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        past: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # x: [B, T, dim]; cos/sin: [B, 1, T, D/2]; mask: [B, 1, T, P+T] bool;
        # past: [B, 2, H, P, D] cached K (after RoPE) / V or None
        # -> (out [B, T, dim], k [B, H, P+T, D], v [B, H, P+T, D])
        q, k, v = self.wqkv(x).unflatten(-1, (3, self.n_head, self.head_dim)).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if past is not None:
            k = torch.cat([past[:, 0], k], dim=2)
            v = torch.cat([past[:, 1], v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(out.transpose(1, 2).flatten(2)), k, v


class TransformerBlock(nn.Module):
    """Pre-norm block with layer-scale on both residual branches."""

    def __init__(self, cfg: CodecTransformerConfig) -> None:
        super().__init__()
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg.dim, cfg.intermediate_size)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention_layer_scale = LayerScale(cfg.dim)
        self.ffn_layer_scale = LayerScale(cfg.dim)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        past: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a, k, v = self.attention(self.attention_norm(x), cos, sin, mask, past)
        h = x + self.attention_layer_scale(a)
        return h + self.ffn_layer_scale(self.feed_forward(self.ffn_norm(h))), k, v


class WindowedTransformer(nn.Module):
    """Causal transformer where query t sees keys t-window+1..t, channels-first in and out.

    The streamed form keeps, per layer, the K (after RoPE) and V of the last `window - 1` steps plus the
    absolute position of the next step, so RoPE positions (and their bf16-rounded tables) continue exactly
    as in a whole-sequence call from position 0.
    """

    def __init__(self, cfg: CodecTransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.window = cfg.window_size
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def _run(
        self, x: torch.Tensor, start: torch.Tensor, past: torch.Tensor | None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        # x: [B, C, T]; start: [B] int64 position of x[..., 0]; past: [B, L, 2, H, P, D] or None
        # -> (out [B, C, T], per-layer [B, 2, H, P+T, D] K/V of past + new steps; empty if past is None)
        n_past = 0 if past is None else past.shape[-2]
        steps = x.shape[-1]
        q_pos = start[:, None] + torch.arange(steps, device=x.device)  # [B, T]
        k_pos = start[:, None] + torch.arange(-n_past, steps, device=x.device)  # [B, P+T]
        # A key is visible if it exists (cache slots before position 0 are empty) and lies in the window.
        rel = q_pos[:, :, None] - k_pos[:, None, :]  # [B, T, P+T]
        mask = ((rel >= 0) & (rel < self.window) & (k_pos[:, None, :] >= 0))[:, None]
        cos, sin = rope_tables(q_pos, self.cfg.head_dim, self.cfg.rope_base)
        h = x.transpose(1, 2)
        kv: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            h, k, v = layer(h, cos, sin, mask, None if past is None else past[:, i])
            if past is not None:
                kv.append(torch.stack([k, v], dim=1))
        return self.norm(h).transpose(1, 2), kv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, C, T] from position 0 -> [B, C, T]
        start = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
        return self._run(x, start, None)[0]

    def step(
        self, x: torch.Tensor, past: torch.Tensor, start: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [B, C, t]; past: [B, L, 2, H, window-1, D]; start: [B] int64
        # -> (out [B, C, t], new past [B, L, 2, H, window-1, D])
        out, kv = self._run(x, start, past)
        keep = past.shape[-2]
        return out, torch.stack([layer_kv[..., layer_kv.shape[-2] - keep :, :] for layer_kv in kv], dim=1)


# ---------------------------------------------------------------------------------------------------
# Vector quantizers
# ---------------------------------------------------------------------------------------------------


class VectorQuantizer(nn.Module):
    """Factorized DAC-style VQ: 1x1 in_proj to `codebook_dim`, cosine lookup, 1x1 out_proj back.
    (On disk its projections use the legacy `weight_g`/`weight_v` weight-norm spelling.)"""

    def __init__(self, latent_dim: int, codebook_size: int, codebook_dim: int) -> None:
        super().__init__()
        self.in_proj = nn.Conv1d(latent_dim, codebook_dim, 1)
        self.out_proj = nn.Conv1d(codebook_dim, latent_dim, 1)
        self.codebook = nn.Embedding(codebook_size, codebook_dim)

    def decode_code(self, codes: torch.Tensor) -> torch.Tensor:
        # codes: [B, T] (in range) -> [B, latent, T]; raw (not normalized) codebook rows
        return self.out_proj(self.codebook(codes).transpose(1, 2))

    def quantize(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # z: [B, latent, T] -> (quantized [B, latent, T], codes [B, T], z_e [B, codebook_dim, T])
        z_e = self.in_proj(z)
        enc = F.normalize(z_e.transpose(1, 2).flatten(0, 1))  # [B*T, d]
        book = F.normalize(self.codebook.weight)  # [N, d]
        # Squared distance of unit vectors (= 2 - 2 cos): the reference's formula; its argmin is the
        # argmax cosine similarity, and using the same expression keeps near-ties resolving the same way.
        dist = enc.pow(2).sum(1, keepdim=True) - 2 * enc @ book.t() + book.pow(2).sum(1, keepdim=True).t()
        codes = torch.argmax(-dist, dim=1).view(z.shape[0], z.shape[-1])
        z_q = self.codebook(codes).transpose(1, 2)
        # NOTE: the reference's straight-through estimator `z_e + (z_q - z_e)` is not exactly z_q in float;
        # the residual of the next stage depends on it, so it is reproduced here.
        z_q = z_e + (z_q - z_e)
        return self.out_proj(z_q), codes, z_e


class ResidualVQ(nn.Module):
    def __init__(self, n: int, latent_dim: int, codebook_size: int, codebook_dim: int) -> None:
        super().__init__()
        self.quantizers = nn.ModuleList(
            VectorQuantizer(latent_dim, codebook_size, codebook_dim) for _ in range(n)
        )

    def _vqs(self) -> list[VectorQuantizer]:
        return [vq for vq in self.quantizers if isinstance(vq, VectorQuantizer)]

    def from_codes(self, codes: torch.Tensor) -> torch.Tensor:
        # codes: [B, n, T] -> [B, latent, T], summed in codebook order like the reference
        vqs = self._vqs()
        z = vqs[0].decode_code(codes[:, 0])
        for i in range(1, len(vqs)):
            z = z + vqs[i].decode_code(codes[:, i])
        return z

    def quantize(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # z: [B, latent, T] -> (sum of quantized [B, latent, T], codes [B, n, T], z_e [B, n, d, T])
        residual, total = z, torch.zeros_like(z)
        codes, z_es = [], []
        for vq in self._vqs():
            quantized, c, z_e = vq.quantize(residual)
            total = total + quantized
            residual = residual - quantized
            codes.append(c)
            z_es.append(z_e)
        return total, torch.stack(codes, dim=1), torch.stack(z_es, dim=1)


# ---------------------------------------------------------------------------------------------------
# Encoder / decoder stacks
# ---------------------------------------------------------------------------------------------------


class EncoderBlock(nn.Module):
    """3 residual units at dim/2 -> Snake -> strided causal conv k=2s to dim (-> transformer, last block)."""

    def __init__(self, dim: int, stride: int, transformer: CodecTransformerConfig | None) -> None:
        super().__init__()
        half = dim // 2
        layers: list[nn.Module] = [ResidualUnit(half, d) for d in (1, 3, 9)]
        layers += [Snake1d(half), CausalConv1d(half, dim, 2 * stride, stride=stride)]
        if transformer is not None:
            layers.append(WindowedTransformer(transformer))
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, dim/2, L] -> [B, dim, L / stride]
        return self.block(x)


class Encoder(nn.Module):
    def __init__(
        self, dim: int, rates: tuple[int, ...], latent_dim: int, transformer: CodecTransformerConfig
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [CausalConv1d(1, dim, 7)]
        for i, stride in enumerate(rates):
            dim *= 2
            layers.append(EncoderBlock(dim, stride, transformer if i == len(rates) - 1 else None))
        layers += [Snake1d(dim), CausalConv1d(dim, latent_dim, 3)]
        self.block = nn.Sequential(*layers)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        # audio: [B, 1, N] -> [B, latent, N / prod(rates)]
        return self.block(audio)


class DecoderBlock(nn.Module):
    """Snake -> causal transposed conv (k=2s, stride s) -> 3 residual units (dilation 1, 3, 9)."""

    def __init__(self, in_dim: int, out_dim: int, stride: int) -> None:
        super().__init__()
        self.block = nn.Sequential(
            Snake1d(in_dim),
            CausalConvTranspose1d(in_dim, out_dim, 2 * stride, stride),
            *(ResidualUnit(out_dim, d) for d in (1, 3, 9)),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, in_dim, L] -> [B, out_dim, L * stride]
        return self.block(x)

    def step(self, x: torch.Tensor, tails: Tails) -> torch.Tensor:
        return step_sequence(self.block, x, tails)


class Decoder(nn.Module):
    """Causal conv k7 -> decoder blocks (channels halve each time) -> Snake -> conv k7 to 1 -> tanh.
    (The reference config names a decoder transformer but never builds it: no weights, no layer.)"""

    def __init__(self, latent_dim: int, dim: int, rates: tuple[int, ...]) -> None:
        super().__init__()
        layers: list[nn.Module] = [CausalConv1d(latent_dim, dim, 7)]
        for stride in rates:
            layers.append(DecoderBlock(dim, dim // 2, stride))
            dim //= 2
        layers += [Snake1d(dim), CausalConv1d(dim, 1, 7), nn.Tanh()]
        self.model = nn.Sequential(*layers)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        # z: [B, latent, L] -> [B, 1, L * prod(rates)]
        return self.model(z)

    def step(self, z: torch.Tensor, tails: Tails) -> torch.Tensor:
        return step_sequence(self.model, z, tails)


class DownsampleQuantizer(nn.Module):
    """Semantic VQ + residual VQs on a latent that is downsampled (strided conv + ConvNeXt per factor) and
    run through `pre_module` before quantization; decode sums the VQ outputs, runs `post_module` and
    upsamples back (transposed conv + ConvNeXt per factor)."""

    def __init__(
        self,
        latent_dim: int,
        semantic_codebook_size: int,
        n_codebooks: int,
        codebook_size: int,
        codebook_dim: int,
        downsample_factor: tuple[int, ...],
        pre_module: CodecTransformerConfig,
        post_module: CodecTransformerConfig,
    ) -> None:
        super().__init__()
        self.semantic_quantizer = ResidualVQ(1, latent_dim, semantic_codebook_size, codebook_dim)
        self.quantizer = ResidualVQ(n_codebooks, latent_dim, codebook_size, codebook_dim)
        self.downsample = nn.Sequential(
            *(
                nn.Sequential(
                    CausalConv1d(latent_dim, latent_dim, f, stride=f, weight_norm=False),
                    ConvNeXtBlock(latent_dim),
                )
                for f in downsample_factor
            )
        )
        self.upsample = nn.Sequential(
            *(
                nn.Sequential(
                    CausalConvTranspose1d(latent_dim, latent_dim, f, f, weight_norm=False),
                    ConvNeXtBlock(latent_dim),
                )
                for f in reversed(downsample_factor)
            )
        )
        self.pre_module = WindowedTransformer(pre_module)
        self.post_module = WindowedTransformer(post_module)

    def codes_to_latent(self, codes: torch.Tensor) -> torch.Tensor:
        # codes: [B, 1 + n_codebooks, T] (already clamped) -> z_q [B, latent, T]
        residual = self.quantizer.from_codes(codes[:, 1:])
        return self.semantic_quantizer.from_codes(codes[:, :1]) + residual

    def quantize(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # z: [B, latent, T] (after downsample + pre_module)
        # -> (codes [B, 1 + n_codebooks, T], z_e [B, 1 + n_codebooks, codebook_dim, T])
        semantic, sem_codes, sem_ze = self.semantic_quantizer.quantize(z)
        _, res_codes, res_ze = self.quantizer.quantize(z - semantic)
        return torch.cat([sem_codes, res_codes], dim=1), torch.cat([sem_ze, res_ze], dim=1)
