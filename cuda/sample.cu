// One sampling draw per batch row in one kernel: top-p / top-k filtering at temperature 1, the temperature softmax,
// and the exponential race (race.cuh's noise), over at most SAMPLE_MAX_V candidates (S2's 4097 main ids,
// the fast codebooks). The torch form (rtts/kernels/reference.py: filtered_probs + race) is a radix sort, a scan, a
// scatter, two softmaxes, an argmax and ~10 elementwise kernels per draw, 11 draws per frame.
//
// Per row, in the logits dtype T (bf16 or float32) as the reference rounds:
//   1. sort descending, ties by lower index (only the prefix that matters: see sample_row);
//   2. p_r = T(exp(x_r - x_0) / sum), the softmax at temperature 1 over the sorted logits;
//   3. cum_r = T(p_0 + ... + p_r) accumulated in float32; rank r is cut when cum_r > T(top_p) or r >= top_k; rank 0
//      is always kept, and as cum is non-decreasing the kept ranks are a prefix [0, K);
//   4. s_r = T(x_r / max(temperature, 1e-5)) on the kept ranks, q_r = T(exp(s_r - s_0) / sum over kept);
//   5. the winner is argmax q_r / noise(id_r), ties to the lower original index.
// The float32 sums (steps 2-4) are trees here and run in other orders in torch, so a rank whose cumulative mass lies
// within a rounding of top_p can fall on the other side of the cut than in the reference; everything else is the
// same arithmetic.
// Block: SAMPLE_THREADS threads; dynamic shared memory: see sample_row (kernels.draw.sample_smem_bytes).
#include "race.cuh"

#define SAMPLE_THREADS 1024
#define SAMPLE_MAX_V 8192
#define SAMPLE_BIN_BITS 12                 // histogram bins: the top 12 bits of a logit's order key
#define SAMPLE_BINS (1 << SAMPLE_BIN_BITS)
#define SAMPLE_MARGIN 0.02f                // candidates hold more than top_p + this (rounded sums differ by less)
// Round to the logits dtype and back.
template <typename T>
__device__ __forceinline__ float to_dtype(float v);
template <>
__device__ __forceinline__ float to_dtype<bf16_t>(float v) { return bf16_to_float(float_to_bf16(v)); }
template <>
__device__ __forceinline__ float to_dtype<float>(float v) { return v; }

// Float bits -> an unsigned whose ascending order is the floats' ascending order (finite values and infinities);
// -0 becomes +0 first, so the two zeros tie (and go by index) as in torch's sort.
__device__ __forceinline__ unsigned ordered(float v) {
    const unsigned u = __float_as_uint(v + 0.0f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Exclusive prefix (over the block, in thread order) of one int and one float per thread; totals returned too.
__device__ __forceinline__ void block_scan2(int c, float m, int& c_before, float& m_before, int* sc, float* sm) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int ci = c;
    float mi = m;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int cv = __shfl_up_sync(0xffffffffu, ci, o);
        const float mv = __shfl_up_sync(0xffffffffu, mi, o);
        if (lane >= o) {
            ci += cv;
            mi += mv;
        }
    }
    __syncthreads();  // sc/sm may still be read from a previous scan
    if (lane == 31) {
        sc[warp] = ci;
        sm[warp] = mi;
    }
    __syncthreads();
    c_before = ci - c;
    m_before = mi - m;
    for (int w = 0; w < warp; ++w) {
        c_before += sc[w];
        m_before += sm[w];
    }
}

