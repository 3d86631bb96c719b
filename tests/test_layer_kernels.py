"""The layer-op kernels (RMSNorm, residual add + RMSNorm, QK-norm + RoPE + KV store) and the fused sampling draw:
the torch references on the CPU, and each CUDA kernel against its reference on random, never-zero inputs with odd
sizes (GPU tests, marked `gpu`)."""

from __future__ import annotations

import pytest
import torch

from rtts.engine import sampling
from rtts.kernels import draw, norm_rope, reference
from rtts.kernels.rng import exponential_noise
from rtts.model.rope import rope_table

GPU = pytest.mark.gpu


def _rope_inputs(B: int, S: int, H: int, KV: int, D: int, rows: int, ctx: int, device: str, dtype: torch.dtype,
                 shared_table: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    qkv = torch.randn(B, S, (H + 2 * KV) * D, generator=g) * 3 + 0.1
    table = rope_table(ctx, D, 1e6)  # [ctx, D/2, 2] bf16
    positions = torch.stack([torch.randperm(ctx, generator=g)[:S] for _ in range(B)])  # distinct per row
    slot = torch.randperm(rows, generator=g)[:B]
    rope = table[positions[:1]] if shared_table else table[positions]
    if shared_table:
        positions = positions[:1].expand(B, S).contiguous()
    return {
        "qkv": qkv.to(device, dtype),
        "rope": rope.to(device),
        "k_cache": (torch.randn(rows, ctx, KV, D, generator=g) + 0.5).to(device, dtype),
        "v_cache": (torch.randn(rows, ctx, KV, D, generator=g) - 0.5).to(device, dtype),
        "rows": slot.to(device),
        "positions": positions.to(device),
        "q_norm": (torch.rand(D, generator=g) + 0.5).to(device, dtype),
        "k_norm": (torch.rand(D, generator=g) + 0.5).to(device, dtype),
    }


# ---------------------------------------------------------------------------------------------------- CPU


def test_reference_qkv_rope_store_writes_only_the_new_positions() -> None:
    t = _rope_inputs(B=3, S=2, H=4, KV=2, D=16, rows=5, ctx=12, device="cpu", dtype=torch.float32,
                     shared_table=False)
    k0, v0 = t["k_cache"].clone(), t["v_cache"].clone()
    q = reference.qkv_rope_store(t["qkv"], t["q_norm"], t["k_norm"], 1e-6, t["rope"], t["k_cache"], t["v_cache"],
                                 t["rows"], t["positions"], 4)
    assert q.shape == (3, 2, 4, 16)
    written = torch.zeros(5, 12, dtype=torch.bool)
    written[t["rows"][:, None].expand(3, 2), t["positions"]] = True
    assert torch.equal(t["k_cache"][~written], k0[~written]) and torch.equal(t["v_cache"][~written], v0[~written])
    # v is stored as projected; k rotated: its norm per pair is kept by the rotation (after the QK-norm)
    v = t["qkv"][..., (4 + 2) * 16:].view(3, 2, 2, 16)
    assert torch.equal(t["v_cache"][t["rows"][:, None].expand(3, 2), t["positions"]], v)
    kn = reference.rmsnorm(t["qkv"][..., 64:96].view(3, 2, 2, 16), t["k_norm"], 1e-6)
    kc = t["k_cache"][t["rows"][:, None].expand(3, 2), t["positions"]]
    pair = lambda x: x.unflatten(-1, (-1, 2)).pow(2).sum(-1)  # noqa: E731
    torch.testing.assert_close(pair(kc), pair(kn), rtol=1e-2, atol=1e-3)


def test_reference_race_is_the_torch_race() -> None:
    probs = torch.softmax(torch.randn(3, 37), -1)
    seeds, counters, ids = torch.tensor([1, -5, 1 << 40]), torch.tensor([0, 7, (1 << 33) + 3]), torch.arange(37) * 11
    want = sampling.race(probs, exponential_noise(seeds, counters, 4, ids))
    assert torch.equal(reference.exponential_race(probs, seeds, counters, 4, ids), want)
    assert torch.equal(draw.exponential_race(probs, seeds, counters, 4, ids), want)  # the CPU takes the reference


def test_layer_op_strict_checks() -> None:
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="weight"):
        norm_rope.rmsnorm(x, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="add_rmsnorm"):
        norm_rope.add_rmsnorm(x, torch.randn(2, 7), torch.ones(8), 1e-6)
    t = _rope_inputs(B=2, S=1, H=2, KV=1, D=8, rows=3, ctx=4, device="cpu", dtype=torch.float32, shared_table=False)
    with pytest.raises(ValueError, match="features"):
        norm_rope.qkv_rope_store(t["qkv"][..., :-8], None, None, 1e-6, t["rope"], t["k_cache"], t["v_cache"],
                                 t["rows"], t["positions"], 2)
    with pytest.raises(ValueError, match="both"):
        norm_rope.qkv_rope_store(t["qkv"], t["q_norm"], None, 1e-6, t["rope"], t["k_cache"], t["v_cache"],
                                 t["rows"], t["positions"], 2)
    with pytest.raises(ValueError, match="int64"):
        draw.exponential_race(torch.rand(2, 5), torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64),
                              0, torch.arange(5))


