// Block-scaled FP8 GEMM for decode batches of 17-128 tokens on Hopper (wgmma), y[M, N] = x[M, K] @ w[N, K]^T, with
// the operands of fp8_gemm_wgmma.cu (packed weights, 1x128 token scales sx[K/128, Mp], 128x128 weight scales), but
// 64-row tiles, one consumer warpgroup and the tokens streamed through the ring next to the weights.
//
// Why a second kernel: at 32-128 tokens the 128-row kernel needs two consumer warpgroups of 140+ registers and stages
// every token block it uses up front (up to 128 KB), so one of its CTAs fills an SM. The next GEMM then cannot become
// resident and stream its weights while this one finishes (what makes the 1-16 token chain fast), and a split tile's
// shares are 32 KB, which the settling CTA reads after its stream. Here:
//   - an iteration is (64-row half tile h, 128-wide K block kb): half of a packed 16 KB block (rows 64 * (h % 2) of
//     block [h / 2][kb]), 8 KB of weights, one m64nNTk32 wgmma chain;
//   - each ring stage holds those 8 KB, the NT x 128 tokens of the same K block and their NT scales, all completing
//     on one mbarrier. Weights are constants and are copied for the first `stages` iterations before
//     griddepcontrol.wait; tokens and their scales (written by the kernel ahead) after it. Tokens are a tensor-map
//     TMA load (kernels._token_map): the copy engine applies the 128-byte swizzle the wgmma descriptor reads and
//     zero-fills the rows past M, so no thread touches them;
//   - 192 threads (a consumer warpgroup, a producer warp, a publisher warp), at most 168 registers and ~100 KB of
//     shared memory (host plan): two CTAs per SM, so under PDL the next GEMM becomes resident and prefills its ring
//     while this one finishes;
//   - a split tile's shares are 64 x NT floats (16 KB at 64 tokens).
// Stream-K split, settlement, determinism and the deadlock argument are those of fp8_gemm_wgmma.cu (streamk.cuh),
// over T = N/64 * K/128 iterations.
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

