// Block-scaled FP8 GEMM for decode shapes on Hopper tensor cores (wgmma), y[M, N] = x[M, K] @ w[N, K]^T:
//   x: float8 e4m3, 1x128 blocks, scales sx[K/128, Mp] (K-major, Mp = M rounded up to 4), M <= 64
//   w: float8 e4m3, 128x128 blocks, scales sw[ceil(N/128), K/128] (row-major)
//   y: bfloat16
//
// Swap-AB: weight rows are the wgmma M side and the tokens (M padded to NT = 8..64) the N side, so one token costs
// an 8-column sliver instead of a 64-row tile. A CTA is two warpgroups; an iteration is one (128-row tile, 128-wide K
// block): each warpgroup takes 64 of the rows, issues four m64nNTk32 wgmmas and promotes the FP32 result with
// total += acc * sw * sx (per 128-K block, so FP8 rounding never accumulates across blocks).
//
// Weights never touch shared memory. At decode sizes the GEMM is a weight stream, and what bounds it is how many
// weight bytes each SM keeps in flight without stalling on synchronization. Each thread loads its own wgmma A
// fragments straight from global memory into a ring of DEPTH iterations of registers (16-byte loads, 64 B per
// thread per iteration, every 32-byte sector fully used), and wgmma reads A from those registers: no copy into
// shared memory, no barrier, no proxy fence per iteration. The price is a K permutation: a thread's 16 contiguous
// bytes are not the 4+4 byte K slices the A fragment layout assigns it, so the kernel permutes K identically on the
// token side (a dot product does not care about K order), when it copies the tokens into shared memory.
//
// Tokens: every K block this CTA needs is copied once into 128-byte-swizzled K-major shared memory (the layout the B
// descriptors read) at the start, one cp.async group per block in first-use order; an iteration waits only for the
// block it is about to use the first time, so compute starts after the first block lands.
//
// Stream-K: the grid is persistent (one CTA per SM) and CTA c takes the contiguous iteration range
// [c*T/C, (c+1)*T/C) of the T = tiles * K/128 iterations in tile-major order, so every CTA streams the same number of
// weight bytes whatever the shape (no wave quantization, no separate split-K launch for narrow N). A tile covered
// by one CTA is written straight to y; a tile shared by several writes FP32 partials, and the last to arrive (a
// per-tile counter) sums them in CTA order (deterministic) and resets the counter, so graph replays need no memset.
// Partials are parked with plain stores and settled after the main loop, so the one fence a CTA needs never stalls
// its loads.
#include "sm90.cuh"

#define TILE_ROWS 128  // weight rows per iteration: one 128x128 scale block, 64 per warpgroup
#define THREADS 256

__device__ __forceinline__ i64 unit_begin(int c, i64 T, int C) { return (i64)c * T / C; }

// The CTA whose iteration range holds iteration u: the largest c with floor(c*T/C) <= u.
__device__ __forceinline__ int unit_owner(i64 u, i64 T, int C) { return (int)(((u + 1) * C + T - 1) / T) - 1; }

// Partial-tile slot of CTA c for tile t: a CTA shares at most its first and its last tile.
__device__ __forceinline__ i64 partial_slot(int c, int t, i64 T, int C, int KB) {
    return 2 * (i64)c + (t == (int)(unit_begin(c, T, C) / KB) ? 0 : 1);
}

// K permutation inside a 128-byte K block, in 4-byte words. Thread (g, q) of a warp loads bytes [16q, 16q + 16) and
// [64 + 16q, 64 + 16q + 16) of its rows; the A fragment of k32 step s wants logical words 8s + q (a0/a1) and
// 8s + 4 + q (a2/a3). Giving it physical words 4q + s and 16 + 4q + s maps logical word 8s + 4h + q to physical
// word 16h + 4q + s.
__device__ __forceinline__ int phys_word(int lw) { return 16 * ((lw >> 2) & 1) + 4 * (lw & 3) + (lw >> 3); }

// 16 weight bytes, streamed: read once, so not kept in L1; the L2 fetches 256 B (the next K block of the same rows).
__device__ __forceinline__ void ldg_stream16(unsigned (&r)[4], const fp8_t* p) {
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "l"(p));
}

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

template <int NT>
__device__ __forceinline__ void store_tile(const float (&v)[NT / 2], bf16_t* __restrict__ y, int row0, int M, int N) {
    const int t = threadIdx.x & 127, warp = t >> 5, lane = t & 31;
#pragma unroll
    for (int r = 0; r < NT / 2; ++r) {
        const int n = row0 + 16 * warp + (lane >> 2) + 8 * ((r & 3) >> 1);
        const int m = 8 * (r >> 2) + 2 * (lane & 3) + (r & 1);
        if (n < N && m < M) y[(i64)m * N + n] = float_to_bf16(v[r]);
    }
}

