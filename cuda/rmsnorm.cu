// RMSNorm over the last dimension of bf16 rows, optionally after a residual add, in one kernel (the torch form is
// eight: cast, square, mean, add, rsqrt, multiply, cast, scale).
//
//   y = bf16(bf16(v * rsqrt(mean(v^2) + eps)) * w),  v = x            (rmsnorm_bf16)
//                                                    v = h = bf16(x + r), also stored  (add_rmsnorm_bf16)
// The two roundings are the model's order (normalize in float32, cast back, then scale by the bf16 weight); the
// sum of squares is a tree in float32, so y can differ from torch's reduction order in the last bit of a few rows.
// One CTA per row; the row (a few KB) is read twice, the second time from L1/L2.
// Launched with PDL (kernels.rmsnorm): the next kernel (usually the GEMM this row feeds) may start streaming its
// weights at once; the inputs are read only after pdl_depend.
#include "common.cuh"

#define NORM_THREADS 256

__device__ __forceinline__ float block_sum(float v, float* red) {
    v = warp_sum(v);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float t = lane < NORM_THREADS / 32 ? red[lane] : 0.f;
    return warp_sum(t);
}

template <bool RESIDUAL>
__device__ __forceinline__ void norm_row(const bf16_t* __restrict__ x, const bf16_t* __restrict__ r,
                                         const bf16_t* __restrict__ w, bf16_t* __restrict__ h, bf16_t* __restrict__ y,
                                         int D, float eps) {
    __shared__ float red[NORM_THREADS / 32];
    pdl_trigger();
    pdl_depend();
    float ss = 0.f;
    for (int i = threadIdx.x; i < D; i += NORM_THREADS) {
        float v = bf16_to_float(x[i]);
        if (RESIDUAL) {
            const bf16_t hv = float_to_bf16(v + bf16_to_float(r[i]));
            h[i] = hv;
            v = bf16_to_float(hv);
        }
        ss += v * v;
    }
    // mean as torch computes it (sum times the float reciprocal of the count), then rsqrt
    const float rs = rsqrtf(block_sum(ss, red) * (1.0f / (float)D) + eps);
    for (int i = threadIdx.x; i < D; i += NORM_THREADS) {
        const float v = RESIDUAL ? bf16_to_float(float_to_bf16(bf16_to_float(x[i]) + bf16_to_float(r[i])))
                                 : bf16_to_float(x[i]);
        y[i] = float_to_bf16(__fmul_rn(bf16_to_float(float_to_bf16(__fmul_rn(v, rs))), bf16_to_float(w[i])));
    }
}

// x bf16 [rows, D] (row stride ldx), w bf16 [D] -> y bf16 [rows, D] (contiguous)
extern "C" __global__ void __launch_bounds__(NORM_THREADS) rmsnorm_bf16(const bf16_t* __restrict__ x, int ldx,
                                                                         const bf16_t* __restrict__ w,
                                                                         bf16_t* __restrict__ y, int D, float eps) {
    const i64 row = blockIdx.x;
    norm_row<false>(x + row * ldx, nullptr, w, nullptr, y + row * D, D, eps);
}

// h = x + r (bf16 [rows, D], contiguous), stored; y = rmsnorm(h) * w
extern "C" __global__ void __launch_bounds__(NORM_THREADS) add_rmsnorm_bf16(const bf16_t* __restrict__ x,
                                                                             const bf16_t* __restrict__ r,
                                                                             const bf16_t* __restrict__ w,
                                                                             bf16_t* __restrict__ h,
                                                                             bf16_t* __restrict__ y, int D, float eps) {
    const i64 off = (i64)blockIdx.x * D;
    norm_row<true>(x + off, r + off, w, h + off, y + off, D, eps);
}
