"""The codec's kernels (cuda/snake.cu, cuda/codec_residual.cu: rtts/kernels/codec_ops.py) and the GPU rewrites of its
convolutions (rtts/model/codec_conv.py: dilated convs by phases, conv biases added by the kernels): each against its
torch reference on CPU, and on the GPU against the torch expression (marked `gpu`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rtts import env, kernels
from rtts.kernels import reference as ref

GPU = pytest.mark.gpu


def test_reference_snake_is_the_codec_expression() -> None:
    x, alpha = torch.randn(2, 5, 7), torch.rand(1, 5, 1) + 0.3
    want = x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)
    assert torch.equal(kernels.snake(x, alpha), want)  # CPU: the wrapper runs the reference
    assert torch.equal(ref.snake(x, alpha.view(5)), want)


def test_codec_snake_keeps_other_dtypes_on_the_torch_expression() -> None:
    from rtts.model.codec_conv import Snake1d

    m = Snake1d(5)
    m.alpha.data.uniform_(0.3, 2.0)
    x = torch.randn(2, 5, 7).to(torch.float64)
    m64 = m.to(torch.float64)
    with torch.no_grad():
        assert torch.equal(m64(x), x + (m64.alpha + 1e-9).reciprocal() * torch.sin(m64.alpha * x).pow(2))


def test_snake_checks() -> None:
    with pytest.raises(ValueError, match="float32, bfloat16 or float16 .B, C, L. with contiguous rows"):
        kernels.snake(torch.randn(2, 5, 7).transpose(1, 2), torch.ones(7))
    with pytest.raises(ValueError, match="float32, bfloat16 or float16 .B, C, L. with contiguous rows"):
        kernels.snake(torch.randn(5, 7), torch.ones(5))
    with pytest.raises(ValueError, match="float32, bfloat16 or float16 .B, C, L. with contiguous rows"):
        kernels.snake(torch.randn(2, 5, 7, dtype=torch.float64), torch.ones(5))
    with pytest.raises(ValueError, match="one per channel"):
        kernels.snake(torch.randn(2, 5, 7), torch.ones(4))
    with pytest.raises(ValueError, match="bias must hold 5 floats"):
        kernels.snake(torch.randn(2, 5, 7), torch.ones(5), torch.ones(3))
    with pytest.raises(ValueError, match="bias_residual: want x and y"):
        kernels.bias_residual(torch.randn(2, 5, 7), torch.randn(2, 5, 8), None)
    with pytest.raises(ValueError, match="bias_residual: want x and y"):  # y must be contiguous
        kernels.bias_residual(torch.randn(2, 5, 7), torch.randn(2, 5, 9)[..., :7], None)


def test_codec_kernel_layouts() -> None:
    """The layouts the codec kernels read in place: contiguous rows, evenly spaced (a tensor or its slice along L)."""
    from rtts.kernels.codec_ops import row_stride

    x = torch.randn(3, 4, 10)
    assert row_stride(x) == 10 and row_stride(x[..., 2:8]) == 10 and row_stride(x[:1, 1:3]) == 10
    assert row_stride(x[:, 1:3]) is None  # rows evenly spaced within a batch entry, not across them
    assert row_stride(x.transpose(1, 2)) is None and row_stride(x[..., ::2]) is None
    assert row_stride(x[:, :, None].expand(3, 4, 2, 10).reshape(3, 8, 10)) == 10  # a copy: contiguous again
    assert row_stride(torch.randn(4, 5)) is None
    assert row_stride(torch.randn(1, 1, 6)[..., 1:4]) is not None


def test_snake_with_bias_on_a_slice_is_the_expression_on_the_biased_copy() -> None:
    g = torch.Generator().manual_seed(3)
    full = torch.randn(2, 5, 12, generator=g)
    x, alpha, bias = full[..., 3:10], torch.rand(5, generator=g) + 0.3, torch.randn(5, generator=g)
    want = ref.snake(x.contiguous() + bias.view(1, 5, 1), alpha)
    got = kernels.snake(x, alpha, bias)
    assert got.is_contiguous() and torch.equal(got, want)
    res = torch.randn(2, 5, 7, generator=g)
    assert torch.equal(kernels.bias_residual(x, res, bias), x + (res + bias.view(1, 5, 1)))
    assert torch.equal(kernels.bias_residual(x, res, None), x + res)


@pytest.mark.parametrize("B,C,N,L,K,d", [(1, 5, 5, 31, 7, 3), (3, 2, 6, 19, 3, 2),
                                         (2, 4, 4, 6 * 9 + 1, 7, 9), (2, 3, 4, 70, 7, 9), (1, 1, 1, 13, 7, 1)])
def test_conv_by_phases_is_the_dilated_conv(B: int, C: int, N: int, L: int, K: int, d: int) -> None:
    from rtts.kernels.codec_ops import row_stride
    from rtts.model.codec_conv import conv1d_by_phases

    g = torch.Generator().manual_seed(L * d)
    x, w, b = torch.randn(B, C, L, generator=g), torch.randn(N, C, K, generator=g), torch.randn(N, generator=g)
    want = F.conv1d(x, w, b, dilation=d)
    got = conv1d_by_phases(x, w, b, d)
    assert got.shape == want.shape and row_stride(got) is not None
    assert N == 1 or got.stride(1) % 4 == 0  # rows the Snake kernel after reads 4 at a time
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv1d_by_phases(x, w, None, d), F.conv1d(x, w, None, dilation=d), rtol=1e-5, atol=1e-5)


def test_snake_into_and_from_phases_are_the_layout() -> None:
    g = torch.Generator().manual_seed(5)
    B, C, L, d, J, start = 2, 3, 11, 3, 7, 6
    x, alpha, bias = torch.randn(B, C, L, generator=g), torch.rand(C, generator=g) + 0.3, torch.randn(C, generator=g)
    phases = torch.full((B * d, J, C), 7.0)
    kernels.snake_into_phases(x, alpha, bias, phases, start)
    signal = phases.view(B, d, J, C).permute(0, 3, 2, 1).reshape(B, C, J * d)  # position q = j * d + p
    assert torch.equal(signal[..., start : start + L], ref.snake(x + bias.view(1, C, 1), alpha))
    assert (signal[..., :start] == 7).all() and (signal[..., start + L :] == 7).all()  # the rest untouched
    back = kernels.snake_from_phases(phases, alpha, None, B, start + L)
    assert back.shape == (B, C, start + L) and torch.equal(back, ref.snake(signal[..., : start + L], alpha))
    with pytest.raises(ValueError, match="past"):
        kernels.snake_into_phases(x, alpha, None, phases, J * d - L + 1)


def test_channels_last_weight_is_made_once_per_weight_version() -> None:
    from rtts.model.codec_conv import CausalConv1d

    conv = CausalConv1d(4, 4, 7, dilation=3)
    w = conv.channels_last_weight()
    assert w.shape == (4, 4, 1, 7) and w.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(w[:, :, 0], conv.conv.weight) and conv.channels_last_weight() is w
    with torch.no_grad():
        conv.conv.weight.mul_(2)  # a new version (as load_state_dict makes)
    assert torch.equal(conv.channels_last_weight()[:, :, 0], conv.conv.weight)


@pytest.mark.parametrize("dilation", [1, 3, 9])
def test_residual_unit_through_phases_is_the_unit(dilation: int) -> None:
    """The GPU path's arithmetic (its kernels run as their references here): the whole sequence and a stream of
    uneven chunks, with the context carried in `tails`, against the plain unit."""
    from rtts.model.codec_conv import ResidualUnit

    torch.manual_seed(dilation)
    unit = ResidualUnit(4, dilation)
    for p in unit.parameters():
        p.data.normal_(0, 0.3)
    conv7 = unit.block[1]
    conv7.tail_id = 0
    x = torch.randn(2, 4, 40)
    with torch.no_grad():
        plain = unit(x)
        torch.testing.assert_close(unit._through_phases(x, None), plain, rtol=1e-5, atol=1e-5)
        tails = [torch.zeros(2, 4, conv7.context)]
        plain_tails = [torch.zeros(2, 4, conv7.context)]
        got, want, start = [], [], 0
        for size in (1, 7, 13, 19):
            chunk = x[..., start : start + size]
            got.append(unit._through_phases(chunk, tails))
            want.append(unit.step(chunk, plain_tails))
            start += size
            torch.testing.assert_close(tails[0], plain_tails[0], rtol=0, atol=0)
    torch.testing.assert_close(torch.cat(got, -1), torch.cat(want, -1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(got, -1), plain, rtol=1e-5, atol=1e-5)


@GPU
@pytest.mark.parametrize("B,C,L", [(1, 1536, 32), (3, 96, 16384), (2, 7, 13), (64, 768, 257), (1, 1, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_snake_kernel(B: int, C: int, L: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(B * C + L)
    x = (torch.randn(B, C, L, generator=g) * 3).to(dtype).cuda()
    alpha = (torch.rand(C, generator=g) * 2 + 0.05).cuda()  # never zero; trained alphas sit around 0.1-3
    y = kernels.snake(x, alpha)
    want = ref.snake(x.float(), alpha)  # float32 math, as the kernel does it
    assert y.dtype == dtype and y.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(y, want, rtol=2e-6, atol=2e-6)
    else:
        torch.testing.assert_close(y.float(), want.to(dtype).float(), rtol=1e-2, atol=1e-2)
        assert (y.float() != want.to(dtype).float()).float().mean() < 0.01  # one rounding of float32, nearly always
    if L % 4 == 0:  # the scalar path on an unaligned view gives the same values
        xs = torch.empty(B * C * L + 1, dtype=dtype, device="cuda")[1:].view(B, C, L)
        xs.copy_(x)
        assert torch.equal(kernels.snake(xs, alpha), y)


@GPU
def test_codec_decode_with_the_snake_kernel_matches_the_torch_expression() -> None:
    from rtts.model.codec import CodecConfig, codec_from_state_dict, random_codec_state_dict

    cfg = CodecConfig.release()
    codec = codec_from_state_dict(random_codec_state_dict(cfg, seed=0), cfg, torch.device("cuda"), torch.float32)
    codes = torch.randint(0, 1024, (2, cfg.num_codebooks, 6), device="cuda")
    # true float32: under TF32 a last-bit change of a Snake output can flip the rounding of a convolution input
    # (torch.backends.cuda.matmul is not an object monkeypatch can restore: saved and restored here)
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        fast = codec.decode(codes)
        with env.override_kernel_switches(reference_kernels=True):
            slow = codec.decode(codes)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-4)


@GPU
@pytest.mark.parametrize("B,C,L,start", [(3, 96, 64, 8), (2, 7, 13, 1), (64, 384, 128, 16), (1, 1, 5, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_snake_kernel_with_bias_on_a_slice(B: int, C: int, L: int, start: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(B * C + L)
    full = (torch.randn(B, C, L + start + 5, generator=g) * 3).to(dtype).cuda()
    x = full[..., start : start + L]  # as the streamed transposed conv leaves its output
    alpha = (torch.rand(C, generator=g) * 2 + 0.05).cuda()
    bias = torch.randn(C, generator=g).cuda()
    y = kernels.snake(x, alpha, bias)
    want = ref.snake(x.float() + bias.view(1, C, 1), alpha)  # float32 math, as the kernel does it
    assert y.is_contiguous() and y.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(y, want, rtol=2e-6, atol=2e-6)
    else:
        torch.testing.assert_close(y.float(), want.to(dtype).float(), rtol=1e-2, atol=1e-2)
        assert (y.float() != want.to(dtype).float()).float().mean() < 0.01
    assert torch.equal(kernels.snake(x.contiguous(), alpha, bias), y)  # the slice reads as its copy


@GPU
@pytest.mark.parametrize("B,C,L,start", [(3, 96, 64, 8), (2, 7, 13, 1), (64, 192, 256, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bias_residual_kernel(B: int, C: int, L: int, start: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(B + C * L)
    x = torch.randn(B, C, L + start, generator=g).to(dtype).cuda()[..., start:]
    y = torch.randn(B, C, L, generator=g).to(dtype).cuda()
    bias = torch.randn(C, generator=g).cuda()
    got = kernels.bias_residual(x, y, bias)
    want = (x.float() + (y.float() + bias.view(1, C, 1))).to(dtype)  # float32 math, one rounding
    assert got.is_contiguous() and torch.equal(got, want)
    assert torch.equal(kernels.bias_residual(x, y, None), (x.float() + y.float()).to(dtype))


@GPU
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_conv_by_phases_on_the_gpu(dtype: torch.dtype) -> None:
    """The release decoder's worst dilated shape (64 streams, 384 channels, dilation 9) in the served precisions."""
    from rtts.model.codec_conv import conv1d_by_phases

    g = torch.Generator().manual_seed(9)
    x = torch.randn(64, 384, 2102, generator=g).to(dtype).cuda()
    w = (torch.randn(384, 384, 7, generator=g) / 50).to(dtype).cuda()
    b = torch.randn(384, generator=g).to(dtype).cuda()
    want = F.conv1d(x.float(), w.float(), b.float(), dilation=9)
    got = conv1d_by_phases(x, w, b, 9).float()
    plain = F.conv1d(x, w, b, dilation=9).float()
    err, plain_err = (got - want).abs().max(), (plain - want).abs().max()
    assert err <= 1.5 * plain_err + 1e-3, (err, plain_err)  # no worse than cuDNN's dilated conv in that precision


