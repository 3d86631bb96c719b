// Block-scaled FP8 GEMM for decode shapes on Hopper tensor cores (wgmma), y[M, N] = x[M, K] @ w[N, K]^T:
//   x:  float8 e4m3 [M, K], 1x128 blocks, scales sx[K/128, Mp] (K-major, Mp = M rounded up to 4), M <= 128
//   wp: float8 e4m3 weights in the packed tile layout [N/128][K/128][128 rows][128 bytes]: each 16 KB block is one
//       128x128 scale block already in the 128-byte-swizzled K-major layout the wgmma descriptors read
//       (pack_weight in rtts/kernels/reference.py), so it lands in shared memory with one contiguous bulk copy
//   sw: 128x128 block scales [N/128, K/128] (row-major)
//   y:  bfloat16 [M, N]
//
// Swap-AB: weight rows are the wgmma M side and the tokens (M padded to NT = 8..128) the N side, so one token costs
// an 8-column sliver instead of a 64-row tile. An iteration is one (128-row tile, 128-wide K block).
//
// Warp specialization (the decode GEMM is a weight stream; what bounds it is how many weight bytes each SM keeps in
// flight without stalling on synchronization):
//   - warp 8 (producer): one thread walks this CTA's iterations and, for each, waits until stage s is free, then
//     issues one 16 KB bulk copy (TMA engine) of the packed block that completes on full[s]. Packed blocks are in
//     iteration order, so a CTA's weights are one contiguous stream.
//   - warp 9 (publisher, global stream-K only): counts this CTA's first tile in when its share was parked mid-range
//     (a release add, whose fence would otherwise stall a consumer warpgroup while the ring holds weights).
//   - warps 0-7 (two consumer warpgroups, 64 rows each): wait on full[s], four m64nNTk32 wgmmas from shared memory,
//     release the stage (empty[s], one arrive per warp once its wgmma wait returns), promote in FP32:
//     total += acc * sw * sx (per 128-K block, so FP8 rounding never accumulates across blocks). Per iteration only
//     the two mbarriers of the stage, plus, the first time a token block is used, a wait for its copies and a
//     consumer barrier (so for most of a decode GEMM's iterations: a CTA visits min(K/128, its iterations) blocks).
//
// Tokens and weight scales: every K block of tokens this CTA needs, and the scale of each of its iterations, is copied
// once into shared memory at the start (cp.async, one group per token block in first-use order); an iteration waits
// only for the block it uses the first time (tiles up to 16 tokens wide wait for all of them at once).
//
// Stream-K: the grid is persistent (one CTA per SM) and CTA c takes the contiguous iteration range
// [c*T/C, (c+1)*T/C) of the T = tiles * K/128 iterations in tile-major order, so every CTA streams the same number of
// weight bytes whatever the shape (no wave quantization, no separate split-K launch for narrow N). A tile covered by
// one CTA is written straight to y. A tile shared by several is summed by the one holding its first K block (always
// that CTA's last segment), in CTA order (the same bits on every launch): the others park their FP32 shares in a
// per-stream workspace and count themselves in with a release add (no round trip, so a CTA publishing its first
// tile mid-range keeps streaming), the summing CTA spins on the tile's counter and resets it (graph replays need no
// memset). Publishing never waits and a CTA only waits for later ones, so the spin cannot deadlock while the grid's
// CTAs are all resident (the planner's grids are at most one per SM, except where it grows a grid whose tokens
// leave no room for two stages) or are dispatched in index order. It waits for the count to reach `want` rather than
// equal it: should scratch ever be shared by mistake, a wrong result is recoverable and a hung GPU is not.
// Cluster mode (CLUSTER, planned by the host where it settles faster) keeps every shared tile inside a cluster of
// CTAs and sums it in distributed shared memory instead (reduce_slice).
//
// PDL: launched with programmatic stream serialization, the prologue (barrier setup, the weight copies the ring holds,
// the weight scales) runs while the previous kernel finishes: only constants are read before griddepcontrol.wait,
// every other global read and all global writes come after it. The kernel lets its own dependents launch at once
// (measured: later triggers were slower), so with the lean instances (two CTAs per SM) the next GEMM streams its
// weights into its ring while this one finishes.
#include "streamk.cuh"