template <int NT, int DEPTH>
__global__ void __launch_bounds__(THREADS, 1) fp8_gemm_wgmma(const fp8_t* __restrict__ x, const float* __restrict__ sx,
                                                            const fp8_t* __restrict__ w, const float* __restrict__ sw,
                                                            bf16_t* __restrict__ y, float* __restrict__ ws,
                                                            int* __restrict__ counters, int M, int N, int K, int Mp) {
    constexpr int B_BYTES = NT * 128;  // one K block of tokens
    constexpr int R = NT / 2;          // accumulator registers per thread
    // FP8 wgmma accumulates with reduced precision (about 14 mantissa bits, not FP32), so the four k32 MMAs of a
    // 128-wide K block go into separate accumulators (as many as registers allow) that are summed in FP32: with
    // four, no tensor-core sum spans more than 32 products. Measured: one accumulator per block averaged 0.3-0.43
    // bf16 ulp of error against the exact product, with outliers of thousands of ulp on outputs near zero.
    constexpr int ACCS = NT <= 32 ? 4 : 2;
    extern __shared__ unsigned char smem_raw[];
    // Swizzle atoms need 1024-byte alignment; the launch asks for 1 KB of slack.
    const unsigned raw = smem_u32(smem_raw);
    unsigned char* smem = smem_raw + (((raw + 1023u) & ~1023u) - raw);
    __shared__ int s_last;

    const int tid = threadIdx.x, wg = tid >> 7, t = tid & 127, lane = tid & 31;
    const int KB = K >> 7, tiles = (N + TILE_ROWS - 1) / TILE_ROWS, C = gridDim.x, c = blockIdx.x;
    const i64 T = (i64)tiles * KB;
    const i64 it0 = unit_begin(c, T, C);
    const int iters = (int)(unit_begin(c + 1, T, C) - it0);
    const int nb = min(KB, iters);  // distinct K blocks this CTA visits: slot b holds block (kb0 + b) % KB
    const int kb0 = (int)(it0 % KB);
    const unsigned base = smem_u32(smem);
    float* s_x = reinterpret_cast<float*>(smem + nb * B_BYTES);  // [nb][NT] token scales

    // Weight cursor (the next iteration to load), stepped without divisions. This thread's rows in the tile:
    // 64 * wg + 16 * warp + g and the same + 8; its bytes in the K block: 16q and 64 + 16q.
    int ld_tile = (int)(it0 / KB), ld_kb = kb0;
    const int row_in_tile = 64 * wg + 16 * (t >> 5) + (lane >> 2);
    const int byte_in_block = 16 * (lane & 3);
    unsigned a_ring[DEPTH][4][4];  // [iteration][row g lo, row g hi, row g+8 lo, row g+8 hi][word]
    float sw_ring[DEPTH];
    auto load_weights = [&](unsigned (&a)[4][4], float& s) {
        const int r0 = ld_tile * TILE_ROWS + row_in_tile;
        const fp8_t* p = w + (i64)r0 * K + ld_kb * 128 + byte_in_block;
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // rows g, g + 8
            if (r0 + 8 * h < N) {
                ldg_stream16(a[2 * h], p + (i64)8 * h * K);
                ldg_stream16(a[2 * h + 1], p + (i64)8 * h * K + 64);
            } else {
#pragma unroll
                for (int i = 0; i < 4; ++i) a[2 * h][i] = a[2 * h + 1][i] = 0u;
            }
        }
        s = __ldg(sw + (i64)ld_tile * KB + ld_kb);
        if (++ld_kb == KB) {
            ld_kb = 0;
            ++ld_tile;
        }
    };