// Sort keys[0, n) ascending in place (n <= np, a power of two; keys[n, np) must hold ~0).
__device__ __forceinline__ void bitonic_sort(unsigned long long* keys, int np) {
    for (int k = 2; k <= np; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < np; i += SAMPLE_THREADS) {
                const int l = i ^ j;
                if (l > i) {
                    const unsigned long long a = keys[i], c = keys[l];
                    if (((i & k) == 0) == (a > c)) {
                        keys[i] = c;
                        keys[l] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
}

// logits [B, V] (row stride ldl); temperature, top_p [B] (param dtype P); top_k int64 [B]; seeds, counters int64 [B];
// ids int64 [V]; draw_mul = (draw * 0x27D4EB2F) mod 2^32; NP = V rounded up to a power of two (<= SAMPLE_MAX_V)
// -> out int64 [B]: the drawn index into ids.
// Only a prefix of the sorted order matters (the kept ranks and the first cut one), so the row is not sorted whole:
// a histogram of the logits' top bits (SAMPLE_BINS bins, with their softmax mass) finds the highest bins holding more
// than top_p + SAMPLE_MARGIN of the mass or top_k tokens; those candidates (a prefix of the order) are ranked by
// counting (C <= SAMPLE_THREADS) or by a bitonic sort (flat rows, or top_p ~ 1 with no top-k).
template <typename T, typename P>
__device__ __forceinline__ void sample_row(const T* __restrict__ logits, int ldl, const P* __restrict__ temperature,
                                           const P* __restrict__ top_p, const i64* __restrict__ top_k,
                                           const i64* __restrict__ seeds, const i64* __restrict__ counters,
                                           const i64* __restrict__ ids, int V, int NP, unsigned draw_mul,
                                           i64* __restrict__ out) {
    // dynamic: xs float[NP] | bin_n int[SAMPLE_BINS] | bin_m float[SAMPLE_BINS] | cand u64[NP] | sorted u64[THREADS]
    extern __shared__ unsigned long long dyn[];
    float* xs = reinterpret_cast<float*>(dyn);
    int* bin_n = reinterpret_cast<int*>(xs + NP);
    float* bin_m = reinterpret_cast<float*>(bin_n + SAMPLE_BINS);
    unsigned long long* cand = reinterpret_cast<unsigned long long*>(bin_m + SAMPLE_BINS);
    unsigned long long* sorted = cand + NP;
    __shared__ float red[SAMPLE_THREADS / 32];
    __shared__ int sc[SAMPLE_THREADS / 32];
    __shared__ float sm[SAMPLE_THREADS / 32];
    __shared__ int stop_bin, n_cand, cut_at;
    __shared__ float best_v[SAMPLE_THREADS / 32];
    __shared__ int best_i[SAMPLE_THREADS / 32];
    const int b = blockIdx.x, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const T* x = logits + (i64)b * ldl;
    const float tp = to_dtype<T>(load_as_float<P>(top_p, b));
    const i64 tk = top_k[b];

    // 1. the row, its maximum and the softmax denominator at temperature 1
    float mx = -RTTS_INF;
    for (int i = tid; i < V; i += SAMPLE_THREADS) {
        xs[i] = load_as_float<T>(x, i);
        mx = fmaxf(mx, xs[i]);
    }
    for (int i = tid; i < SAMPLE_BINS; i += SAMPLE_THREADS) {
        bin_n[i] = 0;
        bin_m[i] = 0.f;
    }
    mx = warp_max(mx);
    if (lane == 0) red[warp] = mx;
    if (tid == 0) {
        stop_bin = SAMPLE_BINS - 1;
        n_cand = 0;
        cut_at = 0x7fffffff;
    }
    __syncthreads();
    const float x0 = warp_max(lane < SAMPLE_THREADS / 32 ? red[lane] : -RTTS_INF);
    float s = 0.f;
    for (int i = tid; i < V; i += SAMPLE_THREADS) s += expf(xs[i] - x0);
    const float sum = block_sum<SAMPLE_THREADS>(s, red);

    // 2. histogram by value, highest bin first: count and (unrounded) mass
    for (int i = tid; i < V; i += SAMPLE_THREADS) {
        const int bin = (int)(~ordered(xs[i]) >> (32 - SAMPLE_BIN_BITS));
        atomicAdd(&bin_n[bin], 1);
        atomicAdd(&bin_m[bin], expf(xs[i] - x0) / sum);
    }
    __syncthreads();
    // 3. the first bin where the bins so far hold top_k tokens or more than top_p + margin of the mass
    constexpr int PER = SAMPLE_BINS / SAMPLE_THREADS;
    int c_run = 0;
    float m_run = 0.f;
#pragma unroll
    for (int q = 0; q < PER; ++q) {
        c_run += bin_n[tid * PER + q];
        m_run += bin_m[tid * PER + q];
    }
    int c_before;
    float m_before;
    block_scan2(c_run, m_run, c_before, m_before, sc, sm);
#pragma unroll
    for (int q = 0; q < PER; ++q) {
        c_before += bin_n[tid * PER + q];
        m_before += bin_m[tid * PER + q];
        // (at least one token: top_k <= 0, as on the scratch slot's padded rows, still keeps rank 0)
        if (c_before > 0 && ((i64)c_before >= tk || m_before > tp + SAMPLE_MARGIN)) {
            atomicMin(&stop_bin, tid * PER + q);
            break;
        }
    }
    __syncthreads();
    // 4. the candidates: every token in bins up to stop_bin (a prefix of the sorted order), as sort keys
    const int last = stop_bin;
    for (int i = tid; i < V; i += SAMPLE_THREADS) {
        const unsigned desc = ~ordered(xs[i]);
        if ((int)(desc >> (32 - SAMPLE_BIN_BITS)) <= last)
            cand[atomicAdd(&n_cand, 1)] = ((unsigned long long)desc << 32) | (unsigned)i;
    }
    __syncthreads();
    const int C = n_cand;
    unsigned long long* order;
    if (C <= SAMPLE_THREADS) {  // rank by counting: a candidate's rank is the number of smaller keys
        if (tid < C) {
            const unsigned long long k = cand[tid];
            int r = 0;
            for (int j = 0; j < C; ++j) r += cand[j] < k;
            sorted[r] = k;
        }
        order = sorted;
    } else {
        int np = SAMPLE_THREADS;
        while (np < C) np <<= 1;
        for (int i = C + tid; i < np; i += SAMPLE_THREADS) cand[i] = ~0ull;
        __syncthreads();
        bitonic_sort(cand, np);
        order = cand;
    }
    __syncthreads();
    auto value = [&](int r) { return xs[(int)(order[r] & 0xffffffffu)]; };

    // 5. cumulative mass over the sorted candidates: runs of consecutive ranks per thread, offset by a block scan
    // Runs fixed by NP, not by C: the candidate count depends on the order of the histogram's float atomics, and a
    // rank's cumulative mass must not (the same seed gives the same draw).
    const int per = NP > SAMPLE_THREADS ? NP / SAMPLE_THREADS : 1;
    const int r0 = tid * per;
    float run = 0.f;
    for (int r = r0; r < r0 + per && r < C; ++r) run += to_dtype<T>(expf(value(r) - x0) / sum);
    int unused;
    float before;
    block_scan2(0, run, unused, before, sc, sm);
    float cum = before;
    for (int r = r0; r < r0 + per && r < C; ++r) {
        cum += to_dtype<T>(expf(value(r) - x0) / sum);
        if (r > 0 && (to_dtype<T>(cum) > tp || (i64)r >= tk)) {
            atomicMin(&cut_at, r);
            break;
        }
    }
    __syncthreads();
    const int K = max(1, min(cut_at, C));  // kept ranks [0, K): rank 0 always

    // 6. temperature softmax over the kept ranks
    const float t = fmaxf(load_as_float<P>(temperature, b), 1e-5f);
    const float s0 = to_dtype<T>(x0 / t);
    float s2 = 0.f;
    for (int r = tid; r < K; r += SAMPLE_THREADS) s2 += expf(to_dtype<T>(value(r) / t) - s0);
    const float sum2 = block_sum<SAMPLE_THREADS>(s2, red);

    // 7. exponential race among the kept ranks; ties to the lower original index
    const unsigned key = stream_key(seeds[b], counters[b], draw_mul);
    float best = -1.f;
    int at = 0x7fffffff;
    for (int r = tid; r < K; r += SAMPLE_THREADS) {
        const int i = (int)(order[r] & 0xffffffffu);
        const float q = to_dtype<T>(expf(to_dtype<T>(xs[i] / t) - s0) / sum2);
        keep_best(best, at, q / exp1_noise(key, ids[i]), i);
    }
    at = block_best_index<SAMPLE_THREADS>(best, at, best_v, best_i);
    if (tid == 0) out[b] = at < V ? at : 0;  // NaN logits win nothing: still an index the caller may use
}

#define DEFINE_SAMPLE(NAME, T, P)                                                                                  \
    extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)                                                   \
        NAME(const T* logits, int ldl, const P* temperature, const P* top_p, const i64* top_k, const i64* seeds,   \
             const i64* counters, const i64* ids, int V, int NP, unsigned draw_mul, i64* out) {                    \
        sample_row<T, P>(logits, ldl, temperature, top_p, top_k, seeds, counters, ids, V, NP, draw_mul, out);     \
    }

DEFINE_SAMPLE(sample_bf16_bf16, bf16_t, bf16_t)
DEFINE_SAMPLE(sample_bf16_f32, bf16_t, float)
DEFINE_SAMPLE(sample_f32_f32, float, float)
