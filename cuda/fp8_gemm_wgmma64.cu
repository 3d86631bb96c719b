// Block-scaled FP8 GEMM for decode batches of 17-128 tokens on Hopper (wgmma), y[M, N] = x[M, K] @ w[N, K]^T, with
// the operands of fp8_gemm_wgmma.cu (packed weights, 1x128 token scales sx[K/128, Mp], 128x128 weight scales), but
// 64-row tiles, one consumer warpgroup and the tokens streamed through a ring of their own next to the weights'.
//
// Why a second kernel: at 32-128 tokens the 128-row kernel needs two consumer warpgroups of 140+ registers and stages
// every token block it uses up front (up to 128 KB), so one of its CTAs fills an SM. The next GEMM then cannot become
// resident and stream its weights while this one finishes (what makes the 1-16 token chain fast), and a split tile's
// shares are 32 KB, which the settling CTA reads after its stream. Here:
//   - an iteration is (64-row half tile h, 128-wide K block kb): half of a packed 16 KB block (rows 64 * (h % 2) of
//     block [h / 2][kb]), 8 KB of weights, one m64nNTk32 wgmma chain;
//   - two rings: 8 KB weight stages, and token stages holding the NT x 128 tokens of an iteration's K block with
//     their NT scales. Weights are constants and fill their ring before griddepcontrol.wait; tokens and their
//     scales (written by the kernel ahead) come after it (separate rings let the host size them apart; measured,
//     weight rings deeper than four stages were no faster). Tokens are a tensor-map TMA load (gemm.launch_wgmma):
//     the copy engine applies the 128-byte swizzle the wgmma descriptor reads and zero-fills the rows past M;
//   - 192 threads (a consumer warpgroup, a producer warp, a publisher warp), at most 168 registers and under half an
//     SM's shared memory (host plan): two CTAs per SM. Short layers run one CTA per SM, so under PDL the next GEMM
//     becomes resident and fills its weight ring while this one finishes; long ones (gate|up, w2) two of their own
//     (gemm_plan.wgmma64_plan: the one consumer warpgroup, not the ring, bounds a lone CTA's stream);
//   - a split tile's shares are 64 x NT floats (16 KB at 64 tokens), and the CTA summing a tile bulk-copies the
//     others into its then free ring region, `slots` at a time, and sums them from shared memory (one L2 round trip
//     for all of them where they fit, instead of one per pair read into registers). Each sharer raises its own flag
//     (counters[c], reset by the settling CTA) and each share is copied as soon as its flag is up (faster than
//     waiting on one per-tile count before copying any share: bench/results/traces/README.md).
// The stream-K split, who settles which tile, the summation order (determinism) and the deadlock argument are those
// of fp8_gemm_wgmma.cu (streamk.cuh), over T = N/64 * K/128 iterations.
#include "streamk.cuh"

#define H_ROWS 64            // weight rows per iteration (half a packed block)
#define H_BYTES 8192         // their bytes
#define H_CONSUMERS 128      // one warpgroup
#define H_THREADS (H_CONSUMERS + 64)
#define H_BAR_READY 1        // producer warp -> consumers: stage barriers initialized (H_CONSUMERS + 32 threads)
#define H_BAR_PUBLISH 2      // consumers -> publisher warp: the first tile's share is parked (H_CONSUMERS + 32)
#define H_BAR_CONSUMERS 3    // the consumer warpgroup

// u / KB and u % KB in 32-bit arithmetic whenever u fits (always, for decode shapes): 64-bit division is emulated.
__device__ __forceinline__ void split_unit(i64 u, int KB, int& tile, int& kb) {
    if (u < (1ll << 32)) {
        tile = (int)((unsigned)u / (unsigned)KB);
        kb = (int)((unsigned)u - (unsigned)tile * (unsigned)KB);
    } else {
        tile = (int)(u / KB);
        kb = (int)(u - (i64)tile * KB);
    }
}

// Half tile h, K block kb of the packed weights [N/128][K/128][128 rows][128 bytes].
__device__ __forceinline__ const fp8_t* half_block(const fp8_t* wp, int h, int kb, int KB) {
    return wp + ((i64)(h >> 1) * KB + kb) * (2 * H_BYTES) + (h & 1) * H_BYTES;
}

