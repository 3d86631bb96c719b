// Block-scaled FP8 weight -> bf16 [N, K]: y[n, k] = q[n, k] * s[n / 128, k / 128], rounded to nearest even.
//
// What it is for: an FP8 linear over more rows than one decode GEMM launch takes (a prompt's prefill, hundreds of
// positions) dequantizes its weight once and runs one dense bf16 GEMM, instead of re-streaming the weight through
// the decode GEMM in 128-token slices (kernels.dequantize_weight, quant.FP8Linear). It is a pure copy: 1 byte read
// and 2 written per weight, one 16-byte chunk (16 weights) per thread, every read coalesced.
//
// PACKED: q is the wgmma GEMM's tile layout [N/128][K/128][128 rows][128 bytes], each row's 16-byte chunks in the
// 128-byte swizzle order (chunk c of row r at position c ^ (r % 8), reference.pack_weight); threads walk the packed
// bytes in order and write 32-byte pieces of output rows. Otherwise q is [N, K] row-major (K % 16 == 0).
// Launched plainly (no PDL): its output is fresh memory that the kernel ahead may have been using until it freed it.
#include "common.cuh"

// e4m3 bits -> float, exact (every e4m3 value is a float): normals rebias the exponent (7 -> 127), subnormals are
// m * 2^-9. The saturating quantizer never writes the NaN codes (0x7f, 0xff).
__device__ __forceinline__ float e4m3_to_float(unsigned b) {
    const unsigned e = (b >> 3) & 15u, m = b & 7u;
    const float mag = e ? __uint_as_float(((e + 120u) << 23) | (m << 20)) : (float)m * 0.001953125f;
    return __uint_as_float(__float_as_uint(mag) | ((b & 0x80u) << 24));
}

template <bool PACKED>
__global__ void dequantize_fp8(const fp8_t* __restrict__ q, const float* __restrict__ s, bf16_t* __restrict__ y,
                               int N, int K) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;  // 16-byte chunk
    const int CK = K >> 4;                                      // chunks per row
    if (i >= (i64)N * CK) return;
    int n, k;
    if constexpr (PACKED) {
        const int KB = K >> 7;
        const i64 block = i >> 10;  // 1024 chunks per 16 KB block
        const int r = (int)(i >> 3) & 127, pos = (int)i & 7;
        n = (int)(block / KB) * 128 + r;
        k = (int)(block % KB) * 128 + 16 * (pos ^ (r & 7));
    } else {
        n = (int)(i / CK);
        k = (int)(i - (i64)n * CK) * 16;
    }
    const uint4 raw = *reinterpret_cast<const uint4*>(q + i * 16);
    const float scale = s[(i64)(n >> 7) * ((K + 127) >> 7) + (k >> 7)];
    const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
    unsigned out[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const unsigned word = w[j >> 1] >> (16 * (j & 1));
        const float a = e4m3_to_float(word & 0xffu) * scale, b = e4m3_to_float((word >> 8) & 0xffu) * scale;
        out[j] = (unsigned)float_to_bf16(a) | ((unsigned)float_to_bf16(b) << 16);
    }
    uint4* dst = reinterpret_cast<uint4*>(y + (i64)n * K + k);
    dst[0] = make_uint4(out[0], out[1], out[2], out[3]);
    dst[1] = make_uint4(out[4], out[5], out[6], out[7]);
}
