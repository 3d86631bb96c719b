// The exponential race shared by exponential_race.cu and sample.cu: the counter-based Exp(1) noise of
// rtts/kernels/rng.py (32-bit integer math; the reference's int64 products masked to 32 bits are products mod 2^32),
// and the block-wide argmax with torch.argmax's tie rule (the lower index).
#pragma once
#include "common.cuh"

#define RACE_MIX_MUL 0x045D9F3Bu
#define RACE_GOLD 0x9E3779B1u

__device__ __forceinline__ unsigned mix32(unsigned x) {
    x = ((x >> 16) ^ x) * RACE_MIX_MUL;
    x = ((x >> 16) ^ x) * RACE_MIX_MUL;
    return (x >> 16) ^ x;
}

// rng.stream_keys: one 32-bit key per (stream seed, stream counter, draw); draw_mul = (draw * 0x27D4EB2F) mod 2^32
__device__ __forceinline__ unsigned stream_key(i64 seed, i64 counter, unsigned draw_mul) {
    unsigned k = mix32((unsigned)seed ^ draw_mul);
    k = mix32(k ^ (unsigned)((unsigned long long)seed >> 32));
    k = mix32(k ^ (unsigned)counter);
    return mix32(k ^ (unsigned)((unsigned long long)counter >> 32));
}

// rng.exponential_noise at vocabulary id `id`: u = (h >> 8 + 0.5) * 2^-24 is exact, -logf is torch's log
__device__ __forceinline__ float exp1_noise(unsigned key, i64 id) {
    unsigned h = mix32(key ^ ((unsigned)id * 0x61C8864Fu));
    h = mix32(h ^ (h >> 7) ^ RACE_GOLD);
    return -logf(((float)(h >> 8) + 0.5f) * (1.0f / 16777216.0f));
}

template <typename T>
__device__ __forceinline__ float load_as_float(const T* p, i64 i);
template <>
__device__ __forceinline__ float load_as_float<bf16_t>(const bf16_t* p, i64 i) { return bf16_to_float(p[i]); }
template <>
__device__ __forceinline__ float load_as_float<float>(const float* p, i64 i) { return p[i]; }

// Better (value, index): larger value, then lower index.
__device__ __forceinline__ void keep_best(float& v, int& i, float v2, int i2) {
    if (v2 > v || (v2 == v && i2 < i)) {
        v = v2;
        i = i2;
    }
}

// The block's best (value, index) from each thread's; the result is valid in thread 0. THREADS: the block size.
// Every thread must call it; bv / bi: THREADS / 32 entries of shared memory.
template <int THREADS>
__device__ __forceinline__ int block_best_index(float best, int at, float* bv, int* bi) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        keep_best(best, at, __shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, at, o));
    if (lane == 0) {
        bv[warp] = best;
        bi[warp] = at;
    }
    __syncthreads();
    if (threadIdx.x == 0)
        for (int w = 1; w < THREADS / 32; ++w) keep_best(best, at, bv[w], bi[w]);
    return at;
}
