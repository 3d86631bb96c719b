"""Hot GPU ops: CUDA C++ in `cuda/*.cu`, compiled at run time through CuPy, each with a pure-torch reference.

Every op checks shapes, dtypes and layouts strictly (no silent unsqueeze, cast or copy), then runs the CUDA kernel
when `_jit.available()` and the tensors live on the GPU, else the reference in `reference.py` (the CPU path, and what
`RTTS_REFERENCE_KERNELS=1` forces everywhere). Only `_jit.py` imports CuPy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading
from collections.abc import Callable, Iterator

import numpy as np
import torch

from rtts import env
from rtts.kernels import reference
from rtts.kernels.gemm_plan import (  # noqa: F401  (re-exported: tests, benchmarks and probes plan through here)
    _CLUSTER_NT,
    _GEMM_INSTANCES,
    _H_INSTANCES,
    _H_ROWS,
    _H_THREADS,
    _LEAN_NT,
    _MAX_CLUSTER,
    _MAX_GRID_PER_SM,
    _SMEM_LIMIT,
    _SMEM_PAIR_LIMIT,
    _SMS,
    _TILE_ROWS,
    _TM_INSTANCES,
    _TM_NT,
    _TM_THREADS,
    _WGMMA_INSTANCES,
    _WGMMA_NT,
    _WGMMA_THREADS,
    WgmmaPlan,
    _wgmma_instance,
    gemm_plan,
    prefer_token_major,
    wgmma64_plan,
    wgmma64_smem_bytes,
    wgmma_plan,
    wgmma_smem_bytes,
    wgmma_tm_plan,
)
from rtts.kernels.reference import FP8, pad4


def _use_cuda(*ts: torch.Tensor) -> bool:
    if not all(t.is_cuda for t in ts):
        return False
    from rtts.kernels import _jit

    return _jit.available()


def _check(cond: bool, msg: str | Callable[[], str]) -> None:
    """Raise ValueError(msg) unless cond. A message that formats shapes is passed as a lambda: these checks run on
    every launch of an eager prefill, where formatting them anyway cost microseconds per call."""
    if not cond:
        raise ValueError(msg if isinstance(msg, str) else msg())


def _i32(v: int) -> np.int32:
    return np.int32(v)


# ---------------------------------------------------------------------------------------------------- quantization


def quantize_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x bf16 [M, K] (row-contiguous, K % 128 == 0) -> (q fp8 [M, K], scale fp32 [K/128, pad4(M)])."""
    _check(x.dim() == 2 and x.dtype == torch.bfloat16,
           lambda: f"quantize_1x128: want bf16 [M, K], got {x.dtype} {tuple(x.shape)}")
    M, K = x.shape
    _check(K % 128 == 0 and x.stride(1) == 1,
           lambda: f"quantize_1x128: K={K} must be a multiple of 128 with unit stride")
    if not _use_cuda(x):
        return reference.quantize_1x128(x)
    _check(x.stride(0) % 4 == 0 and x.data_ptr() % 8 == 0,
           "quantize_1x128: rows must start 8-byte aligned (the kernel reads 4 bf16 per load)")
    from rtts.kernels import _jit

    q = torch.empty(M, K, dtype=FP8, device=x.device)
    s = torch.empty(K // 128, pad4(M), dtype=torch.float32, device=x.device)  # the kernel writes the padding too
    if M == 0:
        return q, s
    warps = M * (K // 128)
    fn = _jit.function("fp8_quant.cu", "quantize_1x128")
    _jit.launch(fn, (math.ceil(warps / 8),), (256,),
                (x.data_ptr(), _i32(x.stride(0)), q.data_ptr(), s.data_ptr(), _i32(M), _i32(K), _i32(pad4(M))),
                pdl=True)
    return q, s


def swiglu_quantize(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up bf16 [M, 2I] = [gate | up] (contiguous, I % 128 == 0) -> quantized silu(gate) * up, as quantize_1x128."""
    _check(gate_up.dim() == 2 and gate_up.dtype == torch.bfloat16 and gate_up.is_contiguous(),
           lambda: f"swiglu_quantize: want contiguous bf16 [M, 2I], got {gate_up.dtype} {tuple(gate_up.shape)}")
    M, I2 = gate_up.shape
    _check(I2 % 256 == 0, lambda: f"swiglu_quantize: 2I={I2} must be a multiple of 256")
    if not _use_cuda(gate_up):
        return reference.swiglu_quantize(gate_up)
    _check(gate_up.data_ptr() % 8 == 0, "swiglu_quantize: gate_up must start 8-byte aligned (4 bf16 per load)")
    from rtts.kernels import _jit

    I = I2 // 2  # noqa: E741
    q = torch.empty(M, I, dtype=FP8, device=gate_up.device)
    s = torch.empty(I // 128, pad4(M), dtype=torch.float32, device=gate_up.device)  # padding written by the kernel
    if M == 0:
        return q, s
    warps = M * (I // 128)
    fn = _jit.function("fp8_quant.cu", "swiglu_quantize_1x128")
    _jit.launch(fn, (math.ceil(warps / 8),), (256,),
                (gate_up.data_ptr(), q.data_ptr(), s.data_ptr(), _i32(M), _i32(I), _i32(pad4(M))), pdl=True)
    return q, s


# ---------------------------------------------------------------------------------------------------- FP8 GEMM

def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _sm_count(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


@functools.cache
def _is_sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def _use_wgmma(device: torch.device) -> bool:
    """The wgmma kernel needs sm_90a (Hopper); RTTS_MMA_GEMM=1 opts out."""
    return not env.legacy_gemm() and _is_sm90(_index(device))


@dataclasses.dataclass
class _StreamK:
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
_STREAMK: dict[tuple[int, int, bool, str], _StreamK] = {}
_CAPTURE = threading.local()  # .family: the graph family captures on this thread belong to (graph_scratch)


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
_STREAMK_TILES = 1 << 16  # counters: N up to 8M rows
_ATT_COUNTERS = 1 << 16  # decode attention: batch x KV heads


def _streamk_floats(sms: int) -> int:
    """Partials capacity: one 128-row tile slot per CTA (a CTA parks at most its first tile's share) for
    _MAX_GRID_PER_SM CTAs per SM at 64 tokens (17 MB on an H200); a 128-token plan may use half that grid."""
    return sms * _MAX_GRID_PER_SM * _TILE_ROWS * 64


def _graph_scratch_key(idx: int) -> tuple[int, int, bool, str]:
    """_STREAMK key of captured graphs on device idx: one per graph family (graph_scratch, this thread's)."""
    return (idx, 0, True, getattr(_CAPTURE, "family", ""))


def _streamk(device: torch.device, sms: int, for_graphs: bool | None = None) -> _StreamK:
    """The scratch for GEMMs launched now: the current stream's, or the graphs' one while a capture runs."""
    from rtts.kernels import _jit

    graphs = torch.cuda.is_current_stream_capturing() if for_graphs is None else for_graphs
    idx = _index(device)
    key = _graph_scratch_key(idx) if graphs else (idx, _jit.stream_handle(idx), False, "")
    sk = _STREAMK.get(key)
    if sk is None:
        floats = _streamk_floats(sms) if _use_wgmma(device) else 0  # partials: only the wgmma GEMM splits tiles
        sk = _StreamK(torch.empty(floats, dtype=torch.float32, device=device),
                      torch.zeros(_STREAMK_TILES, dtype=torch.int32, device=device),
                      torch.zeros(_ATT_COUNTERS, dtype=torch.int32, device=device))
        _STREAMK[key] = sk
    return sk


def reserve_graph_scratch(device: torch.device) -> None:
    """Allocate the current graph family's split scratch now (before a capture; see graph_scratch)."""
    if device.type == "cuda":
        _streamk(device, _sm_count(_index(device)), for_graphs=True)


def packs_weights(device: torch.device) -> bool:
    """Whether FP8 weights on `device` should be stored packed (pack_weight): the wgmma kernel streams only the
    packed layout; other GPUs and the CPU keep [N, K]."""
    return device.type == "cuda" and _use_cuda(torch.empty(0, device=device)) and _use_wgmma(device)


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
    _check(wq.dtype == FP8 and wq.dim() == 2, lambda: f"pack_weight: want fp8 [N, K], got {wq.dtype} {tuple(wq.shape)}")
    wp = reference.pack_weight(wq.contiguous())
    if wp.is_cuda:
        torch.cuda.current_stream(wp.device).synchronize()
    return wp


def fp8_gemm(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """xq fp8 [M, K], sx fp32 [K/128, pad4(M)], wq fp8 [N, K] or packed [N/128, K/128, 128, 128] (pack_weight),
    sw fp32 [ceil(N/128), K/128] -> bf16 [M, N]. Packed weights run the wgmma kernel (sm_90a, launched with PDL: it
    streams the packed weights before waiting for the kernels ahead of it, see pack_weight), [N, K] the mma.sync
    kernel (any GPU)."""
    _check(xq.dtype == FP8 and wq.dtype == FP8,
           lambda: f"fp8_gemm: want float8_e4m3fn operands, got {xq.dtype}, {wq.dtype}")
    _check(xq.dim() == 2 and wq.dim() in (2, 4) and xq.is_contiguous() and wq.is_contiguous(),
           "fp8_gemm: operands must be contiguous, x 2-D and w 2-D or packed 4-D")
    M, K = xq.shape
    packed = wq.dim() == 4
    if packed:
        _check(tuple(wq.shape[1:]) == (K // 128, 128, 128) and K % 128 == 0,
               lambda: f"fp8_gemm: packed weight {tuple(wq.shape)} does not match K={K}")
        N = wq.shape[0] * 128
    else:
        N = wq.shape[0]
        _check(wq.shape[1] == K and K % 128 == 0,
               lambda: f"fp8_gemm: K mismatch or not a multiple of 128 ({K}, {wq.shape[1]})")
    _check(sx.dtype == torch.float32 and tuple(sx.shape) == (K // 128, pad4(M)) and sx.is_contiguous(),
           lambda: f"fp8_gemm: sx must be fp32 [{K // 128}, {pad4(M)}], got {sx.dtype} {tuple(sx.shape)}")
    _check(sw.dtype == torch.float32 and tuple(sw.shape) == (math.ceil(N / 128), K // 128) and sw.is_contiguous(),
           lambda: f"fp8_gemm: sw must be fp32 [{math.ceil(N / 128)}, {K // 128}], got {sw.dtype} {tuple(sw.shape)}")
    if not _use_cuda(xq, sx, wq, sw):
        return reference.fp8_gemm(xq, sx, wq, sw)
    if M == 0:
        return torch.empty(0, N, dtype=torch.bfloat16, device=xq.device)
    wgmma = packed and _use_wgmma(xq.device)
    forced, rows = env.gemm_cluster(), env.gemm_rows()  # read per call; the cached plan checks are keyed by them
    step = _wgmma_step(N, K, _index(xq.device), forced, rows) if wgmma else 128  # larger batches: token slices
    wgmma = wgmma and _wgmma_fits(min(M, step), N, K, _index(xq.device), forced, rows)
    if packed and not wgmma:  # packed weights without a wgmma plan (other GPUs, huge layers): correct, not fast
        wq, packed, step = reference.unpack_weight(wq), False, 128
    if M > step:
        return torch.cat([fp8_gemm(xq[i:i + step].contiguous(), _slice_scales(sx, i, min(M, i + step)), wq, sw)
                          for i in range(0, M, step)])
    return _fp8_gemm_wgmma(xq, sx, wq, sw) if wgmma else _fp8_gemm_mma(xq, sx, wq, sw)


@functools.cache
def _wgmma_step(N: int, K: int, device_index: int, cluster: int | None = None, rows: int | None = None) -> int:
    """Tokens per wgmma launch beyond 64: 128 when that plan is one wave of CTAs, else 64. The 64-row kernel's plans
    always are (at most two CTAs per SM, each within half an SM's shared memory). The 128-row kernel's 128-token tile
    needs twice the shared memory per K block, so wide K ranges push its grid past the SM count (measured on the
    H200 at M = 128: gate|up 72 us as one two-wave 128-token launch vs 62 us as two 64-token launches)."""
    sms = _sm_count(device_index)
    try:
        plan = _plan(128, N, K, device_index, cluster=cluster, rows=rows)
    except ValueError:
        return 64
    one_wave = plan.grid <= (2 * sms if plan.rows == _H_ROWS else sms)
    return 128 if one_wave and scratch_fits(plan, N, sms) else 64


@functools.cache
def _cluster_capacity(device_index: int) -> tuple[int, ...] | None:
    """How many clusters of each size (index = CTAs per cluster, 0..8) the GPU co-schedules with one CTA per SM
    (the driver's answer for the cluster instance at a shared-memory size that allows one CTA per SM). Clusters live
    inside one GPC, so on GPUs whose GPCs hold unequal SM counts this is below sms // size."""
    from rtts.kernels import _jit

    if not _jit.available():  # planning without a GPU (tests): assume sms // size
        return None
    sms = _sm_count(device_index)
    fn = _jit.function("fp8_gemm_wgmma.cu", _wgmma_instance(_CLUSTER_NT, True), _WGMMA_INSTANCES)
    _jit.set_dynamic_smem(fn, _SMEM_LIMIT)
    out = [0, sms]
    for cs in range(2, _MAX_CLUSTER + 1):
        out.append(_jit.max_active_clusters(fn, cs, _WGMMA_THREADS, 120 * 1024))
    return tuple(out)


def _plan(M: int, N: int, K: int, device_index: int, stages: int | None = None,
          cluster: int | None = None, rows: int | None = None) -> WgmmaPlan:
    """The plan launched: `cluster` / `rows` forced by the caller or RTTS_GEMM_CLUSTER / RTTS_GEMM_ROWS, else the
    planner's choice (where the driver encodes tensor maps): the token-major kernel where it has a plan and
    RTTS_GEMM_TM allows it (gemm_plan.prefer_token_major: from 9 tokens), else the 64-row kernel for more than 16
    tokens, unless a cluster split is forced (only the 128-row kernel has one)."""
    if cluster is None:
        cluster = env.gemm_cluster()
    if rows is None:
        rows = env.gemm_rows()
    sms = _sm_count(device_index)
    tm = env.gemm_token_major()
    if (cluster is None and rows is None and M <= _TM_NT[-1] and (tm or (tm is None and prefer_token_major(M)))
            and _tensor_maps()):
        try:
            return wgmma_tm_plan(M, N, K, sms, stages)
        except ValueError:
            pass  # the layer does not cut into one tile per SM: stream-K below
    if _rows64(M, cluster, rows):
        try:
            return wgmma64_plan(M, N, K, sms, stages)
        except ValueError:
            if rows == _H_ROWS:  # forced: no fallback
                raise
    return wgmma_plan(M, N, K, sms, stages, cluster, _cluster_capacity(device_index))


def _tensor_maps() -> bool:
    from rtts.kernels import _jit

    return _jit.tensor_maps_available()


def _rows64(M: int, cluster: int | None, rows: int | None) -> bool:
    if (cluster is not None and cluster > 1) or rows == _TILE_ROWS or not _tensor_maps():
        return False
    return rows == _H_ROWS or M > _LEAN_NT


def scratch_fits(plan: WgmmaPlan, N: int, sms: int) -> bool:
    """A global stream-K plan's shares and counters fit the per-stream scratch (at 64 tokens: layers up to ~200M
    weights); cluster plans use none."""
    return plan.cluster > 1 or plan.token_major or (N // plan.rows <= _STREAMK_TILES
                                and plan.grid * plan.rows * plan.nt <= _streamk_floats(sms))


@functools.cache
def _wgmma_fits(M: int, N: int, K: int, device_index: int, cluster: int | None, rows: int | None = None) -> bool:
    """A plan exists for M tokens (with `cluster` / `rows` forced, or not) and its scratch fits."""
    try:
        plan = _plan(M, N, K, device_index, cluster=cluster, rows=rows)
    except ValueError:
        return False
    return scratch_fits(plan, N, _sm_count(device_index))


def _fp8_gemm_wgmma(xq: torch.Tensor, sx: torch.Tensor, wp: torch.Tensor, sw: torch.Tensor,
                    stages: int | None = None, cluster: int | None = None, rows: int | None = None) -> torch.Tensor:
    M, K = xq.shape
    N = wp.shape[0] * _TILE_ROWS
    dev = _index(xq.device)
    _check(wp.dim() == 4 and M <= _WGMMA_NT[-1], lambda: f"fp8_gemm: no wgmma plan for {M}x{N}x{K}")
    try:
        plan = _plan(M, N, K, dev, stages, cluster, rows)
    except ValueError as e:
        raise ValueError(f"fp8_gemm: {e}") from None
    return launch_wgmma(plan, xq, sx, wp, sw)


def launch_wgmma(plan: WgmmaPlan, xq: torch.Tensor, sx: torch.Tensor, wp: torch.Tensor,
                 sw: torch.Tensor) -> torch.Tensor:
    """Run the wgmma GEMM with a given plan (the planner's, or one a probe builds: bench/probes)."""
    from rtts.kernels import _jit

    M, K = xq.shape
    N = wp.shape[0] * _TILE_ROWS
    dev = _index(xq.device)
    # The plan actually launched (a forced split or stage count included) must fit the scratch it writes.
    _check(scratch_fits(plan, N, _sm_count(dev)),
           lambda: f"fp8_gemm: {plan} for {M}x{N}x{K} exceeds the stream-K scratch")
    sk = _streamk(xq.device, _sm_count(dev))
    y = torch.empty(M, N, dtype=torch.bfloat16, device=xq.device)
    tail = (wp.data_ptr(), sw.data_ptr(), y.data_ptr(), sk.partials.data_ptr(), sk.counters.data_ptr(), _i32(M),
            _i32(N), _i32(K), _i32(pad4(M)), _i32(plan.stages))
    def token_map() -> _jit.TensorMap:
        # Tokens and their scales are bulk-copied: both must start 16-byte aligned (fresh torch tensors do).
        _check(xq.data_ptr() % 16 == 0 and sx.data_ptr() % 16 == 0, "fp8_gemm: x and sx must be 16-byte aligned")
        return _jit.tensor_map_2d(xq.data_ptr(), M, K, plan.nt, 128)

    if plan.token_major:
        _check(plan.stages % 2 == 0 and plan.tstages % 2 == 0 and plan.stages >= 2 and plan.tstages >= 2,
               lambda: f"fp8_gemm: token-major rings need even stage counts, got {plan}")
        fn = _jit.function("fp8_gemm_wgmma_tm.cu", f"fp8_gemm_wgmma_tm<{plan.nt},{plan.rows},{plan.cluster}>",
                           _TM_INSTANCES)
        _jit.set_dynamic_smem(fn, plan.smem)
        _jit.launch(fn, (plan.grid,), (_TM_THREADS,), (token_map(), sx.data_ptr(), wp.data_ptr(), sw.data_ptr(),
                                                        y.data_ptr(), _i32(M), _i32(N), _i32(K), _i32(pad4(M)),
                                                        _i32(plan.stages), _i32(plan.tstages)),
                    shared_mem=plan.smem, pdl=True, cluster=plan.cluster)
        return y
    if plan.rows == _H_ROWS:
        fn = _jit.function("fp8_gemm_wgmma64.cu", f"fp8_gemm_wgmma64<{plan.nt}>", _H_INSTANCES)
        _jit.set_dynamic_smem(fn, plan.smem)
        _jit.launch(fn, (plan.grid,), (_H_THREADS,), (token_map(), sx.data_ptr(), *tail, _i32(plan.tstages),
                                                       _i32(max(1, plan.slots))), shared_mem=plan.smem, pdl=True)
        return y
    if plan.nt <= _LEAN_NT and plan.cluster == 1 and env.gemm_tma_tokens() and _jit.tensor_maps_available():
        fn = _jit.function("fp8_gemm_wgmma.cu", f"fp8_gemm_wgmma_lean_tma<{plan.nt}>", _WGMMA_INSTANCES)
        _jit.set_dynamic_smem(fn, plan.smem)
        _jit.launch(fn, (plan.grid,), (_WGMMA_THREADS,), (token_map(), xq.data_ptr(), sx.data_ptr(), *tail),
                    shared_mem=plan.smem, pdl=True)
        return y
    fn = _jit.function("fp8_gemm_wgmma.cu", _wgmma_instance(plan.nt, plan.cluster > 1), _WGMMA_INSTANCES)
    _jit.set_dynamic_smem(fn, plan.smem)
    _jit.launch(fn, (plan.grid,), (_WGMMA_THREADS,), (xq.data_ptr(), sx.data_ptr(), *tail), shared_mem=plan.smem,
                pdl=True, cluster=plan.cluster)
    return y


def _fp8_gemm_mma(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    from rtts.kernels import _jit

    M, K = xq.shape
    N = wq.shape[0]
    nt, warps, splits, per = gemm_plan(M, N, K)
    grid = (math.ceil(N / (warps * 16)), splits)
    y = torch.empty(M, N, dtype=torch.bfloat16, device=xq.device)
    split = splits > 1
    fn = _jit.function("fp8_gemm.cu", f"fp8_gemm<{nt},{warps},{str(split).lower()}>", _GEMM_INSTANCES)
    out = torch.empty(splits, M, N, dtype=torch.float32, device=xq.device) if split else y
    _jit.launch(fn, grid, (warps * 32,), (xq.data_ptr(), sx.data_ptr(), wq.data_ptr(), sw.data_ptr(),
                                          out.data_ptr(), _i32(M), _i32(N), _i32(K), _i32(pad4(M)), _i32(per)))
    if split:
        red = _jit.function("fp8_gemm.cu", "gemm_reduce_splits", _GEMM_INSTANCES)
        _jit.launch(red, (math.ceil(M * N / 256),), (256,), (out.data_ptr(), y.data_ptr(), _i32(splits), _i32(M * N)))
    return y


def _slice_scales(sx: torch.Tensor, a: int, b: int) -> torch.Tensor:
    s = torch.zeros(sx.shape[0], pad4(b - a), dtype=sx.dtype, device=sx.device)
    s[:, : b - a] = sx[:, a:b]
    return s


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
# (quant.FP8Linear / FP8FeedForward): the decode GEMM takes at most 128 tokens per launch, and slicing hundreds of
# positions into 128-token launches re-streams the weight per slice, with a handful of launches each (measured on
# the H200: 320-position FP8 prefill 87 ms vs 26 ms bf16, bench/results/traces/prefill-time-*).
FP8_DENSE_ROWS = 128


def fp8_runs_dense(x: torch.Tensor) -> bool:
    """Whether FP8 linears take the rows of x [..., K] dense (more than FP8_DENSE_ROWS of them)."""
    return x.numel() > FP8_DENSE_ROWS * x.shape[-1]


def dequantize_weight(wq: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """wq fp8 [N, K] or packed [N/128, K/128, 128, 128] (pack_weight), sw fp32 [ceil(N/128), ceil(K/128)] ->
    bf16 [N, K] = wq * sw per 128x128 block (cuda/dequant.cu)."""
    _check(wq.dtype == FP8 and wq.dim() in (2, 4) and wq.is_contiguous(),
           lambda: f"dequantize_weight: want a contiguous float8_e4m3fn [N, K] or packed weight, got {wq.dtype} "
                   f"{tuple(wq.shape)}")
    packed = wq.dim() == 4
    if packed:
        _check(tuple(wq.shape[2:]) == (128, 128),
               lambda: f"dequantize_weight: packed blocks must be 128x128, got {tuple(wq.shape)}")
        N, K = wq.shape[0] * 128, wq.shape[1] * 128
    else:
        N, K = wq.shape
        _check(K % 16 == 0, lambda: f"dequantize_weight: K={K} must be a multiple of 16")
    _check(sw.dtype == torch.float32 and tuple(sw.shape) == (math.ceil(N / 128), math.ceil(K / 128))
           and sw.is_contiguous(),
           lambda: f"dequantize_weight: sw must be contiguous fp32 [{math.ceil(N / 128)}, {math.ceil(K / 128)}], got "
                   f"{sw.dtype} {tuple(sw.shape)}")
    if not _use_cuda(wq, sw):
        return reference.dequantize_bf16(wq, sw)
    from rtts.kernels import _jit

    y = torch.empty(N, K, dtype=torch.bfloat16, device=wq.device)
    chunks = N * K // 16
    if chunks == 0:
        return y
    fn = _jit.function("dequant.cu", f"dequantize_fp8<{'true' if packed else 'false'}>", _DEQUANT_INSTANCES)
    _jit.launch(fn, (math.ceil(chunks / 256),), (256,), (wq.data_ptr(), sw.data_ptr(), y.data_ptr(), _i32(N), _i32(K)))
    return y


_DEQUANT_INSTANCES = ("dequantize_fp8<true>", "dequantize_fp8<false>")


# ---------------------------------------------------------------------------------------------------- attention


_ATT_TILE, _ATT_STAGES = 64, 2  # must match cuda/decode_attention.cu
_ATT_CTAS_PER_SM = 2  # 64 KB of K/V tiles each (head dim 128); the kernels' launch bounds (decode_attention.cu)
# The merging CTA keeps every split's (max, sum) per query head in its pipeline memory: 2 x S x G floats, within the
# 32 KB of head dim 64 for G up to 8 at this many splits.
_ATT_MAX_SPLITS = 256
# The last split merges (no second launch) from this many splits, when the grid is one wave (attention_fuses).
_ATT_FUSE_MIN_SPLITS = 4
# What each split adds to the merge, in 64-key tiles of one CTA's stream (attention_splits). Fitted to the H200
# (session 15, bench/probes/attention_variants.py with forced splits, head dim 128, G = 4): 1 x 2048 keys took 9.5 /
# 8.4 / 9.2 us at 8 / 16 / 32 splits (the planner had picked 32), 1 x 512 6.5 / 8.0 at 8 / 4 splits.
_ATT_MERGE_TILES_PER_SPLIT = 0.125


def attention_splits(B: int, n_kv: int, L: int, sms: int = _SMS) -> tuple[int, int]:
    """(splits, keys per split) for a cache of L positions. CTAs run in waves of `_ATT_CTAS_PER_SM` per SM, so a
    split count that leaves the last wave nearly empty costs a whole wave: pick the split minimizing
    waves x (64-key tiles per CTA + a fixed cost of about two tiles for the pipeline fill and the merge) plus the
    merge's reading of every split (_ATT_MERGE_TILES_PER_SPLIT each), with at most _ATT_MAX_SPLITS splits."""
    slots = sms * _ATT_CTAS_PER_SM
    best: tuple[float, int, int] | None = None
    for want in range(1, min(_ATT_MAX_SPLITS, max(1, math.ceil(L / _ATT_TILE))) + 1):
        chunk = math.ceil(math.ceil(L / want) / _ATT_TILE) * _ATT_TILE
        S = math.ceil(L / chunk)
        cost = math.ceil(B * n_kv * S / slots) * (chunk / _ATT_TILE + 2) + S * _ATT_MERGE_TILES_PER_SPLIT
        if best is None or cost < best[0]:
            best = (cost, S, chunk)
    assert best is not None
    return best[1], best[2]


def attention_fuses(B: int, n_kv: int, S: int, sms: int = _SMS) -> bool:
    """Whether the split CTAs merge their partials themselves (the `_fused` kernels) instead of a second launch.
    Measured on the H200 (bench/probes/attention_variants.py, head dim 128, G = 4), with the CUDA-core kernel of
    session 9: fused, batch 1 x 2048 keys (32 splits) 17.9 -> 11.3 us and 1 x 512 (8) 9.9 -> 8.4, but 16 x 512 (3
    splits, one wave) 20.8 -> 22.8 and 64 x 2048 (3 splits, four waves) 170 -> 199: the merging CTA holds its SM slot
    through dependent L2 round trips, which later waves wait for, while a second launch merges with memory idle. So:
    one wave, enough splits. The tensor-core kernel at two CTAs per SM keeps the rule (session 11: 1 x 2048 fused 9.2
    vs launched 10.9 us, 16 x 512 16.4 vs 14.8, 64 x 2048 124.0 vs 123.8)."""
    return S >= _ATT_FUSE_MIN_SPLITS and B * n_kv * S <= sms * _ATT_CTAS_PER_SM


def attention_smem_bytes(D: int) -> int:
    """Dynamic shared memory of one attention CTA: the K and V tiles of every pipeline stage."""
    return _ATT_STAGES * 2 * _ATT_TILE * D * 2


def decode_attention_fast(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether decode_attention would run its CUDA kernel for these tensors (callers keep their own reference
    attention otherwise, e.g. the float32 CPU path)."""
    H, D = q.shape[-2], q.shape[-1]
    n_kv = k_cache.shape[-2]
    return (q.dtype == k_cache.dtype == torch.bfloat16 and D in (64, 128) and H % n_kv == 0
            and H // n_kv in (1, 2, 4, 8) and _use_cuda(q, k_cache))


def decode_attention(
    q: torch.Tensor,  # [B, H, D] bf16
    k_cache: torch.Tensor,  # [rows, L, n_kv, D] bf16
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [B] int64
    lens: torch.Tensor,  # [B] int64, each in [1, L]
) -> torch.Tensor:
    """Softmax attention of one query per stream over positions [0, lens) of its slot -> [B, H, D] bf16.
    Lengths are read on the device: one captured graph serves any lengths up to L."""
    _check(q.dim() == 3 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape,
           lambda: f"decode_attention: want q [B, H, D], caches [rows, L, n_kv, D]; "
                   f"got {tuple(q.shape)}, {tuple(k_cache.shape)}")
    B, H, D = q.shape
    rows, L, n_kv, Dk = k_cache.shape
    _check(D == Dk and H % n_kv == 0, lambda: f"decode_attention: head dims {D} vs {Dk}, heads {H} vs kv heads {n_kv}")
    _check(q.dtype == k_cache.dtype == v_cache.dtype == torch.bfloat16, "decode_attention: bf16 tensors only")
    _check(q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous(),
           "decode_attention: tensors must be contiguous")
    _check(slots.dtype == torch.int64 and lens.dtype == torch.int64 and slots.shape == lens.shape == (B,),
           "decode_attention: slots and lens must be int64 [B]")
    G = H // n_kv
    if not _use_cuda(q, k_cache, v_cache, slots, lens) or D not in (64, 128) or G not in (1, 2, 4, 8):
        return reference.decode_attention(q, k_cache, v_cache, slots, lens)
    from rtts.kernels import _jit

    dev = _index(q.device)
    S, chunk = attention_splits(B, n_kv, L, _sm_count(dev))
    smem = attention_smem_bytes(D)
    out = torch.empty_like(q)
    fused = S > 1 and attention_fuses(B, n_kv, S, _sm_count(dev))
    counters = out  # unused unless fused
    if S > 1:
        ws_o = torch.empty(B, n_kv, S, G, D, dtype=torch.float32, device=q.device)
        ws_ml = torch.empty(B, n_kv, S, G, 2, dtype=torch.float32, device=q.device)
        _check(2 * S * G * 4 <= smem, lambda: f"decode_attention: {S} splits x {G} heads exceed the merge buffer")
    else:
        ws_o = ws_ml = out  # unused
    if fused:
        # The last split of each (stream, KV head) merges them; its count lives in this stream's (or graph
        # family's) scratch, like the GEMM's tile counters, so concurrent streams never share one.
        counters = _streamk(q.device, _sm_count(dev)).att_counters
        _check(B * n_kv <= counters.numel(), lambda: f"decode_attention: {B} streams x {n_kv} KV heads exceed the "
                                                     "split counters")
    fn = _jit.function("decode_attention.cu", f"decode_attention_{'fused_' if fused else ''}{D}_{G}")
    _jit.set_dynamic_smem(fn, smem)
    _jit.launch(fn, (S, n_kv, B), (128,), (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
                                           lens.data_ptr(), ws_o.data_ptr(), ws_ml.data_ptr(), out.data_ptr(),
                                           counters.data_ptr(), _i32(n_kv), _i32(L), _i32(chunk),
                                           np.float32(1.0 / math.sqrt(D))),
                shared_mem=smem)
    if S > 1 and not fused:
        merge = _jit.function("decode_attention.cu", f"decode_attention_merge_{D}_{G}")
        _jit.launch(merge, (n_kv, B), (128,), (ws_o.data_ptr(), ws_ml.data_ptr(), out.data_ptr(), _i32(n_kv),
                                               _i32(S)), shared_mem=2 * S * G * 4)
    return out


# ---------------------------------------------------------------------------------------------------- token window


def token_window_shift(buf: torch.Tensor, slots: torch.Tensor, new: torch.Tensor, active: torch.Tensor) -> None:
    """In place: buf int32 [S, W, C]; for each row b with active[b], slot slots[b]'s window shifts left by one and
    new[b] (int32 [B, C]) becomes its last column. Graph-safe (no host reads)."""
    _check(buf.dtype == torch.int32 and buf.dim() == 3 and buf.is_contiguous(),
           "token_window_shift: buf int32 [S, W, C]")
    B = slots.shape[0]
    _check(new.dtype == torch.int32 and tuple(new.shape) == (B, buf.shape[2]) and new.is_contiguous(),
           lambda: f"token_window_shift: new must be int32 [{B}, {buf.shape[2]}]")
    _check(slots.dtype == torch.int64 and active.dtype == torch.bool and active.shape == (B,),
           "token_window_shift: slots int64 [B], active bool [B]")
    W, C = buf.shape[1], buf.shape[2]
    _check(W * C <= 1024, "token_window_shift: W * C must be <= 1024")
    if not _use_cuda(buf, slots, new, active):
        reference.token_window_shift(buf, slots, new, active)
        return
    from rtts.kernels import _jit

    fn = _jit.function("token_window.cu", "token_window_shift")
    threads = max(32, (W * C + 31) // 32 * 32)
    _jit.launch(fn, (B,), (threads,), (buf.data_ptr(), slots.data_ptr(), new.data_ptr(), active.data_ptr(), _i32(W),
                                       _i32(C)))


# ---------------------------------------------------------------------------------------------------- codec

_SNAKE_TYPES = {torch.float32: "float", torch.bfloat16: "bf16_t"}
SNAKE_DTYPES = frozenset(_SNAKE_TYPES)  # what snake() takes (other dtypes: the caller's torch expression)
_SNAKE_INSTANCES = tuple(f"snake<{t}, {v}>" for t in _SNAKE_TYPES.values() for v in (4, 1))


def snake(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """The codec's Snake activation in one pass (cuda/snake.cu): x [B, C, L] contiguous float32 or bf16, alpha [C]
    (any float dtype; its float32 copy is what the kernel reads) -> x + sin(alpha x)^2 / (alpha + 1e-9)."""
    _check(x.dim() == 3 and x.is_contiguous() and x.dtype in _SNAKE_TYPES,
           lambda: f"snake: want a contiguous float32 or bfloat16 [B, C, L], got {x.dtype} {tuple(x.shape)} "
                   f"(contiguous: {x.is_contiguous()})")
    B, C, L = x.shape
    _check(alpha.numel() == C and alpha.is_floating_point(),
           lambda: f"snake: alpha must hold {C} floats (one per channel), got {alpha.dtype} {tuple(alpha.shape)}")
    if not _use_cuda(x, alpha):
        return reference.snake(x, alpha.reshape(C).to(x.dtype))
    from rtts.kernels import _jit

    a = alpha.reshape(C).to(device=x.device, dtype=torch.float32).contiguous()
    y = torch.empty_like(x)
    n = x.numel()
    if n == 0:
        return y
    vec = 4 if L % 4 == 0 and x.data_ptr() % 16 == 0 and y.data_ptr() % 16 == 0 else 1
    fn = _jit.function("snake.cu", f"snake<{_SNAKE_TYPES[x.dtype]}, {vec}>", _SNAKE_INSTANCES)
    _jit.launch(fn, (-(-n // (256 * vec)),), (256,), (x.data_ptr(), a.data_ptr(), y.data_ptr(), n,
                                                           _i32(C), _i32(L)))
    return y


def warmup(device: torch.device) -> None:
    """Compile and load every kernel module now (before any CUDA-graph capture)."""
    if device.type != "cuda":
        return
    from rtts.kernels import _jit

    if not _jit.available():
        return
    _jit.function("fp8_quant.cu", "quantize_1x128")
    _jit.function("fp8_quant.cu", "swiglu_quantize_1x128")
    for inst in _SNAKE_INSTANCES:
        _jit.function("snake.cu", inst, _SNAKE_INSTANCES)
    if _use_wgmma(device):
        for inst in _WGMMA_INSTANCES:
            _jit.set_dynamic_smem(_jit.function("fp8_gemm_wgmma.cu", inst, _WGMMA_INSTANCES), _SMEM_LIMIT)
        for inst in _H_INSTANCES:
            _jit.set_dynamic_smem(_jit.function("fp8_gemm_wgmma64.cu", inst, _H_INSTANCES), _SMEM_PAIR_LIMIT)
        for inst in _TM_INSTANCES if env.gemm_token_major() is not False else ():
            _jit.set_dynamic_smem(_jit.function("fp8_gemm_wgmma_tm.cu", inst, _TM_INSTANCES), _SMEM_PAIR_LIMIT)
        _cluster_capacity(_index(device))
    _streamk(device, _sm_count(_index(device)))
    reserve_graph_scratch(device)  # the decode graphs' (default family), allocated outside any capture
    for inst in _GEMM_INSTANCES:  # [N, K] weights (any GPU)
        _jit.function("fp8_gemm.cu", inst, _GEMM_INSTANCES)
    _jit.function("fp8_gemm.cu", "gemm_reduce_splits", _GEMM_INSTANCES)
    for inst in _DEQUANT_INSTANCES:
        _jit.function("dequant.cu", inst, _DEQUANT_INSTANCES)
    for d in (64, 128):
        for g in (1, 2, 4, 8):
            for kind in ("", "fused_"):
                _jit.set_dynamic_smem(_jit.function("decode_attention.cu", f"decode_attention_{kind}{d}_{g}"),
                                      attention_smem_bytes(d))
            _jit.function("decode_attention.cu", f"decode_attention_merge_{d}_{g}")  # <= 16 KB: the default limit
    _jit.function("token_window.cu", "token_window_shift")
    from rtts.kernels import draw, norm_rope

    norm_rope.warmup()
    draw.warmup()
