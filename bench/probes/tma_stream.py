"""The weight-streaming ceiling the wgmma GEMM should approach: read N bytes once, nothing else.

Two probe kernels, timed like the kernel benchmarks (CUDA-graph replay, copies rotated past the L2):
- `tma_stream`: the GEMM's memory skeleton. One CTA per SM (grid = SMs, or 2x), a producer thread bulk-copies its
  contiguous range in 16 KB blocks into an S-stage mbarrier ring, eight consumer warps wait on each block and
  release it. No MMA, no tokens, no stream-K settlement.
- `ldg_stream`: plain 16-byte loads over a grid-stride loop (what a register-streaming kernel gets).

    python bench/probes/tma_stream.py            # on the GPU machine, from the repository root

`tma_stream_pdl` is the same kernel launched as the GEMMs are (programmatic dependent launch: it lets its dependents
launch at once and its consumers wait for the kernel ahead, so the ring fills early).

Session 3 on the H200 (commit 9ef5491 tree): tma_stream S=4 grid=132 read 10.5 / 15.7 / 24.9 / 49.8 MB in 4.9 / 6.0 /
8.0 / 13.3 us (2.1 / 2.6 / 3.1 / 3.7 TB/s: ~2.6 us fixed, ~4.7 TB/s marginal); ldg_stream needed 8 CTAs per SM to
match it; an empty 288-thread launch cost 0.86 us.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rtts.bench.kernels import graph_calls, time_graph
from rtts.kernels import _jit

SOURCE = r"""
#include "sm90.cuh"
template <bool PDL>
__device__ __forceinline__ void stream_body(const unsigned char* w, long long T, int S, float* out) {
    extern __shared__ unsigned char smem_raw[];
    const unsigned raw = smem_u32(smem_raw);
    unsigned char* smem = smem_raw + (((raw + 1023u) & ~1023u) - raw);
    const unsigned base = smem_u32(smem), full0 = base + S * 16384, empty0 = full0 + 8 * S;
    const int tid = threadIdx.x, C = gridDim.x, c = blockIdx.x;
    const long long i0 = (long long)c * T / C;
    const int iters = (int)((long long)(c + 1) * T / C - i0);
    if (tid == 256) {
        for (int s = 0; s < S; ++s) { mbar_init(full0 + 8 * s, 1); mbar_init(empty0 + 8 * s, 8); }
        fence_proxy_async();
    }
    if (PDL) pdl_launch_dependents();
    __syncthreads();
    if (tid >= 256) {
        if (tid == 256)
            for (int j = 0; j < iters; ++j) {
                const int s = j % S;
                if (j >= S) mbar_wait(empty0 + 8 * s, ((j / S) - 1) & 1);
                mbar_arrive_expect_tx(full0 + 8 * s, 16384);
                bulk_copy_g2s(base + s * 16384, w + (i0 + j) * 16384, 16384, full0 + 8 * s);
            }
        return;
    }
    float acc = 0.f;
    if (PDL) pdl_wait();  // like the GEMM's consumers: the ring fills before the kernel ahead is done
    for (int j = 0; j < iters; ++j) {
        const int s = j % S;
        mbar_wait(full0 + 8 * s, (j / S) & 1);
        acc += *(volatile float*)(smem + s * 16384 + tid * 4);
        __syncwarp();
        if ((tid & 31) == 0) mbar_arrive(empty0 + 8 * s);
    }
    if (acc == 12345.f) out[0] = acc;
}
extern "C" __global__ void __launch_bounds__(288, 1)
tma_stream(const unsigned char* w, long long T, int S, float* out) { stream_body<false>(w, T, S, out); }
extern "C" __global__ void __launch_bounds__(288, 1)
tma_stream_pdl(const unsigned char* w, long long T, int S, float* out) { stream_body<true>(w, T, S, out); }
extern "C" __global__ void __launch_bounds__(256) ldg_stream(const uint4* w, long long n16, float* out) {
    unsigned acc = 0;
    for (long long i = blockIdx.x * 256ll + threadIdx.x; i < n16; i += (long long)gridDim.x * 256) {
        const uint4 v = __ldg(w + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345) out[0] = acc;
}
"""


def _launch(fn: Any, grid: int, block: int, args: tuple[Any, ...], smem: int = 0) -> None:
    with _jit.external_stream(torch.cuda.current_stream().cuda_stream):
        fn((grid,), (block,), args, shared_mem=smem)


def main() -> None:
    import cupy as cp

    text = SOURCE.replace('#include "sm90.cuh"', _jit.source("sm90.cuh"))
    mod = cp.RawModule(code=text, options=(_jit.arch_option(), "--std=c++17"))
    tma, ldg = mod.get_function("tma_stream"), mod.get_function("ldg_stream")
    pdl = mod.get_function("tma_stream_pdl")
    tma.max_dynamic_shared_size_bytes = pdl.max_dynamic_shared_size_bytes = 12 * 16384 + 2048
    out = torch.zeros(4, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for mb in (10.5, 15.7, 24.9, 49.8):  # the S2-Pro FP8 linears: wo, wqkv, w2, gate|up
        nbytes = int(mb * 1e6) // 16384 * 16384
        n = max(2, int(180e6 // nbytes) + 1)
        ws = [torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_() for _ in range(n)]
        T = nbytes // 16384
        row = []
        for S in (2, 4, 8):
            for grid in (sms, 2 * sms):
                def f(i: int, S: int = S, grid: int = grid) -> None:
                    _launch(tma, grid, 288, (ws[i % n].data_ptr(), np.int64(T), np.int32(S), out.data_ptr()),
                            S * 16384 + 2048)

                us = 1e6 * time_graph(graph_calls(f, n))
                row.append(f"tma S={S} grid={grid}: {us:.1f} us {nbytes / us / 1e6:.2f} TB/s")
        for S in (4, 6, 8):  # launched like the GEMMs (programmatic dependent launch)
            def fp(i: int, S: int = S) -> None:
                _jit.launch(pdl, (sms,), (288,), (ws[i % n].data_ptr(), int(T), np.int32(S), out.data_ptr()),
                            shared_mem=S * 16384 + 2048, pdl=True)

            us = 1e6 * time_graph(graph_calls(fp, n))
            row.append(f"tma+PDL S={S} grid={sms}: {us:.1f} us {nbytes / us / 1e6:.2f} TB/s")
        for grid in (sms, 4 * sms, 8 * sms):
            def g(i: int, grid: int = grid) -> None:
                _launch(ldg, grid, 256, (ws[i % n].data_ptr(), np.int64(nbytes // 16), out.data_ptr()))

            us = 1e6 * time_graph(graph_calls(g, n))
            row.append(f"ldg grid={grid}: {us:.1f} us {nbytes / us / 1e6:.2f} TB/s")
        print(f"{mb} MB: " + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
