"""FP8 weight dequantization (cuda/dequant.cu) and the dense prefill path it serves: FP8 linears over more than
gemm.FP8_DENSE_ROWS rows run one bf16 GEMM on the dequantized weight instead of 128-token slices of the decode
GEMM. CPU tests check the reference, the wrapper's checks and the routing; GPU tests (marked `gpu`) check the kernel
bit for bit against the reference on random, never-zero weights of odd sizes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rtts import kernels
from rtts.kernels import gemm, reference
from rtts.model.quant import FP8FeedForward, FP8Linear

GPU = pytest.mark.gpu


def _weight(N: int, K: int, seed: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """A quantized weight whose blocks span very different magnitudes (subnormal e4m3 codes included)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * torch.logspace(-3, 1, N)[:, None] + 1e-3
    w[0, :8] = torch.tensor([1e-9, -1e-9, 3e-4, -3e-4, 1.0, -1.0, 7e-3, 2e-5])  # tiny values next to large ones
    q, s = reference.quantize_weight(w)
    return q.to(device), s.to(device)


def _linear(K: int, N: int, seed: int) -> FP8Linear:
    mod = FP8Linear(K, N)
    q, s = _weight(N, K, seed)
    mod.weight = nn.Parameter(q, requires_grad=False)
    mod.weight_scale = nn.Parameter(s, requires_grad=False)
    return mod


# ---------------------------------------------------------------------------------------------------- CPU


def test_reference_dequantizes_packed_and_plain_alike() -> None:
    q, s = _weight(256, 384, seed=0)
    plain = reference.dequantize_bf16(q, s)
    assert plain.dtype == torch.bfloat16 and plain.shape == (256, 384)
    assert torch.equal(reference.dequantize_bf16(reference.pack_weight(q), s), plain)
    assert torch.equal(plain, (q.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)).bfloat16())
    assert torch.count_nonzero(plain) > 0.99 * plain.numel()


def test_dequantize_weight_checks_its_operands() -> None:
    q, s = _weight(256, 256, seed=1)
    assert torch.equal(kernels.dequantize_weight(q, s), reference.dequantize_bf16(q, s))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        kernels.dequantize_weight(q.float(), s)
    with pytest.raises(ValueError, match="sw must be"):
        kernels.dequantize_weight(q, s[:1])
    with pytest.raises(ValueError, match="sw must be"):
        kernels.dequantize_weight(q, s.double())
    with pytest.raises(ValueError, match="contiguous"):
        kernels.dequantize_weight(q.t(), s)
    with pytest.raises(ValueError, match="multiple of 16"):
        kernels.dequantize_weight(q[:, :200].contiguous(), s)