#pragma unroll
    for (int d = 0; d < DEPTH; ++d)
        if (d < iters) load_weights(a_ring[d], sw_ring[d]);

    // Token blocks, permuted to match the weight fragments (4-byte copies, zero fill past M), one group per block.
    for (int b = 0; b < nb; ++b) {
        const int kb = kb0 + b < KB ? kb0 + b : kb0 + b - KB;
        const unsigned sb = base + b * B_BYTES;
        for (int idx = tid; idx < NT * 32; idx += THREADS) {
            const int r = idx >> 5, lw = idx & 31;
            const bool ok = r < M;
            cp_async4(sb + sw128_offset(r, lw >> 2) + 4 * (lw & 3), x + (i64)(ok ? r : 0) * K + kb * 128 + 4 * phys_word(lw), ok);
        }
        if (tid < NT) cp_async4(smem_u32(s_x + b * NT + tid), sx + (i64)kb * Mp + (tid < M ? tid : 0), tid < M);
        cp_async_commit();
    }

    float total[R], acc[ACCS][R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        total[r] = 0.f;
#pragma unroll
        for (int q = 0; q < ACCS; ++q) acc[q][r] = 0.f;
    }

    int tile = (int)(it0 / KB), kb = kb0, slot = 0;
    bool whole = kb == 0;               // the segment being accumulated started at the tile's first K block
    int shared_tiles[2], n_shared = 0;  // tiles this CTA only partly covers (its first and/or last)
    for (int j0 = 0; j0 < iters; j0 += DEPTH) {
#pragma unroll
        for (int d = 0; d < DEPTH; ++d) {
            const int j = j0 + d;
            if (j >= iters) break;
            if (j < nb) {  // first use of token block j: wait for its copies (every thread's), uniform branch
                cp_async_wait_upto(nb - 1 - j);
                fence_proxy_async();
                __syncthreads();
            }
            const unsigned b = base + slot * B_BYTES;
            wgmma_fence();
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                const unsigned a[4] = {a_ring[d][0][s], a_ring[d][2][s], a_ring[d][1][s], a_ring[d][3][s]};
                wgmma_e4m3_rs<NT>(acc[s % ACCS], a, desc_sw128(b + 32 * s), s >= ACCS);
            }
            wgmma_commit();
            wgmma_wait_all();
#pragma unroll
            for (int q = 0; q < ACCS; ++q) fence_regs(acc[q]);
            const float swv = sw_ring[d];
            if (j + DEPTH < iters) load_weights(a_ring[d], sw_ring[d]);  // refill: iteration j + DEPTH

            const float* sxb = s_x + slot * NT;
#pragma unroll
            for (int i = 0; i < NT / 8; ++i) {
                const int col = 8 * i + 2 * (lane & 3);
                const float s0 = swv * sxb[col], s1 = swv * sxb[col + 1];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float v = acc[0][4 * i + e];
#pragma unroll
                    for (int q = 1; q < ACCS; ++q) v += acc[q][4 * i + e];  // FP32, outside the tensor core
                    total[4 * i + e] += v * ((e & 1) ? s1 : s0);
                }
            }

            if (kb == KB - 1 || j == iters - 1) {  // end of this CTA's segment of `tile`
                if (whole && kb == KB - 1) {
                    store_tile<NT>(total, y, tile * TILE_ROWS + 64 * wg, M, N);
                } else {  // a shared tile: park the partial sum; tiles are settled once, after the loop
                    float* p = ws + partial_slot(c, tile, T, C, KB) * (TILE_ROWS * NT);
#pragma unroll
                    for (int r = 0; r < R; ++r) p[r * THREADS + tid] = total[r];  // [register][thread]: coalesced
                    shared_tiles[n_shared++] = tile;
                }
#pragma unroll
                for (int r = 0; r < R; ++r) total[r] = 0.f;
                whole = true;
            }
            if (++kb == KB) {
                kb = 0;
                ++tile;
            }
            if (++slot == KB) slot = 0;
        }
    }
    if (n_shared == 0) return;  // uniform across the CTA

    // Settle shared tiles: publish this CTA's partials (one fence, with the loads already drained), count
    // arrivals per tile, and let the last arrival sum every share in CTA order and reset the counter.
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        int last = 0;
        for (int i = 0; i < n_shared; ++i) {
            const int st = shared_tiles[i];
            const int c_lo = unit_owner((i64)st * KB, T, C), c_hi = unit_owner((i64)st * KB + KB - 1, T, C);
            if (atomicAdd(&counters[st], 1) == c_hi - c_lo) last |= 1 << i;
        }
        s_last = last;
    }
    __syncthreads();
    for (int i = 0; i < n_shared; ++i) {
        if (!(s_last >> i & 1)) continue;
        __threadfence();
        const int st = shared_tiles[i];
        const int c_lo = unit_owner((i64)st * KB, T, C), c_hi = unit_owner((i64)st * KB + KB - 1, T, C);
        float* sum = acc[0];
#pragma unroll
        for (int r = 0; r < R; ++r) sum[r] = 0.f;
        for (int cc = c_lo; cc <= c_hi; ++cc) {
            const float* q = ws + partial_slot(cc, st, T, C, KB) * (TILE_ROWS * NT);
#pragma unroll
            for (int r = 0; r < R; ++r) sum[r] += __ldcg(q + r * THREADS + tid);
        }
        store_tile<NT>(acc[0], y, st * TILE_ROWS + 64 * wg, M, N);
        if (tid == 0) counters[st] = 0;  // ready for the next launch (graph replays included)
    }
}
