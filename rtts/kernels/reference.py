"""Pure-torch versions of every kernel: the CPU path, the parity baseline, and what RTTS_REFERENCE_KERNELS=1 runs."""

from __future__ import annotations

import math

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128


def pad4(m: int) -> int:
    return (m + 3) // 4 * 4


def quantize_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K % 128 == 0) -> q fp8 [M, K], scale fp32 [K/128, pad4(M)] (K-major; dequant = q * scale)."""
    M, K = x.shape
    xf = x.float().view(M, K // BLOCK, BLOCK)
    scale = xf.abs().amax(-1).clamp(min=1e-4) * (1.0 / FP8_MAX)  # [M, KB]; a product, the same on CPU and GPU
    # Multiply by the float32 reciprocal, as the kernel does, so both round to the same FP8 values.
    q = (xf * (1.0 / scale)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(M, K)
    s = torch.zeros(K // BLOCK, pad4(M), dtype=torch.float32, device=x.device)
    s[:, :M] = scale.T
    return q, s


def swiglu_quantize(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [M, 2I] = [gate | up] -> quantize_1x128(silu(gate) * up) computed in float32."""
    g, u = gate_up.float().chunk(2, dim=-1)
    return quantize_1x128(torch.nn.functional.silu(g) * u)


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> q fp8 [N, K], scale fp32 [ceil(N/128), ceil(K/128)] per 128x128 block (dequant = q * scale)."""
    N, K = w.shape
    nb, kb = math.ceil(N / BLOCK), math.ceil(K / BLOCK)
    wp = torch.zeros(nb * BLOCK, kb * BLOCK, dtype=torch.float32, device=w.device)
    wp[:N, :K] = w.float()
    blocks = wp.view(nb, BLOCK, kb, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX  # [nb, kb]
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(nb * BLOCK, kb * BLOCK)
    return q[:N, :K].contiguous(), scale


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    N, K = q.shape
    s = scale.repeat_interleave(BLOCK, 0)[:N].repeat_interleave(BLOCK, 1)[:, :K]
    return q.float() * s


def dequantize_bf16(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 weight [N, K] or packed [N/128, K/128, 128, 128] and its block scales -> bf16 [N, K] (each q * scale
    product in FP32, rounded to nearest even)."""
    return dequantize_weight(unpack_weight(q) if q.dim() == 4 else q, scale).to(torch.bfloat16)


def _swizzle_chunks(t: torch.Tensor) -> torch.Tensor:
    """[..., 128 rows, 8 chunks, 16] -> same, chunk c of row r moved to position c ^ (r % 8) (an involution)."""
    r = torch.arange(BLOCK, device=t.device)[:, None]
    pos = torch.arange(8, device=t.device)[None, :] ^ (r % 8)  # position p holds chunk p ^ (r % 8)
    return t[..., r, pos, :]