#define TILE_ROWS 128     // weight rows per iteration: one 128x128 scale block, 64 per consumer warpgroup
#define TILE_BYTES 16384  // one packed block
#define CONSUMERS 256     // two warpgroups
#define THREADS (CONSUMERS + 64)
#define BAR_CONSUMERS 1   // named barrier over the consumer threads
#define BAR_READY 2       // producer warp -> consumers: stage barriers initialized (CONSUMERS + 32 threads)
#define BAR_PUBLISH 3     // consumers -> publisher warp: the first tile's share is parked (CONSUMERS + 32 threads)

// Wait until at most n of this thread's cp.async groups are pending (n clamped to 7: waiting for more is safe).
__device__ __forceinline__ void cp_async_wait_upto(int n) {
    switch (n) {
        case 0: cp_async_wait<0>(); break;
        case 1: cp_async_wait<1>(); break;
        case 2: cp_async_wait<2>(); break;
        case 3: cp_async_wait<3>(); break;
        case 4: cp_async_wait<4>(); break;
        case 5: cp_async_wait<5>(); break;
        case 6: cp_async_wait<6>(); break;
        default: cp_async_wait<7>(); break;
    }
}

// Cluster settlement (CLUSTER): the shares of tile t, all in this cluster, are parked in the sharers' shared memory
// (a CTA's first tile in slot A, its last in slot B = the free weight ring); after a cluster barrier each sharer sums
// its slice of the tile (1/S of it, S sharers) from every share in rank order, over distributed shared memory.
// NOTE: each thread's loop takes one DSMEM round trip per element it sums (a global-memory version of this measured
// slower: bench/results/traces/README.md); at 64 tokens that is ~8 per thread.
template <int NT>
__device__ __forceinline__ void reduce_slice(unsigned slot_a, unsigned slot_b, bf16_t* __restrict__ y, int t, i64 base,
                                             i64 Tl, int Cl, int rl, int KB, int M, int N) {
    constexpr int F = TILE_ROWS * NT;  // floats per share: [NT / 2 registers][256 consumer threads]
    const int r_lo = unit_owner((i64)t * KB - base, Tl, Cl), r_hi = unit_owner((i64)t * KB + KB - 1 - base, Tl, Cl);
    const int S = r_hi - r_lo + 1, i = rl - r_lo;
    // Every sharer but the first holds t as its first tile (slot A); the first one does when its range starts at
    // t's first block, else t is its last tile (slot B).
    const bool lo_first = unit_begin(r_lo, Tl, Cl) == (i64)t * KB - base;
    unsigned src[8];  // a cluster has at most 8 CTAs
#pragma unroll
    for (int u = 0; u < 8; ++u)
        src[u] = u < S ? mapa_shared(u > 0 || lo_first ? slot_a : slot_b, (unsigned)(r_lo + u)) : 0u;
    const int lo = i * F / S, hi = (i + 1) * F / S;
    for (int q = lo + (int)threadIdx.x; q < hi; q += CONSUMERS) {
        const int r = q / CONSUMERS, th = q % CONSUMERS, l = th & 31;
        const int n = t * TILE_ROWS + 64 * (th >> 7) + 16 * ((th & 127) >> 5) + (l >> 2) + 8 * ((r & 3) >> 1);
        const int m = 8 * (r >> 2) + 2 * (l & 3) + (r & 1);
        if (m >= M) continue;
        float v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) v[u] = u < S ? ld_cluster_f32(src[u] + 4u * q) : 0.f;
        float sum = 0.f;
#pragma unroll
        for (int u = 0; u < 8; ++u) if (u < S) sum += v[u];
        if (n < N) y[(i64)m * N + n] = float_to_bf16(sum);
    }
}

