"""Time variants of the wgmma FP8 GEMM kernel side by side on the GPU, without committing to any of them.

Each variant is a list of (anchor, replacement) edits applied in memory to `cuda/fp8_gemm_wgmma.cu` (the repository
file is untouched; an anchor that no longer matches fails loudly). For every variant the modules are recompiled and
the S2-Pro linears are timed exactly as `python -m rtts.bench kernels` times them (CUDA-graph replay over weight
copies rotated past the L2): the GEMM alone and `fp8_linear` (activation quantize + GEMM, the serving path).
Prints one line per shape and writes `gemm-variants.json` under $OUT (or the current directory).

    python bench/probes/gemm_variants.py            # on the GPU machine, from the repository root
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch
from kernel_patch import gemm_source

from rtts import kernels
from rtts.bench.kernels import S2_GEMMS, copies_for, time_graph
from rtts.kernels import _jit
from rtts.kernels import reference as ref

TRIGGER = "    pdl_launch_dependents();\n    const fp8_t* src"
FIRST_WAIT = "            named_barrier(BAR_CONSUMERS, CONSUMERS);\n        }\n        mbar_wait(full0 + 8 * s, phase);"
AFTER_LOOP = "    if (settle >= 0) {"
VARIANTS: dict[str, list[tuple[str, str]]] = {
    "base": [],
    # Dependents launch (and start streaming their weights) once this CTA has its tokens, not at its start: their
    # prefetch then no longer competes with this kernel's token loads.
    "trigger_after_tokens": [
        (TRIGGER, "    const fp8_t* src"),
        (FIRST_WAIT, "            named_barrier(BAR_CONSUMERS, CONSUMERS);\n            if (j == 0 && tid == 0) "
                     "pdl_launch_dependents();\n        }\n        mbar_wait(full0 + 8 * s, phase);"),
    ],
    "trigger_after_loop": [
        (TRIGGER, "    const fp8_t* src"),
        (AFTER_LOOP, "    if (tid == 0) pdl_launch_dependents();\n    if (settle >= 0) {"),
    ],
}


def patched(edits: list[tuple[str, str]]) -> Callable[[str], str]:
    return gemm_source(edits, "gemm_variants.py")


def main() -> None:
    dev = torch.device("cuda")
    out: dict[str, dict[str, float]] = {}
    cases = []
    for name, N, K in S2_GEMMS:
        R = min(copies_for(N * K), 8)
        ws = [ref.quantize_weight(torch.randn(N, K, device=dev).bfloat16() * 0.05) for _ in range(R)]
        packed = [(kernels.prepare_weight(q), s) for q, s in ws]
        for M in (1, 16, 64):
            cases.append((name, M, R, packed, torch.randn(M, K, device=dev).bfloat16()))
    for variant, edits in VARIANTS.items():
        _jit.source = patched(edits)  # type: ignore[assignment]
        _jit.forget_compiled()
        kernels.warmup(dev)
        for name, M, R, packed, x in cases:
            xq, sx = kernels.quantize_1x128(x)
            n = max(32, R)
            gemm = [lambda i=i: kernels.fp8_gemm(xq, sx, *packed[i % R]) for i in range(n)]
            linear = [lambda i=i: kernels.fp8_linear(x, *packed[i % R]) for i in range(n)]
            row = {"gemm_us": 1e6 * time_graph(gemm), "linear_us": 1e6 * time_graph(linear)}
            out[f"{variant} {name} M={M}"] = row
            print(f"{variant:22s} {name:16s} M={M:3d}  gemm {row['gemm_us']:6.2f} us  "
                  f"linear {row['linear_us']:6.2f} us", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "gemm-variants.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
