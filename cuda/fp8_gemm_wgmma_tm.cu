// Block-scaled FP8 GEMM for decode batches of up to 64 tokens on Hopper (wgmma), tokens as the MMA's M side, with the
// operands of fp8_gemm_wgmma.cu (packed weights [N/128][K/128][128 rows][128 bytes], 1x128 token scales
// sx[K/128, Mp], 128x128 weight scales sw[N/128, K/128], y bf16 [M, N]).
//
// Where it runs (gemm_plan.prefer_token_major): layers that cut into one tile per SM, whole-K tiles from 9 tokens,
// cluster pairs from 9 too (RTTS_GEMM_TM=0 / 1: never / wherever it has a plan). It beats stream-K on wqkv and wo;
// long layers (w2) stay on stream-K (gemm_plan._TM_MAX_ITERS). bench/results/traces/README.md has every run.
//
// Why a third kernel: the swap-AB kernels put weight rows on the wgmma M side (64 per warpgroup), so a layer of N rows
// has N/64 or N/128 tiles, too few to give every SM one whole tile, and their stream-K split leaves most tiles in
// pieces that a settling CTA sums after its stream (a measured tail after the median CTA's exit: see
// bench/results/traces/README.md). Here the 64 (zero-padded) token rows are the wgmma M side and a tile is WN
// weight rows (the N side: any multiple of 8), so the planner (gemm_plan.wgmma_tm_plan) can cut N into one tile per
// SM, each over all of K (S = 1) or over half of it with the two halves in a cluster pair (S = 2): no stream-K,
// no scratch, no settlement through L2; a tile ends with one sum in shared memory (and for S = 2 the totals the two
// ranks push into each other's shared memory, each rank storing half of the tile).
//   - an iteration is one 128-wide K block: WN x 128 weight bytes (one bulk copy, two where the tile crosses a packed
//     block's 128 rows) and the 64 x 128 token block (tensor-map TMA, 128-byte swizzle, rows past M zero-filled;
//     at NT = 32 only 32 rows are loaded and rows 32-63 of the MMA compute rows that are never stored);
//   - two rings as in fp8_gemm_wgmma64.cu: weight stages, filled before griddepcontrol.wait (constants), and token
//     stages with the block's token scales, filled after it; both with even stage counts (see the consumer loop);
//   - two consumer warpgroups take alternate K blocks (each with its own FP32 total, summed in a fixed order at the
//     end), so one's promotion overlaps the other's MMAs; a producer warp streams both rings;
//   - 288 threads, at most 112 registers and under half an SM's shared memory: two CTAs per SM, so under PDL the next
//     GEMM becomes resident beside this one and fills its weight ring while this one finishes.
// Rounding: each k32 MMA's products go to one of ACCS accumulators summed in FP32 per K block, then scaled by the
// block's token and weight scales (fp8_gemm_wgmma.cu says why).
#include "sm90.cuh"

#define TM_CONSUMERS 256            // two warpgroups
#define TM_THREADS (TM_CONSUMERS + 32)
#define TM_BAR_READY 1              // producer warp -> consumers: stage barriers initialized (TM_CONSUMERS + 32)
#define TM_BAR_SUM 2                // both consumer warpgroups
#define TM_BAR_STORE 3              // warpgroup 0 (tm_store)
#define TM_TOKEN_BYTES 8192         // one token stage: the MMA's 64 rows x 128 bytes
#define TM_SCALES 64                // token scales per token stage

// D[64 x WN] (+)= A[64 x 32] * B[WN x 32]^T as wgmmas of N = 32 / 16 / 8 over consecutive row pieces of the weight
// tile (row O of the tile starts O * 128 bytes into it: pieces start on 8-row swizzle atoms). Piece O's registers are
// d[O / 2 ...]: the m64nN accumulator layout puts column 8 j + c in registers 4 j + ..., the same as one wide MMA's.
// a / b are the descriptor low words (desc_sw128_lo) of the k step's token and weight bytes; the loop adds offsets
// to two per-stage words (sm90.cuh says why that holds) instead of rebuilding each MMA's descriptor (the rebuilds were
// a large share of the loop's instructions, in a loop whose issue rate bounds the kernel).
template <int WN, int O = 0>
__device__ __forceinline__ void wgmma_rows(float (&d)[WN / 2], unsigned a, unsigned b, int accumulate) {
    if constexpr (O < WN) {
        constexpr int P = WN - O >= 32 ? 32 : (WN - O >= 16 ? 16 : 8);
        wgmma_e4m3<P>(*reinterpret_cast<float(*)[P / 2]>(&d[O / 2]), desc_of(a), desc_of(b + O * 128 / 16),
                      accumulate);
        wgmma_rows<WN, O + P>(d, a, b, accumulate);
    }
}

