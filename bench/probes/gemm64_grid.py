"""Time the 64-row GEMM (fp8_gemm_wgmma64) with plans the planner does not make: grids of one, 1.5 and two CTAs per
SM, and every ring depth that fits two CTAs per SM, per S2-Pro shape and token count (same method as the kernel bench:
a CUDA graph of calls with weights rotated past the L2).
Usage: python bench/probes/gemm64_grid.py OUT_DIR [layer names]"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from rtts import kernels
from rtts.bench.kernels import S2_GEMMS, packed_weights, time_plan
from rtts.kernels.common import sm_count
from rtts.kernels.gemm_plan import wgmma64_plan


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    kernels.warmup(torch.device("cuda"))
    sms = sm_count(0)
    res: dict[str, float] = {}
    for name, N, K in [g for g in S2_GEMMS if g[0] in sys.argv[2:]] or S2_GEMMS:
        R, packed = packed_weights(N, K)
        for M in (32, 64, 128):
            xq, sx = kernels.quantize_1x128(torch.randn(M, K, device="cuda", dtype=torch.bfloat16))
            base = wgmma64_plan(M, N, K, sms)
            for grid in (sms, sms * 3 // 2, 2 * sms):
                top = wgmma64_plan(M, N, K, sms, grid=grid).stages
                for st in sorted({3, 4, 6, 9, top} & set(range(2, top + 1))):
                    plan = wgmma64_plan(M, N, K, sms, st, grid=grid)
                    us = time_plan(plan, xq, sx, packed, R)
                    key = f"{name} M={M} grid={plan.grid} stages={plan.stages}"
                    res[key] = us
                    print(f"{key}: {us:.2f} us{'  (planner)' if plan == base else ''}", flush=True)
    (out / "gemm64-grid.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
