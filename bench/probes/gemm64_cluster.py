"""The 64-row GEMM's cluster split (cuda/fp8_gemm_wgmma64.cu, CLUSTER instances: clusters of S CTAs over whole tiles,
shared tiles summed over distributed shared memory) against the planner's plan and the 64-row global stream-K plan,
timed like the kernel bench (CUDA-graph replay of a chain of calls over weight copies rotated past the L2, PDL on),
on the S2-Pro linears. Every cluster plan's output is checked against the torch reference and against itself on a
second call first (bits), so a fast wrong plan cannot pass unnoticed.

    python bench/probes/gemm64_cluster.py OUT [token counts, default 32,64,128]   # on the GPU machine

Prints one line per layer, token count and plan, and writes OUT/gemm64-cluster.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from rtts import kernels
from rtts.bench.kernels import S2_GEMMS, packed_weights, time_plan
from rtts.kernels import reference as ref

CLUSTERS = (2, 3, 4, 5, 6, 8)


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    ms = [int(m) for m in sys.argv[2].split(",")] if len(sys.argv) > 2 else [32, 64, 128]
    dev = torch.device("cuda")
    sms = kernels._sm_count(0)
    kernels.warmup(dev)
    res: dict[str, dict[str, object]] = {}
    for name, N, K in S2_GEMMS:
        R, packed = packed_weights(N, K)
        wq, sw = ref.quantize_weight(torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.05)
        wp = kernels.pack_weight(wq)
        for M in ms:
            xq, sx = kernels.quantize_1x128(torch.randn(M, K, device=dev, dtype=torch.bfloat16))
            want = ref.fp8_gemm(xq, sx, wq, sw).float()
            plans: dict[str, kernels.WgmmaPlan] = {"planner": kernels._plan(M, N, K, 0),
                                                   "streamk64": kernels.wgmma64_plan(M, N, K, sms)}
            for cs in CLUSTERS:
                for per_sm in (1, 2):
                    try:
                        plans[f"c{cs}x{per_sm}"] = kernels.wgmma64_plan(M, N, K, sms, grid=per_sm * sms, cluster=cs)
                    except ValueError:
                        pass
            for key, plan in plans.items():
                got = kernels.launch_wgmma(plan, xq, sx, wp, sw)
                err = float((got.float() - want).abs().max() / want.abs().max())
                same = bool(torch.equal(kernels.launch_wgmma(plan, xq, sx, wp, sw), got))
                us = time_plan(plan, xq, sx, packed, R) if err < 1e-2 and same else float("nan")
                desc = (f"{'token-major' if plan.token_major else plan.rows} rows={plan.rows} S={plan.cluster} "
                        f"grid={plan.grid} st={plan.stages}/{plan.tstages} iters={plan.iters}")
                res[f"{name} M={M} {key}"] = {"us": us, "rel_err": err, "deterministic": same, "plan": desc}
                print(f"{name} M={M} {key} ({desc}) err={err:.1e} same={same}: {us:.2f} us", flush=True)
    (out / "gemm64-cluster.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