// One K block of a consumer warpgroup: acc = tokens[64 x 128] * weights[WN x 128]^T, the four k32 steps (32 bytes:
// low word + 2) spread over ACCS accumulators, waited for. a / b: the stages' descriptor low words.
template <int WN, int ACCS>
__device__ __forceinline__ void tm_mma_block(float (&acc)[ACCS][WN / 2], unsigned a, unsigned b) {
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < 4; ++k) wgmma_rows<WN>(acc[k % ACCS], a + 2 * k, b + 2 * k, k >= ACCS);
    wgmma_commit();
    wgmma_wait_all();
#pragma unroll
    for (int q = 0; q < ACCS; ++q) fence_regs(acc[q]);
}

// total += acc * sx[row] * sw[column's weight block]: x0 / x1 are the scales of this thread's two token rows, wa / wb
// those of the weight blocks left / right of tile column `split` (a multiple of 8, so a column group of 8 never
// straddles it).
template <int WN, int ACCS>
__device__ __forceinline__ void tm_promote(float (&total)[WN / 2], const float (&acc)[ACCS][WN / 2], float x0, float x1,
                                           float wa, float wb, int split) {
#pragma unroll
    for (int j = 0; j < WN / 8; ++j) {
        const float w = 8 * j < split ? wa : wb;
        const float s0 = x0 * w, s1 = x1 * w;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float v = acc[0][4 * j + e];
#pragma unroll
            for (int q = 1; q < ACCS; ++q) v += acc[q][4 * j + e];
            total[4 * j + e] += v * (e < 2 ? s0 : s1);
        }
    }
}

// Warpgroup 0's [64 tokens x WN] total to y[M, N] as bf16: tile columns [0, wn) from n0 (rows past M and columns
// past wn dropped), through `stage` (64 x WN bf16 of free shared memory, 16-byte aligned): the accumulator layout
// gives a thread 4-byte pieces of eight rows, so it is written to shared memory first and copied out in 16-byte
// chunks of whole rows (direct 4-byte stores measured slower: bench/results/traces/README.md).
// Only column groups [g0, g1) (8 columns each) are stored: a cluster pair's ranks store one part each.
template <int WN>
__device__ __forceinline__ void tm_store(const float (&v)[WN / 2], unsigned char* stage, bf16_t* __restrict__ y,
                                         int n0, int wn, int M, int N, int g0, int g1) {
    const int t = threadIdx.x & 127, lane = t & 31;
    const int m = 16 * (t >> 5) + (lane >> 2);
#pragma unroll
    for (int r = 0; r < WN / 2; r += 2) {
        if (r / 4 < g0 || r / 4 >= g1) continue;
        const int row = m + 8 * ((r & 3) >> 1), col = 8 * (r >> 2) + 2 * (lane & 3);
        *reinterpret_cast<unsigned*>(stage + 2 * (row * WN + col)) = pack_bf16x2(v[r], v[r + 1]);
    }
    named_barrier(TM_BAR_STORE, 128);
    const int ch = g1 - g0;  // 16-byte chunks per row
    for (int q = t; q < M * ch; q += 128) {
        const int row = q / ch, c = g0 + q - row * ch;
        if (8 * c < wn)
            *reinterpret_cast<uint4*>(y + (i64)row * N + n0 + 8 * c) =
                *reinterpret_cast<const uint4*>(stage + 2 * (row * WN + 8 * c));
    }
}

