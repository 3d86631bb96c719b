"""What bounds the 64-row GEMM's loop (cuda/fp8_gemm_wgmma64.cu)? Variants of the kernel, patched in memory (the
repository file is untouched; an anchor that no longer matches fails loudly), timed like the kernel bench (a CUDA
graph of calls, weights rotated past the L2) on the S2-Pro linears:

- "pipe": the kernel as built (two accumulator sets: a K block's MMAs run while the block before is promoted);
- "serial": one accumulator set, the K block's MMAs waited for before promotion (the kernel before the two sets),
  with its accumulator split (4 / 2 / 1 per K block at 8-32 / 64 / 128 tokens);
- "serial_acc": one set, with the pipelined kernel's accumulator split;
- ablations of "pipe", wrong outputs, timing only: "w_once" (weights only prefilled: later stages are marked full
  without a copy), "t_once" (the same for tokens), "no_mma" (no tensor-core work).

Then, for "pipe", ring depths the planner does not make (weight stages x token stages, beyond half an SM's shared
memory too) and the 64-row kernel at 1 and 16 tokens (which fp8_gemm runs on the 128-row kernel).

    python bench/probes/gemm64_pipe.py OUT_DIR [layer names]    # on the GPU machine, from the repository root
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch
from kernel_patch import gemm_source

from rtts import kernels
from rtts.bench.kernels import S2_GEMMS, _calls, copies_for, time_graph
from rtts.kernels import _jit
from rtts.kernels import reference as ref

KERNEL = "fp8_gemm_wgmma64.cu"
ONE_SET = ("    constexpr int SETS = NT <= 64 ? 2 : 1;\n", "    constexpr int SETS = 1;\n")
OLD_ACCS = ("    constexpr int ACCS = NT <= 16 ? 4 : (NT == 32 ? 2 : 1);\n",
            "    constexpr int ACCS = NT <= 32 ? 4 : (NT == 64 ? 2 : 1);\n")
VARIANTS: dict[str, list[tuple[str, str]]] = {
    "pipe": [],
    "serial": [ONE_SET, OLD_ACCS],
    "serial_acc": [ONE_SET],
    "w_once": [("                    load_weights(wsg);\n", "                    mbar_arrive(full_w + 8 * wsg);\n")],
    "t_once": [("                    load_tokens(ts);\n", "                    mbar_arrive(full_t + 8 * ts);\n")],
    "no_mma": [("        mma_issue<NT, ACCS>(a, wring + ws_ * H_BYTES, tring + ts_ * B_BYTES);\n", "")],
}
ORIGINAL = _jit.source


def use(edits: list[tuple[str, str]], instances: tuple[str, ...]) -> None:
    _jit.source = gemm_source(edits, "gemm64_pipe.py", original=ORIGINAL, kernel=KERNEL)  # type: ignore[assignment]
    kernels._H_INSTANCES = instances  # type: ignore[attr-defined]  # compile only what is timed
    _jit._module.cache_clear()
    _jit.function.cache_clear()
    _jit._SMEM_SET.clear()


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    dev = torch.device("cuda")
    kernels.warmup(dev)
    sms = kernels._sm_count(0)
    layers = [g for g in S2_GEMMS if g[0] in sys.argv[2:]] or S2_GEMMS
    cases = []
    for name, N, K in layers:
        R = copies_for(N * K)
        ws = [ref.quantize_weight(torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.05) for _ in range(min(R, 8))]
        packed = [(kernels.pack_weight(q), s) for q, s in ws]
        xs = {M: kernels.quantize_1x128(torch.randn(M, K, device=dev, dtype=torch.bfloat16)) for M in (1, 16, 32, 64)}
        cases.append((name, N, K, R, packed, xs))
    res: dict[str, float] = {}

    def time(key: str, plan: kernels.WgmmaPlan, R: int, packed: list, x: tuple) -> None:
        xq, sx = x

        def call(i: int) -> torch.Tensor:
            wp, sw = packed[i % len(packed)]
            return kernels.launch_wgmma(plan, xq, sx, wp, sw)

        us = 1e6 * time_graph(_calls(call, R))
        res[key] = us
        print(f"{key}: {us:.2f} us  {plan}", flush=True)

    for variant, edits in VARIANTS.items():
        ablation = variant in ("w_once", "t_once", "no_mma")
        ms = (64,) if ablation else (32, 64)
        use(edits, tuple(f"fp8_gemm_wgmma64<{n}>" for n in ((64,) if ablation else (32, 64))))
        for name, N, K, R, packed, xs in cases:
            for M in ms:
                time(f"{variant} {name} M={M}", kernels.wgmma64_plan(M, N, K, sms), R, packed, xs[M])
    use([], tuple(f"fp8_gemm_wgmma64<{n}>" for n in (8, 16, 64)))
    for name, N, K, R, packed, xs in cases:
        for M in (1, 16):
            time(f"pipe {name} M={M} (64 rows)", kernels.wgmma64_plan(M, N, K, sms), R, packed, xs[M])
        base = kernels.wgmma64_plan(64, N, K, sms)
        for grid in sorted({base.grid, sms, 2 * sms}):
            for st, ts in ((2, 2), (4, 2), (2, 4), (4, 6), (4, 8), (6, 6), (8, 8), (12, 8)):
                p = kernels.wgmma64_plan(64, N, K, sms, grid=grid)
                smem = kernels.wgmma64_smem_bytes(p.nt, st, ts, p.iters, p.slots)
                if smem > kernels._SMEM_LIMIT:
                    continue
                plan = dataclasses.replace(p, stages=st, tstages=ts, smem=smem)
                time(f"pipe {name} M=64 grid={grid} stages={st} tstages={ts}", plan, R, packed, xs[64])
    (out / "gemm64-pipe.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