# ---------------------------------------------------------------------------------------------------- GPU


def _close_bf16(got: torch.Tensor, want: torch.Tensor, max_share: float = 0.02) -> None:
    """Equal but for a few elements one bf16 rounding apart (a float32 sum in another order)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    diff = (got.float() - want.float()).abs()
    ulp = want.float().abs().clamp(min=1e-30) * 2.0**-7
    assert bool((diff <= ulp * 1.01).all()), float((diff / ulp).max())
    assert float((diff > 0).float().mean()) <= max_share


@GPU
@pytest.mark.parametrize("rows,D", [(1, 2560), (3, 1000), (64, 2560), (5, 77)])
def test_rmsnorm_kernels(rows: int, D: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(rows * D)
    x = (torch.randn(rows, D, device="cuda", generator=g) * 2 + 0.3).bfloat16()
    r = (torch.randn(rows, D, device="cuda", generator=g) - 0.2).bfloat16()
    w = (torch.rand(D, device="cuda", generator=g) + 0.5).bfloat16()
    _close_bf16(norm_rope.rmsnorm(x, w, 1e-6), reference.rmsnorm(x, w, 1e-6))
    h, y = norm_rope.add_rmsnorm(x, r, w, 1e-5)
    h_ref, y_ref = reference.add_rmsnorm(x, r, w, 1e-5)
    assert torch.equal(h, h_ref)
    _close_bf16(y, y_ref)
    x3 = x.view(1, rows, D)  # any leading shape
    _close_bf16(norm_rope.rmsnorm(x3, w, 1e-6), reference.rmsnorm(x3, w, 1e-6))


@GPU
@pytest.mark.parametrize("B,S,H,KV,D,shared,norm", [
    (1, 1, 32, 8, 128, False, True),  # S2-Pro slow decode
    (16, 1, 32, 8, 128, False, True),
    (5, 2, 32, 8, 128, True, False),  # fast model: one table row for the batch, no QK-norm
    (3, 7, 6, 2, 64, False, True),  # prefill-like, odd counts
    (2, 3, 5, 1, 16, True, True),
])
def test_qkv_rope_store_kernel(B: int, S: int, H: int, KV: int, D: int, shared: bool, norm: bool) -> None:
    t = _rope_inputs(B, S, H, KV, D, rows=B + 3, ctx=40, device="cuda", dtype=torch.bfloat16, shared_table=shared,
                     seed=B * S + H)
    qn, kn = (t["q_norm"], t["k_norm"]) if norm else (None, None)
    kc, vc = t["k_cache"].clone(), t["v_cache"].clone()
    q = norm_rope.qkv_rope_store(t["qkv"], qn, kn, 1e-6, t["rope"], kc, vc, t["rows"], t["positions"], H)
    q_ref = reference.qkv_rope_store(t["qkv"], qn, kn, 1e-6, t["rope"], t["k_cache"], t["v_cache"], t["rows"],
                                     t["positions"], H)
    assert torch.equal(vc, t["v_cache"])  # untouched elsewhere, copied exactly at the new positions
    if norm:
        _close_bf16(q, q_ref)
        _close_bf16(kc, t["k_cache"], max_share=0.02)
    else:  # no reduction: the same rounded ops in the same order, bit for bit
        assert torch.equal(q, q_ref) and torch.equal(kc, t["k_cache"])



@GPU
def test_qkv_rope_store_kernel_never_writes_outside_the_caches() -> None:
    """A cache row or position out of range (a host bug) stores nothing; every in-range token is stored as usual."""
    t = _rope_inputs(4, 2, 32, 8, 128, rows=4, ctx=40, device="cuda", dtype=torch.bfloat16, shared_table=False)
    t["rows"][1], t["rows"][2] = 4, -1
    t["positions"][3, 1] = 40
    kc, vc = t["k_cache"].clone(), t["v_cache"].clone()
    norm_rope.qkv_rope_store(t["qkv"], t["q_norm"], t["k_norm"], 1e-6, t["rope"], kc, vc, t["rows"], t["positions"],
                             32)
    stored = torch.zeros(4, 40, dtype=torch.bool)
    stored[int(t["rows"][0]), t["positions"][0].cpu()] = True
    stored[int(t["rows"][3]), int(t["positions"][3, 0])] = True
    assert torch.equal(kc[~stored.cuda()], t["k_cache"][~stored.cuda()])
    assert torch.equal(vc[~stored.cuda()], t["v_cache"][~stored.cuda()])
    assert not torch.equal(vc[stored.cuda()], t["v_cache"][stored.cuda()])
@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B,n,first_id", [(1, 4097, 151_000), (16, 4096, 0), (3, 33, 7), (64, 1025, 1 << 31)])
def test_exponential_race_kernel_is_bit_identical(dtype: torch.dtype, B: int, n: int, first_id: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(n + B)
    logits = torch.randn(B, n, device="cuda", generator=g) * 3
    logits[0, n // 2:] = -float("inf")  # a top-p cut: zero probabilities
    probs = torch.softmax(logits, -1).to(dtype)
    seeds = torch.randint(-(1 << 62), 1 << 62, (B,), device="cuda", generator=g)
    counters = torch.randint(0, 1 << 40, (B,), device="cuda", generator=g)
    ids = torch.arange(first_id, first_id + n, device="cuda")
    for d in (0, 1, 11):
        got = draw.exponential_race(probs, seeds, counters, d, ids)
        assert torch.equal(got, reference.exponential_race(probs, seeds, counters, d, ids)), d
    zero = torch.zeros(2, n, device="cuda", dtype=dtype)  # every ratio 0: the first index, as torch.argmax
    assert draw.exponential_race(zero, seeds[:1].repeat(2), counters[:1].repeat(2), 0, ids).tolist() == [0, 0]


@GPU
@pytest.mark.parametrize("ldtype,pdtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                           (torch.float32, torch.float32)])
@pytest.mark.parametrize("V", [4097, 1024, 33, 8192])
def test_sample_kernel_matches_the_torch_draw(ldtype: torch.dtype, pdtype: torch.dtype, V: int) -> None:
    """The fused draw against filtered_probs + race on 192 rows of mixed parameters. Float32 sums in another order
    can move a rank whose cumulative mass sits on the top-p boundary, or a probability's last bit: a few rows may
    draw differently, but every drawn token is one the reference keeps and the rest agree."""
    B = 192
    g = torch.Generator(device="cuda").manual_seed(V)
    logits = (torch.randn(B, V, device="cuda", generator=g) * torch.linspace(0.5, 6, B, device="cuda")[:, None])
    logits = logits.to(ldtype)
    temp = torch.tensor([0.7, 1.0, 0.3, 1.5, 0.0, 0.8], device="cuda").repeat(B // 6).to(pdtype)
    top_p = torch.tensor([0.8, 0.9, 1.0, 0.5, 0.95, 0.7, 0.0, 0.6], device="cuda").repeat(B // 8).to(pdtype)
    top_k = torch.tensor([30, 1 << 40, 1, 5000, 2, 1 << 40, 7, 0, 1 << 40, 64, 1 << 40, 3], device="cuda")
    top_k = top_k.repeat(B // 12)
    seeds = torch.randint(-(1 << 62), 1 << 62, (B,), device="cuda", generator=g)
    counters = torch.randint(0, 1 << 20, (B,), device="cuda", generator=g)
    ids = torch.arange(V, device="cuda") + 151_000
    for d in (0, 3):
        got = draw.sample(logits, temp, top_p, top_k, seeds, counters, d, ids)
        probs = reference.filtered_probs(logits, temp, top_p, top_k)
        want = reference.exponential_race(probs, seeds, counters, d, ids)
        agree = (got == want).float().mean().item()
        assert agree >= 0.97, agree
        cut = (probs.gather(1, got[:, None])[:, 0] == 0).float().mean().item()
        assert cut <= 0.03, cut  # a token the reference cuts: only at the top-p boundary
        # top-k 1, or top-k / top-p 0 (the scratch slot's padded rows): the largest logit, lowest index on ties
        greedy = (top_k <= 1) | (top_p == 0)
        assert torch.equal(got[greedy], logits[greedy].float().argmax(-1))


@GPU
@pytest.mark.parametrize("M,D", [(1, 2560), (3, 1024), (64, 2560), (6, 128)])
def test_rmsnorm_quant_kernels(M: int, D: int) -> None:
    """The quantized norm kernels against quantize_1x128 of the bf16 norm: the same FP8 bytes and scales but where
    the norm's float32 sum rounded a value differently (checked through the dequantized rows)."""
    g = torch.Generator(device="cuda").manual_seed(M * D)
    x = (torch.randn(M, D, device="cuda", generator=g) * 2 + 0.3).bfloat16()
    r = (torch.randn(M, D, device="cuda", generator=g) - 0.2).bfloat16()
    w = (torch.rand(D, device="cuda", generator=g) + 0.5).bfloat16()
    h, got2 = norm_rope.add_rmsnorm_quant(x, r, w, 1e-6)
    h_ref, want2 = reference.add_rmsnorm(x, r, w, 1e-6)
    assert torch.equal(h, h_ref)
    for got, want in ((norm_rope.rmsnorm_quant(x, w, 1e-6), reference.rmsnorm(x, w, 1e-6)), (got2, want2)):
        q_ref, s_ref = reference.quantize_1x128(want)
        assert got.q.shape == q_ref.shape and got.scale.shape == s_ref.shape
        deq = got.q.float().view(M, D // 128, 128) * got.scale[:, :M].T[..., None]
        deq_ref = q_ref.float().view(M, D // 128, 128) * s_ref[:, :M].T[..., None]
        torch.testing.assert_close(deq, deq_ref, rtol=0.13, atol=1e-3)  # one e4m3 step at most
        assert float((got.q.view(torch.uint8) == q_ref.view(torch.uint8)).float().mean()) > 0.9
        assert torch.equal(got.scale[:, M:], s_ref[:, M:])  # padding rows: zero scales


@GPU
def test_draw_kernels_on_nan_rows_and_signed_zeros() -> None:
    """A NaN row (broken weights, an overflow) must still give an index the engine can use, not a device assert;
    -0 and +0 logits tie and go by index, as in torch's sort."""
    V = 300
    ids = torch.arange(V, device="cuda")
    seeds, counters = torch.tensor([1, 2], device="cuda"), torch.tensor([0, 0], device="cuda")
    one = torch.ones(2, device="cuda")
    nan = torch.full((2, V), float("nan"), device="cuda")
    got = draw.sample(nan, one, one * 0.9, torch.tensor([30, 1 << 40], device="cuda"), seeds, counters, 0, ids)
    assert bool(((got >= 0) & (got < V)).all())
    got = draw.exponential_race(nan, seeds, counters, 0, ids)
    assert bool(((got >= 0) & (got < V)).all())
    zeros = torch.zeros(2, V, device="cuda")
    zeros[:, 0], zeros[:, 1] = -1.0, -0.0  # the largest logits: -0 at index 1, +0 from index 2 on
    top1 = torch.ones(2, dtype=torch.int64, device="cuda")
    assert draw.sample(zeros, one, one, top1, seeds, counters, 0, ids).tolist() == [1, 1]  # -0 ties +0: lowest index
