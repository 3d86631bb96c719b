"""Kernel benchmarks on the GPU: FP8 GEMMs (S2-Pro shapes), the MLP block, decode attention.

Every timing is a CUDA-graph replay of many calls whose weights (or KV caches) rotate through enough copies to exceed
the 60 MB L2, so each call reads from HBM as in a real decode step; the reported time per call is the median over
repeated replays. Effective bandwidth counts the bytes an op must move (weights + activations + output, or the K/V
bytes attended).
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rtts import env, kernels
from rtts.bench.common import environment, write_results
from rtts.kernels import _jit, gemm
from rtts.kernels import reference as ref
from rtts.kernels.common import sm_count
from rtts.kernels.gemm_plan import WgmmaPlan

L2_BYTES = 60 << 20
# (name, N, K): the transformer linears of S2-Pro; the fast model's 4 layers have the same shapes.
S2_GEMMS = [("wqkv", 6144, 2560), ("wo", 2560, 4096), ("w1w3 (gate|up)", 19456, 2560), ("w2", 2560, 9728)]


def time_graph(fns: list[Callable[[], Any]], reps: int = 20) -> float:
    """Median seconds per call of `fns` (one call each) captured in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns[:2]:
            f()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            for f in fns:
                f()
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / len(fns))
    return statistics.median(times)


MIN_CALLS = 32  # per captured graph: amortizes the graph's own launch latency, which the events would count


def graph_calls(fn: Callable[[int], Any], n: int) -> list[Callable[[], Any]]:
    """fn(0), fn(1), ... as calls for time_graph: n of them, at least MIN_CALLS."""
    return [functools.partial(fn, i) for i in range(max(n, MIN_CALLS))]


def copies_for(nbytes: int) -> int:
    return max(2, math.ceil(3 * L2_BYTES / nbytes))


PackedCopies = list[tuple[torch.Tensor, torch.Tensor]]


def packed_weights(N: int, K: int) -> tuple[int, PackedCopies]:
    """Random [N, K] weights (bf16 scaled like a trained layer's) quantized and packed, in up to 8 copies, and the
    calls per graph that rotate through enough of them to exceed the L2 (what the GEMM probes time plans on)."""
    R = copies_for(N * K)
    qs = [ref.quantize_weight(torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.05) for _ in range(min(R, 8))]
    return R, [(kernels.pack_weight(q), s) for q, s in qs]


def time_plan(plan: WgmmaPlan, xq: torch.Tensor, sx: torch.Tensor, packed: PackedCopies, calls: int) -> float:
    """Microseconds per call of the wgmma GEMM launched with `plan`, `calls` calls over the packed copies in turn."""
    def call(i: int) -> torch.Tensor:
        wp, sw = packed[i % len(packed)]
        return gemm.launch_wgmma(plan, xq, sx, wp, sw)

    return 1e6 * time_graph(graph_calls(call, calls))