@GPU
@pytest.mark.parametrize("pairs", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,C,L,d,start,pad", [(2, 3, 11, 3, 6, 5), (64, 384, 2048, 9, 54, 5), (3, 96, 17, 3, 18, 5),
                                               (2, 40, 70, 1, 6, 5), (64, 384, 2048, 9, 54, 6), (3, 96, 130, 3, 17, 6),
                                               (2, 98, 66, 9, 0, 4)])
def test_phase_kernels(pairs: bool, dtype: torch.dtype, B: int, C: int, L: int, d: int, start: int, pad: int) -> None:
    """Both kernels against the CPU reference, with rows `L + pad` apart (even pads: the two-element accesses of
    RTTS_CODEC_TILE_PAIRS where C and the lengths are even too; partial tiles at both edges)."""
    g = torch.Generator().manual_seed(L + d)
    J = -(-(start + L) // d) + 1
    full = (torch.randn(B, C, L + pad, generator=g) * 3).to(dtype)
    x, alpha, bias = full[..., 2 : 2 + L], torch.rand(C, generator=g) + 0.1, torch.randn(C, generator=g)
    want = torch.full((B * d, J, C), 7.0)
    kernels.snake_into_phases(x.float(), alpha, bias, want, start)  # CPU: the reference, in float32 as the kernel
    got = torch.full((B * d, J, C), 7.0, dtype=dtype, device="cuda")
    tol = {"rtol": 2e-6, "atol": 2e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}  # one rounding
    with env.override_kernel_switches(codec_tile_pairs=pairs):
        kernels.snake_into_phases(full.cuda()[..., 2 : 2 + L], alpha.cuda(), bias.cuda(), got, start)
        torch.testing.assert_close(got.cpu().float(), want, **tol)
        back = kernels.snake_from_phases(got, alpha.cuda(), bias.cuda(), B, start + L)
    back_want = kernels.snake_from_phases(got.cpu().float(), alpha, bias, B, start + L)
    torch.testing.assert_close(back.cpu().float(), back_want, **tol)


@GPU
@pytest.mark.parametrize("pairs", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dilation", [1, 3, 9])
def test_streamed_unit_through_phases_on_the_gpu(dtype: torch.dtype, dilation: int, pairs: bool) -> None:
    """The served path: a half-precision dilated unit streamed in uneven chunks (one shorter than its context) through
    the phase kernels, against the same unit with the phases by copies (`_biases_in_kernels`), chunk by chunk."""
    from rtts.model.codec_conv import ResidualUnit

    torch.manual_seed(dilation)
    unit = ResidualUnit(96, dilation).cuda().to(dtype)
    for p in unit.parameters():
        p.data.normal_(0, 0.2)
    conv7 = unit.block[1]
    conv7.tail_id = 0
    x = torch.randn(4, 96, 300, device="cuda").to(dtype)
    tails = [torch.zeros(4, 96, conv7.context, device="cuda", dtype=dtype)]
    ref_tails = [t.clone() for t in tails]
    start = 0
    with torch.no_grad(), env.override_kernel_switches(codec_tile_pairs=pairs):
        for size in (5, 64, 31, 200):
            chunk = x[..., start : start + size]
            got = unit._through_phases(chunk, tails)
            want = unit._biases_in_kernels(chunk, ref_tails)
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
            assert torch.equal(tails[0], ref_tails[0])  # the context carried is the same Snake output
            start += size
        whole = unit._through_phases(x, None)
        torch.testing.assert_close(whole.float(), unit._biases_in_kernels(x, None).float(), rtol=2e-2, atol=2e-2)


def _codec(dtype: torch.dtype):  # type: ignore[no-untyped-def]
    from rtts.model.codec import CodecConfig, codec_from_state_dict, random_codec_state_dict

    cfg = CodecConfig.release()
    return codec_from_state_dict(random_codec_state_dict(cfg, seed=0), cfg, torch.device("cuda"), dtype), cfg


@GPU
@pytest.mark.parametrize("fused,phases", [(True, True), (True, False), (False, True)])
def test_codec_rewrites_match_torch(fused: bool, phases: bool) -> None:
    """The whole decode and a stream of uneven chunks, with the biases in the kernels (and the dilated-conv switch,
    which acts in half precision only), against the decode with neither (true float32: TF32 would round the two
    differently)."""
    codec, cfg = _codec(torch.float32)
    codes = torch.randint(0, 1024, (2, cfg.num_codebooks, 12), device="cuda")
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with env.override_kernel_switches(codec_fused=False, codec_polyphase=False):
            plain = codec.decode(codes)
        with env.override_kernel_switches(codec_fused=fused, codec_polyphase=phases):
            whole = codec.decode(codes)
            state, out, start = codec.new_stream_state(2), [], 0
            for size in (1, 3, 8):
                out.append(codec.decode_stream(codes[..., start : start + size], state))
                start += size
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    streamed = torch.cat(out, dim=-1)
    torch.testing.assert_close(whole, plain, rtol=0, atol=1e-4)
    torch.testing.assert_close(streamed, plain[..., : streamed.shape[-1]], rtol=0, atol=1e-4)


@GPU
def test_float16_codec_with_the_rewrites_keeps_its_precision() -> None:
    """The served precision: float16 with both rewrites stays as close to float32 as float16 without them."""
    codec32, cfg = _codec(torch.float32)
    codec16, _ = _codec(torch.float16)
    codes = torch.randint(0, 1024, (4, cfg.num_codebooks, 8), device="cuda")
    want = codec32.decode(codes).float()

    def snr(got: torch.Tensor) -> float:
        return float(10 * torch.log10(want.pow(2).sum() / (got.float() - want).pow(2).sum()))

    with env.override_kernel_switches(codec_fused=False, codec_polyphase=False):
        before = snr(codec16.decode(codes))
    with env.override_kernel_switches(codec_channels_last=False):
        after = snr(codec16.decode(codes))
    channels_last = snr(codec16.decode(codes))  # served: both + channels last
    assert after > 40 and after > before - 1.0, (after, before)
    assert channels_last > 40 and channels_last > before - 1.0, (channels_last, before)
