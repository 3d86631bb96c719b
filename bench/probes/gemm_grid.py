"""Time the wgmma GEMMs' planner choices against the same plans on other CTA counts: the 128-row kernel's lean
(1-16 token) plans as the planner makes them for fewer SMs (`wgmma_plan(..., sms=g)`: g CTAs, ranges, ring depth and
shared memory all recomputed), and the 64-row kernel's (17-64 tokens) with its `grid` override; same method as the
kernel bench (a CUDA graph of calls with weights rotated past the L2).
Usage: python bench/probes/gemm_grid.py OUT_DIR"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from rtts import kernels
from rtts.bench.kernels import S2_GEMMS, packed_weights, time_plan
from rtts.kernels import gemm
from rtts.kernels.common import sm_count
from rtts.kernels.gemm_plan import wgmma64_plan, wgmma_plan


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    kernels.warmup(torch.device("cuda"))
    sms = sm_count(0)
    res: dict[str, float] = {}
    for name, N, K in S2_GEMMS:
        R, packed = packed_weights(N, K)
        for M in (1, 16, 32, 64):
            xq, sx = kernels.quantize_1x128(torch.randn(M, K, device="cuda", dtype=torch.bfloat16))
            plans = {}
            for g in (96, 112, 120, 128, sms):
                if M <= 16:
                    plans[g] = wgmma_plan(M, N, K, g, cluster=1)
                for g2 in ((g, 3 * sms // 2, 2 * sms) if g == sms else (g,)) if M > 16 else ():
                    plans[g2] = wgmma64_plan(M, N, K, sms, grid=g2)
            base = gemm.plan_gemm(M, N, K, 0)
            for plan in plans.values():
                us = time_plan(plan, xq, sx, packed, R)
                key = f"{name} M={M} grid={plan.grid} stages={plan.stages} rows={plan.rows}"
                res[key] = us
                print(f"{key}: {us:.2f} us{'  (planner)' if plan == base else ''}", flush=True)
    (out / "gemm-grid.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
