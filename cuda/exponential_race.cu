// The sampling draw: index = argmax_i p[i] / q(i), q(i) ~ Exp(1) a pure function of (stream seed, stream counter,
// draw id, vocabulary id) (rtts/kernels/rng.py), fused with the argmax. The torch form builds the noise with ~70
// elementwise integer kernels per draw; this is one kernel, bit-identical: the hash is 32-bit integer math (the
// reference's int64 products masked to 32 bits are products mod 2^32), u = (h >> 8 + 0.5) * 2^-24 is exact, -logf
// and the IEEE division are the same library calls torch makes, and ties go to the lowest index as torch.argmax.
// One CTA per batch row.
#include "race.cuh"

#define RACE_THREADS 256

// probs [B, n] (row stride ldp); seeds, counters int64 [B]; ids int64 [n]; draw_mul = (draw * 0x27D4EB2F) mod 2^32
// -> out int64 [B] (an index into ids)
template <typename P>
__device__ __forceinline__ void race_row(const P* __restrict__ probs, int ldp, const i64* __restrict__ seeds,
                                         const i64* __restrict__ counters, const i64* __restrict__ ids, int n,
                                         unsigned draw_mul, i64* __restrict__ out) {
    __shared__ float bv[RACE_THREADS / 32];
    __shared__ int bi[RACE_THREADS / 32];
    const int b = blockIdx.x, tid = threadIdx.x;
    const unsigned key = stream_key(seeds[b], counters[b], draw_mul);
    const P* p = probs + (i64)b * ldp;
    float best = -1.f;  // every ratio is >= 0
    int at = 0x7fffffff;
    for (int i = tid; i < n; i += RACE_THREADS)
        keep_best(best, at, load_as_float<P>(p, i) / exp1_noise(key, ids[i]), i);
    at = block_best_index<RACE_THREADS>(best, at, bv, bi);
    if (tid == 0) out[b] = at < n ? at : 0;  // NaN probabilities win nothing: still an index the caller may use
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
