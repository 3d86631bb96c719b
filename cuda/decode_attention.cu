// Decode attention: one new query per stream over its slot's KV cache, grouped-query heads packed.
//   q      bf16 [B, n_kv*G, HD]           (RoPE applied)
//   kc, vc bf16 [rows, L, n_kv, HD]       (the slot-indexed cache of one layer; row stride L*n_kv*HD)
//   slots  int64 [B]                      (cache row of each batch row)
//   lens   int64 [B]                      (keys to attend: positions 0..lens-1; read on the device, so one captured
//                                          graph serves any lengths)
// Grid (S, n_kv, B): CTA (s, h, b) handles keys [s*chunk, (s+1)*chunk) of KV head h for the G query heads that share
// it, so each K/V byte is read once. With S > 1 (split-KV keeps small batches from idling most SMs) the splits write
// partials (m, l, o) that merge_splits combines, in one of two places (the host picks, kernels.attention_fuses):
//   - decode_attention_merge_HD_G, a second launch (grid (n_kv, B)), once every split is done;
//   - the `_fused` instances: the last CTA of each (b, h) to finish merges its splits, counted in `counters`
//     (int32 [B * n_kv], zero; reset by that CTA, so graph replays need no memset). No second launch, which
//     measured 17.9 -> 11.3 us at batch 1 x 2048 keys (32 splits); but the merging CTA holds its SM slot through
//     several dependent L2 round trips, slow while the other CTAs saturate memory, so grids of more than one wave
//     keep the second launch (fused: 64 x 2048 keys 170 -> 199 us, bench/probes/attention_variants.py).
//
// Memory: 64-key tiles of K and V (32 KB at head dim 128) stream through a double-buffered cp.async pipeline
// (16-byte copies, zero fill past the length): one tile loads while the other computes, and three CTAs share an SM,
// so ~100 KB per SM is in flight instead of one row per warp. The host picks the split count so the last wave of
// CTAs is nearly full (see attention_splits). Rows sit in shared memory with their 16-byte chunks XOR-swizzled by
// row (chunk c of row r at c ^ (r % 8)): the score pass reads one row per lane pair and the value pass one row per
// warp, both bank-conflict free.
// Compute: warp w owns keys 16w..16w+15 of each tile. Scores: lane pair (l, l+16) splits one key's dimensions and
// combines with one shuffle. Online softmax in base 2 per warp, then the warp accumulates P.V with every lane owning
// HD/32 output dimensions; warps merge in shared memory at the end.
#include "sm90.cuh"

#define WARPS 4
#define TILE 64
#define STAGES 2
#define LOG2E 1.4426950408889634f

// Combine the S split partials of one (b, kv head): ws_ml [S][G][2] (max, sum) and ws_o [S][G][HD] from partial row
// p0 = ((b * n_kv + h) * S) * G on, into out rows q0 .. q0 + G - 1, by one CTA of 128 threads (the split that
// finished last, its pipeline memory free, or decode_attention_merge), with `buf` (shared memory, at least 2 * S * G
// floats): every (max, sum) pair is read once, in one round trip,
// then each thread sums 4 output dims over the splits with float4 loads kept 8 deep in flight. Splits are summed in
// index order whichever CTA merges, so every launch gives the same bits. Not inlined: ptxas then budgets its
// registers apart from the main loop's (inlined, the kernel spilled 44 bytes at 168 registers; head dim 128, G = 4).
template <int HD, int G>
__device__ __noinline__ void merge_splits(const float* __restrict__ ws_o, const float* __restrict__ ws_ml,
                                             bf16_t* __restrict__ out, float* buf, i64 p0, i64 q0, int S) {
    __shared__ float gmax[G], ginv[G];
    const int tid = threadIdx.x;
    float* ms = buf;           // [S][G] maxima, then the splits' weights exp2(m - max)
    float* ls = buf + S * G;   // [S][G] sums
    for (int i = tid; i < S * G; i += blockDim.x) {
        ms[i] = __ldcg(ws_ml + (p0 + i) * 2);
        ls[i] = __ldcg(ws_ml + (p0 + i) * 2 + 1);
    }
    __syncthreads();
    if (tid < G) {
        float mx = -RTTS_INF, lsum = 0.f;
        for (int s = 0; s < S; ++s) mx = fmaxf(mx, ms[s * G + tid]);
        if (mx != -RTTS_INF)
            for (int s = 0; s < S; ++s)
                if (ms[s * G + tid] != -RTTS_INF) lsum += ls[s * G + tid] * exp2f(ms[s * G + tid] - mx);
        gmax[tid] = mx;
        ginv[tid] = lsum > 0.f ? 1.f / lsum : 0.f;  // no valid key at all: zeros, as the unsplit kernel writes
    }
    __syncthreads();
    for (int i = tid; i < S * G; i += blockDim.x) {
        const float m = ms[i];
        ms[i] = m == -RTTS_INF ? 0.f : exp2f(m - gmax[i % G]);  // an empty split (past the length) weighs nothing
    }
    __syncthreads();
    constexpr int Q = HD / 4;  // float4s per head row
    for (int i = tid; i < G * Q; i += blockDim.x) {
        const int gi = i / Q, d4 = i - gi * Q;
        const float4* src = reinterpret_cast<const float4*>(ws_o) + (p0 + gi) * Q + d4;
        float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
        for (int s = 0; s < S; ++s) {
            const float f = ms[s * G + gi];
            const float4 v = __ldcg(src + (i64)s * G * Q);
            o.x += f * v.x;
            o.y += f * v.y;
            o.z += f * v.z;
            o.w += f * v.w;
        }
        const float inv = ginv[gi];
        bf16_t* dst = out + (q0 + gi) * HD + 4 * d4;
        dst[0] = float_to_bf16(o.x * inv);
        dst[1] = float_to_bf16(o.y * inv);
        dst[2] = float_to_bf16(o.z * inv);
        dst[3] = float_to_bf16(o.w * inv);
    }
}