def bench_gemm(N: int, K: int, M: int, stages: tuple[int, ...] = (), clusters: tuple[int, ...] = (),
               rows: tuple[int, ...] = ()) -> dict[str, Any]:
    dev = "cuda"
    R = copies_for(N * K)
    ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.05 for _ in range(min(R, 8))]
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    qs = [ref.quantize_weight(w) for w in ws]
    packed = [(kernels.prepare_weight(q), s) for q, s in qs]  # what the serving path streams
    xq, sx = kernels.quantize_1x128(x)
    n = len(ws)
    reps = R  # calls per graph, cycling the copies
    out: dict[str, Any] = {}
    def bf16(i: int) -> torch.Tensor:
        return x @ ws[i % n].T

    def served(i: int) -> torch.Tensor:  # what the serving path runs: packed weights on sm_90a
        wq, sw = packed[i % n]
        return kernels.fp8_gemm(xq, sx, wq, sw)

    def linear(i: int) -> torch.Tensor:
        wq, sw = packed[i % n]
        return kernels.fp8_linear(x, wq, sw)

    def mma(i: int) -> torch.Tensor:  # the mma.sync kernel (GPUs without wgmma)
        wq, sw = qs[i % n]
        return gemm.fp8_gemm_mma(xq, sx, wq, sw)

    out["bf16_us"] = 1e6 * time_graph(graph_calls(bf16, reps))
    out["fp8_gemm_us"] = 1e6 * time_graph(graph_calls(served, reps))
    out["mma_sync_us"] = 1e6 * time_graph(graph_calls(mma, reps))
    for st in stages if M <= 64 and packed[0][0].dim() == 4 else ():
        def staged(i: int, st: int = st) -> torch.Tensor:
            wq, sw = packed[i % n]
            return gemm.fp8_gemm_wgmma(xq, sx, wq, sw, stages=st)

        out[f"wgmma_stages{st}_us"] = 1e6 * time_graph(graph_calls(staged, reps))
    for cs in clusters if M <= 64 and packed[0][0].dim() == 4 else ():
        try:
            gemm.plan_gemm(M, N, K, 0, cluster=cs)
        except ValueError:
            continue

        def split(i: int, cs: int = cs) -> torch.Tensor:
            wq, sw = packed[i % n]
            return gemm.fp8_gemm_wgmma(xq, sx, wq, sw, cluster=cs)

        out[f"wgmma_cluster{cs}_us"] = 1e6 * time_graph(graph_calls(split, reps))
    for rw in rows if M <= 128 and packed[0][0].dim() == 4 else ():
        if not gemm.scratch_fits(gemm.plan_gemm(M, N, K, 0, rows=rw), N, sm_count(0)):
            continue  # fp8_gemm would run this one in token slices

        def tiled(i: int, rw: int = rw) -> torch.Tensor:
            wq, sw = packed[i % n]
            return gemm.fp8_gemm_wgmma(xq, sx, wq, sw, rows=rw)

        out[f"wgmma_rows{rw}_us"] = 1e6 * time_graph(graph_calls(tiled, reps))
    if packed[0][0].dim() == 4:
        switches = env.kernel_switches()
        p = gemm.plan_gemm(min(M, gemm.wgmma_step(N, K, 0, switches.gemm_cluster, switches.gemm_rows)), N, K, 0)
        if p.token_major:
            out["plan"] = f"token-major {p.rows} cols, K/{p.cluster}, {p.stages} st, {p.grid} CTAs"
        else:
            how = f"cluster {p.cluster}" if p.cluster > 1 else "global"
            out["plan"] = f"{p.rows} rows, {how}, {p.stages} st, {p.grid} CTAs"
    out["fp8_linear_us"] = 1e6 * time_graph(graph_calls(linear, reps))
    # torch._scaled_mm with per-tensor scales (the stock FP8 path); FP8 MMA needs M padded to 16.
    Mp = max(16, (M + 15) // 16 * 16)
    xp = torch.zeros(Mp, K, device=dev, dtype=torch.float8_e4m3fn)
    xp[:M] = (x / x.abs().max() * 400).to(torch.float8_e4m3fn)
    wts = [(w / w.abs().max() * 400).to(torch.float8_e4m3fn) for w in ws]
    one = torch.ones((), device=dev)
    def scaled(i: int) -> torch.Tensor:
        return torch._scaled_mm(xp, wts[i % n].T, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    try:
        out["scaled_mm_us"] = 1e6 * time_graph(graph_calls(scaled, reps))
    except RuntimeError as e:  # not every torch build has every FP8 layout
        out["scaled_mm_error"] = str(e)[:200]  # type: ignore[assignment]
    w_bytes, a_bytes = N * K, M * K + M * N * 2 + (K // 128) * M * 4
    out["fp8_gemm_TBps"] = (w_bytes + a_bytes) / (out["fp8_gemm_us"] * 1e-6) / 1e12
    out["bf16_TBps"] = (2 * N * K + 2 * M * K + 2 * M * N) / (out["bf16_us"] * 1e-6) / 1e12
    out["speedup_vs_bf16"] = out["bf16_us"] / out["fp8_gemm_us"]
    return out


def bench_mlp(M: int, dim: int = 2560, hidden: int = 9728, rows: tuple[int, ...] = ()) -> dict[str, float]:
    dev = "cuda"
    nbytes = 3 * hidden * dim
    n = min(copies_for(nbytes), 6)
    w1s = [torch.randn(hidden, dim, device=dev, dtype=torch.bfloat16) * 0.05 for _ in range(n)]
    w3s = [torch.randn(hidden, dim, device=dev, dtype=torch.bfloat16) * 0.05 for _ in range(n)]
    w2s = [torch.randn(dim, hidden, device=dev, dtype=torch.bfloat16) * 0.05 for _ in range(n)]
    x = torch.randn(M, dim, device=dev, dtype=torch.bfloat16)
    gu = [(kernels.prepare_weight(q), s) for q, s in (ref.quantize_weight(torch.cat([a, b])) for a, b in zip(w1s, w3s))]
    dn = [(kernels.prepare_weight(q), s) for q, s in (ref.quantize_weight(w) for w in w2s)]
    reps = copies_for(nbytes)

    def bf16(i: int) -> torch.Tensor:
        return (torch.nn.functional.silu(x @ w1s[i % n].T) * (x @ w3s[i % n].T)) @ w2s[i % n].T

    def fp8(i: int) -> torch.Tensor:
        xq, sx = kernels.quantize_1x128(x)
        h = kernels.fp8_gemm(xq, sx, *gu[i % n])
        hq, sh = kernels.swiglu_quantize(h)
        return kernels.fp8_gemm(hq, sh, *dn[i % n])

    b = 1e6 * time_graph(graph_calls(bf16, reps))
    f = 1e6 * time_graph(graph_calls(fp8, reps))
    out = {"bf16_us": b, "fp8_us": f, "speedup_vs_bf16": b / f}
    for rw in rows:  # the GEMMs' tile height forced (read by fp8_gemm while the graph is captured)
        with env.override_kernel_switches(gemm_rows=rw):
            out[f"fp8_rows{rw}_us"] = 1e6 * time_graph(graph_calls(fp8, reps))
    return out


def bench_attention(B: int, L: int, n_kv: int = 8, G: int = 4, D: int = 128) -> dict[str, float]:
    dev = "cuda"
    kv_bytes = 2 * B * L * n_kv * D * 2
    n = min(copies_for(kv_bytes), 4)
    caches = [(torch.randn(B, L, n_kv, D, device=dev, dtype=torch.bfloat16),
               torch.randn(B, L, n_kv, D, device=dev, dtype=torch.bfloat16)) for _ in range(n)]
    q = torch.randn(B, n_kv * G, D, device=dev, dtype=torch.bfloat16)
    slots = torch.arange(B, device=dev)
    lens = torch.full((B,), L, device=dev, dtype=torch.int64)
    reps = copies_for(kv_bytes)
    def ours_call(i: int) -> torch.Tensor:
        k, v = caches[i % n]
        return kernels.decode_attention(q, k, v, slots, lens)

    # SDPA on K/V already laid out [B, H, L, D] (no gather counted against it).
    kt = [(k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()) for k, v in caches]
    q4 = q[:, :, None]

    def sdpa_call(i: int) -> torch.Tensor:
        k, v = kt[i % n]
        return torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=True)

    ours = 1e6 * time_graph(graph_calls(ours_call, reps))
    sdpa = 1e6 * time_graph(graph_calls(sdpa_call, reps))
    return {"ours_us": ours, "sdpa_us": sdpa, "ours_read_TBps": kv_bytes / (ours * 1e-6) / 1e12,
            "speedup_vs_sdpa": sdpa / ours}


def bench_layer_ops(B: int, dim: int = 2560, H: int = 32, KV: int = 8, D: int = 128, ctx: int = 2048,
                    n_main: int = 4097) -> dict[str, float]:
    """The decode step's small ops at batch B (S2-Pro slow shapes): kernel vs the torch ops they replace. Their
    bytes are tiny (L2-resident), so this is launch and latency, which is what they cost in a step."""
    from rtts.kernels import draw, norm_rope
    from rtts.kernels.rng import exponential_noise
    from rtts.model.rope import rope_table

    dev, bf = "cuda", torch.bfloat16
    x, r = torch.randn(B, 1, dim, device=dev, dtype=bf), torch.randn(B, 1, dim, device=dev, dtype=bf)
    w = torch.rand(dim, device=dev, dtype=bf) + 0.5
    qkv = torch.randn(B, 1, (H + 2 * KV) * D, device=dev, dtype=bf)
    kc, vc = (torch.zeros(B + 1, ctx, KV, D, device=dev, dtype=bf) for _ in range(2))
    rows, pos = torch.arange(B, device=dev), torch.full((B, 1), ctx // 2, device=dev)
    rope = rope_table(ctx, D, 1e6, dev)[pos]
    qn, kn = (torch.rand(D, device=dev, dtype=bf) + 0.5 for _ in range(2))
    logits = (torch.randn(B, n_main, device=dev) * 3).to(bf)
    probs = torch.softmax(logits.float(), -1).to(bf)
    temp, top_p = torch.full((B,), 0.8, device=dev, dtype=bf), torch.full((B,), 0.8, device=dev, dtype=bf)
    top_k = torch.full((B,), 30, device=dev)
    seeds, counters, ids = torch.arange(B, device=dev), torch.zeros(B, dtype=torch.int64, device=dev), \
        torch.arange(n_main, device=dev)
    # the repetition window as the engine keeps it: [slots, 10, 1] int32, one more slot than rows (the scratch slot)
    win, slots = torch.randint(0, n_main, (B + 1, 10, 1), device=dev, dtype=torch.int32), rows.clone()
    newest, active = torch.randint(0, n_main, (B, 1), device=dev, dtype=torch.int32), torch.ones(B, dtype=torch.bool,
                                                                                                  device=dev)
    ops: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
        "rmsnorm": (lambda: norm_rope.rmsnorm(x, w, 1e-6), lambda: ref.rmsnorm(x, w, 1e-6)),
        "add_rmsnorm": (lambda: norm_rope.add_rmsnorm(x, r, w, 1e-6), lambda: ref.add_rmsnorm(x, r, w, 1e-6)),
        "rmsnorm_quant": (lambda: norm_rope.rmsnorm_quant(x, w, 1e-6),
                          lambda: kernels.quantize_1x128(norm_rope.rmsnorm(x, w, 1e-6).view(B, dim))),
        "qkv_rope_store": (lambda: norm_rope.qkv_rope_store(qkv, qn, kn, 1e-6, rope, kc, vc, rows, pos, H),
                           lambda: ref.qkv_rope_store(qkv, qn, kn, 1e-6, rope, kc, vc, rows, pos, H)),
        "exponential_race": (lambda: draw.exponential_race(probs, seeds, counters, 2, ids),
                             lambda: torch.argmax(probs.float() / exponential_noise(seeds, counters, 2, ids), -1)),
        "sample": (lambda: draw.sample(logits, temp, top_p, top_k, seeds, counters, 2, ids),
                   lambda: ref.exponential_race(ref.filtered_probs(logits, temp, top_p, top_k), seeds, counters, 2,
                                                ids)),
        "token_window": (lambda: kernels.token_window_shift(win, slots, newest, active),
                         lambda: ref.token_window_shift(win, slots, newest, active)),
    }
    out: dict[str, float] = {}
    for name, (ours, torch_ops) in ops.items():
        out[f"{name}_us"] = 1e6 * time_graph([ours] * MIN_CALLS)
        out[f"{name}_torch_us"] = 1e6 * time_graph([torch_ops] * MIN_CALLS)
    return out


def bench_prefill_gemm(N: int, K: int, M: int) -> dict[str, float]:
    """An FP8 linear over M prefill rows (more than one decode GEMM launch takes): the dense path (dequantize the
    packed weight to bf16, one bf16 GEMM) against bf16 weights and against slicing the rows into launches of the
    decode GEMM (what FP8 prefill ran before the dense path). Also the dequantize kernel alone (1 byte read and 2
    written per weight) and the torch ops it replaces."""
    dev = "cuda"
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=dev) * 0.05
    wq, sw = ref.quantize_weight(w)
    wp = kernels.prepare_weight(wq)
    n = copies_for(N * K)
    wps, sws = [wp.clone() for _ in range(n)], [sw.clone() for _ in range(n)]
    wbs = [w.bfloat16() for _ in range(copies_for(2 * N * K))]
    lin = torch.nn.functional.linear

    def dequant(i: int) -> torch.Tensor:
        return kernels.dequantize_weight(wps[i % n], sws[i % n])

    def dense(i: int) -> torch.Tensor:
        return lin(x, dequant(i))

    def bf16(i: int) -> torch.Tensor:
        return lin(x, wbs[i % len(wbs)])

    def sliced(i: int) -> torch.Tensor:
        return kernels.fp8_linear(x, wps[i % n], sws[i % n])

    out = {k: 1e6 * time_graph(graph_calls(f, 2 * n)) for k, f in
           (("dequant_us", dequant), ("dense_us", dense), ("bf16_us", bf16), ("sliced_us", sliced))}
    ref.dequantize_bf16(wp, sw)  # the torch ops, timed eagerly (they are not all capturable)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(3):
        ref.dequantize_bf16(wp, sw)
    b.record()
    b.synchronize()
    out["dequant_torch_us"] = 1e3 * a.elapsed_time(b) / 3
    out["dequant_TBps"] = 3 * N * K / (out["dequant_us"] * 1e-6) / 1e12
    return out


# (channels, samples per frame) at the release codec decoder's Snake activations: 1536 channels at 4 steps per frame
# (after the 2 x 2 upsampler), then the blocks' 768 / 384 / 192 / 96 channels at 32 / 256 / 1024 / 2048.
CODEC_SNAKES = [(1536, 4), (768, 32), (384, 256), (192, 1024), (96, 2048)]


def bench_snake(B: int, C: int, L: int) -> dict[str, float]:
    """The codec's Snake activation over [B, C, L] float32 (cuda/snake.cu) against torch's five elementwise ops."""
    n = copies_for(4 * B * C * L)
    xs = [torch.randn(B, C, L, device="cuda") for _ in range(n)]
    alpha = torch.rand(C, device="cuda") + 0.1

    def ours(i: int) -> torch.Tensor:
        return kernels.snake(xs[i % n], alpha)

    def torch_ops(i: int) -> torch.Tensor:
        return ref.snake(xs[i % n], alpha)

    out = {k: 1e6 * time_graph(graph_calls(f, 2 * n)) for k, f in (("snake_us", ours), ("torch_us", torch_ops))}
    out["snake_TBps"] = 8 * B * C * L / (out["snake_us"] * 1e-6) / 1e12  # 4 bytes read + 4 written per element
    return out


def bench_bias_residual(B: int, C: int, L: int) -> dict[str, float]:
    """The end of the codec's residual unit, x + (conv + bias), over [B, C, L] float16 (the served codec precision;
    cuda/codec_residual.cu) against torch's two passes (the conv's broadcast bias add, then the residual add)."""
    n = copies_for(2 * 2 * B * C * L)
    xs = [torch.randn(B, C, L, device="cuda", dtype=torch.float16) for _ in range(n)]
    ys = [torch.randn(B, C, L, device="cuda", dtype=torch.float16) for _ in range(n)]
    bias = torch.randn(C, device="cuda")
    b16 = bias.half().view(1, C, 1)

    def ours(i: int) -> torch.Tensor:
        return kernels.bias_residual(xs[i % n], ys[i % n], bias)

    def torch_ops(i: int) -> torch.Tensor:
        return xs[i % n] + (ys[i % n] + b16)

    out = {k: 1e6 * time_graph(graph_calls(f, 2 * n)) for k, f in (("residual_us", ours), ("torch_us", torch_ops))}
    out["residual_TBps"] = 6 * B * C * L / (out["residual_us"] * 1e-6) / 1e12  # 2 x 2 bytes read + 2 written
    return out


def bench_phases(B: int, C: int, L: int, d: int = 9) -> dict[str, float]:
    """Snake into a dilated conv's phase layout (channels last) and out of it, float16 [B, C, L] (cuda/snake.cu
    snake_to_phases / snake_from_phases), against the torch passes they replace: Snake and a layout transpose."""
    n = copies_for(2 * B * C * L)
    xs = [torch.randn(B, C, L, device="cuda", dtype=torch.float16) for _ in range(n)]
    alpha, bias = torch.rand(C, device="cuda") + 0.1, torch.randn(C, device="cuda")
    J = -(-(L + 6 * d) // d)
    phases = [torch.zeros(B * d, J, C, device="cuda", dtype=torch.float16) for _ in range(n)]

    def into(i: int) -> torch.Tensor:
        kernels.snake_into_phases(xs[i % n], alpha, bias, phases[i % n], 6 * d)
        return phases[i % n]

    def out_of(i: int) -> torch.Tensor:
        return kernels.snake_from_phases(phases[i % n], alpha, bias, B, L)

    def torch_ops(i: int) -> torch.Tensor:
        return ref.snake(xs[i % n], alpha.half()).transpose(1, 2).contiguous()

    out = {"torch_us": 1e6 * time_graph(graph_calls(torch_ops, 2 * n))}
    for pairs in (False, True):  # one element per access, and two (RTTS_CODEC_TILE_PAIRS)
        with env.override_kernel_switches(codec_tile_pairs=pairs):
            for k, f in (("into", into), ("from", out_of)):
                key = f"{k}{'2' if pairs else ''}"
                out[f"{key}_us"] = 1e6 * time_graph(graph_calls(f, 2 * n))
                out[f"{key}_TBps"] = 4 * B * C * L / (out[f"{key}_us"] * 1e-6) / 1e12  # 2 bytes read + 2 written
    return out


@dataclass(frozen=True)
class CodecTable:
    """One table of the codec section: a kernel's bench over the release decoder's chunk shapes."""

    title: str
    header: str
    batches: tuple[int, ...]
    shapes: list[tuple[int, int]]  # (channels, samples per frame)
    bench: Callable[[int, int, int], dict[str, float]]
    cells: Callable[[dict[str, float]], str]  # a row's cells after streams and shape


def copy_bandwidth() -> dict[str, float]:
    """Bytes read + written per second by a 1 GiB device copy, two ways: the memcpy node (copy engines inside a graph)
    and an SM kernel (elementwise negate). The larger is the practical HBM ceiling the attention is held to."""
    a = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    nbytes = 2 * a.numel() * a.element_size()
    memcpy = nbytes / time_graph([lambda: b.copy_(a)], reps=10) / 1e12
    kernel = nbytes / time_graph([lambda: torch.neg(a, out=b)], reps=10) / 1e12
    return {"memcpy_TBps": memcpy, "kernel_TBps": kernel, "copy_TBps": max(memcpy, kernel)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m rtts.bench kernels")
    p.add_argument("--m", default="1,16,64,128")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--stages", default="", help="also time the wgmma GEMM with at most these weight stages (e.g. 2,4)")
    p.add_argument("--clusters", default="", help="also time the wgmma GEMM with these splits forced (1 = global "
                   "stream-K, 2-8 = clusters of that many CTAs)")
    p.add_argument("--rows", default="", help="also time the wgmma GEMM (and the MLP block) with these tile heights "
                   "forced (64 = fp8_gemm_wgmma64, 128 = fp8_gemm_wgmma)")
    p.add_argument("--sections", default="gemm,mlp,attention,layer,prefill,codec",
                   help="which tables to time; a subset writes kernels-<sections>-<gpu>-<date> instead")
    args = p.parse_args(argv)
    sections = args.sections.split(",")
    kernels.warmup(torch.device("cuda"))
    ms = [int(x) for x in args.m.split(",")]
    stages = tuple(int(x) for x in args.stages.split(",") if x)
    clusters = tuple(int(x) for x in args.clusters.split(",") if x)
    tile_rows = tuple(int(x) for x in args.rows.split(",") if x)
    bw = copy_bandwidth()
    copy_tbps = bw["copy_TBps"]
    print(f"copy bandwidth: memcpy {bw['memcpy_TBps']:.2f} TB/s, kernel {bw['kernel_TBps']:.2f} TB/s", flush=True)
    rows = ["## FP8 GEMM (slow and fast transformer linears; N x K)", "",
            "rtts fp8 GEMM = the kernel fp8_gemm dispatches to (wgmma on sm_90a; plan: weight rows per tile (128: "
            "fp8_gemm_wgmma, 64: fp8_gemm_wgmma64), global stream-K or clusters of N CTAs settled in distributed "
            "shared memory, ring stages, CTAs; token-major N cols, K/S: fp8_gemm_wgmma_tm, tiles of N weight rows "
            "over all of K (S = 1) or half of it in cluster pairs (S = 2), one per SM); mma.sync = the portable "
            "kernel, for comparison.", "",
            "| layer | N x K | M | torch bf16 us | torch _scaled_mm us | rtts fp8 GEMM us | plan | mma.sync us "
            "| + act quant us | TB/s (rtts) | TB/s (bf16) | speedup vs bf16 |", "|---" * 12 + "|"]
    gemms: list[dict[str, Any]] = []
    for name, N, K in S2_GEMMS if "gemm" in sections else ():
        for M in ms:
            r = bench_gemm(N, K, M, stages, clusters, tile_rows)
            gemms.append({"layer": name, "N": N, "K": K, "M": M, **r})
            rows.append(f"| {name} | {N}x{K} | {M} | {r['bf16_us']:.1f} | {r.get('scaled_mm_us', float('nan')):.1f} "
                        f"| {r['fp8_gemm_us']:.1f} | {r.get('plan', '-')} | {r['mma_sync_us']:.1f} "
                        f"| {r['fp8_linear_us']:.1f} "
                        f"| {r['fp8_gemm_TBps']:.2f} | {r['bf16_TBps']:.2f} | {r['speedup_vs_bf16']:.2f}x |")
            extra = " ".join(f"{k}={v:.1f}" for k, v in r.items()
                             if k.startswith(("wgmma_stages", "wgmma_cluster", "wgmma_rows")))
            print(rows[-1], extra, flush=True)
    rows += ["", "## MLP block (gate|up GEMM -> SwiGLU + quantize -> down), 2560 -> 9728 -> 2560", "",
             "| M | bf16 us | fp8 us | speedup |", "|---|---|---|---|"]
    mlp = []
    for M in ms if "mlp" in sections else ():
        r = bench_mlp(M, rows=tile_rows)
        mlp.append({"M": M, **r})
        rows.append(f"| {M} | {r['bf16_us']:.1f} | {r['fp8_us']:.1f} | {r['speedup_vs_bf16']:.2f}x |")
        print(rows[-1], " ".join(f"{k}={v:.1f}" for k, v in r.items() if k.startswith("fp8_rows")), flush=True)
    rows += ["", f"## Decode attention (8 KV heads x 4 query heads x 128; copy bandwidth {copy_tbps:.2f} TB/s "
             f"read+write: SM copy kernel {bw['kernel_TBps']:.2f}, graph memcpy {bw['memcpy_TBps']:.2f})", "",
             "| batch | context | rtts us | SDPA us | rtts read TB/s | % of copy BW | speedup |",
             "|---|---|---|---|---|---|---|"]
    attn = []
    for B in (1, 16, 64) if "attention" in sections else ():
        for L in (512, 2048):
            r = bench_attention(B, L)
            r["pct_of_copy"] = 100 * r["ours_read_TBps"] / copy_tbps
            attn.append({"B": B, "L": L, **r})
            rows.append(f"| {B} | {L} | {r['ours_us']:.1f} | {r['sdpa_us']:.1f} | {r['ours_read_TBps']:.2f} "
                        f"| {r['pct_of_copy']:.0f}% | {r['speedup_vs_sdpa']:.2f}x |")
            print(rows[-1], flush=True)
    rows += ["", "## Decode-step layer ops (S2-Pro slow shapes, one token per stream; kernel vs the torch ops it "
             "replaces, us per call)", "",
             "| batch | rmsnorm | torch | add+rmsnorm | torch | rmsnorm+quantize | rmsnorm kernel, then quantize "
             "| qk-norm+rope+kv store | torch | race (4097 ids) | torch | top-p/top-k + race (4097) | torch "
             "| token window shift (10 x 1) | torch |",
             "|---" * 15 + "|"]
    layer = []
    for B in (1, 16, 64) if "layer" in sections else ():
        r = bench_layer_ops(B)
        layer.append({"B": B, **r})
        rows.append(f"| {B} | " + " | ".join(f"{r[f'{n}_us']:.1f} | {r[f'{n}_torch_us']:.1f}" for n in
                                             ("rmsnorm", "add_rmsnorm", "rmsnorm_quant", "qkv_rope_store",
                                              "exponential_race", "sample", "token_window")) + " |")
        print(rows[-1], flush=True)
    rows += ["", "## FP8 prefill linears (M rows over one decode GEMM launch: the weight dequantized to bf16, one "
             "dense GEMM; vs bf16 weights and vs 128-token slices of the decode GEMM)", "",
             "| layer | N x K | M | dequant us | dequant TB/s | torch ops us | dequant + bf16 GEMM us | bf16 GEMM us "
             "| sliced FP8 GEMM us |", "|---" * 9 + "|"]
    prefill = []
    for name, N, K in S2_GEMMS if "prefill" in sections else ():
        for M in (320, 512):
            r = bench_prefill_gemm(N, K, M)
            prefill.append({"layer": name, "N": N, "K": K, "M": M, **r})
            rows.append(f"| {name} | {N}x{K} | {M} | {r['dequant_us']:.1f} | {r['dequant_TBps']:.2f} "
                        f"| {r['dequant_torch_us']:.0f} | {r['dense_us']:.1f} | {r['bf16_us']:.1f} "
                        f"| {r['sliced_us']:.1f} |")
            print(rows[-1], flush=True)
    codec: list[dict[str, Any]] = []
    codec_tables = [
        CodecTable("Codec Snake activation (float32 [streams, channels, 8 frames x samples per frame]: the release "
                   "decoder's shapes for one 8-frame chunk; kernel vs torch's expression)",
                   "| streams | channels x length | rtts us | TB/s | torch us | speedup |", (1, 16, 64), CODEC_SNAKES,
                   bench_snake,
                   lambda r: f"{r['snake_us']:.1f} | {r['snake_TBps']:.2f} | {r['torch_us']:.1f} | "
                             f"{r['torch_us'] / r['snake_us']:.1f}x"),
        CodecTable("Codec residual add (float16 [streams, channels, 8 frames x samples per frame], x + (conv + bias): "
                   "kernel vs torch's bias add and residual add)",
                   "| streams | channels x length | rtts us | TB/s | torch us | speedup |", (16, 64), CODEC_SNAKES[1:],
                   bench_bias_residual,
                   lambda r: f"{r['residual_us']:.1f} | {r['residual_TBps']:.2f} | {r['torch_us']:.1f} | "
                             f"{r['torch_us'] / r['residual_us']:.1f}x"),
        CodecTable("Codec phase layout (float16 [streams, channels, 8 frames x samples per frame] into / out of a "
                   "dilation-9 conv's phases, channels last, with Snake: kernels vs torch's Snake + a transpose)",
                   "| streams | channels x length | into us | TB/s | out of us | TB/s | pairs: into us | TB/s | "
                   "out of us | TB/s | torch us |", (16, 64),
                   CODEC_SNAKES[1:], bench_phases,
                   lambda r: f"{r['into_us']:.1f} | {r['into_TBps']:.2f} | {r['from_us']:.1f} | "
                             f"{r['from_TBps']:.2f} | {r['into2_us']:.1f} | {r['into2_TBps']:.2f} | "
                             f"{r['from2_us']:.1f} | {r['from2_TBps']:.2f} | {r['torch_us']:.1f}"),
    ]
    for t in codec_tables:
        rows += ["", f"## {t.title}", "", t.header, "|" + "---|" * (t.header.count(" | ") + 1)]
        for B in t.batches if "codec" in sections else ():
            for C, per_frame in t.shapes:
                L = 8 * per_frame
                r = t.bench(B, C, L)
                codec.append({"B": B, "C": C, "L": L, **r})  # each table's keys tell its rows apart
                rows.append(f"| {B} | {C}x{L} | {t.cells(r)} |")
                print(rows[-1], flush=True)
    machine = environment()
    machine["nvrtc"] = _jit.nvrtc_version()
    data = {"env": machine, **bw, "gemm": gemms, "mlp": mlp, "attention": attn, "layer_ops": layer,
            "prefill": prefill, "codec": codec}
    tables = "\n".join(rows).split("\n## ")  # keep the tables of the sections timed
    keep = {"gemm": "FP8 GEMM", "mlp": "MLP block", "attention": "Decode attention", "layer": "Decode-step layer ops",
            "prefill": "FP8 prefill linears", "codec": "Codec "}
    kept = [t.lstrip("# ") for t in tables if any(t.lstrip("# ").startswith(keep[s]) for s in sections)]
    rows = ["\n".join("## " + t for t in kept)]
    every = {"gemm", "mlp", "attention", "layer", "prefill", "codec"}
    name = "kernels" if every <= set(sections) else "kernels-" + "-".join(sections)
    jp, mp = write_results(args.out, name, data, "\n".join(rows))
    print(f"wrote {jp} and {mp}")
