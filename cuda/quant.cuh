// 1x128 activation quantization shared by fp8_quant.cu and rmsnorm.cu: one warp quantizes a 128-wide block of one
// row (32 lanes x 4 values) to float8 e4m3 with a float32 scale; scales are K-major, scale[kb * Mp + m], and the
// padding rows M..Mp of each K block are zeros (the GEMM reads them).
#pragma once
#include "common.cuh"

__device__ __forceinline__ void quantize_block(const float v[4], int lane, fp8_t* __restrict__ q_out,
                                               float* __restrict__ scale_out) {
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
    amax = warp_max(amax);
    // amax * fl(1/448), as the torch reference computes it (torch turns a division by a scalar into this product).
    const float scale = fmaxf(amax, 1e-4f) * (1.0f / FP8_E4M3_MAX);
    const float inv = __frcp_rn(scale);  // IEEE reciprocal even under fast-math: matches the torch reference bit for bit
    const unsigned short lo = float2_to_e4m3x2(v[0] * inv, v[1] * inv);
    const unsigned short hi = float2_to_e4m3x2(v[2] * inv, v[3] * inv);
    reinterpret_cast<unsigned*>(q_out)[lane] = (unsigned)lo | ((unsigned)hi << 16);
    if (lane == 0) *scale_out = scale;
}

// The warp of the last row writes the scales of the padding rows M..Mp of its K block (`scale_kb`: that block's Mp).
__device__ __forceinline__ void zero_scale_padding(float* __restrict__ scale_kb, int m, int M, int Mp, int lane) {
    if (m == M - 1 && lane >= 1 && lane < Mp - m) scale_kb[m + lane] = 0.f;
}
