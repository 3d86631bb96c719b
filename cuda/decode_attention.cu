// Decode attention: one new query per stream over its slot's KV cache, grouped-query heads packed.
//   q      bf16 [B, n_kv*G, HD]           (RoPE applied)
//   kc, vc bf16 [rows, L, n_kv, HD]       (the slot-indexed cache of one layer; row stride L*n_kv*HD)
//   slots  int64 [B]                      (cache row of each batch row)
//   lens   int64 [B]                      (keys to attend: positions 0..lens-1; read on the device, so one captured
//                                          graph serves any lengths)
// Grid (S, n_kv, B): CTA (s, h, b) handles keys [s*chunk, (s+1)*chunk) of KV head h for the G query heads that share
// it, so each K/V byte is read once. With S > 1 (split-KV keeps small batches from idling most SMs) the splits write
// partials (m, l, o) that merge_splits combines, in one of two places (the host picks, attention.attention_fuses):
//   - decode_attention_merge_HD_G, a second launch (grid (n_kv, B)), once every split is done;
//   - the `_fused` instances: the last CTA of each (b, h) to finish merges its splits, counted in `counters`
//     (int32 [B * n_kv], zero; reset by that CTA, so graph replays need no memset). No second launch, which pays
//     off for one wave of many splits; but the merging CTA holds its SM slot through several dependent L2 round
//     trips, slow while the other CTAs saturate memory, so grids of more than one wave keep the second launch
//     (measured: bench/results/traces/README.md, "Figures moved out of code comments").
//
// Memory: 64-key tiles of K and V (32 KB at head dim 128) stream through a double-buffered cp.async pipeline
// (16-byte copies, zero fill past the length): one tile loads while the other computes, two CTAs per SM. The host
// picks the split count so the last wave of CTAs is nearly full (see attention_splits). Rows sit in shared memory
// with their 16-byte chunks XOR-swizzled by row (chunk c of row r at c ^ (r % 8)), so the eight rows of every
// ldmatrix read land in different banks.
// Compute (tensor cores, mma.m16n8k16 bf16 -> FP32): warp w owns keys 16w..16w+15 of each tile; the G query heads are
// the rows of the A operand (padded to 8). Scores Q K^T, an online softmax in base 2 on the accumulator fragments, then
// P V with P (rounded to bf16) straight from those fragments; warps merge in shared memory at the end.
// Tensor cores rather than CUDA cores, and two CTAs per SM rather than three (which spilled): both measured faster
// (bench/results/traces/README.md).
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
// registers apart from the main loop's (inlined, it made the kernel spill).
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

// A warp's running state: thread t holds query row t/4 (rows G.. are zero padding): its running max, its
// partial sum over the keys it scored, and output dims 8j + 2(t%4), +1 of each n8 tile j.
template <int HD>
struct WarpState {
    float m, l, o[HD / 8][2];
};

// The queries as bf16 pairs in shared memory, rows G..7 zero: a row stride of HD/2 + 4 words puts the
// 32 lanes' operand reads (row t/4, pair t%4 of a k16 step) in 32 different banks. Read per step rather than held in
// registers (16 more a thread).
template <int HD>
using QPairs = unsigned[8][HD / 2 + 4];

// One 64-key tile, tensor cores (mma.m16n8k16, the G query rows padded to 8): warp w takes keys 16w..16w+15 as two
// n8 tiles. Scores S = Q K^T with K rows straight from the swizzled tile (ldmatrix), online softmax in base 2 on the
// accumulator fragments, whose layout is that of the A operand of the next MMA (P, rounded to bf16), then O += P V
// with V transposed by ldmatrix. kt, vt: shared addresses of the tile's K and V rows.
template <int HD>
__device__ __forceinline__ void mma_tile(WarpState<HD>& st, const QPairs<HD>& qp, unsigned kt, unsigned vt, int warp,
                                         int lane, int key0, int end, float qscale) {
    constexpr int ROW = HD * 2, KS = HD / 16;
    float sc[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
    const int kr = warp * 16 + (lane >> 4) * 8 + (lane & 7), kc = (lane >> 3) & 1;  // this lane's ldmatrix row
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
        unsigned kf[4];  // B operands of keys 0-7 (dims 16ks.., 16ks+8..), then of keys 8-15
        ldmatrix_x4(kt + kr * ROW + (((2 * ks + kc) ^ (kr & 7)) << 4), kf);
        const unsigned qa_lo = qp[lane >> 2][8 * ks + (lane & 3)], qa_hi = qp[lane >> 2][8 * ks + 4 + (lane & 3)];
        mma_bf16_rows8(sc[0], qa_lo, qa_hi, kf[0], kf[1]);
        mma_bf16_rows8(sc[1], qa_lo, qa_hi, kf[2], kf[3]);
    }
    float tmax = -RTTS_INF;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const bool valid = key0 + 8 * nt + 2 * (lane & 3) + j < end;
            sc[nt][j] = valid ? sc[nt][j] * qscale : -RTTS_INF;
            tmax = fmaxf(tmax, sc[nt][j]);
        }
    tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));  // the row's four threads
    tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 2));
    const float mn = fmaxf(st.m, tmax);
    // Every key of the warp past the length (the same keys for every row): nothing to add, and the MMAs below stay
    // warp-uniform. Otherwise corr = 0 on a row's first valid keys (m = -inf), when l and o are still zero.
    const float corr = mn == -RTTS_INF ? 1.f : exp2f(st.m - mn);
    float lsum = 0.f;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            sc[nt][j] = sc[nt][j] == -RTTS_INF ? 0.f : exp2f(sc[nt][j] - mn);
            lsum += sc[nt][j];
        }
    st.l = st.l * corr + lsum;
    st.m = mn;
