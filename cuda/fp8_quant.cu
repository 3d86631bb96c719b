// 1x128 activation quantization to float8 e4m3 with float32 scales, and the fused SwiGLU + quantize that feeds the
// MLP's down projection without a bf16 round trip through HBM.
//
// Scales are K-major: scale[kb * Mp + m] for row m and 128-column block kb (Mp = M rounded up to 4), the layout the
// GEMM reads; the padding rows M..Mp are written as zeros (the buffer comes uninitialized: no memset kernel ahead of
// this one in the chain). Dequantized value = q * scale; scale = max(amax, 1e-4) / 448.
// One warp per (row, 128-block): 32 lanes x 4 values.
// Launched with PDL (kernels.quantize_1x128 / swiglu_quantize): each CTA lets the next kernel (the GEMM this feeds)
// launch at once, so the GEMM's weight stream starts while this and the kernel before it finish; the input is read
// only after pdl_depend.
#include "quant.cuh"

// x bf16 [M, K] (row stride ldx) -> q fp8 [M, K], scale fp32 [K/128, Mp]
extern "C" __global__ void quantize_1x128(const bf16_t* __restrict__ x, int ldx, fp8_t* __restrict__ q,
                                          float* __restrict__ scale, int M, int K, int Mp) {
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    const int KB = K >> 7;
    pdl_trigger();
    pdl_depend();
    if (warp >= M * KB) return;
    const int m = warp / KB, kb = warp - m * KB;
    const bf16_t* src = x + (i64)m * ldx + kb * 128 + lane * 4;
    const uint2 raw = *reinterpret_cast<const uint2*>(src);
    float v[4] = {bf16_to_float(raw.x & 0xffff), bf16_to_float(raw.x >> 16),
                  bf16_to_float(raw.y & 0xffff), bf16_to_float(raw.y >> 16)};
    quantize_block(v, lane, q + (i64)m * K + kb * 128, scale + (i64)kb * Mp + m);
    zero_scale_padding(scale + (i64)kb * Mp, m, M, Mp, lane);
}

// gate_up bf16 [M, 2I] = [gate | up] -> h = silu(gate) * up -> q fp8 [M, I], scale fp32 [I/128, Mp]
extern "C" __global__ void swiglu_quantize_1x128(const bf16_t* __restrict__ gu, fp8_t* __restrict__ q,
                                                 float* __restrict__ scale, int M, int I, int Mp) {
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    const int KB = I >> 7;
    pdl_trigger();
    pdl_depend();
    if (warp >= M * KB) return;
    const int m = warp / KB, kb = warp - m * KB;
    const bf16_t* gp = gu + (i64)m * 2 * I + kb * 128 + lane * 4;
    const uint2 graw = *reinterpret_cast<const uint2*>(gp);
    const uint2 uraw = *reinterpret_cast<const uint2*>(gp + I);
    const unsigned gw[2] = {graw.x, graw.y}, uw[2] = {uraw.x, uraw.y};
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float g = bf16_to_float((gw[i >> 1] >> (16 * (i & 1))) & 0xffff);
        const float u = bf16_to_float((uw[i >> 1] >> (16 * (i & 1))) & 0xffff);
        v[i] = g / (1.0f + __expf(-g)) * u;
    }
    quantize_block(v, lane, q + (i64)m * I + kb * 128, scale + (i64)kb * Mp + m);
    zero_scale_padding(scale + (i64)kb * Mp, m, M, Mp, lane);
}
