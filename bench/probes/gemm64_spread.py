"""A/B of the 64-row GEMM's two settlements (plan.spread False: the tile's first sharer sums it after its stream;
True: every sharer sums a slice), on the planner's plans: each S2-Pro linear, then the MLP block (quantize -> gate|up
-> SwiGLU + quantize -> down), at 32/64/128 tokens. Same method as the kernel bench (CUDA graph, weights rotated past
the L2). Usage: python bench/probes/gemm64_spread.py OUT_DIR"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from rtts import kernels
from rtts.bench.kernels import S2_GEMMS, _calls, copies_for, time_graph
from rtts.kernels import reference as ref


def packed_weights(N: int, K: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    ws = [ref.quantize_weight(torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.05) for _ in range(n)]
    return [(kernels.pack_weight(q), s) for q, s in ws]


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    kernels.warmup(torch.device("cuda"))
    sms = kernels._sm_count(0)
    res: dict[str, float] = {}
    for name, N, K in S2_GEMMS:
        R = copies_for(N * K)
        packed = packed_weights(N, K, min(R, 8))
        for M in (32, 64, 128):
            xq, sx = kernels.quantize_1x128(torch.randn(M, K, device="cuda", dtype=torch.bfloat16))
            for spread in (False, True):
                plan = kernels.wgmma64_plan(M, N, K, sms)._replace(spread=spread)

                def call(i: int, plan: kernels.WgmmaPlan = plan) -> torch.Tensor:
                    wp, sw = packed[i % len(packed)]
                    return kernels.launch_wgmma(plan, xq, sx, wp, sw)

                key = f"{name} M={M} grid={plan.grid} spread={spread}"
                res[key] = 1e6 * time_graph(_calls(call, R))
                print(f"{key}: {res[key]:.2f} us", flush=True)
    dim, hidden = 2560, 9728
    R = copies_for(3 * dim * hidden)
    n = min(R, 6)
    gu, dn = packed_weights(2 * hidden, dim, n), packed_weights(dim, hidden, n)
    for M in (32, 64, 128):
        x = torch.randn(M, dim, device="cuda", dtype=torch.bfloat16)
        for spread in (False, True):
            pg = kernels.wgmma64_plan(M, 2 * hidden, dim, sms)._replace(spread=spread)
            pd = kernels.wgmma64_plan(M, dim, hidden, sms)._replace(spread=spread)

            def mlp(i: int, pg: kernels.WgmmaPlan = pg, pd: kernels.WgmmaPlan = pd) -> torch.Tensor:
                xq, sx = kernels.quantize_1x128(x)
                h = kernels.launch_wgmma(pg, xq, sx, *gu[i % n])
                hq, sh = kernels.swiglu_quantize(h)
                return kernels.launch_wgmma(pd, hq, sh, *dn[i % n])

            key = f"MLP M={M} spread={spread}"
            res[key] = 1e6 * time_graph(_calls(mlp, R))
            print(f"{key}: {res[key]:.2f} us", flush=True)
    (out / "gemm64-spread.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
