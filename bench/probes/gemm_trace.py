"""Per-CTA timeline of the wgmma FP8 GEMM on the GPU: where a launch spends its time.

Compiles an instrumented copy of `cuda/fp8_gemm_wgmma.cu` (the source text is patched in memory at the anchors below;
the repository file is untouched) that records `%globaltimer` at a few points per CTA, runs one cold launch per shape
(the L2 swept by a read-only pass first), and prints min / median / max microseconds after the first CTA started:

    enter        CTA start (consumer thread 0)
    ready        the producer warp has initialized the stage barriers
    first_full   the first weight block landed (consumer thread 0)
    last_iter    the last iteration's weights landed
    settle       (a CTA summing a shared tile) every other share of it was counted in
    exit         CTA end

plus the four slowest CTAs in full. When an anchor no longer matches the
kernel, this fails loudly: move the anchor, not the kernel. Used in session 3 to find that stream-K settlement (not
the weight stream) cost 4-6 us per GEMM (bench/results/kernels-h200-2026-11-30.md, "Reading").

    python bench/probes/gemm_trace.py            # on the GPU machine, from the repository root
"""

from __future__ import annotations

import statistics

import torch
from kernel_patch import gemm_source

from rtts import kernels
from rtts.kernels import _jit, gemm
from rtts.kernels import reference as ref
from rtts.kernels.common import sm_count
from rtts.kernels.gemm_plan import WGMMA_INSTANCES, wgmma_plan

SLOTS = 8
PROBE = (
    f"__device__ unsigned long long g_trace[4096 * {SLOTS}];\n"
    "__device__ __forceinline__ void TR(int k) {\n"
    "    unsigned long long t;\n"
    '    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));\n'
    f"    g_trace[blockIdx.x * {SLOTS} + k] = t;\n"
    "}\n"
)
ANCHORS = [  # (text in the kernel, replacement)
    ("#define TILE_ROWS 128", PROBE + "#define TILE_ROWS 128"),
    ("const int tid = threadIdx.x, lane = tid & 31;",
     "const int tid = threadIdx.x, lane = tid & 31; if (tid == 0) TR(0);"),
    ("        named_barrier_arrive(BAR_READY, CONSUMERS + 32);",
     "        if (tid == CONSUMERS) TR(1);\n        named_barrier_arrive(BAR_READY, CONSUMERS + 32);"),
    ("        mbar_wait(full0 + 8 * s, phase);",
     "        mbar_wait(full0 + 8 * s, phase); if (tid == 0 && j == 0) TR(2);"),
    ("        if (kb == KB - 1 || j == iters - 1) {  // end of this CTA's segment of `tile`",
     "        if (tid == 0 && j == iters - 1) TR(3);\n"
     "        if (kb == KB - 1 || j == iters - 1) {  // end of this CTA's segment of `tile`"),
    ("        named_barrier(BAR_CONSUMERS, CONSUMERS);  // the acquire above orders",
     "        if (tid == 0) TR(4);\n"
     "        named_barrier(BAR_CONSUMERS, CONSUMERS);  // the acquire above orders"),
]
LABELS = [(0, "enter"), (1, "ready"), (2, "first_full"), (3, "last_iter"), (4, "settle"), (5, "exit")]
SHAPES = [("wqkv", 6144, 2560), ("wo", 2560, 4096), ("gate_up", 19456, 2560), ("w2", 2560, 9728)]


instrumented_source = gemm_source(ANCHORS, "gemm_trace.py", "    if (tid == 0) TR(5);\n")


def main() -> None:
    import cupy as cp

    _jit.source = instrumented_source  # type: ignore[assignment]
    kernels.warmup(torch.device("cuda"))
    g = _jit.module("fp8_gemm_wgmma.cu", WGMMA_INSTANCES).get_global("g_trace")
    sweep = torch.ones(256 << 20, dtype=torch.uint8, device="cuda")
    sms = sm_count(0)
    for name, N, K in SHAPES:
        for M in (1, 64):
            wq, sw = ref.quantize_weight(torch.randn(N, K, device="cuda").bfloat16() * 0.05)
            wp = kernels.pack_weight(wq)
            xq, sx = kernels.quantize_1x128(torch.randn(M, K, device="cuda").bfloat16())
            nt, stages, grid, smem = wgmma_plan(M, N, K, sms, cluster=1)[:4]
            cp.cuda.runtime.memset(g.ptr, 0, 4096 * SLOTS * 8)
            for _ in range(3):  # the last launch is the one recorded
                sweep.max()  # read-only: evicts the weights without leaving dirty lines to write back
                torch.cuda.synchronize()
                gemm.fp8_gemm_wgmma(xq, sx, wp, sw, cluster=1)
                torch.cuda.synchronize()
            tr = cp.ndarray((4096 * SLOTS,), dtype=cp.uint64, memptr=g).get().reshape(4096, SLOTS)[:grid]
            tr = tr.astype("int64")
            t0 = int(tr[:, 0].min())
            cols = []
            for k, label in LABELS:
                v = [(int(x) - t0) / 1e3 for x in tr[:, k] if x > 0]
                if v:
                    cols.append(f"{label}={min(v):.2f}/{statistics.median(v):.2f}/{max(v):.2f}")
            print(f"{name} M={M} grid={grid} stages={stages} smem={smem}: " + "  ".join(cols), flush=True)
            for i in sorted(range(grid), key=lambda i: -int(tr[i, 5]))[:4]:
                print(f"    slow CTA {i}: " + " ".join(
                    f"{label}={(int(tr[i, k]) - t0) / 1e3:.2f}" for k, label in LABELS if tr[i, k] > 0), flush=True)


if __name__ == "__main__":
    main()
