// Shared device helpers for rtts kernels. Self-contained (no CUDA headers), so NVRTC needs no include paths.
#pragma once

typedef unsigned short bf16_t;   // raw bfloat16 bits
typedef unsigned char fp8_t;     // raw float8 e4m3 bits
typedef long long i64;

#define FP8_E4M3_MAX 448.0f
#define RTTS_INF __int_as_float(0x7f800000)  // NVRTC has no math headers: no INFINITY

__device__ __forceinline__ float bf16_to_float(bf16_t h) { return __uint_as_float(((unsigned)h) << 16); }

// Round to nearest even (NaN handling is not needed: inputs are finite activations).
__device__ __forceinline__ bf16_t float_to_bf16(float f) {
    unsigned u = __float_as_uint(f);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

// Two floats -> two e4m3 bytes (lo = a, hi = b), saturating to +-448.
__device__ __forceinline__ unsigned short float2_to_e4m3x2(float a, float b) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(b), "f"(a));
    return r;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over a block of THREADS threads, returned to every thread; red: THREADS / 32 floats of shared memory, which
// may be reused by the next call (the leading barrier waits for every read of the previous one).
template <int THREADS>
__device__ __forceinline__ float block_sum(float v, float* red) {
    v = warp_sum(v);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    return warp_sum(lane < THREADS / 32 ? red[lane] : 0.f);
}

// Programmatic dependent launch (sm_90+; no-ops below): a kernel launched with programmatic stream serialization may
// start while the previous kernel on the stream runs. pdl_trigger lets the next kernel launch (and stream what does
// not depend on this one); pdl_wait blocks until the previous kernel has completed and its writes are visible, so
// everything this kernel reads or writes that the previous one may touch comes after it.
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_depend() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