// A settled tile to y[M, N] as bf16 through shared memory (`stage`: NT x 128 bytes, 16-byte aligned): the
// accumulator layout gives a thread single values of four token rows (store_tile writes them as 2-byte pieces), so
// they are staged as [token][64 rows] bf16, their 16-byte chunks XOR-swizzled by token row (the four token rows a
// warp writes at once then hit different banks), and copied out in 16-byte chunks of whole token rows. Rows past M
// are dropped; the 64-row kernel's N is a multiple of 64, so every column is in range.
template <int NT>
__device__ __forceinline__ void store_tile_staged(const float (&v)[NT / 2], unsigned char* stage,
                                                  bf16_t* __restrict__ y, int row0, int M, int N) {
    const int t = threadIdx.x, lane = t & 31;
#pragma unroll
    for (int r = 0; r < NT / 2; ++r) {
        const int n = 16 * (t >> 5) + (lane >> 2) + 8 * ((r & 3) >> 1);  // row of the tile
        const int m = 8 * (r >> 2) + 2 * (lane & 3) + (r & 1);            // token
        *reinterpret_cast<bf16_t*>(stage + m * 128 + (((n >> 3) ^ (m & 7)) << 4) + (n & 7) * 2) = float_to_bf16(v[r]);
    }
    named_barrier(H_BAR_CONSUMERS, H_CONSUMERS);
    for (int q = t; q < M * 8; q += H_CONSUMERS) {
        const int m = q >> 3, c = q & 7;
        *reinterpret_cast<uint4*>(y + (i64)m * N + row0 + 8 * c) =
            *reinterpret_cast<const uint4*>(stage + m * 128 + ((c ^ (m & 7)) << 4));
    }
}

