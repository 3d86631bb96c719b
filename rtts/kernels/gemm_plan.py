"""Launch plans of the FP8 GEMM kernels: pure functions of the shape and the GPU's SM count (no torch, no CUDA), so
the CPU tests check every plan the GPU would launch.

- `wgmma_plan`: the 128-row wgmma kernel (cuda/fp8_gemm_wgmma.cu), 1-16 tokens (and forced splits / tile heights):
  token tile, global stream-K or thread-block-cluster split, ring stages.
- `wgmma64_plan`: the 64-row kernel (cuda/fp8_gemm_wgmma64.cu), 17-128 tokens: token tile, CTAs per SM, weight and
  token stages, share buffers of a settling CTA.
- `wgmma_tm_plan`: the token-major kernel (cuda/fp8_gemm_wgmma_tm.cu), up to 64 tokens on layers that cut into one
  whole-K (or half-K pair) tile per SM: tile width, K split, stages (`prefer_token_major`: where it runs).
- `mma_plan`: the portable mma.sync kernel (cuda/fp8_gemm.cu).

The constants below were tuned on an H200; the measurements behind them are in bench/results/traces/README.md
("Figures moved out of code comments").
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

SMS = 132  # H200: the mma.sync split-K plan and attention_splits' default (callers on a GPU pass the real count)

_NT = (1, 2, 4, 8, 16)
GEMM_INSTANCES = tuple(f"fp8_gemm<{nt},{w},{str(s).lower()}>" for nt in _NT for w in (4, 8) for s in (False, True))

# wgmma kernel (sm_90a): packed weights streamed by bulk copies through a ring of 16 KB stages.
WGMMA_NT = (8, 16, 32, 64, 128)  # token tile widths (M <= 128 per launch)
LEAN_NT = 16  # tiles up to this width run the 96-register instance, two CTAs per SM (see the kernel)
CLUSTER_NT = 64  # widest tile with a cluster-settled instance (its shares must fit in the weight ring)
TILE_ROWS = 128  # weight rows per iteration (one 128x128 scale block)
_TILE_BYTES = 128 * 128
WGMMA_THREADS = 256 + 64  # two consumer warpgroups, a producer warp and a publisher warp
SMEM_LIMIT = 227 * 1024 - 64  # per CTA, less the kernel's static shared memory
# Two CTAs per SM (lean instances): 228 KB per SM, less 1 KB reserved per CTA and the static shared memory.
SMEM_PAIR_LIMIT = 112 * 1024
_MAX_STAGES = 4  # one CTA per SM: deeper rings measured slower per GEMM
_MAX_STAGES_LEAN = 6  # two per SM: the next GEMM prefetches this much while the previous one settles
# ... but no more than half of a CTA's range: what the next GEMM prefetches competes for HBM with the tail of the one
# it waits for.
_LEAN_RANGE_SHARE = 0.5
_MIN_STAGES = 2
MAX_CLUSTER = 8  # portable cluster size
# Auto plan: global stream-K settlement has one CTA read every other share of a tile from L2 after the stream, so
# it costs about this many 16 KB blocks of that SM's weight stream per byte-equivalent block of shares read beyond
# one (a fit to timings: global wins at few tokens, clusters where global splits a tile over many CTAs). Cluster
# settlement spreads the reading.
_SETTLE_COST = 0.35
MAX_GRID_PER_SM = 4  # stream-K scratch is sized for this many CTAs per SM

# 64-row kernel (cuda/fp8_gemm_wgmma64.cu) for 17-128 tokens: one consumer warpgroup per 64-row half tile, tokens
# streamed through the ring by tensor-map TMA, two CTAs per SM.
_H_NT = (32, 64, 128)
H_ROWS = 64
_H_BYTES = H_ROWS * 128
H_THREADS = 128 + 64
# Weight stages (8 KB each): deeper rings, which let the next GEMM prefetch more of its stream, were no faster.
_H_MAX_STAGES = 4
_H_TOKEN_STAGES = 4  # token stages (3 at 128 tokens, 16 KB each): tokens come from L2, a short round trip
# CTAs per SM by layer length (iterations one CTA per SM would stream): at _H_LONG_ITERS or more, two of the layer's
# own per SM; from _H_MID_ITERS, one or two (1.5 on average); below, one, leaving the second slot to the next GEMM.
# A lone CTA's single consumer warpgroup, not its ring depth, seems to bound its stream (a second CTA of the same GEMM
# helped where more stages did not). The token tile shifts this: at 32 tokens short layers move up to 1.5 (long ones
# made the MLP chain slower there), and at 128 tokens mid-length layers drop to one (h_ctas_per_sm).
_H_LONG_ITERS = 20
_H_MID_ITERS = 12


def h_ctas_per_sm(nt: int, T: int, sms: int) -> float:
    """CTAs per SM of the 64-row kernel for a token tile of `nt` over T iterations (see _H_LONG_ITERS)."""
    per_sm = 2.0 if T >= _H_LONG_ITERS * sms else 1.5 if T >= _H_MID_ITERS * sms else 1.0
    if nt <= 32 and per_sm == 1.0:
        return 1.5
    return 1.0 if nt >= 128 and per_sm == 1.5 else per_sm


H_INSTANCES = tuple(f"fp8_gemm_wgmma64<{nt}>" for nt in _H_NT)


# Token-major kernel (cuda/fp8_gemm_wgmma_tm.cu) for up to 64 tokens: tokens on the wgmma M side, tiles of up to WN
# weight rows over all of K (S = 1) or half of it in a cluster pair (S = 2), one per SM, no stream-K.
TM_NT = (32, 64)
_TM_WN = (16, 24, 32, 40, 48)  # tile widths compiled (the planner picks among them; 64 spills at 96 registers)
TM_THREADS = 256 + 32  # two consumer warpgroups and a producer warp
_TM_TOKEN_BYTES = 8192  # a token stage: the MMA's 64 rows x 128
# Both rings have even stage counts: the two consumer warpgroups take alternate K blocks, so with an even count each
# stage is only ever used by one of them. With an odd one a warpgroup could reach a stage's next use while the other
# warpgroup's load into it (one phase earlier) was still pending, and the parity wait would pass it (a three-stage
# ring hung). Six token stages leave room for eight weight stages at WN = 48 and for a pair's receive buffer (the
# fastest split of the ring measured).
_TM_TOKEN_STAGES = 6
TM_MAX_STAGES = 8
# Auto plans only for layers of at most this many K blocks per CTA: longer ones (w2) ran slower than stream-K.
_TM_MAX_ITERS = 24
# Where the planner prefers token-major plans to stream-K: from this many tokens, whole-K plans and cluster pairs
# alike (below it the lean 128-row kernel measured faster).
_TM_MIN_M = 9
TM_INSTANCES = tuple(f"fp8_gemm_wgmma_tm<{nt},{wn},{s}>" for nt in TM_NT for wn in _TM_WN for s in (1, 2))


class WgmmaPlan(NamedTuple):
    """Launch plan of the wgmma GEMM. cluster == 1: stream-K over the whole grid, settled through global memory;
    cluster > 1: clusters of that many CTAs, each owning whole tiles, settled in distributed shared memory."""

    nt: int  # token tile width
    stages: int  # 16 KB weight stages per CTA
    grid: int  # CTAs
    smem: int  # dynamic shared memory per CTA
    cluster: int  # CTAs per cluster (1: none)
    iters: int  # the most iterations (weight blocks of `rows` x 128) any CTA streams
    rows: int = TILE_ROWS  # weight rows per tile: 128 (fp8_gemm_wgmma) or 64 (fp8_gemm_wgmma64, global stream-K)
    tstages: int = 0  # 64 rows: token stages (`stages` counts its 8 KB weight stages)
    slots: int = 0  # 64 rows: shares a settling CTA copies into shared memory at once
    token_major: bool = False  # fp8_gemm_wgmma_tm: `rows` = the tile width WN, `cluster` = the K split S


def wgmma_instance(nt: int, cluster: bool) -> str:
    name = "fp8_gemm_wgmma_lean" if nt <= LEAN_NT else "fp8_gemm_wgmma"
    return f"{name}<{nt},{'true' if cluster else 'false'}>"


WGMMA_INSTANCES = tuple(wgmma_instance(nt, cl) for nt in WGMMA_NT for cl in (False, True)
                         if not (cl and nt > CLUSTER_NT)) + tuple(
    f"fp8_gemm_wgmma_lean_tma<{nt}>" for nt in WGMMA_NT if nt <= LEAN_NT)


def wgmma_smem_bytes(nt: int, blocks: int, stages: int, iters: int, cluster: bool = False) -> int:
    """Dynamic shared memory of one CTA: `stages` 16 KB weight stages, `blocks` K blocks of NT tokens (bytes and
    scales), the weight scales of its `iters` iterations, the parked share of its first tile (cluster settlement),
    two mbarriers per stage and the tokens' (TMA instances), 1 KB of alignment slack."""
    slot = TILE_ROWS * nt * 4 if cluster else 0
    return 1024 + stages * _TILE_BYTES + blocks * nt * (128 + 4) + 4 * iters + slot + 16 * stages + 16


