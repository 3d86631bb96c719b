// Block-scaled FP8 GEMM for decode shapes: y[M, N] = x[M, K] @ w[N, K]^T with
//   x: float8 e4m3, 1x128 blocks, scales sx[K/128, Mp] (K-major, Mp = M rounded up to 4)
//   w: float8 e4m3, 128x128 blocks, scales sw[ceil(N/128), K/128] (row-major)
//   y: bfloat16 (or float32 partial sums per K split, reduced by gemm_reduce_splits)
//
// Swap-AB for small M: weight rows fill the 16-row side of each tensor-core MMA (mma.sync m16n8k32 e4m3, FP32
// accumulate) and tokens the 8-column side, so M = 1..128 wastes at most 7 columns instead of 15 rows. Each warp owns
// 16 weight rows and every token; a CTA owns WARPS*16 rows and a range of K blocks (split-K gives narrow-N layers
// enough CTAs to fill the GPU). Per 128-wide K block the FP32 MMA sum is promoted into the running total with
// sw * sx (the DeepGEMM-style promotion), so FP8 rounding never accumulates across blocks.
//
// Weight loads: each thread streams 32 contiguous bytes of two rows per K block (four 16-byte loads per block, the
// next block's in flight while the current one computes). To make that possible the 128 K positions of a block are
// permuted identically for weights and activations (thread t, step s, half h holds bytes 32t + 8s + 4h .. +3), which
// leaves every dot product unchanged. Activations go through shared memory (shared by the CTA's warps), rows padded
// to 132 bytes so the fragment reads are bank-conflict free.
#include "common.cuh"

#define XS_STRIDE 132

