// Decode attention: one new query per stream over its slot's KV cache, grouped-query heads packed.
//   q      bf16 [B, n_kv*G, HD]           (RoPE applied)
//   kc, vc bf16 [rows, L, n_kv, HD]       (the slot-indexed cache of one layer; row stride L*n_kv*HD)
//   slots  int64 [B]                      (cache row of each batch row)
//   lens   int64 [B]                      (keys to attend: positions 0..lens-1; read on the device, so one captured
//                                          graph serves any lengths)
// Grid (S, n_kv, B): CTA (s, h, b) handles keys [s*chunk, (s+1)*chunk) of KV head h for the G query heads that share
// it, so each K/V byte is read once. 4 warps take 32-key tiles; in a tile each lane scores one key (its whole K row,
// 256 B for HD=128) against the G queries, then the warp accumulates V with every lane owning HD/32 dimensions.
// Online softmax in base 2; warps merge in shared memory; with S > 1 splits write partials (m, l, o) that
// decode_attention_merge combines (split-KV keeps small batches from idling most SMs).
#include "common.cuh"

#define WARPS 4
#define LOG2E 1.4426950408889634f

template <int HD, int G>
__device__ __forceinline__ void attend_split(const bf16_t* __restrict__ q, const bf16_t* __restrict__ kc,
                                             const bf16_t* __restrict__ vc, const i64* __restrict__ slots,
                                             const i64* __restrict__ lens, float* __restrict__ ws_o,
                                             float* __restrict__ ws_ml, bf16_t* __restrict__ out, int n_kv, int L,
                                             int chunk, float scale) {
    constexpr int DPL = HD / 32;  // V dims per lane
    __shared__ float qs[G][HD];
    __shared__ float wm[WARPS][G], wl[WARPS][G];
    __shared__ float wo[WARPS][G][HD];
    const int s = blockIdx.x, h = blockIdx.y, b = blockIdx.z, S = gridDim.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int H = n_kv * G;
    const i64 len = lens[b];
    const int start = s * chunk;
    const int end = (int)min((i64)start + chunk, len);
    const float qscale = scale * LOG2E;
    for (int i = threadIdx.x; i < G * HD; i += blockDim.x) {
        const int gi = i / HD, d = i - gi * HD;
        qs[gi][d] = bf16_to_float(q[((i64)b * H + h * G + gi) * HD + d]) * qscale;
    }
    __syncthreads();

    const i64 row_stride = (i64)L * n_kv * HD;  // one slot
    const i64 key_stride = (i64)n_kv * HD;      // one position
    const bf16_t* kbase = kc + slots[b] * row_stride + h * HD;
    const bf16_t* vbase = vc + slots[b] * row_stride + h * HD;

    float m[G], l[G], acc[G][DPL];
#pragma unroll
    for (int gi = 0; gi < G; ++gi) {
        m[gi] = -RTTS_INF;
        l[gi] = 0.f;
#pragma unroll
        for (int d = 0; d < DPL; ++d) acc[gi][d] = 0.f;
    }

    for (int tile = start + warp * 32; tile < end; tile += WARPS * 32) {
        const int key = tile + lane;
        const bool valid = key < end;
        float sc[G];
#pragma unroll
        for (int gi = 0; gi < G; ++gi) sc[gi] = 0.f;
        if (valid) {
            const uint4* kr = reinterpret_cast<const uint4*>(kbase + (i64)key * key_stride);
#pragma unroll
            for (int c = 0; c < HD / 8; ++c) {
                const uint4 raw = __ldg(kr + c);
                const unsigned wds[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const float kv = bf16_to_float((wds[j >> 1] >> (16 * (j & 1))) & 0xffff);
#pragma unroll
                    for (int gi = 0; gi < G; ++gi) sc[gi] += qs[gi][c * 8 + j] * kv;
                }
            }
        }
        float p[G];
#pragma unroll
        for (int gi = 0; gi < G; ++gi) {
            const float tmax = warp_max(valid ? sc[gi] : -RTTS_INF);
            const float mn = fmaxf(m[gi], tmax);
            const float corr = exp2f(m[gi] - mn);  // m = -inf at first: corr = 0, and l/acc are 0 anyway
            p[gi] = valid ? exp2f(sc[gi] - mn) : 0.f;
            l[gi] = l[gi] * corr + warp_sum(p[gi]);
            m[gi] = mn;
#pragma unroll
            for (int d = 0; d < DPL; ++d) acc[gi][d] *= corr;
        }
        const int nk = min(32, end - tile);
        for (int kk = 0; kk < nk; ++kk) {
            const bf16_t* vr = vbase + (i64)(tile + kk) * key_stride + lane * DPL;
            float v[DPL];
            if (DPL == 4) {
                const uint2 raw = __ldg(reinterpret_cast<const uint2*>(vr));
                v[0] = bf16_to_float(raw.x & 0xffff);
                v[1] = bf16_to_float(raw.x >> 16);
                v[2 % DPL] = bf16_to_float(raw.y & 0xffff);
                v[3 % DPL] = bf16_to_float(raw.y >> 16);
            } else {
                const unsigned raw = __ldg(reinterpret_cast<const unsigned*>(vr));
                v[0] = bf16_to_float(raw & 0xffff);
                v[1 % DPL] = bf16_to_float(raw >> 16);
            }
#pragma unroll
            for (int gi = 0; gi < G; ++gi) {
                const float pk = __shfl_sync(0xffffffffu, p[gi], kk);
#pragma unroll
                for (int d = 0; d < DPL; ++d) acc[gi][d] += pk * v[d];
            }
        }
    }

    // Merge the warps.
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
    for (int i = threadIdx.x; i < G * HD; i += blockDim.x) {
        const int gi = i / HD, d = i - gi * HD;
        float mx = -RTTS_INF;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, wm[w][gi]);
        float lsum = 0.f, o = 0.f;
        if (mx != -RTTS_INF) {
#pragma unroll
            for (int w = 0; w < WARPS; ++w) {
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
}

#define DEFINE_ATTN(HD, G)                                                                                        \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) decode_attention_##HD##_##G(                          \
        const bf16_t* q, const bf16_t* kc, const bf16_t* vc, const i64* slots, const i64* lens, float* ws_o,      \
        float* ws_ml, bf16_t* out, int n_kv, int L, int chunk, float scale) {                                     \
        attend_split<HD, G>(q, kc, vc, slots, lens, ws_o, ws_ml, out, n_kv, L, chunk, scale);                     \
    }

DEFINE_ATTN(128, 1)
DEFINE_ATTN(128, 2)
DEFINE_ATTN(128, 4)
DEFINE_ATTN(128, 8)
DEFINE_ATTN(64, 1)
DEFINE_ATTN(64, 2)
DEFINE_ATTN(64, 4)
DEFINE_ATTN(64, 8)

// Combine S split partials per (b, kv head, query head, dim): grid (n_kv, B), block G*HD threads (<= 1024).
extern "C" __global__ void decode_attention_merge(const float* __restrict__ ws_o, const float* __restrict__ ws_ml,
                                                  bf16_t* __restrict__ out, int n_kv, int G, int HD, int S) {
    const int h = blockIdx.x, b = blockIdx.y;
    const int i = threadIdx.x;
    if (i >= G * HD) return;
    const int gi = i / HD, d = i - gi * HD;
    const i64 base = ((i64)b * n_kv + h) * S;
    float mx = -RTTS_INF;
    for (int s = 0; s < S; ++s) mx = fmaxf(mx, ws_ml[((base + s) * G + gi) * 2]);
    float lsum = 0.f, o = 0.f;
    for (int s = 0; s < S; ++s) {
        const i64 k = (base + s) * G + gi;
        const float mm = ws_ml[k * 2];
        if (mm == -RTTS_INF) continue;  // an empty split (past this stream's length)
        const float f = exp2f(mm - mx);
        lsum += ws_ml[k * 2 + 1] * f;
        o += ws_o[k * HD + d] * f;
    }
    out[((i64)b * n_kv * G + h * G + gi) * HD + d] = float_to_bf16(lsum > 0.f ? o / lsum : 0.f);
}
