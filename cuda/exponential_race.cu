// The sampling draw: index = argmax_i p[i] / q(i), q(i) ~ Exp(1) a pure function of (stream seed, stream counter,
// draw id, vocabulary id) (rtts/kernels/rng.py), fused with the argmax. The torch form builds the noise with ~70
// elementwise integer kernels per draw; this is one kernel, bit-identical: the hash is 32-bit integer math (the
// reference's int64 products masked to 32 bits are products mod 2^32), u = (h >> 8 + 0.5) * 2^-24 is exact, -logf
// and the IEEE division are the same library calls torch makes, and ties go to the lowest index as torch.argmax.
// One CTA per batch row.
#include "common.cuh"

#define RACE_THREADS 256
#define MIX_MUL 0x045D9F3Bu
#define GOLD 0x9E3779B1u

__device__ __forceinline__ unsigned mix32(unsigned x) {
    x = ((x >> 16) ^ x) * MIX_MUL;
    x = ((x >> 16) ^ x) * MIX_MUL;
    return (x >> 16) ^ x;
}

__device__ __forceinline__ unsigned stream_key(i64 seed, i64 counter, unsigned draw_mul) {
    unsigned k = mix32((unsigned)seed ^ draw_mul);
    k = mix32(k ^ (unsigned)((unsigned long long)seed >> 32));
    k = mix32(k ^ (unsigned)counter);
    return mix32(k ^ (unsigned)((unsigned long long)counter >> 32));
}

__device__ __forceinline__ float exp1_noise(unsigned key, i64 id) {
    unsigned h = mix32(key ^ ((unsigned)id * 0x61C8864Fu));
    h = mix32(h ^ (h >> 7) ^ GOLD);
    const float u = ((float)(h >> 8) + 0.5f) * (1.0f / 16777216.0f);
    return -logf(u);
}

// Better (value, index): larger value, then lower index.
__device__ __forceinline__ void keep_best(float& v, int& i, float v2, int i2) {
    if (v2 > v || (v2 == v && i2 < i)) {
        v = v2;
        i = i2;
    }
}

template <typename P>
__device__ __forceinline__ float prob_at(const P* p, int i);
template <>
__device__ __forceinline__ float prob_at<bf16_t>(const bf16_t* p, int i) { return bf16_to_float(p[i]); }
template <>
__device__ __forceinline__ float prob_at<float>(const float* p, int i) { return p[i]; }

// probs [B, n] (row stride ldp); seeds, counters int64 [B]; ids int64 [n]; draw_mul = (draw * 0x27D4EB2F) mod 2^32
// -> out int64 [B] (an index into ids)
template <typename P>
__device__ __forceinline__ void race_row(const P* __restrict__ probs, int ldp, const i64* __restrict__ seeds,
                                         const i64* __restrict__ counters, const i64* __restrict__ ids, int n,
                                         unsigned draw_mul, i64* __restrict__ out) {
    __shared__ float bv[RACE_THREADS / 32];
    __shared__ int bi[RACE_THREADS / 32];
    const int b = blockIdx.x, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const unsigned key = stream_key(seeds[b], counters[b], draw_mul);
    const P* p = probs + (i64)b * ldp;
    float best = -1.f;  // every ratio is >= 0
    int at = 0x7fffffff;
    for (int i = tid; i < n; i += RACE_THREADS) keep_best(best, at, prob_at<P>(p, i) / exp1_noise(key, ids[i]), i);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        keep_best(best, at, __shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, at, o));
    if (lane == 0) {
        bv[warp] = best;
        bi[warp] = at;
    }
    __syncthreads();
    if (tid == 0) {
        for (int w = 1; w < RACE_THREADS / 32; ++w) keep_best(best, at, bv[w], bi[w]);
        out[b] = at < n ? at : 0;  // NaN probabilities win nothing: still an index the caller may use
    }
}

extern "C" __global__ void __launch_bounds__(RACE_THREADS)
    exponential_race_bf16(const bf16_t* probs, int ldp, const i64* seeds, const i64* counters, const i64* ids, int n,
                          unsigned draw_mul, i64* out) {
    race_row<bf16_t>(probs, ldp, seeds, counters, ids, n, draw_mul, out);
}

extern "C" __global__ void __launch_bounds__(RACE_THREADS)
    exponential_race_f32(const float* probs, int ldp, const i64* seeds, const i64* counters, const i64* ids, int n,
                         unsigned draw_mul, i64* out) {
    race_row<float>(probs, ldp, seeds, counters, ids, n, draw_mul, out);
}