template <int HD, int G, bool FUSED>
__device__ __forceinline__ void attend_split(const bf16_t* __restrict__ q, const bf16_t* __restrict__ kc,
                                             const bf16_t* __restrict__ vc, const i64* __restrict__ slots,
                                             const i64* __restrict__ lens, float* __restrict__ ws_o,
                                             float* __restrict__ ws_ml, bf16_t* __restrict__ out,
                                             int* __restrict__ counters, int n_kv, int L, int chunk, float scale) {
    constexpr int CH = HD / 8;            // 16-byte chunks per row
    constexpr int ROW = HD * 2;           // bytes per row
    constexpr int DPL = HD / 32;          // output dims per lane
    constexpr int QH = HD / 2 + 4;        // q half-row stride in floats (padding keeps the two halves' banks apart)
    constexpr int TILE_BYTES = TILE * ROW;
    extern __shared__ __align__(16) unsigned char smem[];  // [STAGES][K tile, V tile]; warp merge at the end
    __shared__ __align__(16) float qs[G][2 * QH];
    __shared__ float wm[WARPS][G], wl[WARPS][G];

    const int s = blockIdx.x, h = blockIdx.y, b = blockIdx.z, S = gridDim.x;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int H = n_kv * G;
    const i64 len = lens[b];
    const int start = s * chunk;
    const int end = (int)min((i64)start + chunk, len);
    const int ntiles = end > start ? (end - start + TILE - 1) / TILE : 0;
    const float qscale = scale * LOG2E;
    for (int i = tid; i < G * HD; i += blockDim.x) {
        const int gi = i / HD, d = i - gi * HD;
        qs[gi][(d / (HD / 2)) * QH + d % (HD / 2)] = bf16_to_float(q[((i64)b * H + h * G + gi) * HD + d]) * qscale;
    }

    const i64 key_stride = (i64)n_kv * HD;  // elements between positions
    const bf16_t* kbase = kc + slots[b] * (i64)L * key_stride + h * HD;
    const bf16_t* vbase = vc + slots[b] * (i64)L * key_stride + h * HD;
    const unsigned sbase = smem_u32(smem);

    auto load = [&](int t) {  // tile t into stage t % STAGES; always commits a group
        if (t < ntiles) {
            const unsigned st = sbase + (t % STAGES) * 2 * TILE_BYTES;
#pragma unroll
            for (int i = 0; i < 2 * TILE * CH / 128; ++i) {
                const int idx = tid + 128 * i;
                const int which = idx / (TILE * CH), rem = idx - which * TILE * CH;
                const int r = rem / CH, c = rem - r * CH;
                const int key = start + t * TILE + r;
                const bool ok = key < end;
                const bf16_t* src = (which ? vbase : kbase) + (i64)(ok ? key : start) * key_stride + c * 8;
                cp_async16(st + which * TILE_BYTES + r * ROW + ((c ^ (r & 7)) << 4), src, ok);
            }
        }
        cp_async_commit();
    };

    float m[G], l[G], acc[G][DPL];
#pragma unroll
    for (int gi = 0; gi < G; ++gi) {
        m[gi] = -RTTS_INF;
        l[gi] = 0.f;
#pragma unroll
        for (int d = 0; d < DPL; ++d) acc[gi][d] = 0.f;
    }

#pragma unroll
    for (int t = 0; t < STAGES - 1; ++t) load(t);

    const int half = lane >> 4, kr = warp * 16 + (lane & 15);  // score pass: this lane's key row and half
    for (int t = 0; t < ntiles; ++t) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // tile t landed for all; every warp is done with tile t-1's stage
        load(t + STAGES - 1);
        const unsigned char* kt = smem + (t % STAGES) * 2 * TILE_BYTES;
        const unsigned char* vt = kt + TILE_BYTES;

        // Scores of key kr against the G queries (this lane: half of the dimensions).
        float sc[G];
#pragma unroll
        for (int gi = 0; gi < G; ++gi) sc[gi] = 0.f;
#pragma unroll
        for (int cc = 0; cc < CH / 2; ++cc) {
            const int c = half * (CH / 2) + cc;
            const uint4 raw = *reinterpret_cast<const uint4*>(kt + kr * ROW + ((c ^ (kr & 7)) << 4));
            const unsigned wds[4] = {raw.x, raw.y, raw.z, raw.w};
            float kv[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) kv[j] = bf16_to_float((wds[j >> 1] >> (16 * (j & 1))) & 0xffff);
#pragma unroll
            for (int gi = 0; gi < G; ++gi) {
                const float4 q0 = *reinterpret_cast<const float4*>(&qs[gi][half * QH + cc * 8]);
                const float4 q1 = *reinterpret_cast<const float4*>(&qs[gi][half * QH + cc * 8 + 4]);
                sc[gi] += q0.x * kv[0] + q0.y * kv[1] + q0.z * kv[2] + q0.w * kv[3] + q1.x * kv[4] + q1.y * kv[5] +
                          q1.z * kv[6] + q1.w * kv[7];
            }
        }
        const bool valid = start + t * TILE + kr < end;
        float p[G];
#pragma unroll
        for (int gi = 0; gi < G; ++gi) {
            sc[gi] += __shfl_xor_sync(0xffffffffu, sc[gi], 16);
            const float tmax = warp_max(valid ? sc[gi] : -RTTS_INF);
            const float mn = fmaxf(m[gi], tmax);
            if (mn == -RTTS_INF) {  // no valid key yet for this warp (a tile past this stream's length)
                p[gi] = 0.f;
                continue;
            }
            const float corr = exp2f(m[gi] - mn);  // m = -inf at first: corr = 0, and l/acc are 0 anyway
            p[gi] = valid ? exp2f(sc[gi] - mn) : 0.f;
            l[gi] = l[gi] * corr + warp_sum(half ? 0.f : p[gi]);
            m[gi] = mn;
#pragma unroll
            for (int d = 0; d < DPL; ++d) acc[gi][d] *= corr;
        }

        // P.V over the warp's 16 keys: lane owns dims lane*DPL .. +DPL.
#pragma unroll
        for (int kk = 0; kk < 16; ++kk) {
            const int r = warp * 16 + kk;
            float v[DPL];
            if constexpr (DPL == 4) {
                const uint2 raw = *reinterpret_cast<const uint2*>(vt + r * ROW + (((lane >> 1) ^ (r & 7)) << 4) +
                                                                  (lane & 1) * 8);
                v[0] = bf16_to_float(raw.x & 0xffff);
                v[1] = bf16_to_float(raw.x >> 16);
                v[2] = bf16_to_float(raw.y & 0xffff);
                v[3] = bf16_to_float(raw.y >> 16);
            } else {
                const unsigned raw = *reinterpret_cast<const unsigned*>(vt + r * ROW + (((lane >> 2) ^ (r & 7)) << 4) +
                                                                        (lane & 3) * 4);
                v[0] = bf16_to_float(raw & 0xffff);
                v[1] = bf16_to_float(raw >> 16);
            }
#pragma unroll
            for (int gi = 0; gi < G; ++gi) {
                const float pk = __shfl_sync(0xffffffffu, p[gi], kk);
#pragma unroll
                for (int d = 0; d < DPL; ++d) acc[gi][d] += pk * v[d];
            }
        }
    }

    // Merge the warps, through the (now idle) pipeline memory.
    cp_async_wait<0>();
    __syncthreads();
    float(*wo)[G][HD] = reinterpret_cast<float(*)[G][HD]>(smem);  // [WARPS][G][HD]
