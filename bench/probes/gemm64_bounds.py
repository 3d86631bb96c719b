"""What bounds the 64-row GEMM's loop (cuda/fp8_gemm_wgmma64.cu)? Variants of the kernel, patched in memory (the
repository file is untouched; an anchor that no longer matches fails loudly), timed like the kernel bench (a CUDA
graph of calls, weights rotated past the L2) on the S2-Pro linears at 32 and 64 tokens:

- "base": the kernel as built; "acc_old" / "acc1": other accumulator splits per K block (4 / 2 / 1 at 32 / 64 /
  128 tokens as before session 6; one everywhere);
- ablations at 64 tokens, wrong outputs, timing only: "wt_once" (both rings only prefilled: later stages are marked
  full without a copy), "no_mma" (no tensor-core work), both, and "no_settle" (split tiles never summed).

Then ring depths the planner does not make (weight stages x token stages, beyond half an SM's shared memory too)
at 64 tokens and grids of 1, 1.5 (the planner's, where it is) and 2 CTAs per SM (`--sweep`); `--grids`: the
non-ablation variants at 64 tokens on grids of 1-2 CTAs per SM in steps of a quarter (`--grids=G1,G2,...`: those).

    # on the GPU machine, from the repository root:
    python bench/probes/gemm64_bounds.py OUT_DIR [layer names] [variant names] [--sweep] [--grids]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from kernel_patch import gemm_source

from rtts import kernels
from rtts.bench.kernels import S2_GEMMS, PackedCopies, packed_weights, time_plan
from rtts.kernels import _jit, gemm
from rtts.kernels.common import sm_count
from rtts.kernels.gemm_plan import SMEM_LIMIT, WgmmaPlan, wgmma64_plan, wgmma64_smem_bytes

KERNEL = "fp8_gemm_wgmma64.cu"
ACCS = "    constexpr int ACCS = NT <= 16 ? 4 : (NT <= 64 ? 2 : 1);\n"
W_ONCE = ("                    load_weights(wsg);\n", "                    mbar_arrive(full_w + 8 * wsg);\n")
T_ONCE = ("                    load_tokens(ts);\n", "                    mbar_arrive(full_t + 8 * ts);\n")
NO_MMA = ("        mma_block<NT, ACCS>(acc, wring + s * H_BYTES, tring + t * B_BYTES);\n", "")
VARIANTS: dict[str, list[tuple[str, str]]] = {
    "base": [],
    "acc_old": [(ACCS, "    constexpr int ACCS = NT <= 32 ? 4 : (NT == 64 ? 2 : 1);\n")],
    "acc1": [(ACCS, "    constexpr int ACCS = 1;\n")],
    "wt_once": [W_ONCE, T_ONCE],
    "no_mma": [NO_MMA],
    "wt_once_no_mma": [W_ONCE, T_ONCE, NO_MMA],
    "no_settle": [("    if (settle >= 0) {", "    if (settle >= 0 && M < 0) {")],
    # a settled tile written straight from registers in 2-byte pieces (before session 15) instead of staged
    "direct_store": [("        store_tile_staged<NT>(total, smem, y, settle * H_ROWS, M, N);",
                      "        store_tile<NT>(total, y, settle * H_ROWS, M, N);")],
}
ORIGINAL = _jit.source


def use(edits: list[tuple[str, str]], instances: tuple[str, ...]) -> None:
    _jit.source = gemm_source(edits, "gemm64_bounds.py", original=ORIGINAL, kernel=KERNEL)  # type: ignore[assignment]
    gemm.H_INSTANCES = instances  # compile only what is timed (launch_wgmma names these)
    _jit.forget_compiled()


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    dev = torch.device("cuda")
    kernels.warmup(dev)
    sms = sm_count(0)
    layers = [g for g in S2_GEMMS if g[0] in sys.argv[2:]] or S2_GEMMS
    only = [a for a in sys.argv[2:] if a in VARIANTS]
    sweep = "--sweep" in sys.argv
    grids = "--grids" in sys.argv or any(a.startswith("--grids=") for a in sys.argv)
    grid_list = [int(g) for a in sys.argv if a.startswith("--grids=") for g in a[len("--grids="):].split(",")]
    cases = []
    for name, N, K in layers:
        R, packed = packed_weights(N, K)
        xs = {M: kernels.quantize_1x128(torch.randn(M, K, device=dev, dtype=torch.bfloat16)) for M in (32, 64)}
        cases.append((name, N, K, R, packed, xs))
    res: dict[str, float] = {}

    def time(key: str, plan: WgmmaPlan, R: int, packed: PackedCopies, x: tuple) -> None:
        us = time_plan(plan, *x, packed, R)
        res[key] = us
        print(f"{key}: {us:.2f} us  {plan}", flush=True)

    for variant, edits in VARIANTS.items():
        ablation = variant not in ("base", "acc_old", "acc1", "direct_store")
        if only and variant not in only:
            continue
        ms = (64,) if ablation else (32, 64)
        use(edits, tuple(f"fp8_gemm_wgmma64<{m}>" for m in ms))  # NT = M for these token counts
        for name, N, K, R, packed, xs in cases:
            for M in ms:
                time(f"{variant} {name} M={M}", wgmma64_plan(M, N, K, sms), R, packed, xs[M])
            if grids and not ablation:  # grids of 1 / 1.25 / 1.5 / 1.75 / 2 CTAs per SM at 64 tokens, or as listed
                for g in grid_list or sorted({sms, 5 * sms // 4, 3 * sms // 2, 7 * sms // 4, 2 * sms}):
                    time(f"{variant} {name} M=64 grid={g}", wgmma64_plan(64, N, K, sms, grid=g), R, packed,
                         xs[64])
    use([], ("fp8_gemm_wgmma64<64>",))
    for name, N, K, R, packed, xs in cases if sweep else []:
        base = wgmma64_plan(64, N, K, sms)
        for grid in sorted({base.grid, sms, 2 * sms}):
            for st, ts in ((2, 2), (4, 2), (2, 4), (4, 6), (4, 8), (6, 4), (6, 6), (8, 8), (10, 4), (10, 8)):
                p = wgmma64_plan(64, N, K, sms, grid=grid)
                smem = wgmma64_smem_bytes(p.nt, st, ts, p.iters, p.slots)
                if smem > SMEM_LIMIT:
                    continue
                plan = p._replace(stages=st, tstages=ts, smem=smem)
                time(f"base {name} M=64 grid={grid} stages={st} tstages={ts}", plan, R, packed, xs[64])
    (out / "gemm64-bounds.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