def pack_weight(wq: torch.Tensor) -> torch.Tensor:
    """FP8 weight [N, K] (N, K multiples of 128) -> the packed tile layout [N/128, K/128, 128, 128] the wgmma GEMM
    streams: block (t, kb) holds rows 128t.. and K bytes 128kb.. contiguously, each 128-byte row with its 16-byte
    chunks in the 128-byte swizzle order (chunk c of row r at position c ^ (r % 8)) that the kernel's shared-memory
    descriptors read, so one bulk copy per block needs no rearranging on the GPU."""
    N, K = wq.shape
    if N % BLOCK or K % BLOCK:
        raise ValueError(f"pack_weight: [{N}, {K}] is not a multiple of the 128x128 block")
    t = wq.view(torch.uint8).view(N // BLOCK, BLOCK, K // BLOCK, 8, 16).permute(0, 2, 1, 3, 4)
    return _swizzle_chunks(t).contiguous().view(FP8).view(N // BLOCK, K // BLOCK, BLOCK, BLOCK)


def unpack_weight(wp: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_weight: [N/128, K/128, 128, 128] -> [N, K]."""
    NB, KB = wp.shape[:2]
    t = _swizzle_chunks(wp.view(torch.uint8).view(NB, KB, BLOCK, 8, 16))
    return t.permute(0, 2, 1, 3, 4).contiguous().view(FP8).view(NB * BLOCK, KB * BLOCK)


def fp8_gemm(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """Block-scaled product -> bf16 [M, N]: per 128-wide K block, an exact FP32 sum scaled by sw * sx. wq is [N, K]
    or packed (pack_weight)."""
    if wq.dim() == 4:
        wq = unpack_weight(wq)
    M, K = xq.shape
    N = wq.shape[0]
    KB = K // BLOCK
    x = xq.float().view(M, KB, BLOCK)
    w = wq.float().view(N, KB, BLOCK)
    sw_rows = sw.repeat_interleave(BLOCK, 0)[:N]  # [N, KB]
    part = torch.einsum("mkb,nkb->kmn", x, w)  # [KB, M, N]
    y = (part * sx[:, :M, None] * sw_rows.T[:, None, :]).sum(0)
    return y.to(torch.bfloat16)


def fp8_linear(x: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """x [..., K] bf16 -> [..., N] bf16 through 1x128 activation quantization and the block-scaled GEMM."""
    lead = x.shape[:-1]
    xq, sx = quantize_1x128(x.reshape(-1, x.shape[-1]))
    y = fp8_gemm(xq, sx, wq, sw)
    return y.view(*lead, y.shape[-1])


def decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [rows, L, n_kv, D]
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [B] int64
    lens: torch.Tensor,  # [B] int64: attend to positions [0, lens)
) -> torch.Tensor:
    B, H, D = q.shape
    n_kv = k_cache.shape[2]
    L = int(lens.max())
    k = k_cache[slots, :L].float()  # [B, L, n_kv, D]
    v = v_cache[slots, :L].float()
    g = H // n_kv
    qf = q.float().view(B, n_kv, g, D)
    scores = torch.einsum("bhgd,blhd->bhgl", qf, k) / math.sqrt(D)
    mask = torch.arange(L, device=q.device)[None, :] < lens[:, None]  # [B, L]
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    out = torch.einsum("bhgl,blhd->bhgd", torch.softmax(scores, -1), v)
    return out.reshape(B, H, D).to(q.dtype)


def token_window_shift(buf: torch.Tensor, slots: torch.Tensor, new: torch.Tensor, active: torch.Tensor) -> None:
    """buf [S, W, C] (in place): each active row's slot window moves left by one and `new` [B, C] becomes column W-1."""
    cur = buf[slots]  # [B, W, C]
    shifted = torch.cat([cur[:, 1:], new[:, None].to(buf.dtype)], dim=1)
    buf[slots] = torch.where(active[:, None, None].bool(), shifted, cur)


# ---------------------------------------------------------------------------------------------------- norms, RoPE


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalize the last dim in float32, cast back to x's dtype, then scale (the model's order; it matters in bf16)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * w


def add_rmsnorm(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + r (in x's dtype) -> (h, rmsnorm(h))."""
    h = x + r
    return h, rmsnorm(h, w, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of the last dim of x [..., D] in float32; cos/sin broadcast against [..., D // 2]."""
    xs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xs[..., 0], xs[..., 1]
    cos, sin = cos.float(), sin.float()
    return torch.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], dim=-1).flatten(-2).type_as(x)


def qkv_rope_store(
    qkv: torch.Tensor,  # [B, S, (H + 2 * n_kv) * D]
    q_norm: torch.Tensor | None,  # [D] or None
    k_norm: torch.Tensor | None,
    eps: float,
    rope: torch.Tensor,  # [B or 1, S, D // 2, 2] (cos, sin)
    k_cache: torch.Tensor,  # [rows, ctx, n_kv, D]
    v_cache: torch.Tensor,
    rows: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B, S] int64
    n_head: int,
) -> torch.Tensor:
    """Split q/k/v, QK-norm (when given) and RoPE q and k, store k and v at (rows[b], positions[b, s])
    -> q [B, S, H, D]."""
    B, S, _ = qkv.shape
    n_kv, D = k_cache.shape[2], k_cache.shape[3]
    q, k, v = qkv.split([n_head * D, n_kv * D, n_kv * D], dim=-1)
    q, k, v = q.view(B, S, n_head, D), k.view(B, S, n_kv, D), v.view(B, S, n_kv, D)
    if q_norm is not None and k_norm is not None:
        q, k = rmsnorm(q, q_norm, eps), rmsnorm(k, k_norm, eps)
    cos, sin = rope[..., 0].unsqueeze(2), rope[..., 1].unsqueeze(2)  # [B or 1, S, 1, D/2]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    idx = (rows[:, None].expand(B, S), positions)
    k_cache.index_put_(idx, k.to(k_cache.dtype))
    v_cache.index_put_(idx, v.to(v_cache.dtype))
    return q


# ---------------------------------------------------------------------------------------------------- sampling draw


def exponential_race(probs: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor, draw: int,
                     ids: torch.Tensor) -> torch.Tensor:
    """argmax(probs / q) over the last dim, q the stream's Exp(1) noise for (draw, ids) -> [B] int64 indices."""
    from rtts.kernels.rng import exponential_noise

    return torch.argmax(probs.float() / exponential_noise(seeds, counters, draw, ids), dim=-1)


# ---------------------------------------------------------------------------------------------------- sampling


def filtered_probs(
    logits: torch.Tensor,  # [B, V]
    temperature: torch.Tensor,  # [B] (param dtype)
    top_p: torch.Tensor,  # [B] (param dtype)
    top_k: torch.Tensor,  # [B] int64; >= V means "no top-k"
) -> torch.Tensor:
    """-> probabilities [B, V] in the logits dtype."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    # float32 running sum of the rounded probabilities, each partial rounded (torch's CPU cumsum for bf16; see
    # rtts/engine/sampling.py)
    cum = torch.cumsum(torch.softmax(sorted_logits, dim=-1).float(), dim=-1).to(logits.dtype)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    cut = (cum > top_p[:, None].to(cum.dtype)) | (ranks[None, :] >= top_k[:, None])
    cut[:, 0] = False
    remove = torch.zeros_like(cut).scatter_(-1, order, cut)
    masked = logits.masked_fill(remove, float("-inf"))
    # NOTE: divide in float32 and round once, like an op between a bf16 tensor and a float32 scalar.
    scaled = (masked.float() / temperature.float().clamp(min=1e-5)[:, None]).to(logits.dtype)
    return torch.softmax(scaled, dim=-1)


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Exponential race: probs [B, V], noise Exp(1) [B, V] -> index [B] int64."""
    return torch.argmax(probs.float() / noise, dim=-1)


def snake(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """The codec's Snake activation: x [B, C, L], alpha [C] -> x + sin(alpha x)^2 / (alpha + 1e-9), per channel."""
    a = alpha.view(1, -1, 1)
    return x + (a + 1e-9).reciprocal() * torch.sin(a * x).pow(2)


def bias_residual(x: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The end of the codec's residual unit: x, y [B, C, L], bias [C] or None -> x + (y + bias)."""
    return x + (y if bias is None else y + bias.view(1, -1, 1))
