"""Kernels: the torch references against plain math (CPU, always), and every CUDA kernel against its reference on
random non-zero inputs, odd sizes included (marked gpu)."""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Iterator

import pytest
import torch

from rtts import env, kernels
from rtts.kernels import attention, gemm, gemm_plan
from rtts.kernels import reference as ref
from rtts.kernels.common import sm_count
from rtts.kernels.gemm_plan import wgmma_tm_smem_bytes

GPU = pytest.mark.gpu


def _x(*shape: int, scale: float = 1.0, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16).to(device)


@pytest.fixture
def switches() -> Iterator[Callable[..., object]]:
    """switches(name=value, ...) changes kernel switches (env.KernelSwitches fields) for the rest of the test."""
    saved = env.kernel_switches()
    yield env.change_kernel_switches
    env.set_kernel_switches(saved)


def _capture(fn: Callable[[], torch.Tensor], warm: bool = False) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """`fn` captured in a CUDA graph on a side stream (after one eager call there when `warm`): the graph and the
    tensor its replays write."""
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        if warm:
            fn()
        with torch.cuda.graph(g, stream=s):
            out = fn()
    torch.cuda.current_stream().wait_stream(s)
    return g, out


# ---------------------------------------------------------------------------------------------------- references


def test_reference_quantize_roundtrip() -> None:
    x = _x(5, 384, scale=3.0)
    q, s = ref.quantize_1x128(x)
    assert q.dtype == ref.FP8 and s.shape == (3, 8)
    deq = q.float().view(5, 3, 128) * s[:, :5].T[..., None]
    rel = (deq.view(5, 384) - x.float()).abs().max() / x.float().abs().max()
    assert rel < 0.07  # e4m3 keeps 3 mantissa bits


def test_reference_gemm_matches_dequantized_matmul() -> None:
    x, w = _x(7, 256, seed=1), _x(200, 256, seed=2)
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
    wq, sw = ref.quantize_weight(_x(384, 256, scale=0.05, seed=11))
    wp = kernels.pack_weight(wq)
    assert wp.shape == (3, 2, 128, 128) and wp.dtype == ref.FP8
    u, q = wp.view(torch.uint8), wq.view(torch.uint8)
    for t, kb, r, c in ((0, 0, 0, 0), (2, 1, 13, 3), (1, 0, 127, 7), (0, 1, 6, 1)):
        p = c ^ (r % 8)
        assert torch.equal(u[t, kb, r, 16 * p:16 * p + 16], q[128 * t + r, 128 * kb + 16 * c:128 * kb + 16 * c + 16])
    assert torch.equal(ref.unpack_weight(wp).view(torch.uint8), q)
    xq, sx = ref.quantize_1x128(_x(5, 256, seed=12))
    assert torch.equal(kernels.fp8_gemm(xq, sx, wp, sw), kernels.fp8_gemm(xq, sx, wq, sw))
    with pytest.raises(ValueError, match="packed weight"):
        kernels.fp8_gemm(xq, sx, kernels.pack_weight(ref.quantize_weight(_x(128, 384))[0]), sw)
    with pytest.raises(ValueError, match="multiple of the 128x128 block"):
        kernels.pack_weight(ref.quantize_weight(_x(100, 128))[0])


