"""One or two consumer warpgroups in the 64-row GEMM (cuda/fp8_gemm_wgmma64.cu, template WGS): the two split the
token tile, so each iteration's MMA-then-promote chain is half as long. Times every S2-Pro linear at 32/64/128 tokens
for WGS = 1 and 2 over grids of 1, 1.5 and 2 CTAs per SM (the planner's included), like the kernel bench (CUDA graph
of calls, weights rotated past the L2), checks that both give the same bits, then the MLP block with the planner's
plans at each WGS.

    python bench/probes/gemm64_wgs.py OUT_DIR    # on the GPU machine, from the repository root
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from rtts import kernels
from rtts.bench.kernels import S2_GEMMS, _calls, bench_mlp, copies_for, time_graph
from rtts.kernels import reference as ref


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    kernels.warmup(dev)
    sms = kernels._sm_count(0)
    res: dict[str, float] = {}
    for name, N, K in S2_GEMMS:
        R = min(copies_for(N * K), 8)
        packed = [(kernels.pack_weight(q), s) for q, s in
                  (ref.quantize_weight(torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.05) for _ in range(R))]
        for M in (32, 64, 128):
            xq, sx = kernels.quantize_1x128(torch.randn(M, K, device=dev, dtype=torch.bfloat16))
            base = kernels.wgmma64_plan(M, N, K, sms)
            one = kernels.launch_wgmma(base, xq, sx, *packed[0])
            two = kernels.launch_wgmma(base._replace(wgs=2), xq, sx, *packed[0])
            same = bool(torch.equal(one, two))
            line = []
            for grid in sorted({base.grid, sms, int(1.5 * sms), 2 * sms}):
                for wgs in (1, 2):
                    plan = kernels.wgmma64_plan(M, N, K, sms, grid=grid)._replace(wgs=wgs)

                    def call(i: int, plan: kernels.WgmmaPlan = plan) -> torch.Tensor:
                        return kernels.launch_wgmma(plan, xq, sx, *packed[i % R])

                    us = 1e6 * time_graph(_calls(call, R))
                    res[f"{name} M={M} grid={grid} wgs={wgs}"] = us
                    line.append(f"g{grid}/w{wgs} {us:5.2f}{'*' if grid == base.grid else ''}")
            print(f"{name:15s} M={M:3d} same bits {same}: " + "  ".join(line), flush=True)
    plan64 = kernels.wgmma64_plan
    for wgs in (1, 2):
        kernels.wgmma64_plan = lambda *a, wgs=wgs, **k: plan64(*a, **k)._replace(wgs=wgs)  # type: ignore[misc]
        for M in (32, 64, 128):
            mlp = bench_mlp(M)
            res[f"mlp M={M} wgs={wgs}"] = mlp["fp8_us"]
            print(f"mlp M={M:3d} wgs={wgs}: fp8 {mlp['fp8_us']:6.2f} us (bf16 {mlp['bf16_us']:6.2f})", flush=True)
    kernels.wgmma64_plan = plan64  # type: ignore[misc]
    (out / "gemm64-wgs.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