// xmap: tensor map over x fp8 [M, K] (box 128 x NT, 128-byte swizzle, kernels._token_map). stages: ring stages.
template <int NT>
__global__ void __launch_bounds__(H_THREADS, 2)
    fp8_gemm_wgmma64(const __grid_constant__ TensorMap xmap, const float* __restrict__ sx,
                     const fp8_t* __restrict__ wp, const float* __restrict__ sw, bf16_t* __restrict__ y,
                     float* __restrict__ ws, int* __restrict__ counters, int M, int N, int K, int Mp, int stages) {
    constexpr int B_BYTES = NT * 128;          // one K block of tokens
    constexpr int STAGE = H_BYTES + B_BYTES;   // a multiple of 1 KB: every stage keeps the swizzle atoms aligned
    constexpr int R = NT / 2;                  // accumulator registers per thread
    // Separate tensor-core accumulators per k32 step, summed in FP32 (see fp8_gemm_wgmma.cu): as many as 168
    // registers hold next to the FP32 total.
    constexpr int ACCS = NT <= 32 ? 4 : (NT == 64 ? 2 : 1);
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
    // Layout: [stages][8 KB weights | NT x 128 tokens] | [stages][NT] token scales | [iters] weight scales | mbarriers
    const unsigned ring = smem_u32(smem);
    float* s_x = reinterpret_cast<float*>(smem + stages * STAGE);
    float* s_w = s_x + stages * NT;  // iteration j's weight scale
    const unsigned full0 = (smem_u32(s_w + iters) + 7u) & ~7u;
    const unsigned empty0 = full0 + 8 * stages;  // mbarriers full[stages], empty[stages]

    pdl_launch_dependents();
    // A first tile shared with earlier CTAs and finished before this CTA's range ends is published mid-range.
    const bool mid_publish = kb0 != 0 && it0 + iters > (i64)(first_tile + 1) * KB;
    if (tid >= H_CONSUMERS + 32) {  // ---- publisher warp
        if (mid_publish) {
            named_barrier(H_BAR_PUBLISH, H_CONSUMERS + 32);  // the consumers' stores are ordered before this
            if (tid == H_CONSUMERS + 32) red_add_release(&counters[first_tile], 1);
        }
        return;
    }
    if (tid >= H_CONSUMERS) {  // ---- producer warp: one thread streams weights, tokens and token scales
        if (tid == H_CONSUMERS) {
            for (int s = 0; s < stages; ++s) {
                mbar_init(full0 + 8 * s, 1);                  // the producer's arrive (plus the copies' bytes)
                mbar_init(empty0 + 8 * s, H_CONSUMERS / 32);  // one arrive per consumer warp
            }
            fence_proxy_async();  // the inits are visible to the TMA engine (async proxy)
        }
        __syncwarp();
        named_barrier_arrive(H_BAR_READY, H_CONSUMERS + 32);
        if (tid == H_CONSUMERS) {
            const unsigned bytes = STAGE + 4u * Mp;
            const int pre = min(stages, iters);
            int h = first_tile, kb = kb0;
            for (int j = 0; j < pre; ++j) {  // the weights the ring holds: constants, before the wait
                mbar_arrive_expect_tx(full0 + 8 * j, bytes);
                bulk_copy_g2s(ring + j * STAGE, half_block(wp, h, kb, KB), H_BYTES, full0 + 8 * j);
                if (++kb == KB) {
                    kb = 0;
                    ++h;
                }
            }
            pdl_wait();  // tokens and their scales were written by the kernel ahead
            h = first_tile;
            kb = kb0;
            for (int j = 0, s = 0, phase = 0; j < iters; ++j) {  // stage s = j % stages, phase = j / stages & 1
                const unsigned full = full0 + 8 * s, dst = ring + s * STAGE;
                if (j >= pre) {
                    mbar_wait(empty0 + 8 * s, phase ^ 1);  // every consumer warp released it
                    mbar_arrive_expect_tx(full, bytes);
                    bulk_copy_g2s(dst, half_block(wp, h, kb, KB), H_BYTES, full);
                }
                tma_load_2d(dst + H_BYTES, &xmap, kb * 128, 0, full);
                bulk_copy_g2s(smem_u32(s_x + s * NT), sx + (i64)kb * Mp, 4u * Mp, full);
                if (++kb == KB) {
                    kb = 0;
                    ++h;
                }
                if (++s == stages) {
                    s = 0;
                    phase ^= 1;
                }
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
#pragma unroll
    for (int r = 0; r < R; ++r) {
        total[r] = 0.f;
#pragma unroll
        for (int q = 0; q < ACCS; ++q) acc[q][r] = 0.f;
    }

    int tile = first_tile, kb = kb0, settle = -1;
    bool whole = kb == 0;  // the segment being accumulated started at the tile's first K block
    for (int j = 0, s = 0, phase = 0; j < iters; ++j) {  // stage s = j % stages, phase = j / stages & 1
        mbar_wait(full0 + 8 * s, phase);
        const unsigned a = ring + s * STAGE, b = a + H_BYTES;
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < 4; ++k)
            wgmma_e4m3<NT>(acc[k % ACCS], desc_sw128(a + 32 * k), desc_sw128(b + 32 * k), k >= ACCS);
        wgmma_commit();
        wgmma_wait_all();
#pragma unroll
        for (int q = 0; q < ACCS; ++q) fence_regs(acc[q]);

        // Promote in FP32: total += acc * sw * sx (per 128-K block, so FP8 rounding never accumulates across blocks).
        const float swv = s_w[j], *sxb = s_x + s * NT;
#pragma unroll
        for (int i = 0; i < NT / 8; ++i) {
            const int col = 8 * i + 2 * (lane & 3);
            const float s0 = swv * sxb[col], s1 = swv * sxb[col + 1];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float v = acc[0][4 * i + e];
#pragma unroll
                for (int q = 1; q < ACCS; ++q) v += acc[q][4 * i + e];
                total[4 * i + e] += v * ((e & 1) ? s1 : s0);
            }
        }
        __syncwarp();                                // every lane has read the stage's token scales
        if (lane == 0) mbar_arrive(empty0 + 8 * s);  // this warp is done with the stage

        if (kb == KB - 1 || j == iters - 1) {  // end of this CTA's segment of `tile`
            if (whole && kb == KB - 1) {
                store_tile<NT>(total, y, tile * H_ROWS, M, N);
            } else if (whole) {
                settle = tile;  // its first K block is this CTA's: it sums the tile after the loop
            } else {
                // Another CTA settles this tile: park the share (this is its first tile), then count it in.
                float* p = ws + (i64)c * (H_ROWS * NT);
#pragma unroll
                for (int r = 0; r < R; ++r) p[r * H_CONSUMERS + tid] = total[r];  // [register][thread]: coalesced
                if (j + 1 < iters) {
                    named_barrier_arrive(H_BAR_PUBLISH, H_CONSUMERS + 32);
                } else {
                    named_barrier(H_BAR_CONSUMERS, H_CONSUMERS);  // every share stored before the release below
                    if (tid == 0) red_add_release(&counters[tile], 1);
                }
            }
            if (j + 1 < iters) {
#pragma unroll
                for (int r = 0; r < R; ++r) total[r] = 0.f;
            }
            whole = true;
        }
        if (++kb == KB) {
            kb = 0;
            ++tile;
        }
        if (++s == stages) {
            s = 0;
            phase ^= 1;
        }
    }
    if (settle >= 0) {
        // Every other share of the tile counted in (they publish without waiting: this spin never waits on a CTA
        // that waits).
        const int want = unit_owner((i64)settle * KB + KB - 1, T, C) - c;
        if (tid == 0)
            while (load_acquire(&counters[settle]) < want) {
            }
        named_barrier(H_BAR_CONSUMERS, H_CONSUMERS);  // the acquire above orders every thread's reads below
        settle_tile<NT, ACCS, H_CONSUMERS>(total, ws, counters, y, c, settle, T, C, KB, M, N);
    }
}