def test_reference_decode_attention_matches_sdpa() -> None:
    B, H, n_kv, D, L = 3, 8, 2, 64, 40
    q = _x(B, H, D, seed=3)
    kc, vc = _x(5, L, n_kv, D, seed=4), _x(5, L, n_kv, D, seed=5)
    slots, lens = torch.tensor([4, 0, 2]), torch.tensor([40, 1, 17])
    out = ref.decode_attention(q, kc, vc, slots, lens).float()
    for b in range(B):
        n = int(lens[b])
        k = kc[slots[b], :n].float().permute(1, 0, 2).repeat_interleave(H // n_kv, 0)  # [H, n, D]
        v = vc[slots[b], :n].float().permute(1, 0, 2).repeat_interleave(H // n_kv, 0)
        sdpa = torch.nn.functional.scaled_dot_product_attention(q[b].float()[:, None], k, v)[:, 0]
        assert torch.allclose(out[b], sdpa, atol=2e-2)


def test_reference_token_window() -> None:
    buf = torch.arange(4 * 3 * 2, dtype=torch.int32).view(4, 3, 2)
    before = buf.clone()
    kernels.token_window_shift(buf, torch.tensor([2, 0]), torch.tensor([[100, 101], [200, 201]], dtype=torch.int32),
                               torch.tensor([True, False]))
    assert torch.equal(buf[2], torch.tensor([[before[2, 1, 0], before[2, 1, 1]], [before[2, 2, 0], before[2, 2, 1]],
                                             [100, 101]], dtype=torch.int32))
    assert torch.equal(buf[0], before[0]) and torch.equal(buf[1], before[1])


def test_strict_checks() -> None:
    with pytest.raises(ValueError, match="multiple of 128"):
        kernels.quantize_1x128(_x(2, 100))
    with pytest.raises(ValueError, match="bf16"):
        kernels.quantize_1x128(torch.zeros(2, 128))
    xq, sx = ref.quantize_1x128(_x(2, 128))
    wq, sw = ref.quantize_weight(_x(64, 128))
    with pytest.raises(ValueError, match="sx must be"):
        kernels.fp8_gemm(xq, sx[:, :1].contiguous(), wq, sw)
    with pytest.raises(ValueError, match="int64"):
        kernels.decode_attention(_x(1, 4, 64), _x(1, 8, 2, 64), _x(1, 8, 2, 64), torch.tensor([0], dtype=torch.int32),
                                 torch.tensor([3]))


# ---------------------------------------------------------------------------------------------------- CUDA parity


@GPU
@pytest.mark.parametrize("M,K", [(1, 128), (3, 2560), (17, 9728), (64, 4096), (129, 256)])
def test_quantize_kernel(M: int, K: int) -> None:
    x = _x(M, K, scale=2.0, seed=M, device="cuda")
    q, s = kernels.quantize_1x128(x)
    rq, rs = ref.quantize_1x128(x)
    assert torch.equal(s, rs)
    assert (q.float() - rq.float()).abs().max() == 0


@GPU
@pytest.mark.parametrize("M,I", [(1, 128), (5, 9728), (64, 256)])
def test_swiglu_quantize_kernel(M: int, I: int) -> None:  # noqa: E741
    gu = _x(M, 2 * I, scale=2.0, seed=I, device="cuda")
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
    x, w = _x(M, K, seed=M, device="cuda"), _x(N, K, scale=0.05, seed=N, device="cuda")
    wq, sw = ref.quantize_weight(w)
    xq, sx = ref.quantize_1x128(x)
    y = gemm(xq, sx, kernels.pack_weight(wq) if packed else wq, sw).float()
    r = ref.fp8_gemm(xq, sx, wq, sw).float()
    return float((y - r).abs().max() / r.abs().max())


def test_wgmma_plan_fits_the_gpu() -> None:
    for M in (1, 8, 9, 33, 64):
        for N, K in ((2560, 9728), (19456, 2560), (256, 384), (65536, 16384), (128, 128), (2560, 65536)):
            for cluster in (None, 1, 2, 3, 6, 8):
                try:
                    p = gemm_plan.wgmma_plan(M, N, K, sms=132, cluster=cluster)
                except ValueError:  # only a forced cluster size may not fit (too few blocks, or tokens too big)
                    assert cluster is not None and cluster > 1
                    continue
                assert p.nt >= M and p.nt % 8 == 0 and 2 <= p.stages <= 8
                assert p.smem <= 227 * 1024 - 64
                T = N // 128 * (K // 128)
                assert 1 <= p.grid <= T and p.grid % p.cluster == 0  # every CTA gets at least one iteration
                if cluster is not None:
                    assert p.cluster == cluster
                if p.cluster > 1:
                    G, tiles = p.grid // p.cluster, N // 128
                    assert p.grid <= 132 and G <= tiles and tiles // G * (K // 128) >= p.cluster
                    assert p.iters == math.ceil(math.ceil(tiles / G) * (K // 128) / p.cluster)
                    assert p.stages * 16384 >= 128 * p.nt * 4  # the last tile's share is parked in the ring
                else:
                    assert p.iters == math.ceil(T / p.grid)
                blocks = min(K // 128, p.iters)
                assert p.smem >= gemm_plan.wgmma_smem_bytes(p.nt, blocks, p.stages, p.iters, p.cluster > 1)
                if p.nt <= 16 and p.smem <= gemm_plan.SMEM_PAIR_LIMIT:
                    assert 2 * (p.smem + 1024 + 64) <= 228 * 1024  # two lean CTAs share an SM


def unit_owner(u: int, T: int, C: int) -> int:
    """The CTA whose stream-K range holds iteration u (cuda/streamk.cuh)."""
    return ((u + 1) * C + T - 1) // T - 1


def test_wgmma64_plan_fits_two_ctas_per_sm() -> None:
    """The 64-row kernel's plans: a token tile holding M, global stream-K over 1, 1.5 or 2 CTAs per SM by layer length
    and token tile (1.5 at 32 tokens where 64 take 1; at 128, 1 where 64 take 1.5), trimmed to the largest grid of
    as many iterations per CTA whose settlement reads its shares in the fewest rounds, and shared memory that leaves
    room for a second CTA (the next GEMM's, or the layer's own) on every SM."""
    for M in (17, 32, 33, 64, 65, 100, 128):
        for N, K in ((2560, 9728), (19456, 2560), (6144, 2560), (2560, 4096), (128, 128), (384, 1280)):
            p = gemm_plan.wgmma64_plan(M, N, K, sms=132)
            T = N // 64 * (K // 128)
            assert p.rows == 64 and p.cluster == 1 and p.nt in (32, 64, 128) and p.nt >= M > p.nt // 2
            per_sm = 2 if T >= 20 * 132 else 1.5 if T >= 12 * 132 else 1
            per_sm = 1.5 if p.nt == 32 and per_sm == 1 else 1 if p.nt == 128 and per_sm == 1.5 else per_sm
            base = min(T, int(per_sm * 132))
            assert p.iters == math.ceil(T / p.grid) == math.ceil(T / base)  # no CTA streams more than at `base`
            # ... and of those grids (not below the SM count) the largest settling in the fewest rounds
            same = range(base, max(math.ceil(T / p.iters), min(base, 132)) - 1, -1)
            KB = K // 128
            rounds = {g: math.ceil(max(unit_owner(t * KB + KB - 1, T, g) - unit_owner(t * KB, T, g)
                                       for t in range(N // 64)) / p.slots) for g in same}
            assert rounds[p.grid] == min(rounds.values()) and all(rounds[g] > rounds[p.grid] for g in same
                                                                     if g > p.grid)
            assert p.stages == 4 and p.tstages in (3, 4)
            assert p.smem == gemm_plan.wgmma64_smem_bytes(p.nt, p.stages, p.tstages, p.iters, p.slots)
            # A settling CTA's share buffers: at least one, never more than the other shares it can have to read.
            sharers = max(unit_owner(t * KB + KB - 1, T, p.grid) - unit_owner(t * KB, T, p.grid) + 1
                          for t in range(N // 64))
            assert sharers - 1 <= math.ceil((KB - 1) / max(1, p.iters - 1))  # the planner's bound
            assert 1 <= p.slots <= max(1, math.ceil((KB - 1) / max(1, p.iters - 1)))
            assert 2 * (p.smem + 1024 + 64) <= 228 * 1024
            assert gemm.scratch_fits(p, N, 132)
            assert gemm_plan.wgmma64_plan(M, N, K, sms=132, stages=2).stages == 2
    with pytest.raises(ValueError):
        gemm_plan.wgmma64_plan(129, 2560, 2560, sms=132)
    with pytest.raises(ValueError):  # so many iterations per CTA that not one weight stage fits beside their scales
        gemm_plan.wgmma64_plan(64, 1 << 16, 1 << 16, sms=2)
    assert gemm_plan.wgmma64_plan(64, 19456, 2560, sms=132, grid=132).grid == 132  # probes override the CTA count
    # w2 at 64 tokens: 260 CTAs of 12 iterations settle each tile's 6 other shares in one round (264 had 7 in 6 slots)
    assert gemm_plan.wgmma64_plan(64, 2560, 9728, sms=132).grid == 260


@pytest.mark.parametrize("name,unset,cases,bad", [
    ("RTTS_GEMM_TMA_TOKENS", True, (("0", False), ("1", True), (" 0 ", False)), "yes"),
    ("RTTS_GEMM_TM", None, (("0", False), ("1", True), (" 1 ", True)), "on"),
])
def test_strict_gemm_settings(name: str, unset: bool | None, cases: tuple[tuple[str, bool], ...], bad: str) -> None:
    """RTTS_GEMM_TMA_TOKENS (tokens by TMA unless set to 0) and RTTS_GEMM_TM (unset leaves the choice to the planner:
    None; 1 forces the token-major kernel wherever it has a plan, 0 turns it off): anything but 0 / 1 is an error
    rather than a silent default."""
    field = {"RTTS_GEMM_TMA_TOKENS": "gemm_tma_tokens", "RTTS_GEMM_TM": "gemm_token_major"}[name]

    def read(environ: dict[str, str]) -> bool | None:
        return getattr(env.KernelSwitches.from_environ(environ), field)

    assert read({}) is unset
    for v, want in cases:
        assert read({name: v}) is want
    with pytest.raises(ValueError, match=name):
        read({name: bad})


def test_kernel_switches_are_read_once_and_overridden_explicitly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels read their switches from env.kernel_switches() (the environment's at import), not os.environ per
    launch; an override holds inside its block only."""
    before = env.kernel_switches()
    monkeypatch.setenv("RTTS_NO_PDL", "0" if before.no_pdl else "1")
    assert env.kernel_switches() == before
    with env.override_kernel_switches(no_pdl=not before.no_pdl, gemm_rows=64) as inside:
        assert env.kernel_switches() is inside and inside.no_pdl != before.no_pdl and inside.gemm_rows == 64
    assert env.kernel_switches() == before
    assert env.KernelSwitches.from_environ({"RTTS_GEMM_CLUSTER": " 4 ", "RTTS_MMA_GEMM": "yes"}) == \
        env.KernelSwitches(gemm_cluster=4, legacy_gemm=True)


def test_token_major_preference() -> None:
    """The planner takes whole-K token-major plans and cluster-pair plans from 9 tokens (where each measured faster
    than the stream-K kernels)."""
    for M in (1, 8, 9, 16, 17, 32, 33, 64):
        wqkv, wo = gemm_plan.wgmma_tm_plan(M, 6144, 2560, sms=132), gemm_plan.wgmma_tm_plan(M, 2560, 4096, sms=132)
        assert (wqkv.cluster, wo.cluster) == (1, 2) and wqkv.nt == wo.nt == (32 if M <= 32 else 64)
        assert gemm_plan.prefer_token_major(M) == (M > 8)


def test_lean_plans_prefetch_at_most_half_a_range() -> None:
    """The lean (1-16 token) global plans hold at most half of a CTA's range in their ring (at least two stages), as
    far as half an SM's shared memory allows: what the next GEMM prefetches competes with the tail of the one ahead."""
    for M in (1, 8, 9, 16):
        for (N, K), want in {(6144, 2560): 4, (2560, 4096): 3, (2560, 9728): 6 if M <= 8 else 5}.items():
            p = gemm_plan.wgmma_plan(M, N, K, sms=132, cluster=1)
            assert p.stages == want and p.smem == gemm_plan.wgmma_smem_bytes(p.nt, min(K // 128, p.iters), p.stages,
                                                                           p.iters)
        for N, K in ((6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728), (1024, 3072), (256, 384)):
            p = gemm_plan.wgmma_plan(M, N, K, sms=132, cluster=1)
            assert 2 <= p.stages <= max(2, math.ceil(p.iters / 2)) and 2 * (p.smem + 1024 + 64) <= 228 * 1024


def test_wgmma_tm_plan_cuts_whole_tiles_per_sm() -> None:
    """The token-major kernel's plans: one CTA per SM, tiles of whole 8-row groups over all of K or cluster pairs
    over half of it, the split with the fewest weight bytes on the busiest CTA, shared memory for two CTAs per SM;
    layers that do not cut into one tile (pair) per SM within the compiled widths are left to stream-K."""
    want = {(6144, 2560): (48, 1), (2560, 4096): (40, 2), (2560, 2560): (40, 2), (1024, 1024): (16, 2)}
    for M in (17, 32, 33, 64):
        for (N, K), (wn, split) in want.items():
            p = gemm_plan.wgmma_tm_plan(M, N, K, sms=132)
            assert p.token_major and (p.rows, p.cluster) == (wn, split) and p.nt == (32 if M <= 32 else 64)
            T, G = 132 // split, N // 8
            assert p.grid == 132 and p.iters == K // 128 // split and 8 * math.ceil(G / T) <= wn
            assert 2 <= p.stages <= 8 and p.stages % 2 == 0 and p.tstages == 6
            assert p.smem == wgmma_tm_smem_bytes(wn, p.stages, p.tstages, p.iters, split)
            # pairs: a buffer for the peer's two warpgroup totals of this rank's (larger) half of the 8-column groups
            assert p.smem - wgmma_tm_smem_bytes(wn, p.stages, p.tstages, p.iters) == (
                2 * math.ceil(wn / 16) * 64 * 8 * 4 + 8) * (split == 2)
            assert 2 * (p.smem + 1024 + 64) <= 228 * 1024  # the next GEMM's CTA fits beside it
            assert p.stages * wn * 128 >= 64 * wn * 4  # the ring holds a warpgroup's total after the loop
            assert gemm.scratch_fits(p, N, 132)
        with pytest.raises(ValueError):  # 19456 rows: a tile per SM would be wider than any compiled width
            gemm_plan.wgmma_tm_plan(M, 19456, 2560, sms=132)
        with pytest.raises(ValueError):  # 60 groups of 8 rows: not a tile for every SM, whatever the split
            gemm_plan.wgmma_tm_plan(M, 480, 2560, sms=132)
        with pytest.raises(ValueError):  # w2: 38 K blocks per CTA even split in two (slower than stream-K)
            gemm_plan.wgmma_tm_plan(M, 2560, 9728, sms=132)
        assert gemm_plan.wgmma_tm_plan(M, 2560, 9728, sms=132, split=2).iters == 38  # forced: allowed
        # 32 K blocks: whole-K tiles would stream too many, so the (equally cheap) split in two is the plan
        p = gemm_plan.wgmma_tm_plan(M, 2048, 4096, sms=132)
        assert (p.cluster, p.iters) == (2, 16)
    for M in (0, 65, 128):
        with pytest.raises(ValueError):
            gemm_plan.wgmma_tm_plan(M, 6144, 2560, sms=132)
    forced = gemm_plan.wgmma_tm_plan(64, 480, 2560, sms=132, split=1)  # forced: fewer tiles than SMs allowed
    assert (forced.rows, forced.cluster, forced.grid) == (16, 1, 60)
    with pytest.raises(ValueError):  # an odd K-block count cannot split in two
        gemm_plan.wgmma_tm_plan(64, 2560, 384, sms=132, split=2)
    assert gemm_plan.wgmma_tm_plan(40, 6144, 2560, sms=132, stages=2).stages == 2
    odd = gemm_plan.wgmma_tm_plan(40, 6144, 2560, sms=132, stages=5, tstages=5)  # rounded down to even counts
    assert (odd.stages, odd.tstages) == (4, 4)


def test_tensor_map_host_checks() -> None:
    """TMA maps are encoded at a 64-byte aligned host address (the driver's requirement; ctypes aligns to 8), and
    unsupported maps are refused before the driver is asked."""
    from rtts.kernels import _jit

    for _ in range(8):
        assert ctypes.addressof(_jit.aligned_tensor_map()) % 64 == 0
    for bad in ((8, 64, 2560, 64, 128), (16, 64, 2500, 64, 128), (16, 0, 2560, 64, 128), (16, 64, 2560, 300, 128),
                (16, 64, 2560, 64, 256)):
        with pytest.raises(ValueError):
            _jit.tensor_map_2d(*bad)


def test_wgmma_plan_prefers_cluster_settlement() -> None:
    """S2-Pro shapes as measured on the H200: at 1-16 tokens global stream-K everywhere; at 64, wo (tiles split over 8
    CTAs, 32 KB shares) settles in clusters of an even split; cluster capacity below sms // size (unequal GPCs)
    shrinks the choice."""
    for M in (1, 16):
        for N, K in ((6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728)):
            assert gemm_plan.wgmma_plan(M, N, K, sms=132).cluster == 1
    wo = gemm_plan.wgmma_plan(64, 2560, 4096, sms=132)
    assert wo.cluster > 1 and wo.grid <= 132 and 20 % (wo.grid // wo.cluster) == 0 and 32 % wo.cluster == 0
    assert gemm_plan.wgmma_plan(64, 6144, 2560, sms=132).cluster == 1
    cap = (0, 132) + (0,) * 7  # no clusters co-schedule: global stream-K
    assert gemm_plan.wgmma_plan(64, 2560, 4096, sms=132, capacity=cap).cluster == 1
    assert gemm_plan.wgmma_plan(128, 2560, 4096, sms=132).cluster == 1  # 128-token tiles have no cluster instance


def test_wgmma_forced_stages_keep_the_split_and_oversized_plans_are_refused() -> None:
    """A forced stage count (bench --stages) lowers the ring only: the split and grid stay the planner's, so the
    launched plan never outgrows the stream-K scratch the default plan was checked against; scratch_fits refuses
    global plans whose shares would not fit (the launcher checks the plan it actually launches)."""
    for M, N, K in ((64, 19456, 2560), (1, 2560, 4096), (16, 6144, 2560), (64, 2560, 4096)):
        for cluster in (None, 1):
            p = gemm_plan.wgmma_plan(M, N, K, sms=132, cluster=cluster)
            for st in (1, 2, 3):
                q = gemm_plan.wgmma_plan(M, N, K, sms=132, stages=st, cluster=cluster)
                assert (q.grid, q.cluster, q.nt, q.iters) == (p.grid, p.cluster, p.nt, p.iters)
                assert q.stages == max(1, min(st, p.stages), 2 if q.cluster > 1 and q.nt == 64 else 1)
                assert q.smem <= p.smem
            assert gemm.scratch_fits(p, N, 132)
    big = gemm_plan.WgmmaPlan(nt=64, stages=2, grid=3040, smem=0, cluster=1, iters=1)
    assert not gemm.scratch_fits(big, 19456, 132)
    assert gemm.scratch_fits(big._replace(cluster=4), 19456, 132)  # cluster plans settle on chip


def test_wgmma_token_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    """Beyond 64 tokens the 128-row kernel takes a 128-token launch only where its plan is one wave of CTAs
    (measured: a two-wave 128-token gate|up was slower than two 64-token launches)."""
    monkeypatch.setattr(gemm, "sm_count", lambda index: 132)
    gemm.wgmma_step.cache_clear()
    try:
        assert gemm.wgmma_step(6144, 2560, 0, None, 128) == 128
        assert gemm.wgmma_step(2560, 4096, 0, None, 128) == 128
        assert gemm.wgmma_step(19456, 2560, 0, None, 128) == 64
        assert gemm.wgmma_step(2560, 9728, 0, None, 128) == 64
    finally:
        gemm.wgmma_step.cache_clear()


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
    x, w = _x(M, K, seed=3, device="cuda"), _x(N, K, scale=0.05, seed=4, device="cuda")
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
    x, w = _x(M, K, seed=7, device="cuda"), _x(N, K, scale=0.05, seed=8, device="cuda")
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
        x, w = _x(M, K, seed=20 + i, device="cuda"), _x(N, K, scale=0.05, seed=40 + i, device="cuda")
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
    x, w = _x(M, K, seed=M + 40, device="cuda"), _x(N, K, scale=0.05, seed=N + 41, device="cuda")
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
    x, w = _x(M, K, seed=M + 60, device="cuda"), _x(N, K, scale=0.05, seed=N + 61, device="cuda")
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
    x, w = _x(M, K, seed=M + 70, device="cuda"), _x(N, K, scale=0.05, seed=N + 71, device="cuda")
    wq, sw = ref.quantize_weight(w)
    xq, sx = ref.quantize_1x128(x)
    wp = kernels.pack_weight(wq)
    first = gemm.launch_wgmma(plan, xq, sx, wp, sw)
    r = ref.fp8_gemm(xq, sx, wq, sw).float()
    assert (first.float() - r).abs().max() / r.abs().max() < 1e-2
    for _ in range(2):
        assert torch.equal(gemm.launch_wgmma(plan, xq, sx, wp, sw), first)
    g, out = _capture(lambda: gemm.launch_wgmma(plan, xq, sx, wp, sw))
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
    x, w = _x(M, K, seed=M + 40, device="cuda"), _x(N, K, scale=0.05, seed=N + 41, device="cuda")
    wq, sw = ref.quantize_weight(w)
    xq, sx = ref.quantize_1x128(x)
    wp = kernels.pack_weight(wq)
    switches(gemm_token_major=False)  # wqkv at 9-16 tokens would plan the token-major kernel
    assert gemm.plan_gemm(M, N, K, 0).rows == 128
    with env.override_kernel_switches(gemm_tma_tokens=False):
        want = kernels.fp8_gemm(xq, sx, wp, sw)
    for _ in range(3):
        assert torch.equal(kernels.fp8_gemm(xq, sx, wp, sw), want)
    g, out = _capture(lambda: kernels.fp8_gemm(xq, sx, wp, sw))
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
    ws = [ref.quantize_weight(_x(2560, 2560, scale=0.03, seed=20 + i, device="cuda")) for i in range(6)]
    ws = [(kernels.pack_weight(q), s) for q, s in ws]
    from rtts.kernels import _jit

    switches(gemm_token_major=tm)
    if M > 16 and _jit.tensor_maps_available():  # the chain runs the 64-row or the token-major kernel
        p = gemm.plan_gemm(M, 2560, 2560, 0)
        assert p.token_major if tm else (p.rows == 64 and not p.token_major)
    x0 = _x(M, 2560, seed=30, device="cuda")

    def chain() -> torch.Tensor:
        h = x0
        for wp, sw in ws:
            h = kernels.fp8_linear(h, wp, sw)
        return h

    with env.override_kernel_switches(no_pdl=True):
        plain = chain()
    assert torch.equal(chain(), plain)
    g, out = _capture(chain, warm=True)
    for _ in range(3):
        g.replay()
        assert torch.equal(out, plain)


@GPU
@pytest.mark.parametrize("B,L", [(1, 1), (1, 700), (16, 2048), (64, 2048), (3, 130)])
@pytest.mark.parametrize("n_kv,G,D", [(8, 4, 128), (8, 2, 64), (2, 1, 128), (2, 8, 128), (4, 8, 64)])
def test_decode_attention_kernel(B: int, L: int, n_kv: int, G: int, D: int) -> None:
    rows = B + 2
    q = _x(B, n_kv * G, D, seed=B, device="cuda")
    kc, vc = _x(rows, L, n_kv, D, seed=1, device="cuda"), _x(rows, L, n_kv, D, seed=2, device="cuda")
    g = torch.Generator().manual_seed(L)
    slots = torch.randperm(rows, generator=g)[:B].cuda()
    lens = torch.randint(1, L + 1, (B,), generator=g).cuda()
    lens[0] = L
    r = ref.decode_attention(q, kc, vc, slots, lens).float()
    for s, n in zip(slots.tolist(), lens.tolist(), strict=True):  # positions past a length must never be read
        kc[s, n:] = float("nan")
        vc[s, n:] = float("nan")
    out = kernels.decode_attention(q, kc, vc, slots, lens).float()
    assert (out - r).abs().max() < 2e-2


@GPU
@pytest.mark.parametrize("B,fused", [(1, True), (16, False)])
def test_decode_attention_split_merge_is_deterministic_and_replays(B: int, fused: bool) -> None:
    """Split-KV over 2048 keys, merged by the last split of each KV head (one stream: many splits, one wave) or by
    the second launch (16 streams): the counters must be back at zero after every launch (graph replays reuse
    them) and the bits must not depend on which CTA merged. A graph captured once serves new lengths, down to one
    key (every later split empty)."""
    L, n_kv, G, D = 2048, 8, 4, 128
    S, _ = attention.attention_splits(B, n_kv, L, sm_count(0))
    assert S > 1 and attention.attention_fuses(B, n_kv, S, sm_count(0)) == fused
    q = _x(B, n_kv * G, D, seed=5, device="cuda")
    kc, vc = _x(B + 1, L, n_kv, D, seed=6, device="cuda"), _x(B + 1, L, n_kv, D, seed=7, device="cuda")
    slots = torch.arange(1, B + 1, device="cuda")
    lens = torch.full((B,), L, device="cuda")
    first = kernels.decode_attention(q, kc, vc, slots, lens)
    for _ in range(5):
        assert torch.equal(kernels.decode_attention(q, kc, vc, slots, lens), first)
    assert not gemm.streamk_scratch(torch.device("cuda")).att_counters.any()
    kernels.warmup(torch.device("cuda"))
    g, out = _capture(lambda: kernels.decode_attention(q, kc, vc, slots, lens))
    for n in (L, 1, 63, 64, 65, 1000, L):
        lens.fill_(n)
        g.replay()
        torch.cuda.synchronize()
        r = ref.decode_attention(q, kc, vc, slots, lens).float()
        assert (out.float() - r).abs().max() < 2e-2, n
    assert torch.equal(out, first)
    assert not gemm.streamk_scratch(torch.device("cuda"), for_graphs=True).att_counters.any()


def test_attention_fuses_the_merge_only_for_one_wave_of_enough_splits() -> None:
    sms = 132
    assert attention.attention_fuses(1, 8, 32, sms) and attention.attention_fuses(1, 8, 8, sms)
    assert not attention.attention_fuses(16, 8, 3, sms)  # too few splits: the second launch was faster
    assert not attention.attention_fuses(12, 8, 8, sms)  # 768 CTAs: two waves
    assert not attention.attention_fuses(1, 8, 1, sms)


def test_attention_splits_are_bounded() -> None:
    """The merging CTA holds 2 x splits x G floats in its pipeline memory: the planner never exceeds the cap."""
    for B, n_kv, L in [(1, 1, 1 << 16), (1, 8, 1 << 15), (64, 8, 2048), (1, 8, 1)]:
        S, chunk = attention.attention_splits(B, n_kv, L)
        assert 1 <= S <= attention.MAX_SPLITS and S * chunk >= L and (S - 1) * chunk < L
    assert 2 * attention.MAX_SPLITS * 8 * 4 <= attention.attention_smem_bytes(64)


def test_attention_splits_on_the_h200_shapes() -> None:
    """S2-Pro's 8 KV heads on 132 SMs: the split counts that measured fastest (bench/probes/attention_variants.py,
    session 15): one wave, 64-key tiles at 512 keys and two per split at 2048 for one stream (merging 32 splits cost
    more than streaming a second tile), two splits from 16 streams, none from 64."""
    picks = {(B, L): attention.attention_splits(B, 8, L, 132)[0] for B in (1, 16, 64) for L in (512, 2048)}
    assert picks == {(1, 512): 8, (1, 2048): 16, (16, 512): 2, (16, 2048): 2, (64, 512): 1, (64, 2048): 1}


@GPU
def test_token_window_kernel() -> None:
    buf = torch.randint(0, 1000, (9, 10, 1), dtype=torch.int32, device="cuda")
    rbuf = buf.clone()
    slots = torch.tensor([3, 8, 8, 0], device="cuda")  # 8 = padded rows on a scratch slot
    new = torch.randint(0, 1000, (4, 1), dtype=torch.int32, device="cuda")
    active = torch.tensor([True, False, False, True], device="cuda")
    kernels.token_window_shift(buf, slots, new, active)
    ref.token_window_shift(rbuf, slots, new, active)
    assert torch.equal(buf, rbuf)


@GPU
def test_kernels_capture_in_cuda_graph() -> None:
    x, w = _x(16, 2560, device="cuda"), _x(2560, 2560, scale=0.05, device="cuda")
    wq, sw = ref.quantize_weight(w)
    kernels.warmup(torch.device("cuda"))
    eager = kernels.fp8_linear(x, wq, sw)
    g, out = _capture(lambda: kernels.fp8_linear(x, wq, sw), warm=True)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert math.isfinite(float(out.float().abs().max()))


def test_graph_families_get_their_own_gemm_scratch() -> None:
    """Graphs captured under graph_scratch(family) use that family's split-tile scratch, not the decode graphs' (the
    default family): the two threads replay concurrently. The family is per thread and restored on exit."""
    import threading

    default = gemm.graph_scratch_key(0)
    with kernels.graph_scratch("frame-zero"):
        inside = gemm.graph_scratch_key(0)
        other: list[tuple[int, int, bool, str]] = []
        t = threading.Thread(target=lambda: other.append(gemm.graph_scratch_key(0)))
        t.start()
        t.join()
        with kernels.graph_scratch("nested"):
            assert gemm.graph_scratch_key(0)[3] == "nested"
        assert gemm.graph_scratch_key(0) == inside
    assert inside != default and inside[3] == "frame-zero"
    assert other == [default]
    assert gemm.graph_scratch_key(0) == default


def test_launch_arguments_are_packed_as_the_kernel_reads_them() -> None:
    """The driver reads each kernel argument through its kernelParams pointer: 8-byte pointers, 4-byte numpy scalars
    and a TensorMap's 128 bytes (64-byte aligned), one per-thread block per signature, reused by later launches."""
    import ctypes
    import struct

    import numpy as np

    from rtts.kernels import _jit

    sig = (int, np.int32, np.float32, _jit.TensorMap, int)
    blk = _jit._arg_block(sig)
    assert _jit._arg_block(sig) is blk
    tm = _jit.aligned_tensor_map()
    tm.opaque[0], tm.opaque[15] = 0x1122334455667788, 7
    args = (0xDEADBEEF, np.int32(-3), np.float32(1.5), bytes(tm), 42)
    blk.packer.pack_into(blk.buf, blk.offset, *args)
    at = [blk.params[i] for i in range(len(sig))]
    assert [a % 64 for a in at][::3] == [0, 0]  # the block and the map start 64-byte aligned
    assert struct.unpack("<Q", ctypes.string_at(at[0], 8))[0] == 0xDEADBEEF
    assert struct.unpack("<i", ctypes.string_at(at[1], 4))[0] == -3
    assert struct.unpack("<f", ctypes.string_at(at[2], 4))[0] == 1.5
    assert ctypes.string_at(at[3], 128) == bytes(tm)
    assert struct.unpack("<Q", ctypes.string_at(at[4], 8))[0] == 42
    assert blk.maps == (3,)
    with pytest.raises(TypeError):
        _jit._arg_block((int, np.int64))
    # Each thread packs into its own block: the prefill and decode threads launch concurrently.
    import threading

    other: list[object] = []
    t = threading.Thread(target=lambda: other.append(_jit._arg_block(sig)))
    t.start()
    t.join()
    assert other[0] is not blk
