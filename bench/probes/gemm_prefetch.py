"""Does an L2 prefetch of a CTA's whole weight range, issued before griddepcontrol.wait, shorten the GEMM chain?

Both wgmma kernels copy only their ring's first stages before the wait (shared memory bounds how much), so a GEMM's
CTAs that become resident while the kernel ahead finishes fetch at most a ring's worth of their weights early. Here
the producer also issues `cp.async.bulk.prefetch.L2` for the next `PF` iterations' weights (8 or 16 KB each, all of
them for "pf_all"): no shared memory, the bytes wait in the L2 for the ring. Patched in memory (kernel_patch.py; the
repository files are untouched), timed like the kernel bench (CUDA graph of calls, weights rotated past the L2):
fp8_gemm alone, fp8_linear (activation quantize + GEMM, the serving path's pair) and the MLP block, next to torch
bf16 in the same run.

    python bench/probes/gemm_prefetch.py OUT_DIR [variant names]    # on the GPU machine, from the repository root
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from kernel_patch import gemm_source

from rtts import kernels
from rtts.bench.kernels import S2_GEMMS, bench_mlp, copies_for, time_graph
from rtts.kernels import _jit
from rtts.kernels import reference as ref

HELPER = ("__device__ __forceinline__ void prefetch_l2(const void* p, unsigned bytes) {\n"
          '    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");\n'
          "}\n")
RING_128 = ("                ring_next(s, phase, stages);\n            }\n        }\n        if constexpr (!CLUSTER)",
            "                if (j == stages - 1)\n"
            "                    for (int q = stages; q < min(iters, stages + PF); ++q)\n"
            "                        prefetch_l2(src + (i64)q * TILE_BYTES, TILE_BYTES);\n"
            "                ring_next(s, phase, stages);\n            }\n        }\n        if constexpr (!CLUSTER)")
RING_64 = ("            for (int u = 0; u < wpre; ++u) load_weights(u);\n",
           "            for (int u = 0; u < wpre; ++u) load_weights(u);\n"
           "            for (int u = wpre, h = wh, k = wk; u < min(iters, wpre + PF); ++u) {\n"
           "                prefetch_l2(half_block(wp, h, k, KB), H_BYTES);\n"
           "                if (++k == KB) { k = 0; ++h; }\n"
           "            }\n")
VARIANTS = {"base": None, "pf4": 4, "pf8": 8, "pf_all": 1 << 20}
ORIGINAL = _jit.source


def use(pf: int | None) -> None:
    if pf is None:
        _jit.source = ORIGINAL  # type: ignore[assignment]
    else:
        head = f"#define PF {pf}\n" + HELPER
        big_edits = [("#define TILE_ROWS 128", head + "#define TILE_ROWS 128"), RING_128]
        big = gemm_source(big_edits, "gemm_prefetch.py", original=ORIGINAL, kernel="fp8_gemm_wgmma.cu")
        edits64 = [("#define H_ROWS 64", head + "#define H_ROWS 64"), RING_64]
        _jit.source = gemm_source(edits64, "gemm_prefetch.py", original=big,  # type: ignore[assignment]
                                  kernel="fp8_gemm_wgmma64.cu")
    _jit.forget_compiled()


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    out.mkdir(parents=True, exist_ok=True)
    only = [a for a in sys.argv[2:] if a in VARIANTS]
    dev = torch.device("cuda")
    ms = (1, 16, 32, 64)
    cases = []
    for name, N, K in S2_GEMMS:
        R = min(copies_for(N * K), 8)
        ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.05 for _ in range(R)]
        packed = [(kernels.prepare_weight(q), s) for q, s in (ref.quantize_weight(w) for w in ws)]
        cases.append((name, R, ws, packed, {M: torch.randn(M, K, device=dev, dtype=torch.bfloat16) for M in ms}))
    res: dict[str, float] = {}
    for name, R, ws, _, xs in cases:
        for M in ms:
            n = max(32, R)
            x = xs[M]
            res[f"bf16 {name} M={M}"] = 1e6 * time_graph([lambda i=i: x @ ws[i % R].T for i in range(n)])
    for variant, pf in VARIANTS.items():
        if only and variant not in only:
            continue
        use(pf)
        kernels.warmup(dev)
        for name, R, _, packed, xs in cases:
            for M in ms:
                x = xs[M]
                xq, sx = kernels.quantize_1x128(x)
                n = max(32, R)
                g = 1e6 * time_graph([lambda i=i: kernels.fp8_gemm(xq, sx, *packed[i % R]) for i in range(n)])
                lin = 1e6 * time_graph([lambda i=i: kernels.fp8_linear(x, *packed[i % R]) for i in range(n)])
                b = res[f"bf16 {name} M={M}"]
                res[f"{variant} {name} M={M} gemm"], res[f"{variant} {name} M={M} linear"] = g, lin
                print(f"{variant:7s} {name:15s} M={M:3d} gemm {g:6.2f} us ({b / g:4.2f}x bf16 {b:5.2f})  "
                      f"linear {lin:6.2f} us", flush=True)
        for M in (1, 64):
            mlp = bench_mlp(M)
            res[f"{variant} mlp M={M}"] = mlp["fp8_us"]
            print(f"{variant:7s} mlp M={M:3d} fp8 {mlp['fp8_us']:6.2f} us bf16 {mlp['bf16_us']:6.2f} us", flush=True)
    (out / "gemm-prefetch.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
