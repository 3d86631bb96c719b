"""Quantize and GEMM kernels: the torch references against plain math (CPU, always), and every CUDA kernel against
its reference on random non-zero inputs, odd sizes included (marked gpu)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from kernel_util import GPU, bf16_input, capture

from rtts import env, kernels
from rtts.kernels import gemm, gemm_plan
from rtts.kernels import reference as ref
from rtts.kernels.common import sm_count

# ---------------------------------------------------------------------------------------------------- references


def test_reference_quantize_roundtrip() -> None:
    x = bf16_input(5, 384, scale=3.0)
    q, s = ref.quantize_1x128(x)
    assert q.dtype == ref.FP8 and s.shape == (3, 8)
    deq = q.float().view(5, 3, 128) * s[:, :5].T[..., None]
    rel = (deq.view(5, 384) - x.float()).abs().max() / x.float().abs().max()
    assert rel < 0.07  # e4m3 keeps 3 mantissa bits


def test_reference_gemm_matches_dequantized_matmul() -> None:
    x, w = bf16_input(7, 256, seed=1), bf16_input(200, 256, seed=2)
    wq, sw = ref.quantize_weight(w)
    assert sw.shape == (2, 2)
    xq, sx = ref.quantize_1x128(x)
    y = ref.fp8_gemm(xq, sx, wq, sw).float()
    deq_x = xq.float().view(7, 2, 128) * sx[:, :7].T[..., None]
    expect = deq_x.view(7, 256) @ ref.dequantize_weight(wq, sw).T
    assert torch.allclose(y, expect, rtol=1e-2, atol=1e-2)
    exact = x.float() @ w.float().T
    assert (y - exact).abs().max() / exact.abs().max() < 0.1


def test_packed_weight_layout() -> None:
    """pack_weight is a pure reordering: block (t, kb) row r holds 16-byte chunk c of w[128t + r, 128kb:] at
    position c ^ (r % 8); unpack inverts it and the packed GEMM equals the [N, K] one on the CPU path."""
    wq, sw = ref.quantize_weight(bf16_input(384, 256, scale=0.05, seed=11))
    wp = kernels.pack_weight(wq)
    assert wp.shape == (3, 2, 128, 128) and wp.dtype == ref.FP8
    u, q = wp.view(torch.uint8), wq.view(torch.uint8)
    for t, kb, r, c in ((0, 0, 0, 0), (2, 1, 13, 3), (1, 0, 127, 7), (0, 1, 6, 1)):
        p = c ^ (r % 8)
        assert torch.equal(u[t, kb, r, 16 * p:16 * p + 16], q[128 * t + r, 128 * kb + 16 * c:128 * kb + 16 * c + 16])
    assert torch.equal(ref.unpack_weight(wp).view(torch.uint8), q)
    xq, sx = ref.quantize_1x128(bf16_input(5, 256, seed=12))
    assert torch.equal(kernels.fp8_gemm(xq, sx, wp, sw), kernels.fp8_gemm(xq, sx, wq, sw))
    with pytest.raises(ValueError, match="packed weight"):
        kernels.fp8_gemm(xq, sx, kernels.pack_weight(ref.quantize_weight(bf16_input(128, 384))[0]), sw)
    with pytest.raises(ValueError, match="multiple of the 128x128 block"):
        kernels.pack_weight(ref.quantize_weight(bf16_input(100, 128))[0])


def test_strict_checks() -> None:
    with pytest.raises(ValueError, match="multiple of 128"):
        kernels.quantize_1x128(bf16_input(2, 100))
    with pytest.raises(ValueError, match="bf16"):
        kernels.quantize_1x128(torch.zeros(2, 128))
    xq, sx = ref.quantize_1x128(bf16_input(2, 128))
    wq, sw = ref.quantize_weight(bf16_input(64, 128))
    with pytest.raises(ValueError, match="sx must be"):
        kernels.fp8_gemm(xq, sx[:, :1].contiguous(), wq, sw)
    with pytest.raises(ValueError, match="int64"):
        kernels.decode_attention(bf16_input(1, 4, 64), bf16_input(1, 8, 2, 64), bf16_input(1, 8, 2, 64),
                                 torch.tensor([0], dtype=torch.int32), torch.tensor([3]))


# ---------------------------------------------------------------------------------------------------- CUDA parity


@GPU
@pytest.mark.parametrize("M,K", [(1, 128), (3, 2560), (17, 9728), (64, 4096), (129, 256)])
def test_quantize_kernel(M: int, K: int) -> None:
    x = bf16_input(M, K, scale=2.0, seed=M, device="cuda")
    q, s = kernels.quantize_1x128(x)
    rq, rs = ref.quantize_1x128(x)
    assert torch.equal(s, rs)
    assert (q.float() - rq.float()).abs().max() == 0


@GPU
@pytest.mark.parametrize("M,I", [(1, 128), (5, 9728), (64, 256)])
def test_swiglu_quantize_kernel(M: int, I: int) -> None:  # noqa: E741
    gu = bf16_input(M, 2 * I, scale=2.0, seed=I, device="cuda")
    q, s = kernels.swiglu_quantize(gu)
    rq, rs = ref.swiglu_quantize(gu)
    assert torch.allclose(s, rs, rtol=1e-3)
    deq, rdeq = q.float() * s.repeat_interleave(128, 0)[:I, :M].T, rq.float() * rs.repeat_interleave(128, 0)[:I, :M].T
    assert (deq - rdeq).abs().max() <= 0.07 * rdeq.abs().max()  # one FP8 step at most (exp approximation)


@GPU
@pytest.mark.parametrize("M", [1, 3, 16, 17, 64, 100, 128, 200])
@pytest.mark.parametrize("N,K", [(2560, 2560), (6144, 2560), (2560, 9728), (200, 384), (4097, 2560)])
def test_fp8_gemm_kernel(M: int, N: int, K: int) -> None:
    err = _gemm_error(kernels.fp8_gemm, M, N, K)
    assert err < 1e-2, f"relative error {err}"


@GPU
@pytest.mark.parametrize("M", [1, 3, 16, 17, 33, 64, 100, 128, 200])
@pytest.mark.parametrize("N,K", [(2560, 2560), (6144, 2560), (2560, 9728), (256, 384), (19456, 2560), (128, 128)])
def test_fp8_gemm_packed_kernel(M: int, N: int, K: int) -> None:
    """Packed weights: the wgmma kernel on sm_90a (the correct-but-slow unpacked path elsewhere)."""
    err = _gemm_error(kernels.fp8_gemm, M, N, K, packed=True)
    assert err < 1e-2, f"relative error {err}"


def _gemm_error(gemm: Callable[..., torch.Tensor], M: int, N: int, K: int, packed: bool = False) -> float:
    """Max error of `gemm` against the reference on random quantized operands, relative to the largest output."""
    x, w = bf16_input(M, K, seed=M, device="cuda"), bf16_input(N, K, scale=0.05, seed=N, device="cuda")
    wq, sw = ref.quantize_weight(w)
    xq, sx = ref.quantize_1x128(x)
    y = gemm(xq, sx, kernels.pack_weight(wq) if packed else wq, sw).float()
    r = ref.fp8_gemm(xq, sx, wq, sw).float()
    return float((y - r).abs().max() / r.abs().max())


@GPU
@pytest.mark.parametrize("M,N,K", [(1, 2560, 9728), (17, 6144, 2560), (128, 200, 384)])
def test_fp8_gemm_mma_sync_kernel(M: int, N: int, K: int) -> None:
    """The portable mma.sync kernel (GPUs without wgmma) stays correct on Hopper too."""
    assert _gemm_error(gemm.fp8_gemm_mma, M, N, K) < 1e-2


@GPU
@pytest.mark.parametrize("M,tm", [(1, False), (16, False), (32, False), (64, False), (32, True), (64, True)])
def test_fp8_gemm_rounds_like_fp32_accumulation(switches: Callable[..., None], M: int, tm: bool) -> None:
    """Decode-size GEMMs stay close to an FP32-accumulated product rounded to bf16 (0.25 ulp mean error). FP8 wgmma
    accumulates with reduced precision even inside one instruction, so this is a bound, not exactness: on the H200
    this case measured 0.30 / 0.33 / < 0.32 ulp at M = 1 / 16 / 32 with four accumulators per K block (one
    accumulator measured 0.32-0.43 on S2-Pro shapes and flipped a greedy token in the FP8 gate, which is the
    stronger guard: tests/test_quant.py::test_gate_on_gpu_kernels). 32 and 64 tokens run the 64-row kernel with
    two accumulators per K block, or (tm, RTTS_GEMM_TM=1) the token-major kernel, also with two."""
    switches(gemm_token_major=tm)
    N, K = 2560, 4096
    x, w = bf16_input(M, K, seed=3, device="cuda"), bf16_input(N, K, scale=0.05, seed=4, device="cuda")
    wq, sw = ref.quantize_weight(w)
    xq, sx = ref.quantize_1x128(x)
    KB = K // 128
    part = torch.einsum("mkb,nkb->kmn", xq.double().view(M, KB, 128), wq.double().view(N, KB, 128))
    exact = (part * sx[:, :M, None].double() * sw.double().repeat_interleave(128, 0)[:N].T[:, None, :]).sum(0)
    ulp = (exact.abs().clamp(min=1e-30).log2().floor() - 7).exp2()
    err = (kernels.fp8_gemm(xq, sx, kernels.pack_weight(wq), sw).double() - exact).abs() / ulp
    assert float(err.mean()) < 0.35, float(err.mean())


@GPU
@pytest.mark.parametrize("rows", [64, 128])
@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("M", [5, 40, 128])  # 8-, 64- and 128-token tiles
def test_fp8_gemm_stream_k_is_deterministic_and_resets(stages: int, M: int, rows: int) -> None:
    """Tiles shared by several CTAs are summed in a fixed order and their counters end at zero, so repeated calls
    and graph replays give identical bits; with both tile heights (64: fp8_gemm_wgmma64, 128: fp8_gemm_wgmma)."""
    if not gemm.uses_wgmma(torch.device("cuda")):
        pytest.skip("no wgmma on this GPU")
    N, K = 2560, 9728  # 20 tiles x 76 K blocks: most tiles are split across CTAs
    x, w = bf16_input(M, K, seed=7, device="cuda"), bf16_input(N, K, scale=0.05, seed=8, device="cuda")
    wq, sw = ref.quantize_weight(w)
    xq, sx = ref.quantize_1x128(x)
    wp = kernels.pack_weight(wq)
    first = gemm.fp8_gemm_wgmma(xq, sx, wp, sw, stages=stages, cluster=1, rows=rows)
    assert gemm.plan_gemm(M, N, K, 0, stages, 1, rows).rows == rows
    for _ in range(3):
        assert torch.equal(gemm.fp8_gemm_wgmma(xq, sx, wp, sw, stages=stages, cluster=1, rows=rows), first)
    r = ref.fp8_gemm(xq, sx, wq, sw).float()
    assert (first.float() - r).abs().max() / r.abs().max() < 1e-2
    sk = gemm.streamk_scratch(torch.device("cuda"))
    assert int(sk.counters.abs().sum()) == 0


@GPU
def test_fp8_gemm_64_rows_interleaved_plans_share_the_scratch() -> None:
    """Plans of other shapes and token counts park shares in the same stream-K slots and count on the same counters
    in between, yet every call sums only its own launch's shares: the same bits as its first call, the product, and
    every counter back at zero."""
    if not gemm.uses_wgmma(torch.device("cuda")):
        pytest.skip("no wgmma on this GPU")
    cases = []
    for i, (M, N, K) in enumerate([(40, 2560, 9728), (64, 6144, 2560), (17, 2560, 4096), (128, 19456, 2560),
                                   (33, 128, 16384)]):
        x, w = bf16_input(M, K, seed=20 + i, device="cuda"), bf16_input(N, K, scale=0.05, seed=40 + i, device="cuda")
        wq, sw = ref.quantize_weight(w)
        xq, sx = ref.quantize_1x128(x)
        wp = kernels.pack_weight(wq)
        assert gemm.plan_gemm(M, N, K, 0, cluster=1, rows=64).rows == 64
        first = gemm.fp8_gemm_wgmma(xq, sx, wp, sw, cluster=1, rows=64)
        r = ref.fp8_gemm(xq, sx, wq, sw).float()
        assert (first.float() - r).abs().max() / r.abs().max() < 1e-2, (M, N, K)
        cases.append((xq, sx, wp, sw, first))
    for _ in range(4):
        for xq, sx, wp, sw, first in cases:
            assert torch.equal(gemm.fp8_gemm_wgmma(xq, sx, wp, sw, cluster=1, rows=64), first)
    sk = gemm.streamk_scratch(torch.device("cuda"))
    assert int(sk.counters.abs().sum()) == 0


@GPU
@pytest.mark.parametrize("cluster", [1, 2, 3, 5, 6, 8])
@pytest.mark.parametrize("M,N,K", [(1, 6144, 2560), (5, 2560, 9728), (17, 1152, 640), (33, 384, 1280),
                                   (64, 2560, 4096), (9, 19456, 2560), (5, 128, 16384), (40, 128, 16384)])
def test_fp8_gemm_every_split_is_correct_and_deterministic(cluster: int, M: int, N: int, K: int) -> None:
    """Every split the planner can pick (global stream-K, clusters of 2-8 CTAs settled in distributed shared memory)
    computes the product, the same bits on every call; 128 x 16384 splits its one tile over 128 CTAs."""
    if not gemm.uses_wgmma(torch.device("cuda")):
        pytest.skip("no wgmma on this GPU")
    try:
        gemm.plan_gemm(M, N, K, 0, cluster=cluster)
    except ValueError:
        pytest.skip(f"no plan with clusters of {cluster} for {M}x{N}x{K}")
    x, w = bf16_input(M, K, seed=M + 40, device="cuda"), bf16_input(N, K, scale=0.05, seed=N + 41, device="cuda")
    wq, sw = ref.quantize_weight(w)
    xq, sx = ref.quantize_1x128(x)
    wp = kernels.pack_weight(wq)
    first = gemm.fp8_gemm_wgmma(xq, sx, wp, sw, cluster=cluster)
    r = ref.fp8_gemm(xq, sx, wq, sw).float()
    assert (first.float() - r).abs().max() / r.abs().max() < 1e-2
    for _ in range(2):
        assert torch.equal(gemm.fp8_gemm_wgmma(xq, sx, wp, sw, cluster=cluster), first)


@GPU
@pytest.mark.parametrize("rows", [64, 128])
@pytest.mark.parametrize("M,N,K", [(17, 1152, 640), (33, 384, 1280), (64, 2560, 4096), (100, 6144, 2560),
                                   (128, 19456, 2560), (40, 128, 16384), (128, 128, 128), (7, 256, 384)])
def test_fp8_gemm_both_tile_heights(rows: int, M: int, N: int, K: int) -> None:
    """The 64-row kernel (one warpgroup, tokens through the ring by tensor-map TMA, rows past M zero-filled by the copy
    engine) and the 128-row one compute the same product, the same bits on every call, on odd sizes too."""
    if not gemm.uses_wgmma(torch.device("cuda")):
        pytest.skip("no wgmma on this GPU")
    from rtts.kernels import _jit

    if rows == 64 and not _jit.tensor_maps_available():
        pytest.skip("the 64-row kernel needs the driver's tensor maps")
    plan = gemm.plan_gemm(M, N, K, 0, cluster=1, rows=rows)
    assert plan.rows == rows  # the kernel under test is the one that runs
    if not gemm.scratch_fits(plan, N, sm_count(0)):
        pytest.skip("this plan's shares do not fit the stream-K scratch (fp8_gemm would slice the tokens)")
    x, w = bf16_input(M, K, seed=M + 60, device="cuda"), bf16_input(N, K, scale=0.05, seed=N + 61, device="cuda")
    wq, sw = ref.quantize_weight(w)
    xq, sx = ref.quantize_1x128(x)
    wp = kernels.pack_weight(wq)
    first = gemm.fp8_gemm_wgmma(xq, sx, wp, sw, cluster=1, rows=rows)
    r = ref.fp8_gemm(xq, sx, wq, sw).float()
    assert (first.float() - r).abs().max() / r.abs().max() < 1e-2
    for _ in range(2):
        assert torch.equal(gemm.fp8_gemm_wgmma(xq, sx, wp, sw, cluster=1, rows=rows), first)


@GPU
@pytest.mark.parametrize("M,N,K,sms,split,stages", [
    (17, 1280, 640, 32, 1, None),   # 40-row tiles, tile 3 crossing a packed block (rows 120-159)
    (1, 6144, 2560, 132, 1, None),   # one token (31 zero-filled rows of the 32-row tile)
    (12, 6144, 2560, 132, 1, None),  # wqkv's plan at 9-16 tokens
    (33, 6144, 2560, 132, 1, None),  # wqkv's plan: 40- and 48-row tiles, some crossing
    (64, 2560, 4096, 132, 2, None),  # wo's: cluster pairs over half of K each, 32- and 40-row tiles
    (40, 2560, 9728, 132, 2, 2),     # w2's, with a two-stage ring (19 passes around it)
    (20, 384, 256, 20, 2, None),     # one K block per CTA, uneven tiles
    (64, 1024, 3072, 60, 2, 4),
    (50, 3072, 1024, 132, 2, None),
    (32, 2560, 384, 132, 1, 2),      # an odd K-block count, alternate warpgroups ending unevenly
])
def test_fp8_gemm_token_major_kernel(M: int, N: int, K: int, sms: int, split: int, stages: int | None) -> None:
    """The token-major kernel (tokens on the wgmma M side, whole-K or cluster-pair tiles of unequal widths, one per
    CTA) computes the product on tiles that cross packed blocks, short and wrapping rings, both token tiles; the same
    bits on every call and from a CUDA graph."""
    from rtts.kernels import _jit

    if not gemm.uses_wgmma(torch.device("cuda")) or not _jit.tensor_maps_available():
        pytest.skip("no wgmma or no tensor maps on this GPU")
    plan = gemm_plan.wgmma_tm_plan(M, N, K, sms, stages, split)
    assert plan.cluster == split and (stages is None or plan.stages == stages)
    x, w = bf16_input(M, K, seed=M + 70, device="cuda"), bf16_input(N, K, scale=0.05, seed=N + 71, device="cuda")
    wq, sw = ref.quantize_weight(w)
    xq, sx = ref.quantize_1x128(x)
    wp = kernels.pack_weight(wq)
    first = gemm.launch_wgmma(plan, xq, sx, wp, sw)
    r = ref.fp8_gemm(xq, sx, wq, sw).float()
    assert (first.float() - r).abs().max() / r.abs().max() < 1e-2
    for _ in range(2):
        assert torch.equal(gemm.launch_wgmma(plan, xq, sx, wp, sw), first)
    g, out = capture(lambda: gemm.launch_wgmma(plan, xq, sx, wp, sw))
    for _ in range(2):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first)


@GPU
@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("N,K", [(6144, 2560), (2560, 4096), (2560, 9728), (19456, 2560), (256, 384)])
def test_fp8_gemm_lean_tma_tokens_give_the_same_bits(switches: Callable[..., None], M: int, N: int, K: int) -> None:
    """The lean instances' tokens by tensor-map TMA (the default) give the same bits as by cp.async
    (RTTS_GEMM_TMA_TOKENS=0) on the same plan, eagerly and replayed from a graph, and the split-tile counters end at
    zero."""
    from rtts.kernels import _jit

    if not gemm.uses_wgmma(torch.device("cuda")) or not _jit.tensor_maps_available():
        pytest.skip("no wgmma or no tensor maps on this GPU")
    x, w = bf16_input(M, K, seed=M + 40, device="cuda"), bf16_input(N, K, scale=0.05, seed=N + 41, device="cuda")
    wq, sw = ref.quantize_weight(w)
    xq, sx = ref.quantize_1x128(x)
    wp = kernels.pack_weight(wq)
    switches(gemm_token_major=False)  # wqkv at 9-16 tokens would plan the token-major kernel
    assert gemm.plan_gemm(M, N, K, 0).rows == 128
    with env.override_kernel_switches(gemm_tma_tokens=False):
        want = kernels.fp8_gemm(xq, sx, wp, sw)
    for _ in range(3):
        assert torch.equal(kernels.fp8_gemm(xq, sx, wp, sw), want)
    g, out = capture(lambda: kernels.fp8_gemm(xq, sx, wp, sw))
    for _ in range(2):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
    assert int(gemm.streamk_scratch(torch.device("cuda")).counters.abs().sum()) == 0


@GPU
# the 128-row (lean) kernel with its tokens by TMA (the default) or cp.async, the 64-row and the token-major kernel
@pytest.mark.parametrize("M,tma,tm", [(3, True, False), (3, False, False), (16, True, False), (40, True, False),
                                      (40, True, True)])
def test_fp8_gemm_pdl_chain(switches: Callable[..., None], M: int, tma: bool, tm: bool) -> None:
    """GEMMs launched with programmatic dependent launch start while the previous kernel finishes: a chain where
    each GEMM reads the previous one's output (through the quantize kernel) gives the same bits with and without
    PDL, eagerly and replayed from a CUDA graph (the lean kernel with its tokens by TMA, read after
    griddepcontrol.wait by the producer thread, and by cp.async; the 64-row and the token-major kernel at 40)."""
    if not gemm.uses_wgmma(torch.device("cuda")):
        pytest.skip("no wgmma on this GPU")
    if not tma:
        switches(gemm_tma_tokens=False)
    ws = [ref.quantize_weight(bf16_input(2560, 2560, scale=0.03, seed=20 + i, device="cuda")) for i in range(6)]
    ws = [(kernels.pack_weight(q), s) for q, s in ws]
    from rtts.kernels import _jit

    switches(gemm_token_major=tm)
    if M > 16 and _jit.tensor_maps_available():  # the chain runs the 64-row or the token-major kernel
        p = gemm.plan_gemm(M, 2560, 2560, 0)
        assert p.token_major if tm else (p.rows == 64 and not p.token_major)
    x0 = bf16_input(M, 2560, seed=30, device="cuda")

    def chain() -> torch.Tensor:
        h = x0
        for wp, sw in ws:
            h = kernels.fp8_linear(h, wp, sw)
        return h

    with env.override_kernel_switches(no_pdl=True):
        plain = chain()
    assert torch.equal(chain(), plain)
    g, out = capture(chain, warm=True)
    for _ in range(3):
        g.replay()
        assert torch.equal(out, plain)


@GPU
def test_kernels_capture_in_cuda_graph() -> None:
    x, w = bf16_input(16, 2560, device="cuda"), bf16_input(2560, 2560, scale=0.05, device="cuda")
    wq, sw = ref.quantize_weight(w)
    kernels.warmup(torch.device("cuda"))
    eager = kernels.fp8_linear(x, wq, sw)
    g, out = capture(lambda: kernels.fp8_linear(x, wq, sw), warm=True)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert math.isfinite(float(out.float().abs().max()))
