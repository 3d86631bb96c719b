"""Time the MLP block (quantize -> gate|up GEMM -> SwiGLU + quantize -> down GEMM) with each GEMM's plan chosen
explicitly (128-row planner plan, 64-row plan at one or two CTAs per SM), and with the SwiGLU kernel launched with
and without PDL: which GEMM choice holds in a chain, not alone. Same method as the kernel bench.
Usage: python bench/probes/mlp_plans.py OUT_DIR"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from rtts import env, kernels
from rtts.bench.kernels import copies_for, graph_calls, time_graph
from rtts.kernels import gemm
from rtts.kernels import reference as ref
from rtts.kernels.common import sm_count
from rtts.kernels.gemm_plan import WgmmaPlan, wgmma64_plan, wgmma_plan

DIM, HIDDEN = 2560, 9728


def plans(M: int, N: int, K: int, sms: int) -> dict[str, WgmmaPlan]:
    out = {"r128": wgmma_plan(M, N, K, sms),
           "r64g1": wgmma64_plan(M, N, K, sms, grid=sms),
           "r64g2": wgmma64_plan(M, N, K, sms, 4, grid=2 * sms)}
    if M > 64:  # the 128-row kernel slices 128 tokens into two 64-token launches for these layers
        del out["r128"]
    return out


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    kernels.warmup(torch.device("cuda"))
    sms = sm_count(0)
    n = min(copies_for(3 * HIDDEN * DIM), 6)
    gu = [ref.quantize_weight(torch.randn(2 * HIDDEN, DIM, device="cuda", dtype=torch.bfloat16) * 0.05)
          for _ in range(n)]
    dn = [ref.quantize_weight(torch.randn(DIM, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.05) for _ in range(n)]
    gu = [(kernels.pack_weight(q), s) for q, s in gu]
    dn = [(kernels.pack_weight(q), s) for q, s in dn]
    res: dict[str, float] = {}
    for M in (32, 64, 128):
        x = torch.randn(M, DIM, device="cuda", dtype=torch.bfloat16)
        pg, pd = plans(M, 2 * HIDDEN, DIM, sms), plans(M, DIM, HIDDEN, sms)
        for a, plan_a in pg.items():
            for b, plan_b in pd.items():
                for pdl in (True, False):
                    if not pdl and (a, b) != ("r64g2", "r64g2"):
                        continue

                    def mlp(i: int, pa: WgmmaPlan = plan_a, pb: WgmmaPlan = plan_b,
                            pdl: bool = pdl) -> torch.Tensor:
                        xq, sx = kernels.quantize_1x128(x)
                        h = gemm.launch_wgmma(pa, xq, sx, *gu[i % n])
                        with env.override_kernel_switches(no_pdl=not pdl):  # the SwiGLU kernel's launch
                            hq, sh = kernels.swiglu_quantize(h)
                        return gemm.launch_wgmma(pb, hq, sh, *dn[i % n])

                    us = 1e6 * time_graph(graph_calls(mlp, copies_for(3 * HIDDEN * DIM)))
                    key = f"M={M} gate|up={a} {tuple(plan_a)[:3]} w2={b} {tuple(plan_b)[:3]} swiglu_pdl={pdl}"
                    res[key] = us
                    print(f"{key}: {us:.2f} us", flush=True)
    (out / "mlp-plans.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
