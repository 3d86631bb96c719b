// Snake activation of the codec, y = x + sin(alpha_c x)^2 / (alpha_c + 1e-9), in one pass.
//   x, y   [B, C, L] contiguous (float32, raw bfloat16 or raw float16 bits), distinct
//   alpha  float32 [C]
// torch spells it as five elementwise kernels over the whole tensor (alpha * x, sin, pow, the broadcast multiply,
// the add), each a full read and write: 29 of them per codec decode are ~40% of a streaming chunk's GPU time. Here
// each element is read once and written once. Math in float32 in torch's order (sinf, not __sinf: the arguments are
// not small), so float32 results match the reference to the last bit or so.
// Each thread takes VEC consecutive elements of one row (the wrapper picks VEC = 4 only when L % 4 == 0 and the
// pointers are 16-byte aligned, so a vector never straddles two channels).
#include "common.cuh"

__device__ __forceinline__ float snake_value(float v, float a, float inv) {
    const float s = sinf(a * v);
    return v + inv * (s * s);
}

template <int VEC>
__device__ __forceinline__ void load_vec(const float* p, float (&v)[VEC]) {
    if constexpr (VEC == 4) {
        const float4 q = *reinterpret_cast<const float4*>(p);
        v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
    } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[j] = p[j];
    }
}

template <int VEC>
__device__ __forceinline__ void store_vec(float* p, const float (&v)[VEC]) {
    if constexpr (VEC == 4) {
        *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
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
    } else {
        unsigned short* b = reinterpret_cast<unsigned short*>(p);
#pragma unroll
        for (int j = 0; j < VEC; ++j) b[j] = B::from_float(v[j]);
    }
}

template <typename T, int VEC>
__global__ void __launch_bounds__(256) snake(const T* __restrict__ x, const float* __restrict__ alpha,
                                             T* __restrict__ y, i64 n, int C, int L) {
    const i64 i = ((i64)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (i >= n) return;
    // (32-bit division where the tensor allows it: a 64-bit one is ~3x the instructions, per thread)
    const int c = n <= 0xFFFFFFFFll ? (int)(((unsigned)i / (unsigned)L) % (unsigned)C) : (int)((i / L) % C);
    const float a = alpha[c];
    const float inv = 1.0f / (a + 1e-9f);  // torch: (alpha + 1e-9).reciprocal(), correctly rounded in both
    float v[VEC];
    load_vec<VEC>(x + i, v);
#pragma unroll
    for (int j = 0; j < VEC; ++j) v[j] = snake_value(v[j], a, inv);
    store_vec<VEC>(y + i, v);
}