@functools.cache  # pure, and asked on every call of fp8_gemm
def wgmma_plan(M: int, N: int, K: int, sms: int, stages: int | None = None, cluster: int | None = None,
               capacity: tuple[int, ...] | None = None) -> WgmmaPlan:
    """The launch plan for M <= 128 tokens, N % 128 == 0: the smallest token tile holding M, then the split of the
    T = N/128 * K/128 weight blocks over the SMs with the fewest blocks on the busiest CTA, counting global
    settlement as _SETTLE_COST times the share bytes one CTA reads beyond two sharers (`cluster` forces a cluster
    size, 1 = global stream-K):
      - global stream-K: one CTA per SM, each a contiguous T/grid range;
      - clusters of cs CTAs (2..8, NT <= 64): G clusters of whole tiles, each split over its CTAs; G is bounded by
        the SMs and by `capacity[cs]`, how many such clusters the GPU co-schedules one CTA per SM (default
        sms // cs; gemm.cluster_capacity asks the driver). The planner only picks even splits (every cluster
        the same tiles, every CTA the same blocks): on the H200 uneven ones (a cluster barrier waits for its
        busiest CTA) measured slower than global stream-K.
    Stages: as many (up to _MAX_STAGES, or _MAX_STAGES_LEAN for the two-per-SM lean tiles within half an SM's shared
    memory) as the memory the token blocks leave allows (a CTA holds min(K/128, its iterations) of them), and for the
    lean tiles' global plans at most half the CTA's range (_LEAN_RANGE_SHARE); `stages` lowers that. When fewer than
    two fit, a global plan grows its grid."""
    nt = next(n for n in WGMMA_NT if n >= M)
    KB, tiles = K // 128, N // TILE_ROWS
    T = tiles * KB
    lean = nt <= LEAN_NT
    ring_min = -(-(TILE_ROWS * nt * 4) // _TILE_BYTES)  # stages a cluster plan parks a share in

    def stages_for(iters: int, cl: bool) -> tuple[int, int]:
        blocks = min(KB, iters)
        budgets = ((SMEM_PAIR_LIMIT, _MAX_STAGES_LEAN), (SMEM_LIMIT, _MAX_STAGES)) if lean else \
            ((SMEM_LIMIT, _MAX_STAGES),)
        for limit, most in budgets:
            room = limit - wgmma_smem_bytes(nt, blocks, 0, iters, cl)
            st = min(most, room // (_TILE_BYTES + 16))
            if st >= _MIN_STAGES:
                break
        if cl:
            st = max(st, ring_min)  # the ring holds the last tile's share
        return st, wgmma_smem_bytes(nt, blocks, st, iters, cl)

    options: list[tuple[float, WgmmaPlan]] = []
    if cluster in (None, 1):
        grid = min(T, sms)
        while True:
            iters = -(-T // grid)
            st, smem = stages_for(iters, False)
            if st >= _MIN_STAGES or grid >= T:
                break
            grid = min(T, grid + max(1, sms // 4))
        sharers = -(-KB // iters) + (1 if KB % iters else 0)  # the most CTAs one tile is split over
        share_blocks = TILE_ROWS * nt * 4 / _TILE_BYTES  # one parked share, in 16 KB blocks
        if lean and st >= _MIN_STAGES:
            st = max(_MIN_STAGES, min(st, math.ceil(_LEAN_RANGE_SHARE * iters)))
            smem = wgmma_smem_bytes(nt, min(KB, iters), st, iters)
        options.append((iters + _SETTLE_COST * max(0, sharers - 2) * share_blocks,
                        WgmmaPlan(nt, st, grid, smem, 1, iters)))
    if nt <= CLUSTER_NT:
        for cs in range(2, MAX_CLUSTER + 1) if cluster is None else (cluster,) if cluster > 1 else ():
            cap = capacity[cs] if capacity is not None else sms // cs
            G = min(tiles, sms // cs, cap)
            if G < 1 or tiles // G * KB < cs:  # every CTA needs at least one block
                continue
            if cluster is None and (tiles % G or tiles // G * KB % cs):  # auto: even splits only
                continue
            iters = -(-(-(-tiles // G) * KB) // cs)
            st, smem = stages_for(iters, True)
            if smem <= SMEM_LIMIT:
                options.append((iters, WgmmaPlan(nt, st, G * cs, smem, cs, iters)))
    if not options:
        raise ValueError(f"no wgmma plan for {M}x{N}x{K} with cluster={cluster}")
    best = min(options, key=lambda o: (o[0], o[1].cluster))[1]
    if stages is not None:  # lowered after the split is chosen: a forced stage count never reshapes the grid
        st = max(1, min(best.stages, stages), ring_min if best.cluster > 1 else 1)
        best = best._replace(stages=st, smem=wgmma_smem_bytes(nt, min(KB, best.iters), st, best.iters,
                                                              best.cluster > 1))
    return best


def wgmma64_smem_bytes(nt: int, stages: int, tstages: int, iters: int, slots: int = 0) -> int:
    """Dynamic shared memory of one 64-row CTA: the ring region (`stages` 8 KB weight stages and `tstages` NT x 128
    token stages, reused after the loop for `slots` FP32 shares of 64 x NT), NT scales per token stage, the weight
    scales of its `iters` iterations, two mbarriers per stage and one for settling, 1 KB of alignment slack."""
    region = max(stages * _H_BYTES + tstages * nt * 128, slots * H_ROWS * nt * 4)
    return 1024 + region + tstages * nt * 4 + 4 * iters + 16 * (stages + tstages) + 16


def settle_batches(N: int, K: int, grid: int, slots: int) -> int:
    """Rounds in which the settling CTAs of a 64-row plan over `grid` CTAs copy the other shares of their tiles, `slots`
    at a time: the most other sharers any tile has (the kernel's unit_owner split), over `slots`, rounded up."""
    KB = K // 128
    T = N // H_ROWS * KB

    def owner(u: int) -> int:
        return ((u + 1) * grid + T - 1) // T - 1

    most = max(owner(t * KB + KB - 1) - owner(t * KB) for t in range(N // H_ROWS))
    return -(-most // slots)


@functools.cache
def wgmma64_plan(M: int, N: int, K: int, sms: int, stages: int | None = None, grid: int | None = None) -> WgmmaPlan:
    """The 64-row kernel's plan for 17-128 tokens: the smallest token tile of _H_NT holding M; global stream-K of the T
    = N/64 * K/128 half-block iterations over about min(T, sms) CTAs, so a second CTA (the next GEMM's, under PDL) is
    resident beside each, or 1.5 / 2 per SM for layers of _H_MID_ITERS / _H_LONG_ITERS or more iterations per SM, no 1
    at 32 tokens and no 1.5 at 128 (h_ctas_per_sm); _H_TOKEN_STAGES token stages (3 at 128 tokens) and up to
    _H_MAX_STAGES weight stages, within half an SM's shared memory; `stages` lowers the weight stages; `grid` replaces
    the planner's CTA count (probes). Of the grids down to the fewest CTAs with the same most iterations per CTA (and
    not below the SM count), the largest whose settling CTAs copy their tiles' other shares in the fewest rounds
    (settle_batches): each round is a dependent L2 round trip at the very end of the GEMM, while the next one streams
    (one round less measured about 1 us faster). Raises ValueError where not even one weight stage fits (huge layers
    on few SMs): the caller plans the 128-row kernel."""
    if M > _H_NT[-1] or N % H_ROWS or K % 128:
        raise ValueError(f"no 64-row wgmma plan for {M}x{N}x{K}")
    nt = next(n for n in _H_NT if n >= M)
    T = N // H_ROWS * (K // 128)
    forced = grid is not None
    grid = min(T, int(h_ctas_per_sm(nt, T, sms) * sms) if grid is None else grid)
    iters = -(-T // grid)
    ts = _H_TOKEN_STAGES if nt <= 64 else _H_TOKEN_STAGES - 1
    room = SMEM_PAIR_LIMIT - wgmma64_smem_bytes(nt, 0, ts, iters)
    st = min(_H_MAX_STAGES, room // (_H_BYTES + 16))
    if st < 1:
        raise ValueError(f"no 64-row wgmma plan for {M}x{N}x{K}: {iters} iterations per CTA leave no room")
    if stages is not None:
        st = max(1, min(st, stages))
    # A settling CTA reads the other shares of its tile (at most ceil((KB - 1) / (iters - 1)) of them) in batches of
    # `slots`: as many as half an SM's shared memory holds in the ring region (at least one: the ring is longer).
    share = H_ROWS * nt * 4
    others = -(-(K // 128 - 1) // max(1, iters - 1))
    ring = st * _H_BYTES + ts * nt * 128
    slots = max(1, min(others, (SMEM_PAIR_LIMIT - wgmma64_smem_bytes(nt, st, ts, iters) + ring) // share))
    if not forced:  # every grid in range(-(-T // iters), grid + 1) has the same `iters`, hence the same slots; none
        # goes below the SM count (grids short of it leave SMs to the next GEMM's CTAs, which then land two to an SM)
        low = max(-(-T // iters), min(grid, sms))
        grid = min(range(grid, low - 1, -1), key=lambda g: settle_batches(N, K, g, slots))
    return WgmmaPlan(nt, st, grid, wgmma64_smem_bytes(nt, st, ts, iters, slots), 1, iters, H_ROWS, ts, slots)


def wgmma_tm_smem_bytes(wn: int, stages: int, tstages: int, iters: int, split: int = 1) -> int:
    """Dynamic shared memory of one token-major CTA: `stages` weight stages of WN x 128, `tstages` 8 KB token stages
    with 64 scales each, (cluster pairs, split = 2) the buffer receiving the peer's two FP32 warpgroup totals of this
    rank's half of the columns (64 x 8 per column group, the larger half) and its mbarrier, two weight scales per K
    block, two mbarriers per stage, 1 KB of alignment slack."""
    recv = 2 * -(-wn // 16) * 2048 + 8 if split == 2 else 0
    return (1024 + stages * wn * 128 + tstages * (_TM_TOKEN_BYTES + 4 * 64) + recv + 8 * iters
            + 16 * (stages + tstages) + 16)


@functools.cache
def wgmma_tm_plan(M: int, N: int, K: int, sms: int, stages: int | None = None, split: int | None = None,
                  tstages: int | None = None, max_stages: int = TM_MAX_STAGES) -> WgmmaPlan:
    """The token-major kernel's plan for 1-64 tokens (prefer_token_major says where it runs): one CTA per SM (the kernel
    says why), as T = sms / S tiles of whole 8-row groups over all of K (S = 1) or in cluster pairs over half of it each
    (S = 2, K/128 even): the S with the fewer weight bytes on the busiest CTA (ties: no split), its widest tile rounded
    up to a compiled width (_TM_WN); only splits whose tiles fill every SM, and at most _TM_MAX_ITERS K blocks per CTA
    (`split` forces S and skips both checks: tests, probes; `sms` below the GPU's gives fewer, wider tiles).
    _TM_TOKEN_STAGES token stages (`tstages` replaces them), and as many weight stages as the rest of half an SM's
    shared memory holds, up to `max_stages` (probes lift it; `stages` lowers them); both even, at least two. Raises
    ValueError where nothing qualifies: the caller plans another kernel."""
    if not 0 < M <= TM_NT[-1] or N % 8 or K % 128:
        raise ValueError(f"no token-major wgmma plan for {M}x{N}x{K}")
    nt = next(n for n in TM_NT if n >= M)
    KB, G = K // 128, N // 8
    options = []
    for s in (1, 2) if split is None else (split,):
        T = min(G, sms // s)
        if s not in (1, 2) or KB % s or T < 1 or (split is None and (T < sms // s or KB // s > _TM_MAX_ITERS)):
            continue
        need = 8 * -(-G // T)  # the widest tile's rows
        w = next((w for w in _TM_WN if w >= need), None)
        if w is not None:
            options.append((need * KB // s, s, w, T))
    if not options:
        raise ValueError(f"no token-major wgmma plan for {M}x{N}x{K}")
    _, s, w, T = min(options)
    iters = KB // s
    ts = _TM_TOKEN_STAGES if tstages is None else tstages
    ts -= ts % 2
    room = SMEM_PAIR_LIMIT - wgmma_tm_smem_bytes(w, 0, ts, iters, s)
    st = min(max_stages, room // (w * 128 + 16))
    if stages is not None:
        st = min(st, stages)
    st -= st % 2
    if st < _MIN_STAGES or ts < _MIN_STAGES:  # the ring holds a warpgroup's total after the loop (two stages)
        raise ValueError(f"no token-major wgmma plan for {M}x{N}x{K}: no room for two stages of each ring")
    return WgmmaPlan(nt, st, T * s, wgmma_tm_smem_bytes(w, st, ts, iters, s), s, iters, w, ts, 0, True)


def prefer_token_major(M: int) -> bool:
    """Whether the planner runs a token-major plan (wgmma_tm_plan's, whole-K or cluster pairs) for M tokens rather
    than stream-K: from _TM_MIN_M tokens."""
    return M >= _TM_MIN_M


def mma_plan(M: int, N: int, K: int) -> tuple[int, int, int, int]:
    """mma.sync kernel (GPUs without wgmma): (NT, warps, splits, K blocks per split): enough CTAs to fill the GPU,
    split-K only while the FP32 partials stay small next to the weight bytes."""
    nt = next(n for n in _NT if n * 8 >= M)
    warps = 8 if N >= 4096 else 4
    ctas = math.ceil(N / (warps * 16))
    KB = K // 128
    max_split = max(1, min(KB, K // (4 * M)))
    splits = max(1, min(max_split, math.ceil(2 * SMS / ctas)))
    per = math.ceil(KB / splits)
    return nt, warps, math.ceil(KB / per), per