#pragma unroll
    for (int dt = 0; dt < HD / 8; ++dt) {
        st.o[dt][0] *= corr;
        st.o[dt][1] *= corr;
    }
    const unsigned pa_lo = pack_bf16x2(sc[0][0], sc[0][1]), pa_hi = pack_bf16x2(sc[1][0], sc[1][1]);
    const int vr = warp * 16 + ((lane >> 3) & 1) * 8 + (lane & 7), vc = lane >> 4;
#pragma unroll
    for (int dp = 0; dp < KS; ++dp) {
        unsigned vf[4];  // B operands of dims 16dp.. (keys 0-7, 8-15), then of dims 16dp+8..
        ldmatrix_x4_trans(vt + vr * ROW + (((2 * dp + vc) ^ (vr & 7)) << 4), vf);
        mma_bf16_rows8(st.o[2 * dp], pa_lo, pa_hi, vf[0], vf[1]);
        mma_bf16_rows8(st.o[2 * dp + 1], pa_lo, pa_hi, vf[2], vf[3]);
    }
}

template <int HD, int G, bool FUSED>
__device__ __forceinline__ void attend_split(const bf16_t* __restrict__ q, const bf16_t* __restrict__ kc,
                                             const bf16_t* __restrict__ vc, const i64* __restrict__ slots,
                                             const i64* __restrict__ lens, float* __restrict__ ws_o,
                                             float* __restrict__ ws_ml, bf16_t* __restrict__ out,
                                             int* __restrict__ counters, int n_kv, int L, int chunk, float scale) {
    static_assert(G <= 8, "the query heads are the 8 rows of an MMA operand");
    constexpr int CH = HD / 8;            // 16-byte chunks per row
    constexpr int ROW = HD * 2;           // bytes per row
    constexpr int TILE_BYTES = TILE * ROW;
    extern __shared__ __align__(16) unsigned char smem[];  // [STAGES][K tile, V tile]; warp merge at the end
    __shared__ QPairs<HD> qp;
    __shared__ float wm[WARPS][G], wl[WARPS][G];

    const int s = blockIdx.x, h = blockIdx.y, b = blockIdx.z, S = gridDim.x;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int H = n_kv * G;
    const i64 len = lens[b];
    const int start = s * chunk;
    const int end = (int)min((i64)start + chunk, len);
    const int ntiles = end > start ? (end - start + TILE - 1) / TILE : 0;
    const float qscale = scale * LOG2E;
    for (int i = tid; i < 8 * (HD / 2); i += blockDim.x) {
        const int row = i / (HD / 2), pr = i - row * (HD / 2);
        qp[row][pr] = row < G ? reinterpret_cast<const unsigned*>(q + ((i64)b * H + h * G + row) * HD)[pr] : 0u;
    }
    WarpState<HD> mst;
    mst.m = -RTTS_INF;
    mst.l = 0.f;
#pragma unroll
    for (int dt = 0; dt < HD / 8; ++dt) mst.o[dt][0] = mst.o[dt][1] = 0.f;

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

#pragma unroll
    for (int t = 0; t < STAGES - 1; ++t) load(t);

    for (int t = 0; t < ntiles; ++t) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // tile t landed for all; every warp is done with tile t-1's stage
        load(t + STAGES - 1);
        const int kt = (t % STAGES) * 2 * TILE_BYTES, key0 = start + t * TILE + warp * 16;
        mma_tile<HD>(mst, qp, sbase + kt, sbase + kt + TILE_BYTES, warp, lane, key0, end, qscale);
    }

    // Merge the warps, through the (now idle) pipeline memory.
    cp_async_wait<0>();
    __syncthreads();
    float(*wo)[G][HD] = reinterpret_cast<float(*)[G][HD]>(smem);  // [WARPS][G][HD]
    mst.l += __shfl_xor_sync(0xffffffffu, mst.l, 1);  // the row's sum over all 16 keys of each tile
    mst.l += __shfl_xor_sync(0xffffffffu, mst.l, 2);
    if (const int row = lane >> 2; row < G) {
        if ((lane & 3) == 0) {
            wm[warp][row] = mst.m;
            wl[warp][row] = mst.l;
        }
#pragma unroll
        for (int dt = 0; dt < HD / 8; ++dt)
            *reinterpret_cast<float2*>(&wo[warp][row][8 * dt + 2 * (lane & 3)]) =
                make_float2(mst.o[dt][0], mst.o[dt][1]);
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

// Two CTAs per SM (attention.CTAS_PER_SM): three leave 168 registers a thread, and the 128-dim instances spilled.
#define DEFINE_ATTN(HD, G)                                                                                        \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, 2) decode_attention_##HD##_##G(                       \
        const bf16_t* q, const bf16_t* kc, const bf16_t* vc, const i64* slots, const i64* lens, float* ws_o,      \
        float* ws_ml, bf16_t* out, int* counters, int n_kv, int L, int chunk, float scale) {                      \
        attend_split<HD, G, false>(q, kc, vc, slots, lens, ws_o, ws_ml, out, counters, n_kv, L, chunk, scale);    \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, 2) decode_attention_fused_##HD##_##G(                 \
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