// xmap: tensor map over x fp8 [M, K] (box 128 x NT rows, 128-byte swizzle, gemm.launch_wgmma). Two rings:
// `stages` weight stages (8 KB each) and `tstages` token stages (NT x 128 tokens and their NT scales).
template <int NT>
__global__ void __launch_bounds__(H_THREADS, 2)
    fp8_gemm_wgmma64(const __grid_constant__ TensorMap xmap, const float* __restrict__ sx,
                     const fp8_t* __restrict__ wp, const float* __restrict__ sw, bf16_t* __restrict__ y,
                     float* __restrict__ ws, int* __restrict__ counters, int M, int N, int K, int Mp, int stages,
                     int tstages, int slots) {
    constexpr int B_BYTES = NT * 128;          // one K block of tokens: a multiple of 1 KB (swizzle atoms stay aligned)
    constexpr int R = NT / 2;                  // accumulator registers per thread
    // Tensor-core accumulators per K block, summed in FP32 (see fp8_gemm_wgmma.cu). Two at 32 tokens, not the four of
    // the 128-row kernel: each accumulator more is registers and FP32 adds on the loop's critical path (measured
    // slower), and two keep the rounding test's bound (tests/test_kernels.py). One at 64 tokens is barely faster and
    // flipped a greedy token in the FP8 gate: 64 keeps two.
    constexpr int ACCS = NT <= 16 ? 4 : (NT <= 64 ? 2 : 1);
    constexpr int SHARE_BYTES = H_ROWS * NT * 4;  // one parked FP32 share
    extern __shared__ unsigned char smem_raw[];
    const unsigned raw = smem_u32(smem_raw);
    unsigned char* smem = smem_raw + (((raw + 1023u) & ~1023u) - raw);

    const int tid = threadIdx.x, lane = tid & 31;
    const int KB = K >> 7, C = gridDim.x, c = blockIdx.x;
    const i64 T = (i64)(N / H_ROWS) * KB;
    const i64 it0 = unit_begin(c, T, C);
    const int iters = (int)(unit_begin(c + 1, T, C) - it0);
    int first_tile, kb0;
    split_unit(it0, KB, first_tile, kb0);
    // Layout: ring region = [stages][8 KB weights] | [tstages][NT x 128 tokens], after the loop reused for `slots`
    // shares being summed (at least as long as either) | [tstages][NT] token scales | [iters] weight scales |
    // mbarriers full_w[stages], empty_w[stages], full_t[tstages], empty_t[tstages], settle
    const int region = max(stages * H_BYTES + tstages * B_BYTES, slots * SHARE_BYTES);
    const unsigned wring = smem_u32(smem), tring = wring + stages * H_BYTES;
    float* s_x = reinterpret_cast<float*>(smem + region);
    float* s_w = s_x + tstages * NT;  // iteration j's weight scale
    const unsigned full_w = (smem_u32(s_w + iters) + 7u) & ~7u, empty_w = full_w + 8 * stages;
    const unsigned full_t = empty_w + 8 * stages, empty_t = full_t + 8 * tstages;
    const unsigned settle_bar = empty_t + 8 * tstages;

    pdl_launch_dependents();
    // A first tile shared with earlier CTAs and finished before this CTA's range ends is published mid-range.
    const bool mid_publish = kb0 != 0 && it0 + iters > (i64)(first_tile + 1) * KB;
    if (tid >= H_CONSUMERS + 32) {  // ---- publisher warp
        if (mid_publish) {
            named_barrier(H_BAR_PUBLISH, H_CONSUMERS + 32);  // the consumers' stores are ordered before this
            if (tid == H_CONSUMERS + 32) red_add_release(&counters[c], 1);  // this CTA's share flag
        }
        return;
    }
    if (tid >= H_CONSUMERS) {  // ---- producer warp: one thread streams weights, tokens and token scales
        if (tid == H_CONSUMERS) {
            prefetch_tensor_map(&xmap);
            for (int s = 0; s < stages; ++s) {
                mbar_init(full_w + 8 * s, 1);                  // the producer's arrive (plus the copy's bytes)
                mbar_init(empty_w + 8 * s, H_CONSUMERS / 32);  // one arrive per consumer warp
            }
            for (int s = 0; s < tstages; ++s) {
                mbar_init(full_t + 8 * s, 1);
                mbar_init(empty_t + 8 * s, H_CONSUMERS / 32);
            }
            mbar_init(settle_bar, 1);  // (a settling CTA) the share copies
            fence_proxy_async();  // the inits are visible to the TMA engine (async proxy)
        }
        __syncwarp();
        named_barrier_arrive(H_BAR_READY, H_CONSUMERS + 32);
        if (tid == H_CONSUMERS) {
            const unsigned t_bytes = B_BYTES + 4u * Mp;
            // Iteration u's weights go to stage u % stages, its tokens to u % tstages. The weights the ring holds
            // are constants: copied before the wait. Then, each time the consumers are done with iteration i, the
            // stages it used take iteration i + tstages's tokens and i + stages's weights.
            const int wpre = min(stages, iters), tpre = min(tstages, iters);
            int wh = first_tile, wk = kb0;  // (half tile, K block) of the next weight copy
            int tk = kb0;                   // K block of the next token copy
            auto load_weights = [&](int st) {  // the next iteration's weights into weight stage st
                mbar_arrive_expect_tx(full_w + 8 * st, H_BYTES);
                bulk_copy_g2s(wring + st * H_BYTES, half_block(wp, wh, wk, KB), H_BYTES, full_w + 8 * st);
                if (++wk == KB) {
                    wk = 0;
                    ++wh;
                }
            };
            auto load_tokens = [&](int st) {  // the next iteration's tokens and their scales into token stage st
                mbar_arrive_expect_tx(full_t + 8 * st, t_bytes);
                tma_load_2d(tring + st * B_BYTES, &xmap, tk * 128, 0, full_t + 8 * st);
                bulk_copy_g2s(smem_u32(s_x + st * NT), sx + (i64)tk * Mp, 4u * Mp, full_t + 8 * st);
                if (++tk == KB) tk = 0;
            };
            for (int u = 0; u < wpre; ++u) load_weights(u);
            pdl_wait();  // tokens and their scales were written by the kernel ahead
            for (int u = 0; u < tpre; ++u) load_tokens(u);
            // i: the iteration whose release is awaited; (ts, tph) / (wsg, wph): its token / weight stage and phase.
            for (int i = 0, ts = 0, tph = 0, wsg = 0, wph = 0; i + tstages < iters || i + stages < iters; ++i) {
                if (i + tstages < iters) {
                    mbar_wait(empty_t + 8 * ts, tph);
                    load_tokens(ts);
                }
                if (i + stages < iters) {
                    mbar_wait(empty_w + 8 * wsg, wph);
                    load_weights(wsg);
                }
                ring_next(ts, tph, tstages);
                ring_next(wsg, wph, stages);
            }
        }
        return;
    }

    // ---- consumers. Weight scales (constants) are copied before the wait: iteration (h, kb) uses sw[h / 2][kb].
    for (int i = tid; i < iters; i += H_CONSUMERS) {
        int h, kb;
        split_unit(it0 + i, KB, h, kb);
        cp_async4(smem_u32(s_w + i), sw + (i64)(h >> 1) * KB + kb, true);
    }
    cp_async_commit();
    pdl_wait();  // every global write below comes after the kernel ahead (it may still read y or the scratch)
    cp_async_wait<0>();
    named_barrier(H_BAR_READY, H_CONSUMERS + 32);  // stage barriers initialized, every weight scale landed

    float total[R], acc[ACCS][R];
    zero_accumulators(total, acc);

    const unsigned wdesc = desc_sw128_lo(wring), tdesc = desc_sw128_lo(tring);
    int tile = first_tile, kb = kb0, settle = -1;
    bool whole = kb == 0;  // the segment being accumulated started at the tile's first K block
    // weight stage s = j % stages (phase j / stages & 1), token stage t = j % tstages (phase j / tstages & 1)
    for (int j = 0, s = 0, phase = 0, t = 0, tphase = 0; j < iters; ++j) {
        mbar_wait(full_t + 8 * t, tphase);
        mbar_wait(full_w + 8 * s, phase);
        mma_block<NT, ACCS>(acc, wdesc + s * (H_BYTES / 16), tdesc + t * (B_BYTES / 16));
        promote<NT, ACCS>(total, acc, s_w[j], s_x + t * NT, lane);
        __syncwarp();  // every lane has read the token scales
        if (lane == 0) {  // this warp is done with both stages
            mbar_arrive(empty_w + 8 * s);
            mbar_arrive(empty_t + 8 * t);
        }

        if (kb == KB - 1 || j == iters - 1) {  // end of this CTA's segment of `tile`
            if (whole && kb == KB - 1) {
                store_tile<NT>(total, y, tile * H_ROWS, M, N);
            } else if (whole) {
                settle = tile;  // its first K block is this CTA's: it sums the tile after the loop
            } else {
                // Another CTA settles this tile: park the share (this is its first tile), then raise this CTA's
                // flag, counters[c].
                park_share<NT, H_CONSUMERS>(total, ws, counters, c, c, j + 1 < iters, H_BAR_PUBLISH,
                                            H_BAR_CONSUMERS);
            }
            next_segment(total, whole, j + 1 < iters);
        }
        next_block(tile, kb, KB);
        ring_next(s, phase, stages);
        ring_next(t, tphase, tstages);
    }
    if (settle >= 0) {
        // The other shares of the tile (CTAs c + 1 ... c_hi) are bulk-copied into the free ring region, `slots` at a
        // time (one L2 round trip for all of them instead of one per pair of shares read into registers, which left a
        // long tail while the next GEMM streams: bench/results/traces/README.md), and summed in CTA order from shared
        // memory. Each share is copied as soon as its sharer's flag is up, in whatever order they come: lane k of
        // warp 0 polls share k of the batch, so reading the early shares overlaps the wait for the slowest sharer.
        const int want = unit_owner((i64)settle * KB + KB - 1, T, C) - c;
        const int per = min(slots, 32);  // a batch is at most one warp's lanes
        for (int b0 = 0, ph = 0; b0 < want; b0 += per, ph ^= 1) {
            const int nb = min(per, want - b0);
            // Every consumer warp is past its last MMA on the ring (first batch) or done reading the last batch.
            named_barrier(H_BAR_CONSUMERS, H_CONSUMERS);
            if (tid < 32) {
                if (lane == 0) mbar_arrive_expect_tx(settle_bar, (unsigned)(nb * SHARE_BYTES));
                __syncwarp();  // the batch's bytes are expected before any of its copies can land
                bool done = lane >= nb;
                while (__any_sync(0xffffffffu, !done)) {
                    if (!done) {
                        int* flag = counters + c + 1 + b0 + lane;
                        if (load_acquire(flag) != 0) {
                            *flag = 0;                   // ready for the next launch (graph replays included)
                            fence_proxy_async_global();  // the share acquired above, before the copy engine reads it
                            bulk_copy_g2s(wring + lane * SHARE_BYTES, ws + (i64)(c + 1 + b0 + lane) * (H_ROWS * NT),
                                          SHARE_BYTES, settle_bar);
                            done = true;
                        }
                    }
                }
            }
            mbar_wait(settle_bar, ph);
            const float* buf = reinterpret_cast<const float*>(smem);
            for (int k = 0; k < nb; ++k) {
#pragma unroll
                for (int r = 0; r < R; ++r) total[r] += buf[k * (H_ROWS * NT) + r * H_CONSUMERS + tid];
            }
        }
        named_barrier(H_BAR_CONSUMERS, H_CONSUMERS);  // every share read before the ring region stages the tile
        store_tile_staged<NT>(total, smem, y, settle * H_ROWS, M, N);
    }
}