// The GEMM. stages: weight blocks in flight per CTA, sized by the host from the shared memory the tokens leave.
// CLUSTER = false: persistent stream-K over the whole grid, settled through global memory (see the file comment).
// CLUSTER = true: launched in clusters of CS CTAs (cluster dimension set at launch); cluster g takes the whole tiles
// [g * tiles / G, (g + 1) * tiles / G) and splits their iterations stream-K style over its CTAs, so every shared tile
// is settled on chip (reduce_slice) with two cluster barriers and no global atomics.
// TMA (the lean instances' `_tma` entry points, what gemm.launch_wgmma runs where the driver encodes tensor maps;
// RTTS_GEMM_TMA_TOKENS=0 selects cp.async): the tokens of every K block this CTA visits and their scales come by
// tensor-map TMA (xmap: box 128 x NT rows, 128-byte swizzle, rows past M zero-filled by the copy engine, its
// descriptor prefetched in the prologue), issued by the producer thread right after griddepcontrol.wait and landing
// on one mbarrier, instead of 16-byte cp.async copies by every consumer thread plus a consumer barrier. Why: the first
// MMA then follows the wait sooner, and TMA measured faster on every S2-Pro linear at 1 and 16 tokens
// (bench/results/traces/README.md). Scales past Mp are left unwritten: those columns' products are zero (their tokens
// are), are never summed into others, and store_tile drops them.
template <int NT, bool CLUSTER, bool TMA = false>
__device__ __forceinline__ void gemm_body(const fp8_t* __restrict__ x, const float* __restrict__ sx,
                                          const fp8_t* __restrict__ wp, const float* __restrict__ sw,
                                          bf16_t* __restrict__ y, float* __restrict__ ws, int* __restrict__ counters,
                                          int M, int N, int K, int Mp, int stages, const TensorMap* xmap = nullptr) {
    static_assert(!(TMA && CLUSTER), "TMA tokens: global stream-K instances only");
    constexpr int B_BYTES = NT * 128;  // one K block of tokens
    constexpr int R = NT / 2;          // accumulator registers per thread
    // FP8 wgmma accumulates with reduced precision (about 14 mantissa bits, not FP32), so the four k32 MMAs of a
    // 128-wide K block go into separate accumulators (as many as registers allow) that are summed in FP32: with
    // four, no tensor-core sum spans more than 32 products (one accumulator per block measured far less accurate, with
    // outliers on outputs near zero; tests/test_kernels.py bounds the error).
    // NT = 128 keeps one: with 10 warps per CTA, 3 share an SM sub-partition, which caps a thread at 168 registers,
    // and its FP32 total, accumulator and settle sum alone take 192 (ptxas spills ~250 bytes at NT = 128).
    constexpr int ACCS = NT <= 32 ? 4 : (NT == 64 ? 2 : 1);
    extern __shared__ unsigned char smem_raw[];
    // Swizzle atoms need 1024-byte alignment; the launch asks for 1 KB of slack.
    const unsigned raw = smem_u32(smem_raw);
    unsigned char* smem = smem_raw + (((raw + 1023u) & ~1023u) - raw);

    const int tid = threadIdx.x, lane = tid & 31;
    const int KB = K >> 7, tiles = N / TILE_ROWS, C = gridDim.x, c = blockIdx.x;
    const i64 T = (i64)tiles * KB;
    // This CTA's place in the iteration space it shares: the whole grid, or (CLUSTER) its cluster's tiles.
    i64 base = 0, Tl = T;
    int Cl = C, rl = c;
    if constexpr (CLUSTER) {
        Cl = (int)cluster_nctarank();
        rl = (int)cluster_ctarank();
        const int G = C / Cl, g = c / Cl;
        const int tg0 = (int)((i64)g * tiles / G), tg1 = (int)((i64)(g + 1) * tiles / G);
        base = (i64)tg0 * KB;
        Tl = (i64)(tg1 - tg0) * KB;
    }
    const i64 it0 = base + unit_begin(rl, Tl, Cl);
    const int iters = (int)(unit_begin(rl + 1, Tl, Cl) - unit_begin(rl, Tl, Cl));
    const int nb = min(KB, iters);  // distinct K blocks this CTA visits: slot b holds block (kb0 + b) % KB
    const int kb0 = (int)(it0 % KB);
    const int first_tile = (int)(it0 / KB), last_tile = (int)((it0 + iters - 1) / KB);
    // (CLUSTER) whether this CTA shares its first / last tile with others (computed here, off the critical path)
    const bool first_shared = kb0 != 0 || it0 + iters < (i64)(first_tile + 1) * KB;
    const bool last_shared = last_tile != first_tile && (it0 + iters) % KB != 0;
    // Layout: [stages][16 KB] weight stages | (CLUSTER) slot A: the share of this CTA's first tile, [R][256] floats,
    // parked mid-loop | [nb][NT x 128] token blocks | [nb][NT] token scales | [iters] weight scales | mbarriers.
    // The ring and slot A sit at the same offsets in every CTA (peers address them; iters differs between CTAs);
    // both are multiples of 1 KB long, so the token blocks keep the swizzle atoms' alignment.
    constexpr int SLOT_BYTES = CLUSTER ? TILE_ROWS * NT * 4 : 0;
    const unsigned w_base = smem_u32(smem);
    const unsigned slot_a = w_base + stages * TILE_BYTES;
    const unsigned b_base = slot_a + SLOT_BYTES;
    float* s_x = reinterpret_cast<float*>(smem + stages * TILE_BYTES + SLOT_BYTES + nb * B_BYTES);
    float* s_w = s_x + nb * NT;  // iteration j's is sw[it0 + j] (sw is [tiles][KB])
    const unsigned full0 = (smem_u32(s_w + iters) + 7u) & ~7u;
    const unsigned empty0 = full0 + 8 * stages;  // mbarriers full[stages], empty[stages], (TMA) the tokens'
    const unsigned tokens_bar = empty0 + 8 * stages;

    // Prologue. The producer warp initializes the stage barriers and signals (bar.arrive: it does not wait) that
    // they are ready, then issues the first weight copies; the consumers issue their weight-scale and token copies
    // and wait only for the barrier setup. Launched with PDL (_jit.launch), this runs while the previous kernel on
    // the stream finishes: the packed weights and their scales are constants, everything else waits for it (pdl_wait).
    pdl_launch_dependents();
    const fp8_t* src = wp + it0 * TILE_BYTES;
    // A first tile shared with earlier CTAs and finished before this CTA's range ends is published mid-range.
    const bool mid_publish = !CLUSTER && kb0 != 0 && it0 + iters > (i64)(first_tile + 1) * KB;
    if (tid >= CONSUMERS + 32) {  // ---- publisher warp
        if constexpr (CLUSTER) {
            cluster_sync();
            cluster_sync();
        } else if (mid_publish) {
            named_barrier(BAR_PUBLISH, CONSUMERS + 32);  // the consumers' stores are ordered before this
            if (tid == CONSUMERS + 32) red_add_release(&counters[first_tile], 1);
        }
        return;
    }
    if (tid >= CONSUMERS) {  // ---- producer warp: one thread streams the weights
        if (tid == CONSUMERS) {
            for (int s = 0; s < stages; ++s) {
                mbar_init(full0 + 8 * s, 1);                // the producer's arrive (plus the copy's bytes)
                mbar_init(empty0 + 8 * s, CONSUMERS / 32);  // one arrive per consumer warp
            }
            if constexpr (TMA) {
                prefetch_tensor_map(xmap);
                mbar_init(tokens_bar, 1);
            }
            fence_proxy_async();  // the inits are visible to the TMA engine (async proxy)
        }
        __syncwarp();
        named_barrier_arrive(BAR_READY, CONSUMERS + 32);
        if (tid == CONSUMERS) {
            auto load_tokens = [&]() {  // (TMA) every token block and its scales, written by the kernel ahead
                pdl_wait();
                mbar_arrive_expect_tx(tokens_bar, (unsigned)nb * (B_BYTES + 4u * Mp));
                for (int b = 0; b < nb; ++b) {
                    const int kb = kb0 + b < KB ? kb0 + b : kb0 + b - KB;
                    tma_load_2d(b_base + b * B_BYTES, xmap, kb * 128, 0, tokens_bar);
                    bulk_copy_g2s(smem_u32(s_x + b * NT), sx + (i64)kb * Mp, 4u * Mp, tokens_bar);
                }
            };
            for (int j = 0, s = 0, phase = 0; j < iters; ++j) {  // stage s = j % stages, phase = j / stages & 1
                if (TMA && j == stages) load_tokens();  // after the copies the ring holds (constants)
                if (j >= stages) mbar_wait(empty0 + 8 * s, phase ^ 1);  // every consumer warp released it
                mbar_arrive_expect_tx(full0 + 8 * s, TILE_BYTES);
                bulk_copy_g2s(w_base + s * TILE_BYTES, src + (i64)j * TILE_BYTES, TILE_BYTES, full0 + 8 * s);
                ring_next(s, phase, stages);
            }
            if (TMA && iters <= stages) load_tokens();  // the whole range fit in the ring
        }
        if constexpr (!CLUSTER) return;  // the copies complete on their own; the consumers keep the CTA alive
        else {
            __syncwarp();
            cluster_sync();  // the shares are parked (the producer warp only takes part)
            cluster_sync();  // every slice is summed: this CTA's shared memory may go
            return;
        }
    }

    // ---- consumers. Weight scales join the first cp.async group: read per iteration from global memory, their
    // latency (they are as cold as the weights) would serialize the loop. Like the packed weights they are constants
    // (written at load time; gemm.pack_weight waits for its own kernels), so they are read before pdl_wait; the
    // tokens, written by the kernel ahead, after it: one group per K block in first-use order (zero fill past M).
    for (int i = tid; i < iters; i += CONSUMERS) cp_async4(smem_u32(s_w + i), sw + it0 + i, true);
    pdl_wait();
    if constexpr (TMA) {  // the producer thread brings the tokens; the weight scales land before the barrier
        cp_async_commit();
        cp_async_wait<0>();
    } else {
        for (int b = 0; b < nb; ++b) {
            const int kb = kb0 + b < KB ? kb0 + b : kb0 + b - KB;
            const unsigned sb = b_base + b * B_BYTES;
            const int ch = tid & 7;  // 16-byte chunk of the 128-byte row
            for (int r = tid >> 3; r < NT; r += CONSUMERS / 8) {
                const bool ok = r < M;
                cp_async16(sb + sw128_offset(r, ch), x + (i64)(ok ? r : 0) * K + kb * 128 + ch * 16, ok);
            }
            if (tid < NT) cp_async4(smem_u32(s_x + b * NT + tid), sx + (i64)kb * Mp + (tid < M ? tid : 0), tid < M);
            cp_async_commit();
        }
    }
    named_barrier(BAR_READY, CONSUMERS + 32);  // the stage barriers are initialized

    float total[R], acc[ACCS][R];
    zero_accumulators(total, acc);

    // The warpgroup index through a shuffle: the compiler then knows it is warp-uniform and keeps the descriptors
    // below in uniform registers.
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
    const unsigned wdesc = desc_sw128_lo(w_base + wg * (TILE_BYTES / 2)), bdesc = desc_sw128_lo(b_base);
    int tile = first_tile, kb = kb0, slot = 0, settle = -1;
    bool whole = kb == 0;               // the segment being accumulated started at the tile's first K block
    for (int j = 0, s = 0, phase = 0; j < iters; ++j) {  // stage s = j % stages, phase = j / stages & 1
        // First use of token block j: wait for its copies (every consumer's). Narrow tiles (a few KB of tokens, all
        // landing together) wait for all of them at once: one barrier instead of one per iteration.
        if (TMA && j == 0) {
            mbar_wait(tokens_bar, 0);
        } else if (!TMA && (NT <= 16 ? j == 0 : j < nb)) {
            if (NT <= 16)
                cp_async_wait<0>();
            else
                cp_async_wait_upto(nb - 1 - j);
            fence_proxy_async();
            named_barrier(BAR_CONSUMERS, CONSUMERS);
        }
        mbar_wait(full0 + 8 * s, phase);
        mma_block<NT, ACCS>(acc, wdesc + s * (TILE_BYTES / 16), bdesc + slot * (B_BYTES / 16));
        if (lane == 0) mbar_arrive(empty0 + 8 * s);  // this warp's share of the MMAs is done reading the stage

        promote<NT, ACCS>(total, acc, s_w[j], s_x + slot * NT, lane);

        if (kb == KB - 1 || j == iters - 1) {  // end of this CTA's segment of `tile`
            if (whole && kb == KB - 1) {
                store_tile<NT>(total, y, tile * TILE_ROWS + 64 * wg, M, N);
            } else if constexpr (CLUSTER) {
                // Park the share in this CTA's shared memory: the first tile's in slot A, the last tile's in the
                // weight ring, free once both warpgroups are past their last MMAs.
                if (tile != first_tile) named_barrier(BAR_CONSUMERS, CONSUMERS);
                float* p = reinterpret_cast<float*>(smem_raw + ((tile == first_tile ? slot_a : w_base) - raw));
#pragma unroll
                for (int r = 0; r < R; ++r) p[r * CONSUMERS + tid] = total[r];  // [register][thread]: conflict free
            } else if (whole) {
                // A shared tile whose first K block is this CTA's: this is its last segment, and it settles the tile
                // after the loop (where the loop's registers are free for the shares it reads).
                settle = tile;
            } else {
                // Another CTA settles this tile: park the share (this is its first tile, see settle_tile), then count
                // it in (a release add, fire and forget).
                park_share<NT, CONSUMERS>(total, ws, counters, c, tile, j + 1 < iters, BAR_PUBLISH, BAR_CONSUMERS);
            }
            next_segment(total, whole, j + 1 < iters);
        }
        next_block(tile, kb, KB);
        if (++slot == KB) slot = 0;
        ring_next(s, phase, stages);
    }
    if (settle >= 0) {
        await_shares(counters, settle, c, KB, T, C);  // every other share of the tile counted in
        named_barrier(BAR_CONSUMERS, CONSUMERS);  // the acquire above orders every thread's reads below
        settle_tile<NT, (NT <= 16 ? 8 : ACCS), CONSUMERS>(total, ws, counters, y, c, settle, T, C, KB, M, N);
    }
    if constexpr (CLUSTER) {
        cluster_sync();  // every share of every tile of the cluster is parked
        if (iters > 0) {
            if (first_shared) reduce_slice<NT>(slot_a, w_base, y, first_tile, base, Tl, Cl, rl, KB, M, N);
            if (last_shared) reduce_slice<NT>(slot_a, w_base, y, last_tile, base, Tl, Cl, rl, KB, M, N);
        }
        cluster_sync();  // the peers are done reading this CTA's shares
    }
}

