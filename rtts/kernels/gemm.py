"""The block-scaled FP8 GEMM on the GPU: which kernel runs (the wgmma kernels on Hopper, on weights packed by
`pack_weight`; the portable mma.sync kernel elsewhere), its launch plan (`plan_gemm`, over gemm_plan's planners), the
split-tile scratch it settles in, and the launch.

Probes and benchmarks plan and launch through the public names here: `plan_gemm` (the plan fp8_gemm would launch,
splits or tile heights forced or not), `launch_wgmma` (any plan), `fp8_gemm_wgmma` / `fp8_gemm_mma` (one kernel family
regardless of the dispatch), `streamk_scratch` and `wgmma_step`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading
from collections.abc import Iterator

import torch

from rtts import env
from rtts.kernels import _jit, reference
from rtts.kernels.common import check, cuda_index, i32, is_sm90, sm_count, use_cuda
from rtts.kernels.gemm_plan import (
    CLUSTER_NT,
    GEMM_INSTANCES,
    H_INSTANCES,
    H_ROWS,
    H_THREADS,
    LEAN_NT,
    MAX_CLUSTER,
    MAX_GRID_PER_SM,
    SMEM_LIMIT,
    SMEM_PAIR_LIMIT,
    TILE_ROWS,
    TM_INSTANCES,
    TM_NT,
    TM_THREADS,
    WGMMA_INSTANCES,
    WGMMA_NT,
    WGMMA_THREADS,
    WgmmaPlan,
    mma_plan,
    prefer_token_major,
    wgmma64_plan,
    wgmma_instance,
    wgmma_plan,
    wgmma_tm_plan,
)
from rtts.kernels.quant import quantize_1x128
from rtts.kernels.reference import FP8, pad4


def uses_wgmma(device: torch.device) -> bool:
    """The wgmma kernel needs sm_90a (Hopper); RTTS_MMA_GEMM=1 opts out."""
    return not env.kernel_switches().legacy_gemm and is_sm90(cuda_index(device))


# ---------------------------------------------------------------------------------------------------- scratch


@dataclasses.dataclass
class StreamKScratch:
    """Split scratch of one stream: the FP8 GEMM's FP32 partials (one tile slot per CTA) and its counters (per-tile
    arrival counts of the 128-row kernel, per-CTA share flags of the 64-row one), and decode attention's per-(stream, KV
    head) counts of finished splits; the kernels reset their counters themselves. Kept per stream because kernels on one
    stream run in order, while the prefill and decode threads run GEMMs concurrently on their own streams. Allocated
    once, never resized, so pointers baked into captured CUDA graphs stay valid. Graph captures use one scratch per
    device, apart from every stream's eager one (allocated by warmup, before any capture): torch hands out pooled stream
    handles round-robin, so a stream made later (e.g. the prefill thread's) can share the handle a decode graph was
    captured on, and its eager GEMMs would otherwise run concurrently with the graph's replays on one scratch. Captured
    graphs therefore share one per family (graph_scratch): replay a family's graphs one at a time (the decode thread's
    steps are one family, the prefill thread's frame-0 graphs another, and the two threads replay concurrently)."""

    partials: torch.Tensor
    counters: torch.Tensor
    att_counters: torch.Tensor


# (device, stream handle or 0 for graphs, graphs, graph family or "")
_STREAMK: dict[tuple[int, int, bool, str], StreamKScratch] = {}
_CAPTURE = threading.local()  # .family: the graph family captures on this thread belong to (graph_scratch)
_STREAMK_TILES = 1 << 16  # counters: N up to 8M rows
_ATT_COUNTERS = 1 << 16  # decode attention: batch x KV heads


@contextlib.contextmanager
def graph_scratch(family: str) -> Iterator[None]:
    """GEMMs captured inside (on this thread) use `family`'s own split-tile scratch, allocated here, before any
    capture: graphs of different families may then replay concurrently. The default family ("") is the decode
    step's (allocated by warmup)."""
    prev = getattr(_CAPTURE, "family", "")
    _CAPTURE.family = family
    try:
        yield
    finally:
        _CAPTURE.family = prev


def _streamk_floats(sms: int) -> int:
    """Partials capacity: one 128-row tile slot per CTA (a CTA parks at most its first tile's share) for
    MAX_GRID_PER_SM CTAs per SM at 64 tokens (17 MB on an H200); a 128-token plan may use half that grid."""
    return sms * MAX_GRID_PER_SM * TILE_ROWS * 64


def graph_scratch_key(idx: int) -> tuple[int, int, bool, str]:
    """The scratch key of captured graphs on device idx: one per graph family (graph_scratch, this thread's)."""
    return (idx, 0, True, getattr(_CAPTURE, "family", ""))


def streamk_scratch(device: torch.device, for_graphs: bool | None = None) -> StreamKScratch:
    """The scratch for kernels launched now: the current stream's, or the graphs' one while a capture runs (or as
    `for_graphs` says)."""
    graphs = torch.cuda.is_current_stream_capturing() if for_graphs is None else for_graphs
    idx = cuda_index(device)
    key = graph_scratch_key(idx) if graphs else (idx, _jit.stream_handle(idx), False, "")
    sk = _STREAMK.get(key)
    if sk is None:
        # partials: only the wgmma GEMM splits tiles
        floats = _streamk_floats(sm_count(idx)) if uses_wgmma(device) else 0
        sk = StreamKScratch(torch.empty(floats, dtype=torch.float32, device=device),
                            torch.zeros(_STREAMK_TILES, dtype=torch.int32, device=device),
                            torch.zeros(_ATT_COUNTERS, dtype=torch.int32, device=device))
        _STREAMK[key] = sk
    return sk


def reserve_graph_scratch(device: torch.device) -> None:
    """Allocate the current graph family's split scratch now (before a capture; see graph_scratch)."""
    if device.type == "cuda":
        streamk_scratch(device, for_graphs=True)


def scratch_fits(plan: WgmmaPlan, N: int, sms: int) -> bool:
    """A global stream-K plan's shares and counters fit the per-stream scratch (at 64 tokens: layers up to ~200M
    weights); cluster plans use none."""
    return plan.cluster > 1 or plan.token_major or (N // plan.rows <= _STREAMK_TILES
                                                     and plan.grid * plan.rows * plan.nt <= _streamk_floats(sms))


# ---------------------------------------------------------------------------------------------------- weights


def packs_weights(device: torch.device) -> bool:
    """Whether FP8 weights on `device` should be stored packed (pack_weight): the wgmma kernel streams only the
    packed layout; other GPUs and the CPU keep [N, K]."""
    return device.type == "cuda" and use_cuda(torch.empty(0, device=device)) and uses_wgmma(device)


def prepare_weight(wq: torch.Tensor) -> torch.Tensor:
    """FP8 [N, K] in the layout this device's GEMM streams: packed (pack_weight) where the wgmma kernel runs and the
    shape is on the 128x128 grid, else `wq` itself (the mma.sync kernel and the reference read [N, K])."""
    if wq.dim() == 2 and wq.shape[0] % 128 == 0 and wq.shape[1] % 128 == 0 and packs_weights(wq.device):
        return pack_weight(wq)
    return wq


def pack_weight(wq: torch.Tensor) -> torch.Tensor:
    """FP8 [N, K] -> the packed tile layout [N/128, K/128, 128, 128] (see reference.pack_weight).

    On the GPU this waits for the packing to finish: the wgmma GEMM is launched with PDL and streams its weights
    before it waits for the kernels ahead of it, so a packed weight must never be written by a kernel that may still
    be running when a GEMM reading it launches."""
    check(wq.dtype == FP8 and wq.dim() == 2, lambda: f"pack_weight: want fp8 [N, K], got {wq.dtype} {tuple(wq.shape)}")
    wp = reference.pack_weight(wq.contiguous())
    if wp.is_cuda:
        torch.cuda.current_stream(wp.device).synchronize()
    return wp


# ---------------------------------------------------------------------------------------------------- dispatch


def fp8_gemm(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """xq fp8 [M, K], sx fp32 [K/128, pad4(M)], wq fp8 [N, K] or packed [N/128, K/128, 128, 128] (pack_weight),
    sw fp32 [ceil(N/128), K/128] -> bf16 [M, N]. Packed weights run the wgmma kernel (sm_90a, launched with PDL: it
    streams the packed weights before waiting for the kernels ahead of it, see pack_weight), [N, K] the mma.sync
    kernel (any GPU)."""
    check(xq.dtype == FP8 and wq.dtype == FP8,
          lambda: f"fp8_gemm: want float8_e4m3fn operands, got {xq.dtype}, {wq.dtype}")
    check(xq.dim() == 2 and wq.dim() in (2, 4) and xq.is_contiguous() and wq.is_contiguous(),
          "fp8_gemm: operands must be contiguous, x 2-D and w 2-D or packed 4-D")
    M, K = xq.shape
    packed = wq.dim() == 4
    if packed:
        check(tuple(wq.shape[1:]) == (K // 128, 128, 128) and K % 128 == 0,
              lambda: f"fp8_gemm: packed weight {tuple(wq.shape)} does not match K={K}")
        N = wq.shape[0] * 128
    else:
        N = wq.shape[0]
        check(wq.shape[1] == K and K % 128 == 0,
              lambda: f"fp8_gemm: K mismatch or not a multiple of 128 ({K}, {wq.shape[1]})")
    check(sx.dtype == torch.float32 and tuple(sx.shape) == (K // 128, pad4(M)) and sx.is_contiguous(),
          lambda: f"fp8_gemm: sx must be fp32 [{K // 128}, {pad4(M)}], got {sx.dtype} {tuple(sx.shape)}")
    check(sw.dtype == torch.float32 and tuple(sw.shape) == (math.ceil(N / 128), K // 128) and sw.is_contiguous(),
          lambda: f"fp8_gemm: sw must be fp32 [{math.ceil(N / 128)}, {K // 128}], got {sw.dtype} {tuple(sw.shape)}")
    if not use_cuda(xq, sx, wq, sw):
        return reference.fp8_gemm(xq, sx, wq, sw)
    if M == 0:
        return torch.empty(0, N, dtype=torch.bfloat16, device=xq.device)
    wgmma = packed and uses_wgmma(xq.device)
    switches = env.kernel_switches()  # the cached plan checks below are keyed by the forced split and tile height
    forced, rows = switches.gemm_cluster, switches.gemm_rows
    step = wgmma_step(N, K, cuda_index(xq.device), forced, rows) if wgmma else 128  # larger batches: token slices
    wgmma = wgmma and _wgmma_fits(min(M, step), N, K, cuda_index(xq.device), forced, rows)
    if packed and not wgmma:  # packed weights without a wgmma plan (other GPUs, huge layers): correct, not fast
        wq, packed, step = reference.unpack_weight(wq), False, 128
    if M > step:
        return torch.cat([fp8_gemm(xq[i:i + step].contiguous(), _slice_scales(sx, i, min(M, i + step)), wq, sw)
                          for i in range(0, M, step)])
    return fp8_gemm_wgmma(xq, sx, wq, sw) if wgmma else fp8_gemm_mma(xq, sx, wq, sw)


@functools.cache
def wgmma_step(N: int, K: int, device_index: int, cluster: int | None = None, rows: int | None = None) -> int:
    """Tokens per wgmma launch beyond 64: 128 when that plan is one wave of CTAs, else 64. The 64-row kernel's plans
    always are (at most two CTAs per SM, each within half an SM's shared memory). The 128-row kernel's 128-token tile
    needs twice the shared memory per K block, so wide K ranges push its grid past the SM count (a two-wave 128-token
    launch measured slower than two 64-token ones)."""
    sms = sm_count(device_index)
    try:
        plan = plan_gemm(128, N, K, device_index, cluster=cluster, rows=rows)
    except ValueError:
        return 64
    one_wave = plan.grid <= (2 * sms if plan.rows == H_ROWS else sms)
    return 128 if one_wave and scratch_fits(plan, N, sms) else 64


@functools.cache
def cluster_capacity(device_index: int) -> tuple[int, ...] | None:
    """How many clusters of each size (index = CTAs per cluster, 0..8) the GPU co-schedules with one CTA per SM
    (the driver's answer for the cluster instance at a shared-memory size that allows one CTA per SM). Clusters live
    inside one GPC, so on GPUs whose GPCs hold unequal SM counts this is below sms // size."""
    if not _jit.available():  # planning without a GPU (tests): assume sms // size
        return None
    sms = sm_count(device_index)
    fn = _jit.function("fp8_gemm_wgmma.cu", wgmma_instance(CLUSTER_NT, True), WGMMA_INSTANCES)
    _jit.set_dynamic_smem(fn, SMEM_LIMIT)
    out = [0, sms]
    for cs in range(2, MAX_CLUSTER + 1):
        out.append(_jit.max_active_clusters(fn, cs, WGMMA_THREADS, 120 * 1024))
    return tuple(out)


def plan_gemm(M: int, N: int, K: int, device_index: int, stages: int | None = None,
              cluster: int | None = None, rows: int | None = None) -> WgmmaPlan:
    """The wgmma plan fp8_gemm launches: `cluster` / `rows` forced by the caller or RTTS_GEMM_CLUSTER /
    RTTS_GEMM_ROWS, else the planner's choice (where the driver encodes tensor maps): the token-major kernel where it
    has a plan and RTTS_GEMM_TM allows it (gemm_plan.prefer_token_major: from 9 tokens), else the 64-row kernel for
    more than 16 tokens, unless a cluster split is forced (only the 128-row kernel has one)."""
    switches = env.kernel_switches()
    if cluster is None:
        cluster = switches.gemm_cluster
    if rows is None:
        rows = switches.gemm_rows
    sms = sm_count(device_index)
    tm = switches.gemm_token_major
    if (cluster is None and rows is None and M <= TM_NT[-1] and (tm or (tm is None and prefer_token_major(M)))
            and _jit.tensor_maps_available()):
        try:
            return wgmma_tm_plan(M, N, K, sms, stages)
        except ValueError:
            pass  # the layer does not cut into one tile per SM: stream-K below
    if _rows64(M, cluster, rows):
        try:
            return wgmma64_plan(M, N, K, sms, stages)
        except ValueError:
            if rows == H_ROWS:  # forced: no fallback
                raise
    return wgmma_plan(M, N, K, sms, stages, cluster, cluster_capacity(device_index))


def _rows64(M: int, cluster: int | None, rows: int | None) -> bool:
    if (cluster is not None and cluster > 1) or rows == TILE_ROWS or not _jit.tensor_maps_available():
        return False
    return rows == H_ROWS or M > LEAN_NT


@functools.cache
def _wgmma_fits(M: int, N: int, K: int, device_index: int, cluster: int | None, rows: int | None = None) -> bool:
    """A plan exists for M tokens (with `cluster` / `rows` forced, or not) and its scratch fits."""
    try:
        plan = plan_gemm(M, N, K, device_index, cluster=cluster, rows=rows)
    except ValueError:
        return False
    return scratch_fits(plan, N, sm_count(device_index))


# ---------------------------------------------------------------------------------------------------- launch


def fp8_gemm_wgmma(xq: torch.Tensor, sx: torch.Tensor, wp: torch.Tensor, sw: torch.Tensor,
                   stages: int | None = None, cluster: int | None = None, rows: int | None = None) -> torch.Tensor:
    """The wgmma GEMM on packed weights with plan_gemm's plan (`stages`, `cluster`, `rows` forced or not), without
    fp8_gemm's token slicing or fallbacks (tests, benchmarks)."""
    M, K = xq.shape
    N = wp.shape[0] * TILE_ROWS
    dev = cuda_index(xq.device)
    check(wp.dim() == 4 and M <= WGMMA_NT[-1], lambda: f"fp8_gemm: no wgmma plan for {M}x{N}x{K}")
    try:
        plan = plan_gemm(M, N, K, dev, stages, cluster, rows)
    except ValueError as e:
        raise ValueError(f"fp8_gemm: {e}") from None
    return launch_wgmma(plan, xq, sx, wp, sw)


def launch_wgmma(plan: WgmmaPlan, xq: torch.Tensor, sx: torch.Tensor, wp: torch.Tensor,
                 sw: torch.Tensor) -> torch.Tensor:
    """Run the wgmma GEMM with a given plan (the planner's, or one a probe builds: bench/probes)."""
    M, K = xq.shape
    N = wp.shape[0] * TILE_ROWS
    sms = sm_count(cuda_index(xq.device))
    # The plan actually launched (a forced split or stage count included) must fit the scratch it writes.
    check(scratch_fits(plan, N, sms), lambda: f"fp8_gemm: {plan} for {M}x{N}x{K} exceeds the stream-K scratch")
    sk = streamk_scratch(xq.device)
    y = torch.empty(M, N, dtype=torch.bfloat16, device=xq.device)
    tail = (wp.data_ptr(), sw.data_ptr(), y.data_ptr(), sk.partials.data_ptr(), sk.counters.data_ptr(), i32(M),
            i32(N), i32(K), i32(pad4(M)), i32(plan.stages))

    def token_map() -> _jit.TensorMap:
        # Tokens and their scales are bulk-copied: both must start 16-byte aligned (fresh torch tensors do).
        check(xq.data_ptr() % 16 == 0 and sx.data_ptr() % 16 == 0, "fp8_gemm: x and sx must be 16-byte aligned")
        return _jit.tensor_map_2d(xq.data_ptr(), M, K, plan.nt, 128)

    if plan.token_major:
        check(plan.stages % 2 == 0 and plan.tstages % 2 == 0 and plan.stages >= 2 and plan.tstages >= 2,
              lambda: f"fp8_gemm: token-major rings need even stage counts, got {plan}")
        fn = _jit.function("fp8_gemm_wgmma_tm.cu", f"fp8_gemm_wgmma_tm<{plan.nt},{plan.rows},{plan.cluster}>",
                           TM_INSTANCES)
        _jit.set_dynamic_smem(fn, plan.smem)
        _jit.launch(fn, (plan.grid,), (TM_THREADS,), (token_map(), sx.data_ptr(), wp.data_ptr(), sw.data_ptr(),
                                                       y.data_ptr(), i32(M), i32(N), i32(K), i32(pad4(M)),
                                                       i32(plan.stages), i32(plan.tstages)),
                    shared_mem=plan.smem, pdl=True, cluster=plan.cluster)
        return y
    if plan.rows == H_ROWS:
        fn = _jit.function("fp8_gemm_wgmma64.cu", f"fp8_gemm_wgmma64<{plan.nt}>", H_INSTANCES)
        _jit.set_dynamic_smem(fn, plan.smem)
        _jit.launch(fn, (plan.grid,), (H_THREADS,), (token_map(), sx.data_ptr(), *tail, i32(plan.tstages),
                                                      i32(max(1, plan.slots))), shared_mem=plan.smem, pdl=True)
        return y
    if (plan.nt <= LEAN_NT and plan.cluster == 1 and env.kernel_switches().gemm_tma_tokens
            and _jit.tensor_maps_available()):
        fn = _jit.function("fp8_gemm_wgmma.cu", f"fp8_gemm_wgmma_lean_tma<{plan.nt}>", WGMMA_INSTANCES)
        _jit.set_dynamic_smem(fn, plan.smem)
        _jit.launch(fn, (plan.grid,), (WGMMA_THREADS,), (token_map(), xq.data_ptr(), sx.data_ptr(), *tail),
                    shared_mem=plan.smem, pdl=True)
        return y
    fn = _jit.function("fp8_gemm_wgmma.cu", wgmma_instance(plan.nt, plan.cluster > 1), WGMMA_INSTANCES)
    _jit.set_dynamic_smem(fn, plan.smem)
    _jit.launch(fn, (plan.grid,), (WGMMA_THREADS,), (xq.data_ptr(), sx.data_ptr(), *tail), shared_mem=plan.smem,
                pdl=True, cluster=plan.cluster)
    return y


def fp8_gemm_mma(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """The portable mma.sync GEMM on [N, K] weights (GPUs without wgmma, RTTS_MMA_GEMM=1)."""
    M, K = xq.shape
    N = wq.shape[0]
    nt, warps, splits, per = mma_plan(M, N, K)
    grid = (math.ceil(N / (warps * 16)), splits)
    y = torch.empty(M, N, dtype=torch.bfloat16, device=xq.device)
    split = splits > 1
    fn = _jit.function("fp8_gemm.cu", f"fp8_gemm<{nt},{warps},{str(split).lower()}>", GEMM_INSTANCES)
    out = torch.empty(splits, M, N, dtype=torch.float32, device=xq.device) if split else y
    _jit.launch(fn, grid, (warps * 32,), (xq.data_ptr(), sx.data_ptr(), wq.data_ptr(), sw.data_ptr(),
                                          out.data_ptr(), i32(M), i32(N), i32(K), i32(pad4(M)), i32(per)))
    if split:
        red = _jit.function("fp8_gemm.cu", "gemm_reduce_splits", GEMM_INSTANCES)
        _jit.launch(red, (math.ceil(M * N / 256),), (256,), (out.data_ptr(), y.data_ptr(), i32(splits), i32(M * N)))
    return y


def _slice_scales(sx: torch.Tensor, a: int, b: int) -> torch.Tensor:
    s = torch.zeros(sx.shape[0], pad4(b - a), dtype=sx.dtype, device=sx.device)
    s[:, : b - a] = sx[:, a:b]
    return s


# ---------------------------------------------------------------------------------------------------- linear


def fp8_linear(x: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """x bf16 [..., K] -> bf16 [..., N] = quantize_1x128 + fp8_gemm (wq [N, K] or packed)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    xq, sx = quantize_1x128(x2)
    y = fp8_gemm(xq, sx, wq, sw)
    return y.view(*lead, y.shape[-1])


# Over this many rows (a prompt's prefill) an FP8 linear dequantizes its weight to bf16 once and runs one dense GEMM
# (model/quant.py's FP8Linear / FP8FeedForward): the decode GEMM takes at most 128 tokens per launch, and slicing
# hundreds of positions into 128-token launches re-streams the weight per slice, with a handful of launches each
# (measured several times slower than bf16: bench/results/traces/README.md).
FP8_DENSE_ROWS = 128


def fp8_rows_dense(rows: int) -> bool:
    """Whether FP8 linears take `rows` rows dense (more than FP8_DENSE_ROWS of them)."""
    return rows > FP8_DENSE_ROWS


def fp8_runs_dense(x: torch.Tensor) -> bool:
    """Whether FP8 linears take the rows of x [..., K] dense."""
    return fp8_rows_dense(x.numel() // max(1, x.shape[-1]))


def warmup(device: torch.device) -> None:
    """Compile the GEMM kernels, ask the driver for the cluster capacity, and allocate this stream's and the decode
    graphs' split scratch (outside any capture)."""
    if uses_wgmma(device):
        for inst in WGMMA_INSTANCES:
            _jit.set_dynamic_smem(_jit.function("fp8_gemm_wgmma.cu", inst, WGMMA_INSTANCES), SMEM_LIMIT)
        for inst in H_INSTANCES:
            _jit.set_dynamic_smem(_jit.function("fp8_gemm_wgmma64.cu", inst, H_INSTANCES), SMEM_PAIR_LIMIT)
        for inst in TM_INSTANCES if env.kernel_switches().gemm_token_major is not False else ():
            _jit.set_dynamic_smem(_jit.function("fp8_gemm_wgmma_tm.cu", inst, TM_INSTANCES), SMEM_PAIR_LIMIT)
        cluster_capacity(cuda_index(device))
    streamk_scratch(device)
    reserve_graph_scratch(device)  # the decode graphs' (default family), allocated outside any capture
    for inst in GEMM_INSTANCES:  # [N, K] weights (any GPU)
        _jit.function("fp8_gemm.cu", inst, GEMM_INSTANCES)
    _jit.function("fp8_gemm.cu", "gemm_reduce_splits", GEMM_INSTANCES)
