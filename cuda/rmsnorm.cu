// RMSNorm over the last dimension of bf16 rows, optionally after a residual add, optionally quantized for the FP8
// GEMM it feeds, in one kernel (the torch form is eight: cast, square, mean, add, rsqrt, multiply, cast, scale; then
// the 1x128 quantize kernel).
//
//   y = bf16(bf16(v * rsqrt(mean(v^2) + eps)) * w),  v = x            (rmsnorm_bf16)
//                                                    v = h = bf16(x + r), also stored  (add_rmsnorm_bf16)
//   ..._quant: y quantized 1x128 as quantize_1x128 does (q fp8 [rows, D], K-major scales [D/128, Mp]), not stored
// The two roundings are the model's order (normalize in float32, cast back, then scale by the bf16 weight); the
// sum of squares is a tree in float32, so y can differ from torch's reduction order in the last bit of a few rows.
// One CTA per row; the row (a few KB) is read twice, the second time from L1/L2.
// Launched with PDL (kernels.norm_rope): the next kernel (usually the GEMM this row feeds) may start streaming its
// weights at once; the inputs are read only after pdl_depend.
#include "quant.cuh"

#define NORM_THREADS 256

// The normalized, scaled value of element i (v: its input after the residual add), as a float on the bf16 grid.
__device__ __forceinline__ float normed(float v, float rs, const bf16_t* __restrict__ w, int i) {
    return bf16_to_float(float_to_bf16(__fmul_rn(bf16_to_float(float_to_bf16(__fmul_rn(v, rs))), bf16_to_float(w[i]))));
}

template <bool RESIDUAL>
__device__ __forceinline__ float input(const bf16_t* __restrict__ x, const bf16_t* __restrict__ r, int i) {
    return RESIDUAL ? bf16_to_float(float_to_bf16(bf16_to_float(x[i]) + bf16_to_float(r[i]))) : bf16_to_float(x[i]);
}

// Row m: the residual sum (RESIDUAL: stored to h), then rsqrt(mean(v^2) + eps).
template <bool RESIDUAL>
__device__ __forceinline__ float row_rsqrt(const bf16_t* __restrict__ x, const bf16_t* __restrict__ r,
                                           bf16_t* __restrict__ h, int D, float eps) {
    __shared__ float red[NORM_THREADS / 32];
    pdl_trigger();
    pdl_depend();
    float ss = 0.f;
    for (int i = threadIdx.x; i < D; i += NORM_THREADS) {
        const float v = input<RESIDUAL>(x, r, i);
        if (RESIDUAL) h[i] = float_to_bf16(v);
        ss += v * v;
    }
    // mean as torch computes it (sum times the float reciprocal of the count), then rsqrt
    return rsqrtf(block_sum<NORM_THREADS>(ss, red) * (1.0f / (float)D) + eps);
}

template <bool RESIDUAL>
__device__ __forceinline__ void norm_row(const bf16_t* __restrict__ x, const bf16_t* __restrict__ r,
                                         const bf16_t* __restrict__ w, bf16_t* __restrict__ h, bf16_t* __restrict__ y,
                                         int D, float eps) {
    const float rs = row_rsqrt<RESIDUAL>(x, r, h, D, eps);
    for (int i = threadIdx.x; i < D; i += NORM_THREADS)
        y[i] = float_to_bf16(normed(input<RESIDUAL>(x, r, i), rs, w, i));
}

// The quantized variant: warp w takes the 128-wide blocks w, w + 8, ... (D % 128 == 0), 4 values per lane.
template <bool RESIDUAL>
__device__ __forceinline__ void norm_row_quant(const bf16_t* __restrict__ x, const bf16_t* __restrict__ r,
                                               const bf16_t* __restrict__ w, bf16_t* __restrict__ h,
                                               fp8_t* __restrict__ q, float* __restrict__ scale, int m, int M, int Mp,
                                               int D, float eps) {
    const float rs = row_rsqrt<RESIDUAL>(x, r, h, D, eps);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int kb = warp; kb < D / 128; kb += NORM_THREADS / 32) {
        float v[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int i = kb * 128 + lane * 4 + e;
            v[e] = normed(input<RESIDUAL>(x, r, i), rs, w, i);
        }
        quantize_block(v, lane, q + kb * 128, scale + (i64)kb * Mp + m);
        zero_scale_padding(scale + (i64)kb * Mp, m, M, Mp, lane);
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

// x bf16 [M, D] (contiguous) -> rmsnorm(x) * w quantized: q fp8 [M, D], scale fp32 [D/128, Mp]
extern "C" __global__ void __launch_bounds__(NORM_THREADS) rmsnorm_quant_bf16(const bf16_t* __restrict__ x,
                                                                               const bf16_t* __restrict__ w,
                                                                               fp8_t* __restrict__ q,
                                                                               float* __restrict__ scale, int M,
                                                                               int Mp, int D, float eps) {
    const int m = blockIdx.x;
    norm_row_quant<false>(x + (i64)m * D, nullptr, w, nullptr, q + (i64)m * D, scale, m, M, Mp, D, eps);
}

// h = x + r stored; rmsnorm(h) * w quantized as rmsnorm_quant_bf16
extern "C" __global__ void __launch_bounds__(NORM_THREADS) add_rmsnorm_quant_bf16(
    const bf16_t* __restrict__ x, const bf16_t* __restrict__ r, const bf16_t* __restrict__ w, bf16_t* __restrict__ h,
    fp8_t* __restrict__ q, float* __restrict__ scale, int M, int Mp, int D, float eps) {
    const int m = blockIdx.x;
    const i64 off = (i64)m * D;
    norm_row_quant<true>(x + off, r + off, w, h + off, q + off, scale, m, M, Mp, D, eps);
}
