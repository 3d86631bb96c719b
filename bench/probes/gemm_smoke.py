"""One call of each wgmma GEMM variant per shape against the torch reference, printed as it goes: run it under
`timeout` before anything else after a kernel change, so a hang (a stage barrier that never completes) is caught in
seconds and names the variant. Usage: python bench/probes/gemm_smoke.py"""

from __future__ import annotations

import torch

from rtts import kernels
from rtts.kernels import gemm
from rtts.kernels import reference as ref
from rtts.kernels.common import sm_count

SHAPES = [(17, 1152, 640), (40, 2560, 9728), (64, 6144, 2560), (128, 19456, 2560), (5, 256, 384), (64, 128, 128)]


def main() -> None:
    kernels.warmup(torch.device("cuda"))
    for M, N, K in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(M + N)
        x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        w = (torch.randn(N, K, device="cuda", generator=g) * 0.05).bfloat16()
        wq, sw = ref.quantize_weight(w)
        xq, sx = ref.quantize_1x128(x)
        wp = kernels.pack_weight(wq)
        r = ref.fp8_gemm(xq, sx, wq, sw).float()
        for rows in (64, 128):
            plan = gemm.plan_gemm(M, N, K, 0, cluster=1, rows=rows)
            if not gemm.scratch_fits(plan, N, sm_count(0)):
                continue  # fp8_gemm runs this one in token slices
            y = gemm.fp8_gemm_wgmma(xq, sx, wp, sw, cluster=1, rows=rows).float()
            torch.cuda.synchronize()
            err = float((y - r).abs().max() / r.abs().max())
            print(f"{M}x{N}x{K} rows={rows} {plan}: rel err {err:.2e} {'OK' if err < 1e-2 else 'WRONG'}", flush=True)


if __name__ == "__main__":
    main()