// xmap: tensor map over x fp8 [M, K] (box 128 x NT rows, 128-byte swizzle). Grid: T * S CTAs (T tiles), clusters of
// S. Tile c covers the 8-row groups [c * G / T, (c + 1) * G / T) of the G = N / 8: widths differ by at most 8 rows
// and the host picks T (and WN, the widest) so that the grid is one CTA per SM. Why not equal tiles on fewer CTAs:
// any GEMM grid short of the SM count ran slower in a PDL chain (the next GEMM's CTAs double up on the idle SMs;
// bench/results/traces/README.md).
template <int NT, int WN, int S>
__global__ void __launch_bounds__(TM_THREADS, 2)
    fp8_gemm_wgmma_tm(const __grid_constant__ TensorMap xmap, const float* __restrict__ sx,
                      const fp8_t* __restrict__ wp, const float* __restrict__ sw, bf16_t* __restrict__ y, int M,
                      int N, int K, int Mp, int stages, int tstages) {
    static_assert(WN % 8 == 0 && WN <= 128 && (S == 1 || S == 2) && (NT == 32 || NT == 64), "fp8_gemm_wgmma_tm");
    constexpr int R = WN / 2, W_BYTES = WN * 128;
    // Two accumulators per K block: the 64-row kernel's choice at 32-64 tokens (its rounding test's bound holds,
    // and four would not fit two CTAs per SM at WN = 48).
    constexpr int ACCS = 2;
    extern __shared__ unsigned char smem_raw[];
    const unsigned raw = smem_u32(smem_raw);
    unsigned char* smem = smem_raw + (((raw + 1023u) & ~1023u) - raw);

    const int tid = threadIdx.x, lane = tid & 31;
    const int KB = K >> 7, iters = KB / S;
    const int tile = blockIdx.x / S, rank = blockIdx.x % S;  // clusters of S consecutive CTAs: rank = cluster rank
    const int T = gridDim.x / S, G = N >> 3;
    const int kbeg = rank * iters, n0 = 8 * (int)((i64)tile * G / T), wn = 8 * (int)((i64)(tile + 1) * G / T) - n0;
    const int blk = n0 >> 7, split = 128 - (n0 & 127);  // tile columns [0, split) lie in weight block blk
    const int rows_a = min(wn, split);
    // Layout: [stages][WN x 128] weights | [tstages][64 x 128] tokens (both regions multiples of 1 KB: swizzle atoms
    // stay aligned; after the loop the weight ring holds a warpgroup's total, the token ring the bf16 tile stored) |
    // (S = 2) [2][GH][128][4] floats: the peer's warpgroup totals of this rank's column groups (16-byte aligned:
    // the token ring is a multiple of 1 KB) | [tstages][64] token scales | [iters][2] weight scales (left / right of
    // split) | mbarriers full_w, empty_w, full_t, empty_t, (S = 2) recv_bar. (S = 2) rank 0 stores column groups
    // [0, GA), rank 1 [GA, WN / 8): the receive buffer is sized for the larger part, GH groups.
    constexpr int G8 = WN / 8, GA = G8 / 2, GH = G8 - GA;
    constexpr int RECV_BYTES = S == 2 ? 2 * GH * 2048 : 0;
    const unsigned wring = smem_u32(smem), tring = wring + stages * W_BYTES, recv = tring + tstages * TM_TOKEN_BYTES;
    float* s_x = reinterpret_cast<float*>(smem + stages * W_BYTES + tstages * TM_TOKEN_BYTES + RECV_BYTES);
    float* s_w = s_x + tstages * TM_SCALES;
    const unsigned full_w = (smem_u32(s_w + 2 * iters) + 7u) & ~7u, empty_w = full_w + 8 * stages;
    const unsigned full_t = empty_w + 8 * stages, empty_t = full_t + 8 * tstages, recv_bar = empty_t + 8 * tstages;

    pdl_launch_dependents();
    if (tid >= TM_CONSUMERS) {  // ---- producer warp: one thread streams weights, tokens and token scales
        if (tid == TM_CONSUMERS) {
            prefetch_tensor_map(&xmap);
            for (int s = 0; s < stages; ++s) {
                mbar_init(full_w + 8 * s, 1);                  // the producer's arrive (plus the copies' bytes)
                mbar_init(empty_w + 8 * s, TM_CONSUMERS / 64);  // one arrive per warp of the warpgroup using it
            }
            for (int s = 0; s < tstages; ++s) {
                mbar_init(full_t + 8 * s, 1);
                mbar_init(empty_t + 8 * s, TM_CONSUMERS / 64);
            }
            if constexpr (S == 2) {
                // the peer's totals of this rank's column groups land here as transaction bytes
                mbar_init(recv_bar, 1);
                mbar_arrive_expect_tx(recv_bar, 2 * (rank == 0 ? GA : GH) * 2048);
                fence_mbarrier_init_cluster();  // ... visible to the peer once it has waited on the cluster barrier
            }
            fence_proxy_async();  // the inits are visible to the TMA engine (async proxy)
        }
        __syncwarp();
        named_barrier_arrive(TM_BAR_READY, TM_CONSUMERS + 32);
        if constexpr (S == 2) cluster_arrive_relaxed();
        if (tid == TM_CONSUMERS) {
            const unsigned t_bytes = NT * 128 + 4u * Mp;
            const fp8_t* wa = wp + ((i64)blk * KB * 128 + (n0 & 127)) * 128;  // tile rows in block blk, K block 0
            const fp8_t* wb = wp + (i64)(blk + 1) * KB * 16384;              // the rest in block blk + 1
            auto load_weights = [&](int st, int kb) {
                // A narrower tile leaves the stage's last rows as they were: the MMAs compute their columns from
                // stale bytes and tm_store drops them.
                mbar_arrive_expect_tx(full_w + 8 * st, (unsigned)wn * 128u);
                bulk_copy_g2s(wring + st * W_BYTES, wa + (i64)kb * 16384, rows_a * 128, full_w + 8 * st);
                if (rows_a < wn)
                    bulk_copy_g2s(wring + st * W_BYTES + rows_a * 128, wb + (i64)kb * 16384, (wn - rows_a) * 128,
                                  full_w + 8 * st);
            };
            auto load_tokens = [&](int st, int kb) {
                mbar_arrive_expect_tx(full_t + 8 * st, t_bytes);
                tma_load_2d(tring + st * TM_TOKEN_BYTES, &xmap, kb * 128, 0, full_t + 8 * st);
                bulk_copy_g2s(smem_u32(s_x + st * TM_SCALES), sx + (i64)kb * Mp, 4u * Mp, full_t + 8 * st);
            };
            const int wpre = min(stages, iters), tpre = min(tstages, iters);
            for (int u = 0; u < wpre; ++u) load_weights(u, kbeg + u);
            pdl_wait();  // tokens and their scales were written by the kernel ahead
            for (int u = 0; u < tpre; ++u) load_tokens(u, kbeg + u);
            // Each time the consumers release iteration i's stages, they take iteration i + tstages's tokens and
            // i + stages's weights.
            for (int i = 0, ts = 0, tph = 0, wsg = 0, wph = 0; i + tstages < iters || i + stages < iters; ++i) {
                if (i + tstages < iters) {
                    mbar_wait(empty_t + 8 * ts, tph);
                    load_tokens(ts, kbeg + i + tstages);
                }
                if (i + stages < iters) {
                    mbar_wait(empty_w + 8 * wsg, wph);
                    load_weights(wsg, kbeg + i + stages);
                }
                ring_next(ts, tph, tstages);
                ring_next(wsg, wph, stages);
            }
        }
        if constexpr (S == 2) cluster_wait();  // (every thread of the cluster waits once for its arrive)
        return;
    }

    // ---- consumers. The weight scales of this CTA's K blocks (constants) are copied before the wait.
    const int blk_b = rows_a < wn ? blk + 1 : blk;
    for (int i = tid; i < iters; i += TM_CONSUMERS) {
        cp_async4(smem_u32(s_w + 2 * i), sw + (i64)blk * KB + kbeg + i, true);
        cp_async4(smem_u32(s_w + 2 * i + 1), sw + (i64)blk_b * KB + kbeg + i, true);
    }
    cp_async_commit();
    pdl_wait();  // every global write below comes after the kernel ahead (it may still read y)
    cp_async_wait<0>();
    named_barrier(TM_BAR_READY, TM_CONSUMERS + 32);  // stage barriers initialized, every weight scale landed
    if constexpr (S == 2) cluster_arrive_relaxed();  // waited for after the loop, long complete by then

    // The warpgroup index through a shuffle: the compiler then knows it is warp-uniform and keeps the loop's stage
    // indices and descriptors in uniform registers.
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0), m0 = 16 * ((tid & 127) >> 5) + (lane >> 2);  // token rows
    const unsigned tdesc = desc_sw128_lo(tring), wdesc = desc_sw128_lo(wring);
    float total[R], acc[ACCS][R];
    zero_accumulators(total, acc);
    // Warpgroup wg takes iterations wg, wg + 2, ...: weight stage j % stages (phase j / stages & 1), token stage
    // j % tstages. Both stage counts are even (the host checks): every stage is used by one warpgroup only, so the
    // parity waits below never see another warpgroup's use of the stage one phase behind (with an odd count they
    // could pass on its still pending load). A step of 2 wraps at most once.
    int s = wg, ph = 0, t = wg, tph = 0;
    if (s >= stages) s -= stages, ph ^= 1;
    if (t >= tstages) t -= tstages, tph ^= 1;
    for (int j = wg; j < iters; j += 2) {
        mbar_wait(full_t + 8 * t, tph);
        mbar_wait(full_w + 8 * s, ph);
        tm_mma_block<WN, ACCS>(acc, tdesc + t * (TM_TOKEN_BYTES / 16), wdesc + s * (W_BYTES / 16));
        const float x0 = s_x[t * TM_SCALES + m0], x1 = s_x[t * TM_SCALES + m0 + 8];
        __syncwarp();  // every lane has read the token scales
        if (lane == 0) {  // this warp is done with both stages
            mbar_arrive(empty_w + 8 * s);
            mbar_arrive(empty_t + 8 * t);
        }
        tm_promote<WN, ACCS>(total, acc, x0, x1, s_w[2 * j], s_w[2 * j + 1], split);
        s += 2;
        if (s >= stages) s -= stages, ph ^= 1;
        t += 2;
        if (t >= tstages) t -= tstages, tph ^= 1;
    }

    // The tile's sum in a fixed order (the same bits on every launch): warpgroup 0 + warpgroup 1, then for S = 2
    // rank 0's + rank 1's (float addition commutes, so either rank may do the last add). S = 2: each rank stores
    // its own column groups; its warpgroups first push their totals of the peer's groups into the peer's receive
    // buffer (st.async, counted on the peer's recv_bar), then it sums its own groups (warpgroups through the weight
    // ring, free once both are past their last MMA) and adds the peer's pair of totals once they have landed. Why not
    // two cluster barriers with rank 0 reading rank 1's shared memory: that pair sum measured slower
    // (bench/results/traces/README.md).
    int g0 = 0, g1 = G8;
    if constexpr (S == 2) {
        g0 = rank == 0 ? 0 : GA;
        g1 = rank == 0 ? GA : G8;
        const int p0 = rank == 0 ? GA : 0, p1 = rank == 0 ? G8 : GA;  // the peer's groups
        cluster_wait();  // the peer's recv_bar is initialized (its arrive came after the init's fence)
        const unsigned peer = rank ^ 1u;
        const unsigned dst = mapa_shared(recv, peer) + 16u * (tid & 127) + wg * (GH * 2048);
        const unsigned bar = mapa_shared(recv_bar, peer);
#pragma unroll
        for (int j = 0; j < G8; ++j) {
            if (j < p0 || j >= p1) continue;
            st_async_f32x4(dst + 2048u * (j - p0), total[4 * j], total[4 * j + 1], total[4 * j + 2], total[4 * j + 3],
                           bar);
        }
    }
    float* sum = reinterpret_cast<float*>(smem);  // [R][128 threads]: conflict free
    named_barrier(TM_BAR_SUM, TM_CONSUMERS);
    if (wg == 1) {
#pragma unroll
        for (int r = 0; r < R; ++r)
            if (r / 4 >= g0 && r / 4 < g1) sum[r * 128 + tid - 128] = total[r];
        named_barrier_arrive(TM_BAR_SUM, TM_CONSUMERS);  // (warpgroup 0 waits on it) this warpgroup is done
        return;
    }
    named_barrier(TM_BAR_SUM, TM_CONSUMERS);
#pragma unroll
    for (int r = 0; r < R; ++r)
        if (r / 4 >= g0 && r / 4 < g1) total[r] += sum[r * 128 + tid];
    if constexpr (S == 2) {
        const float4* in = reinterpret_cast<const float4*>(smem_raw + (recv - raw)) + tid;  // the peer's warpgroup 0
        mbar_wait(recv_bar, 0);
#pragma unroll
        for (int j = 0; j < G8; ++j) {
            if (j < g0 || j >= g1) continue;
            const float4 a = in[128 * (j - g0)], b = in[GH * 128 + 128 * (j - g0)];  // the peer's warpgroups 0, 1
            total[4 * j] += a.x + b.x;
            total[4 * j + 1] += a.y + b.y;
            total[4 * j + 2] += a.z + b.z;
            total[4 * j + 3] += a.w + b.w;
        }
    }
    tm_store<WN>(total, smem + stages * W_BYTES, y, n0, wn, M, N, g0, g1);  // staged in the free token ring
}
