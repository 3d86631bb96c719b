// What the codec's one-pass elementwise kernels (snake.cu, codec_residual.cu) share: vector loads and stores of
// float32, and of bfloat16 / IEEE half as raw 16-bit words, converted to float32 for the math (VEC = 4 moves one
// 16-byte (float32) or 8-byte (16-bit) word, VEC = 2 half that; the wrappers pick them only where rows and pointers
// are aligned to them, so a vector never straddles two rows), and the split of an element index into row, column and
// channel.
#pragma once
#include "common.cuh"

template <int VEC>
__device__ __forceinline__ void load_vec(const float* p, float (&v)[VEC]) {
    if constexpr (VEC == 4) {
        const float4 q = *reinterpret_cast<const float4*>(p);
        v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
    } else if constexpr (VEC == 2) {
        const float2 q = *reinterpret_cast<const float2*>(p);
        v[0] = q.x; v[1] = q.y;
    } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[j] = p[j];
    }
}

template <int VEC>
__device__ __forceinline__ void store_vec(float* p, const float (&v)[VEC]) {
    if constexpr (VEC == 4) {
        *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
    } else if constexpr (VEC == 2) {
        *reinterpret_cast<float2*>(p) = make_float2(v[0], v[1]);
    } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) p[j] = v[j];
    }
}

// The 16-bit formats, as raw bits: bfloat16 (bf16_t, common.cuh) and IEEE half. f16_t wraps its bits in a struct of
// its own so that the kernel's element type tells the two apart (bf16_t is an unsigned short).
struct f16_t { unsigned short bits; };

template <typename T> struct Bits16;

template <> struct Bits16<bf16_t> {
    static __device__ __forceinline__ float to_float(unsigned short h) { return bf16_to_float(h); }
    static __device__ __forceinline__ unsigned short from_float(float f) { return float_to_bf16(f); }
};

template <> struct Bits16<f16_t> {
    static __device__ __forceinline__ float to_float(unsigned short h) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
        return f;
    }
    static __device__ __forceinline__ unsigned short from_float(float f) {
        unsigned short h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
        return h;
    }
};

template <int VEC, typename T>
__device__ __forceinline__ void load_vec(const T* p, float (&v)[VEC]) {
    using B = Bits16<T>;
    if constexpr (VEC == 4) {
        const uint2 q = *reinterpret_cast<const uint2*>(p);
        v[0] = B::to_float(q.x & 0xffff); v[1] = B::to_float(q.x >> 16);
        v[2] = B::to_float(q.y & 0xffff); v[3] = B::to_float(q.y >> 16);
    } else if constexpr (VEC == 2) {
        const unsigned q = *reinterpret_cast<const unsigned*>(p);
        v[0] = B::to_float(q & 0xffff); v[1] = B::to_float(q >> 16);
    } else {
        const unsigned short* b = reinterpret_cast<const unsigned short*>(p);
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[j] = B::to_float(b[j]);
    }
}

template <int VEC, typename T>
__device__ __forceinline__ void store_vec(T* p, const float (&v)[VEC]) {
    using B = Bits16<T>;
    if constexpr (VEC == 4) {
        uint2 q;
        q.x = (unsigned)B::from_float(v[0]) | ((unsigned)B::from_float(v[1]) << 16);
        q.y = (unsigned)B::from_float(v[2]) | ((unsigned)B::from_float(v[3]) << 16);
        *reinterpret_cast<uint2*>(p) = q;
    } else if constexpr (VEC == 2) {
        *reinterpret_cast<unsigned*>(p) = (unsigned)B::from_float(v[0]) | ((unsigned)B::from_float(v[1]) << 16);
    } else {
        unsigned short* b = reinterpret_cast<unsigned short*>(p);
#pragma unroll
        for (int j = 0; j < VEC; ++j) b[j] = B::from_float(v[j]);
    }
}

// Element i of a [B, C, L] tensor of n elements -> its row (b * C + c), column and channel, with 32-bit divisions
// where n allows (a 64-bit one is ~3x the instructions, per thread).
__device__ __forceinline__ void row_col_channel(i64 i, i64 n, int C, int L, i64& row, i64& col, int& c) {
    if (n <= 0xFFFFFFFFll) {
        const unsigned r = (unsigned)i / (unsigned)L;
        row = r; col = (unsigned)i - r * (unsigned)L; c = (int)(r % (unsigned)C);
    } else {
        row = i / L; col = i - row * L; c = (int)(row % C);
    }
}
