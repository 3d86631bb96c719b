"""Where does a GEMM in a chain spend its time? Per-CTA stamps of consecutive wgmma GEMMs inside one CUDA graph.

The decode step is a chain of kernels; with programmatic dependent launch (PDL) a GEMM's CTAs may start, and stream
their (constant) weights, while the previous kernel finishes, if an SM has room for both. This probe compiles
instrumented copies of `cuda/fp8_gemm_wgmma.cu` and `cuda/fp8_gemm_wgmma64.cu` (what 17-128 tokens run; patched in
memory, the repository files are untouched; an anchor that no longer matches fails loudly) in which every CTA takes
a ticket at entry (tickets are handed out launch by launch) and records `%globaltimer` at entry, when
griddepcontrol.wait returned, at its first weight block, when its last block landed, when a summing CTA's spin
ended, and at exit. It replays a graph of CHAIN launches (weights rotated past the L2) and prints, per later launch
and relative to the previous launch's last CTA exit, the medians over CTAs of: wait returned, first block used, last
block landed, exit; then the last exit; and the six slowest CTAs of launch 3. Variants: the planner's split, at 1
token also forced global stream-K ("1") and clusters of 8 ("8") with PDL, and the planner's split without PDL; each
with the plan, its occupancy (CTAs per SM) and in-graph us per GEMM. Session 4 used it to find the settlement tail
(bench/results/traces/README.md).

    python bench/probes/gemm_chain.py [wqkv wo gate_up w2]    # on the GPU machine, from the repository root
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys

import torch
from kernel_patch import gemm_source

from rtts import env, kernels
from rtts.bench.kernels import copies_for, time_graph
from rtts.kernels import _jit, gemm
from rtts.kernels import reference as ref
from rtts.kernels.gemm_plan import H_INSTANCES, H_THREADS, WGMMA_INSTANCES, WGMMA_THREADS, wgmma_instance

SLOTS = 8
CHAIN = 6
PROBE = (
    f"__device__ unsigned long long g_trace[65536 * {SLOTS}];\n"
    "__device__ unsigned int g_ticket;\n"
    "__device__ __forceinline__ unsigned long long gtime() {\n"
    "    unsigned long long t;\n"
    '    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));\n'
    "    return t;\n"
    "}\n"
    f"#define TRS(k, v) do {{ if (s_ticket < 65536u) g_trace[s_ticket * {SLOTS} + (k)] = (v); }} while (0)\n"
)
ANCHORS = [
    ("#define TILE_ROWS 128", PROBE + "#define TILE_ROWS 128"),
    ("const int tid = threadIdx.x, lane = tid & 31;",
     "const int tid = threadIdx.x, lane = tid & 31; __shared__ unsigned s_ticket;"
     " if (tid == 0) { unsigned long long t0 = gtime(); s_ticket = atomicAdd(&g_ticket, 1u);"
     " TRS(0, t0); } __syncthreads();"),
    ("    pdl_wait();\n    if constexpr (TMA) {",
     "    pdl_wait(); if (tid == 0) TRS(3, gtime());\n    if constexpr (TMA) {"),
    ("        if (kb == KB - 1 || j == iters - 1) {  // end of this CTA's segment of `tile`",
     "        if (tid == 0 && j == iters - 1) TRS(4, gtime());\n"
     "        if (kb == KB - 1 || j == iters - 1) {  // end of this CTA's segment of `tile`"),
    ("        named_barrier(BAR_CONSUMERS, CONSUMERS);  // the acquire above orders",
     "        if (tid == 0) TRS(5, gtime());\n"
     "        named_barrier(BAR_CONSUMERS, CONSUMERS);  // the acquire above orders"),
    ("    pdl_launch_dependents();\n", "    pdl_launch_dependents();\n    if (tid == 0) TRS(6, blockIdx.x + 1);\n"),
    ("        mbar_wait(full0 + 8 * s, phase);",
     "        mbar_wait(full0 + 8 * s, phase); if (tid == 0 && j == 0) TRS(1, gtime());"),
]
# The same stamps in the 64-row kernel (fp8_gemm_wgmma64.cu, what 17-128 tokens run): its consumers' wait.
ANCHORS64 = [
    ("#define H_ROWS 64", PROBE + "#define H_ROWS 64"),
    ANCHORS[1],
    ("    pdl_wait();  // every global write below", "    pdl_wait(); if (tid == 0) TRS(3, gtime());  //"),
    ANCHORS[3],
    # (the 64-row kernel copies each share as its flag comes up: "spin done" is when the first batch has landed)
    ("            mbar_wait(settle_bar, ph);",
     "            mbar_wait(settle_bar, ph); if (tid == 0 && b0 == 0) TRS(5, gtime());"),
    ANCHORS[5],
    ("        mbar_wait(full_w + 8 * s, phase);",
     "        mbar_wait(full_w + 8 * s, phase); if (tid == 0 && j == 0) TRS(1, gtime());"),
]
SHAPES = [("wqkv", 6144, 2560), ("wo", 2560, 4096), ("gate_up", 19456, 2560), ("w2", 2560, 9728)]
EXIT = "    if (tid == 0) TRS(2, gtime());\n"

instrumented_source = gemm_source(ANCHORS64, "gemm_chain.py", EXIT, kernel="fp8_gemm_wgmma64.cu",
                                  original=gemm_source(ANCHORS, "gemm_chain.py", EXIT))


def main() -> None:
    import cupy as cp

    instrument = "--plain" not in sys.argv
    sys.argv = [a for a in sys.argv if a != "--plain"]
    if instrument:
        _jit.source = instrumented_source  # type: ignore[assignment]
    kernels.warmup(torch.device("cuda"))
    modules = {128: _jit.module("fp8_gemm_wgmma.cu", WGMMA_INSTANCES),
               64: _jit.module("fp8_gemm_wgmma64.cu", H_INSTANCES)}
    out: dict[str, object] = {}
    base = env.kernel_switches()
    shapes = [sh for sh in SHAPES if not sys.argv[1:] or sh[0] in sys.argv[1:]]
    for name, N, K in shapes:
        for M in (1, 64):
            R = min(copies_for(N * K), 8)
            qs = [ref.quantize_weight(torch.randn(N, K, device="cuda").bfloat16() * 0.05) for _ in range(R)]
            packed = [(kernels.pack_weight(q), s) for q, s in qs]
            xq, sx = kernels.quantize_1x128(torch.randn(M, K, device="cuda").bfloat16())
            for pdl in (True, False):
                for forced in ("", "1", "8") if pdl and M <= 16 else ("",):
                    env.set_kernel_switches(dataclasses.replace(base, no_pdl=not pdl,
                                                                gemm_cluster=int(forced) if forced else None))
                    plan = gemm.plan_gemm(M, N, K, 0)
                    grid, mod = plan.grid, modules[plan.rows]
                    if plan.rows == 64:
                        fn = _jit.function("fp8_gemm_wgmma64.cu", f"fp8_gemm_wgmma64<{plan.nt}>", H_INSTANCES)
                        threads = H_THREADS
                    else:
                        fn = _jit.function("fp8_gemm_wgmma.cu", wgmma_instance(plan.nt, plan.cluster > 1),
                                           WGMMA_INSTANCES)
                        threads = WGMMA_THREADS
                    try:
                        occ = cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.kernel.ptr, threads,
                                                                                       plan.smem)
                    except Exception as e:  # noqa: BLE001
                        occ = f"? {e}"
                    key = f"{name} M={M} pdl={int(pdl)} {plan} occupancy={occ}"
                    calls = [lambda i=i: kernels.fp8_gemm(xq, sx, *packed[i % R]) for i in range(max(32, R))]
                    us = time_graph(calls) * 1e6
                    row: dict[str, object] = {"us": round(us, 2)}
                    if instrument:
                        g = mod.get_global("g_trace")
                        t = mod.get_global("g_ticket")
                        chain = [lambda i=i: kernels.fp8_gemm(xq, sx, *packed[i % R]) for i in range(CHAIN)]
                        s = torch.cuda.Stream()
                        with torch.cuda.stream(s):
                            chain[0]()
                            graph = torch.cuda.CUDAGraph()
                            with torch.cuda.graph(graph, stream=s):
                                for f in chain:
                                    f()
                        torch.cuda.synchronize()
                        for _ in range(3):
                            cp.cuda.runtime.memset(g.ptr, 0, 65536 * SLOTS * 8)
                            cp.cuda.runtime.memset(t.ptr, 0, 4)
                            graph.replay()
                            torch.cuda.synchronize()
                        tr = cp.ndarray((65536 * SLOTS,), dtype=cp.uint64, memptr=g).get().reshape(65536, SLOTS)
                        tr = tr[: CHAIN * grid].astype("int64").reshape(CHAIN, grid, SLOTS)
                        t0 = int(tr[0, :, 0].min())
                        us = (tr - t0) / 1e3
                        launches = [[round(float(us[k, :, 0].min()), 2), round(float(us[k, :, 2].max()), 2)]
                                    for k in range(CHAIN)]
                        # Per launch after the first, us after the previous launch's last CTA exit (medians over
                        # CTAs): griddepcontrol.wait returned, first weight block used, last block landed, exit;
                        # then the last exit.
                        steps = []
                        for k in range(1, CHAIN):
                            prev = us[k - 1, :, 2].max()
                            steps.append([round(float(statistics.median(us[k, :, c] - prev)), 2) for c in (3, 1, 4, 2)]
                                         + [round(float(us[k, :, 2].max() - prev), 2)])
                        row.update(launches=launches, after_prev_exit=steps)
                        # The slowest CTAs of launch 3: block, then us after launch 2's last exit: entry, wait
                        # returned, first block, last block, spin done (a CTA summing a shared tile; -1 otherwise),
                        # exit.
                        prev = us[2, :, 2].max()
                        slow = []
                        for i in sorted(range(grid), key=lambda i: -us[3, i, 2])[:6]:
                            spin = round(float(us[3, i, 5] - prev), 2) if tr[3, i, 5] > 0 else -1
                            at = [round(float(us[3, i, c] - prev), 2) for c in (0, 3, 1, 4)]
                            slow.append([int(tr[3, i, 6]) - 1, *at, spin, round(float(us[3, i, 2] - prev), 2)])
                        spins = [float(us[3, i, 5] - prev) for i in range(grid) if tr[3, i, 5] > 0]
                        entry = sorted(float(us[3, i, 0] - prev) for i in range(grid))
                        row.update(entry_quartiles=[round(entry[int(q * (grid - 1))], 2) for q in (0, .25, .5, .75, 1)])
                        row.update(slowest=slow, settlers=len(spins),
                                   spin_done_median=round(statistics.median(spins), 2) if spins else None)
                        # every CTA of launch 3 in block order: entry, wait returned, last block landed, spin done
                        # (-1: not settling), exit (us after launch 2's last exit)
                        order = sorted(range(grid), key=lambda i: int(tr[3, i, 6]))
                        row.update(per_cta=[[round(float(us[3, i, c] - prev), 2) if c != 5 or tr[3, i, 5] > 0
                                             else -1 for c in (0, 3, 4, 5, 2)] for i in order])
                    out[key] = row
                    print(f"  {key}: {row}", flush=True)
    env.set_kernel_switches(base)
    dst = os.environ.get("OUT", ".")
    with open(os.path.join(dst, "gemm-chain.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
