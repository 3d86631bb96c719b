"""Launch the kernels worth reading with Nsight Compute, a few times each, nothing else timed: the FP8 GEMM at the
S2-Pro shapes and token counts that miss their target, and decode attention at batch 64.
Usage (on the GPU machine; ncu replays each profiled launch in isolation, caches flushed, no PDL overlap):
  ncu --clock-control none --profile-from-start off --set full python bench/probes/ncu_cases.py [case ...]
Cases: gemm:<layer>:<tokens> (layer wqkv, wo, w1w3, w2) and attn:<batch>:<context>. Inputs are made and every kernel
compiled before the profiled range (torch.cuda.profiler.start / stop), which holds only the case's launches."""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from rtts import kernels
from rtts.bench.kernels import S2_GEMMS
from rtts.kernels import reference as ref

DEFAULT = ["gemm:wqkv:64", "gemm:wo:64", "gemm:wqkv:16", "attn:64:2048", "attn:64:512"]


def profiled(fn: Callable[[], object], reps: int) -> None:
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def run_gemm(layer: str, M: int, reps: int) -> None:
    N, K = next((n, k) for name, n, k in S2_GEMMS if name.startswith(layer))
    wq, sw = ref.quantize_weight(torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.05)
    wp = kernels.prepare_weight(wq)
    xq, sx = kernels.quantize_1x128(torch.randn(M, K, device="cuda", dtype=torch.bfloat16))
    kernels.fp8_gemm(xq, sx, wp, sw)  # scratch allocated, plan cached
    profiled(lambda: kernels.fp8_gemm(xq, sx, wp, sw), reps)


def run_attention(B: int, L: int, reps: int, n_kv: int = 8, G: int = 4, D: int = 128) -> None:
    k, v = (torch.randn(B, L, n_kv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(B, n_kv * G, D, device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(B, device="cuda")
    lens = torch.full((B,), L, device="cuda", dtype=torch.int64)
    kernels.decode_attention(q, k, v, slots, lens)
    profiled(lambda: kernels.decode_attention(q, k, v, slots, lens), reps)


def main() -> None:
    kernels.warmup(torch.device("cuda"))
    for case in sys.argv[1:] or DEFAULT:
        kind, a, b = case.split(":")
        print(f"case {case}", flush=True)
        if kind == "gemm":
            run_gemm(a, int(b), reps=2)
        else:
            run_attention(int(a), int(b), reps=2)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