@pytest.mark.parametrize("rows", [gemm.FP8_DENSE_ROWS + 1, 300])
def test_fp8_linear_over_the_dense_rows_runs_one_dense_gemm(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    mod = _linear(256, 384, seed=2)
    x = torch.randn(1, rows, 256, generator=torch.Generator().manual_seed(3)).bfloat16()

    def no_sliced_gemm(*args: object) -> None:
        raise AssertionError("prefill rows went to the decode GEMM")

    monkeypatch.setattr(gemm, "fp8_gemm", no_sliced_gemm)  # what fp8_linear calls
    with torch.inference_mode():
        y = mod(x)
    assert y.shape == (1, rows, 384)
    assert torch.equal(y, nn.functional.linear(x, reference.dequantize_bf16(mod.weight, mod.weight_scale)))


def test_fp8_linear_at_the_dense_rows_still_runs_the_fp8_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = _linear(256, 128, seed=4)
    calls = []
    fp8_gemm = gemm.fp8_gemm
    monkeypatch.setattr(gemm, "fp8_gemm", lambda *a: calls.append(a[0].shape[0]) or fp8_gemm(*a))
    x = torch.randn(gemm.FP8_DENSE_ROWS, 256, generator=torch.Generator().manual_seed(5)).bfloat16()
    with torch.inference_mode():
        y = mod(x)
    assert calls == [gemm.FP8_DENSE_ROWS]
    dense = nn.functional.linear(x, reference.dequantize_bf16(mod.weight, mod.weight_scale))
    assert float((y.float() - dense.float()).norm() / dense.float().norm()) < 0.05  # activation rounding only


@pytest.mark.parametrize("fused", [True, False])
def test_fp8_mlp_dense_path_matches_its_fp8_path(fused: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The MLP's dense path (prefill) computes silu(x W1^T) * (x W3^T) W2^T on the dequantized weights; the same rows
    sent through the FP8 path (activations quantized 1x128) differ only by that rounding."""
    mlp = FP8FeedForward(256, 384)
    for i, lin in enumerate((mlp.w1, mlp.w3, mlp.w2)):
        q, s = _weight(lin.out_features, lin.in_features, seed=10 + i)
        lin.weight, lin.weight_scale = nn.Parameter(q, requires_grad=False), nn.Parameter(s, requires_grad=False)
    if fused:
        mlp.fuse()
        assert mlp.gate_up is not None
    x = torch.randn(gemm.FP8_DENSE_ROWS + 3, 256, generator=torch.Generator().manual_seed(6)).bfloat16()
    d = lambda m: reference.dequantize_bf16(m.weight, m.weight_scale)  # noqa: E731
    want = nn.functional.linear(nn.functional.silu(nn.functional.linear(x, d(mlp.w1))) *
                                nn.functional.linear(x, d(mlp.w3)), d(mlp.w2))
    with torch.inference_mode():
        got = mlp(x)
        monkeypatch.setattr(gemm, "FP8_DENSE_ROWS", 1 << 20)  # the same rows through the FP8 GEMMs
        fp8 = mlp(x)
    assert torch.equal(got, want)
    assert float((fp8.float() - got.float()).norm() / got.float().norm()) < 0.08


def _fp8_of(lin: nn.Linear) -> FP8Linear:
    mod = FP8Linear(lin.in_features, lin.out_features)
    q, sc = reference.quantize_weight(lin.weight.detach().float())
    mod.weight, mod.weight_scale = nn.Parameter(q, requires_grad=False), nn.Parameter(sc, requires_grad=False)
    return mod


def test_block_over_the_dense_rows_does_not_quantize_in_its_norms(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill block hands bf16 rows to its FP8 modules (which run dense); a decode-sized one quantizes in the norm
    kernels. Both give the same output up to activation rounding."""
    from rtts.kernels import norm_rope
    from rtts.model.dual_ar import Attention, Block
    from rtts.model.rope import rope_table

    torch.manual_seed(0)
    block = Block(256, 384, Attention(256, 2, 1, 128, False, False, True, 1e-6), 1e-6).bfloat16()
    block.attention.wqkv, block.attention.wo = _fp8_of(block.attention.wqkv), _fp8_of(block.attention.wo)
    ff = block.feed_forward
    mlp = FP8FeedForward(256, 384)
    mlp.w1, mlp.w3, mlp.w2 = _fp8_of(ff.w1), _fp8_of(ff.w3), _fp8_of(ff.w2)
    mlp.fuse()
    block.feed_forward = mlp
    assert block.fp8_inputs

    S = gemm.FP8_DENSE_ROWS + 2
    x = torch.randn(1, S, 256).bfloat16()
    positions = torch.arange(S)[None]
    rope = rope_table(S, 128, 1e6)[positions]
    caches = [torch.zeros(1, S, 1, 128, dtype=torch.bfloat16) for _ in range(2)]
    rows = torch.tensor([0])

    def quantizing_norm(*a: object, **k: object) -> None:
        raise AssertionError("a prefill block quantized in its norm")

    with torch.inference_mode():
        with monkeypatch.context() as m:
            m.setattr(norm_rope, "rmsnorm_quant", quantizing_norm)
            m.setattr(norm_rope, "add_rmsnorm_quant", quantizing_norm)
            h, out = block(x, rope, *caches, rows, positions, S)
        monkeypatch.setattr(gemm, "FP8_DENSE_ROWS", 1 << 20)  # the same rows quantized by the norms
        h8, out8 = block(x, rope, *(c.zero_() for c in caches), rows, positions, S)
    y, y8 = (h + out).float(), (h8 + out8).float()
    assert float((y - y8).norm() / y.norm()) < 0.05


# ---------------------------------------------------------------------------------------------------- GPU


@GPU
@pytest.mark.parametrize("N,K,packed", [(384, 640, True), (128, 128, True), (2560, 4096, True), (200, 272, False),
                                        (129, 4096, False), (1, 16, False)])
def test_dequantize_kernel_matches_the_reference(N: int, K: int, packed: bool) -> None:
    q, s = _weight(N, K, seed=N + K)
    want = reference.dequantize_bf16(q, s)
    wq = reference.pack_weight(q) if packed else q
    got = kernels.dequantize_weight(wq.cuda(), s.cuda())
    assert got.dtype == torch.bfloat16 and got.shape == (N, K)
    assert torch.equal(got.cpu(), want)


@GPU
def test_fp8_prefill_rows_run_dense_on_the_gpu() -> None:
    mod = _linear(2560, 1024, seed=7).cuda()
    mod.pack()
    x = torch.randn(512, 2560, generator=torch.Generator().manual_seed(8)).bfloat16().cuda()
    with torch.inference_mode():
        y = mod(x)
        want = nn.functional.linear(x, reference.dequantize_bf16(reference.unpack_weight(mod.weight.cpu()),
                                                                 mod.weight_scale.cpu()).cuda())
        sliced = kernels.fp8_linear(x, mod.weight, mod.weight_scale)  # what the rows cost before: 128-token slices
    assert torch.equal(y, want)
    assert float((sliced.float() - y.float()).norm() / y.float().norm()) < 0.05

