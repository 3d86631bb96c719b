"""GEMM planning on the host (CPU, no kernel launched): the wgmma plans' splits, stages and shared memory on the
H200's shapes, the kernel switches, tensor-map checks, each graph family's scratch and the packed launch arguments."""

from __future__ import annotations

import ctypes
import math

import pytest

from rtts import env, kernels
from rtts.kernels import gemm, gemm_plan
from rtts.kernels.gemm_plan import wgmma_tm_smem_bytes


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
