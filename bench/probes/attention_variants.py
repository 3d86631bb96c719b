"""Variants of the decode-attention kernel (cuda/decode_attention.cu) side by side, timed like the kernel bench
(CUDA graph of calls, KV caches rotated): where the splits are merged (by the last split, or a second launch),
inlining and the fence of the fused merge. Patched in memory (the repository
file is untouched; an anchor that no longer matches fails loudly). With a path to an older decode_attention.cu
(two launches: split kernel + decode_attention_merge, no counters) it is timed too, as "old".

    python bench/probes/attention_variants.py [OLD.cu]    # on the GPU machine, from the repository root
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import torch

from rtts import kernels
from rtts.bench.kernels import _calls, copies_for, time_graph
from rtts.kernels import _jit

KERNEL = "decode_attention.cu"
NOINLINE = "__device__ __noinline__ void merge_splits("
# (edits, merge placement: None = the wrapper's choice (kernels.attention_fuses), True = fused, False = launched)
VARIANTS: dict[str, tuple[list[tuple[str, str]], bool | None]] = {
    "auto": ([], None),
    "fused": ([], True),
    "launched": ([], False),
    "fused_inline": ([(NOINLINE, "__device__ __forceinline__ void merge_splits(")], True),
    # timing only (the handoff is then unordered)
    "fused_nofence": ([("    __threadfence();\n    __syncthreads();\n    if (tid == 0) {",
                        "    __syncthreads();\n    if (tid == 0) {")], True),
}
SIZES = [(1, 512), (1, 2048), (16, 512), (16, 2048), (64, 512), (64, 2048)]
ORIGINAL = _jit.source


def patched(edits: list[tuple[str, str]]):  # type: ignore[no-untyped-def]
    def source(name: str) -> str:
        text = ORIGINAL(name)
        if name != KERNEL:
            return text
        for a, b in edits:
            if a not in text:
                raise SystemExit(f"anchor not found (update bench/probes/attention_variants.py): {a!r}")
            text = text.replace(a, b, 1)
        return text
    return source


def main() -> None:
    dev = torch.device("cuda")
    old = Path(sys.argv[1]).read_text() if len(sys.argv) > 1 else None
    n_kv, G, D = 8, 4, 128
    cases = []
    for B, L in SIZES:
        kv_bytes = 2 * B * L * n_kv * D * 2
        n = min(copies_for(kv_bytes), 4)
        caches = [(torch.randn(B, L, n_kv, D, device=dev, dtype=torch.bfloat16),
                   torch.randn(B, L, n_kv, D, device=dev, dtype=torch.bfloat16)) for _ in range(n)]
        q = torch.randn(B, n_kv * G, D, device=dev, dtype=torch.bfloat16)
        cases.append((B, L, n, caches, q, torch.arange(B, device=dev), torch.full((B,), L, device=dev),
                      copies_for(kv_bytes)))
    res: dict[str, dict[str, float]] = {}
    fuses = kernels.attention_fuses
    for variant, (edits, policy) in VARIANTS.items():
        kernels.attention_fuses = fuses if policy is None else (  # type: ignore[assignment]
            lambda B, n_kv, S, sms=0, policy=policy: policy)
        _jit.source = patched(edits)  # type: ignore[assignment]
        _jit._module.cache_clear()
        _jit.function.cache_clear()
        _jit._SMEM_SET.clear()
        kernels.warmup(dev)
        for B, L, n, caches, q, slots, lens, reps in cases:
            ref = kernels.reference.decode_attention(q, *caches[0], slots, lens).float()
            err = float((kernels.decode_attention(q, *caches[0], slots, lens).float() - ref).abs().max())
            if err >= 2e-2:
                print(f"{variant} {B}x{L}: max error {err}")

            def call(i: int) -> torch.Tensor:
                k, v = caches[i % n]
                return kernels.decode_attention(q, k, v, slots, lens)

            us = 1e6 * time_graph(_calls(call, reps))
            res.setdefault(f"{B}x{L}", {})[variant] = us
    kernels.attention_fuses = fuses  # type: ignore[assignment]
    if old is not None:
        import cupy as cp

        text = old.replace('#include "sm90.cuh"', _jit.source("sm90.cuh"))
        # "old_pdl": the merge launched with PDL (it waits for the split kernel, which lets it launch at once)
        pdl_text = text.replace("    const int s = blockIdx.x, h = blockIdx.y, b = blockIdx.z, S = gridDim.x;",
                                "    pdl_launch_dependents();\n"
                                "    const int s = blockIdx.x, h = blockIdx.y, b = blockIdx.z, S = gridDim.x;", 1)
        pdl_text = pdl_text.replace("    const int h = blockIdx.x, b = blockIdx.y;\n    const int i = threadIdx.x;",
                                    "    pdl_wait();\n    const int h = blockIdx.x, b = blockIdx.y;\n"
                                    "    const int i = threadIdx.x;", 1)
        assert pdl_text.count("pdl_wait();") >= 1 and pdl_text != text
        for name, src, pdl in (("old", text, False), ("old_pdl", pdl_text, True)):
            mod = cp.RawModule(code=src, options=(_jit.arch_option(), "--std=c++17"))
            fn, merge = mod.get_function(f"decode_attention_{D}_{G}"), mod.get_function("decode_attention_merge")
            smem = kernels.attention_smem_bytes(D)
            fn.max_dynamic_shared_size_bytes = smem
            for B, L, n, caches, q, slots, lens, reps in cases:
                S, chunk = kernels.attention_splits(B, n_kv, L, kernels._sm_count(0))

                def call_old(i: int, fn=fn, merge=merge, pdl=pdl, S=S, chunk=chunk, B=B, n=n, caches=caches, q=q,
                             slots=slots, lens=lens, L=L) -> torch.Tensor:
                    k, v = caches[i % n]
                    out = torch.empty_like(q)
                    ws_o = torch.empty(B, n_kv, S, G, D, dtype=torch.float32, device=dev)
                    ws_ml = torch.empty(B, n_kv, S, G, 2, dtype=torch.float32, device=dev)
                    _jit.launch(fn, (S, n_kv, B), (128,), (q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                                           slots.data_ptr(), lens.data_ptr(), ws_o.data_ptr(),
                                                           ws_ml.data_ptr(), out.data_ptr(), np.int32(n_kv),
                                                           np.int32(L), np.int32(chunk),
                                                           np.float32(1.0 / math.sqrt(D))), shared_mem=smem)
                    if S > 1:
                        _jit.launch(merge, (n_kv, B), (G * D,), (ws_o.data_ptr(), ws_ml.data_ptr(), out.data_ptr(),
                                                                 np.int32(n_kv), np.int32(G), np.int32(D),
                                                                 np.int32(S)), pdl=pdl)
                    return out

                ref = kernels.reference.decode_attention(q, *caches[0], slots, lens).float()
                assert (call_old(0).float() - ref).abs().max() < 2e-2
                res.setdefault(f"{B}x{L}", {})[name] = 1e6 * time_graph(_calls(call_old, reps))
    names = list(next(iter(res.values())))
    print("| batch x context | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for k, row in res.items():
        print(f"| {k} | " + " | ".join(f"{row[v]:.1f}" for v in names) + " |")


if __name__ == "__main__":
    main()