#define GEMM_PARAMS                                                                                          \
    const fp8_t *__restrict__ x, const float *__restrict__ sx, const fp8_t *__restrict__ wp,                 \
        const float *__restrict__ sw, bf16_t *__restrict__ y, float *__restrict__ ws, int *__restrict__ counters, \
        int M, int N, int K, int Mp, int stages
#define GEMM_ARGS x, sx, wp, sw, y, ws, counters, M, N, K, Mp, stages

// Register budgets. fp8_gemm_wgmma (NT >= 32): one CTA per SM. fp8_gemm_wgmma_lean (NT <= 16) is held to 96
// registers so that two CTAs fit on an SM (20 warps put 5 on one sub-partition: 5 x 32 x 96 <= 16K registers): a
// GEMM can then start, and stream its weights, on SMs where the previous kernel still runs (PDL).
template <int NT, bool CLUSTER>
__global__ void __launch_bounds__(THREADS, 1) fp8_gemm_wgmma(GEMM_PARAMS) { gemm_body<NT, CLUSTER>(GEMM_ARGS); }

template <int NT, bool CLUSTER>
__global__ void __maxnreg__(96) fp8_gemm_wgmma_lean(GEMM_PARAMS) { gemm_body<NT, CLUSTER>(GEMM_ARGS); }

// The lean instances with their tokens by TMA (see gemm_body): xmap over x fp8 [M, K], box 128 x NT rows.
template <int NT>
__global__ void __maxnreg__(96) fp8_gemm_wgmma_lean_tma(const __grid_constant__ TensorMap xmap, GEMM_PARAMS) {
    gemm_body<NT, false, true>(GEMM_ARGS, &xmap);
}
