"""Time the token-major GEMM (fp8_gemm_wgmma_tm) against the stream-K plans on the S2-Pro shapes, with and without
programmatic dependent launch (the no_pdl kernel switch), over its tile widths, K splits and ring depths (same method as
the kernel bench: a CUDA graph of calls with weights rotated past the L2).
Usage: python bench/probes/gemm_tm.py OUT_DIR [token counts, default 64]
Environment: TM_STAGES / TM_TSTAGES (weight / token ring depths, default 2,4,6,8 / 4,8; deeper than the planner's cap
lifts it for this run), TM_LAYERS (layer name prefixes, default all), TM_PDL (1,0: with and without PDL), TM_PER_SM
(CTAs per SM, default 1: 2 plans two tiles per SM, the layer's own CTAs filling both slots)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from rtts import env, kernels
from rtts.bench.kernels import S2_GEMMS, packed_weights, time_plan
from rtts.kernels import gemm
from rtts.kernels.common import sm_count
from rtts.kernels.gemm_plan import TM_MAX_STAGES, wgmma_tm_plan


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    ms = [int(m) for m in sys.argv[2].split(",")] if len(sys.argv) > 2 else [64]
    kernels.warmup(torch.device("cuda"))
    sms = sm_count(0)
    stages = [int(v) for v in os.environ.get("TM_STAGES", "2,4,6,8").split(",")]
    tstages = [int(v) for v in os.environ.get("TM_TSTAGES", "4,8").split(",")]
    layers = os.environ.get("TM_LAYERS", "").split(",")
    pdls = [v == "1" for v in os.environ.get("TM_PDL", "1,0").split(",")]
    per_sm = [int(v) for v in os.environ.get("TM_PER_SM", "1").split(",")]
    most = max(TM_MAX_STAGES, *stages)  # deeper rings than the planner's cap, for this run
    res: dict[str, float] = {}
    for name, N, K in S2_GEMMS:
        if not any(name.startswith(x) for x in layers):
            continue
        R, packed = packed_weights(N, K)
        for M in ms:
            xq, sx = kernels.quantize_1x128(torch.randn(M, K, device="cuda", dtype=torch.bfloat16))
            stream_k = gemm.plan_gemm(M, N, K, 0, cluster=1, rows=64 if M > 16 else None)
            plans = {"stream-K": stream_k}
            for split in (1, 2):
                for ts in tstages:
                    for st in stages:
                        for f in per_sm:
                            try:
                                p = wgmma_tm_plan(M, N, K, f * sms, st, split, ts, max_stages=most)
                            except ValueError:
                                continue
                            if p.grid == f * sms:
                                plans[f"tm wn={p.rows} S={split} ts={ts} st={p.stages} grid={p.grid}"] = p
            for label, plan in plans.items():
                for pdl in pdls:
                    with env.override_kernel_switches(no_pdl=not pdl):
                        us = time_plan(plan, xq, sx, packed, R)
                    key = f"{name} M={M} {label} pdl={int(pdl)}"
                    res[key] = us
                    print(f"{key}: {us:.2f} us", flush=True)
    (out / "gemm-tm.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