__device__ __forceinline__ void mma_e4m3(float c[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// 32 bytes of weight row `n` (zeros past N) starting at byte 32t of K block kb.
__device__ __forceinline__ void load_w(uint4 dst[2], const fp8_t* __restrict__ w, int n, int N, int K, int kb, int t) {
    if (n < N) {
        const uint4* p = reinterpret_cast<const uint4*>(w + (i64)n * K + kb * 128 + t * 32);
        dst[0] = __ldg(p);
        dst[1] = __ldg(p + 1);
    } else {
        dst[0] = make_uint4(0, 0, 0, 0);
        dst[1] = dst[0];
    }
}

// Tokens [0, ROWS) x 128 bytes of K block kb into shared memory (zeros past M), with their scales. 4-byte stores:
// the padded row stride is not 16-byte aligned.
template <int ROWS>
__device__ __forceinline__ void load_x(unsigned char* __restrict__ xs, float* __restrict__ xsc,
                                       const fp8_t* __restrict__ x, const float* __restrict__ sx, int M, int K, int Mp,
                                       int kb) {
    for (int m = threadIdx.x; m < ROWS; m += blockDim.x) xsc[m] = m < M ? sx[(i64)kb * Mp + m] : 0.f;
    for (int i = threadIdx.x; i < ROWS * 8; i += blockDim.x) {
        const int m = i >> 3, c = (i & 7) * 16;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (m < M) v = __ldg(reinterpret_cast<const uint4*>(x + (i64)m * K + kb * 128 + c));
        unsigned* d = reinterpret_cast<unsigned*>(xs + m * XS_STRIDE + c);
        d[0] = v.x; d[1] = v.y; d[2] = v.z; d[3] = v.w;
    }
}

template <int NT, int WARPS, bool SPLIT>
__global__ void __launch_bounds__(WARPS * 32) fp8_gemm(const fp8_t* __restrict__ x, const float* __restrict__ sx,
                                                       const fp8_t* __restrict__ w, const float* __restrict__ sw,
                                                       void* __restrict__ out, int M, int N, int K, int Mp,
                                                       int kb_per_split) {
    constexpr int ROWS = NT * 8;
    __shared__ __align__(16) unsigned char xs[2][ROWS * XS_STRIDE];
    __shared__ float xsc[2][ROWS];  // activation scales of the block, per token
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * (WARPS * 16) + warp * 16;
    const int KB = K >> 7;
    const int kb0 = blockIdx.y * kb_per_split;
    const int kb1 = min(KB, kb0 + kb_per_split);
    const int nb = n0 >> 7;  // the warp's 16 rows sit inside one 128-row scale block

    float total[NT][4];
#pragma unroll
    for (int i = 0; i < NT; ++i) total[i][0] = total[i][1] = total[i][2] = total[i][3] = 0.f;

    uint4 wa[2], wb[2];  // rows n0+g and n0+g+8
    if (kb0 < kb1) {
        load_w(wa, w, n0 + g, N, K, kb0, t);
        load_w(wb, w, n0 + g + 8, N, K, kb0, t);
        load_x<ROWS>(xs[0], xsc[0], x, sx, M, K, Mp, kb0);
    }
    __syncthreads();
    for (int kb = kb0; kb < kb1; ++kb) {
        const int buf = (kb - kb0) & 1;
        uint4 na[2], nbw[2];
        const bool more = kb + 1 < kb1;
        if (more) {  // next block in flight while this one computes
            load_w(na, w, n0 + g, N, K, kb + 1, t);
            load_w(nbw, w, n0 + g + 8, N, K, kb + 1, t);
            load_x<ROWS>(xs[buf ^ 1], xsc[buf ^ 1], x, sx, M, K, Mp, kb + 1);
        }
        const unsigned ra[8] = {wa[0].x, wa[0].y, wa[0].z, wa[0].w, wa[1].x, wa[1].y, wa[1].z, wa[1].w};
        const unsigned rb[8] = {wb[0].x, wb[0].y, wb[0].z, wb[0].w, wb[1].x, wb[1].y, wb[1].z, wb[1].w};
        float acc[NT][4];
#pragma unroll
        for (int i = 0; i < NT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
        const unsigned char* xb = xs[buf];
#pragma unroll
        for (int s = 0; s < 4; ++s) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const unsigned* xr = reinterpret_cast<const unsigned*>(xb + (nt * 8 + g) * XS_STRIDE + t * 32 + s * 8);
                mma_e4m3(acc[nt], ra[2 * s], rb[2 * s], ra[2 * s + 1], rb[2 * s + 1], xr[0], xr[1]);
            }
        }
        const float swv = (n0 < N) ? sw[(i64)nb * KB + kb] : 0.f;
        const float* sxk = xsc[buf];  // zero past M
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const int c0 = nt * 8 + 2 * t;
            const float s0 = swv * sxk[c0];
            const float s1 = swv * sxk[c0 + 1];
            total[nt][0] += acc[nt][0] * s0;
            total[nt][1] += acc[nt][1] * s1;
            total[nt][2] += acc[nt][2] * s0;
            total[nt][3] += acc[nt][3] * s1;
        }
        __syncthreads();  // the next buffer is written and this one is read by every warp
        if (more) {
            wa[0] = na[0]; wa[1] = na[1];
            wb[0] = nbw[0]; wb[1] = nbw[1];
        }
    }

    // Accumulator (nt, i): row n0 + g + 8*(i >> 1), token nt*8 + 2t + (i & 1).
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int n = n0 + g + 8 * (i >> 1), m = nt * 8 + 2 * t + (i & 1);
            if (n < N && m < M) {
                if (SPLIT) {
                    reinterpret_cast<float*>(out)[((i64)blockIdx.y * M + m) * N + n] = total[nt][i];
                } else {
                    reinterpret_cast<bf16_t*>(out)[(i64)m * N + n] = float_to_bf16(total[nt][i]);
                }
            }
        }
    }
}

// Sum the per-split partials: ws float32 [splits, M, N] -> y bfloat16 [M, N] (fixed order: deterministic).
extern "C" __global__ void gemm_reduce_splits(const float* __restrict__ ws, bf16_t* __restrict__ y, int splits,
                                              int MN) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= MN) return;
    float s = 0.f;
    for (int k = 0; k < splits; ++k) s += ws[(i64)k * MN + i];
    y[i] = float_to_bf16(s);
}