#pragma unroll
    for (int gi = 0; gi < G; ++gi) {
        if (lane == 0) {
            wm[warp][gi] = m[gi];
            wl[warp][gi] = l[gi];
        }
#pragma unroll
        for (int d = 0; d < DPL; ++d) wo[warp][gi][lane * DPL + d] = acc[gi][d];
    }
    __syncthreads();
    for (int i = tid; i < G * HD; i += blockDim.x) {
        const int gi = i / HD, d = i - gi * HD;
        float mx = -RTTS_INF;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, wm[w][gi]);
        float lsum = 0.f, o = 0.f;
        if (mx != -RTTS_INF) {
#pragma unroll
            for (int w = 0; w < WARPS; ++w) {
                if (wm[w][gi] == -RTTS_INF) continue;
                const float f = exp2f(wm[w][gi] - mx);
                lsum += wl[w][gi] * f;
                o += wo[w][gi][d] * f;
            }
        }
        if (S == 1) {
            out[((i64)b * H + h * G + gi) * HD + d] = float_to_bf16(lsum > 0.f ? o / lsum : 0.f);
        } else {
            const i64 base = (((i64)b * n_kv + h) * S + s) * G + gi;
            ws_o[base * HD + d] = o;
            if (d == 0) {
                ws_ml[base * 2] = mx;
                ws_ml[base * 2 + 1] = lsum;
            }
        }
    }
    if (!FUSED || S == 1) return;
    // The last split of (b, h) to finish merges them all (the classic fence-then-count handoff: every CTA's partials
    // are visible device-wide before its arrival is counted, and the last one fences again before reading).
    __shared__ int is_last;
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        int* ctr = counters + (i64)b * n_kv + h;
        is_last = atomicAdd(ctr, 1) == S - 1;
        if (is_last) *ctr = 0;  // every split has arrived: ready for the next launch
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    merge_splits<HD, G>(ws_o, ws_ml, out, reinterpret_cast<float*>(smem), (((i64)b * n_kv + h) * S) * G,
                        (i64)b * H + h * G, S);
}

// The fused instances are held to three CTAs per SM (168 registers, as the split planner kernels.attention_splits
// counts): their merge call otherwise pushes the main loop past it.
#define DEFINE_ATTN(HD, G)                                                                                        \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) decode_attention_##HD##_##G(                          \
        const bf16_t* q, const bf16_t* kc, const bf16_t* vc, const i64* slots, const i64* lens, float* ws_o,      \
        float* ws_ml, bf16_t* out, int* counters, int n_kv, int L, int chunk, float scale) {                      \
        attend_split<HD, G, false>(q, kc, vc, slots, lens, ws_o, ws_ml, out, counters, n_kv, L, chunk, scale);    \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, 3) decode_attention_fused_##HD##_##G(                 \
        const bf16_t* q, const bf16_t* kc, const bf16_t* vc, const i64* slots, const i64* lens, float* ws_o,      \
        float* ws_ml, bf16_t* out, int* counters, int n_kv, int L, int chunk, float scale) {                      \
        attend_split<HD, G, true>(q, kc, vc, slots, lens, ws_o, ws_ml, out, counters, n_kv, L, chunk, scale);     \
    }                                                                                                             \
    /* grid (n_kv, B), 128 threads, 2 * S * G floats of dynamic shared memory */                                  \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) decode_attention_merge_##HD##_##G(                    \
        const float* ws_o, const float* ws_ml, bf16_t* out, int n_kv, int S) {                                    \
        extern __shared__ __align__(16) unsigned char mbuf[];                                                     \
        const int h = blockIdx.x, b = blockIdx.y;                                                                 \
        merge_splits<HD, G>(ws_o, ws_ml, out, reinterpret_cast<float*>(mbuf), (((i64)b * n_kv + h) * S) * G,      \
                            ((i64)b * n_kv + h) * G, S);                                                          \
    }

DEFINE_ATTN(128, 1)
DEFINE_ATTN(128, 2)
DEFINE_ATTN(128, 4)
DEFINE_ATTN(128, 8)
DEFINE_ATTN(64, 1)
DEFINE_ATTN(64, 2)
DEFINE_ATTN(64, 4)
DEFINE_ATTN(64, 8)
