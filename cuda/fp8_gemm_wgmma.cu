// Block-scaled FP8 GEMM for decode shapes on Hopper tensor cores (wgmma), y[M, N] = x[M, K] @ w[N, K]^T:
//   x: float8 e4m3, 1x128 blocks, scales sx[K/128, Mp] (K-major, Mp = M rounded up to 4), M <= 128
//   w: float8 e4m3, 128x128 blocks, scales sw[ceil(N/128), K/128] (row-major)
//   y: bfloat16
//
// Swap-AB: 64 weight rows are the wgmma M side and the tokens (M padded to NT = 8..128) the N side, so one token
// costs an 8-column sliver instead of a 64-row tile. A work unit is (64-row tile, KPU 128-wide K blocks): per K block
// 8 KB of weights, NT x 128 bytes of tokens, four m64nNTk32 wgmmas into a fresh FP32 accumulator, then the FP32
// promotion total += acc * sw * sx (per 128-K block, so FP8 rounding never accumulates across blocks). KPU = 2 halves
// the per-unit synchronization (wait, barrier) that bounds a CTA's streaming rate at small M.
//
// Stream-K: the grid is persistent (a few CTAs per SM) and CTA c takes the contiguous unit range
// [c*T/C, (c+1)*T/C) of the T = tiles * K/128 units in tile-major order, so every CTA streams the same number of
// weight bytes whatever the shape (no wave quantization, no separate split-K launch for narrow N). A tile covered
// by one CTA is written straight to y; a tile shared by several writes FP32 partials, and the last to arrive (a
// per-tile counter) sums them in CTA order (deterministic) and resets the counter, so graph replays need no memset.
// Partials are parked with plain stores and settled after the main loop, so the one fence a CTA needs never stalls
// its load pipeline.
//
// Memory pipeline: STAGES units in flight through cp.async (16-byte copies, zero fill past N and M), placed in the
// 128-byte-swizzled K-major layout the wgmma descriptors read. One warpgroup per CTA both copies and computes.
#include "sm90.cuh"

#define WG_ROWS 64  // weight rows per tile (the wgmma M)

__device__ __forceinline__ i64 unit_begin(int c, i64 T, int C) { return (i64)c * T / C; }

// The CTA whose unit range holds unit u: the largest c with floor(c*T/C) <= u.
__device__ __forceinline__ int unit_owner(i64 u, i64 T, int C) { return (int)(((u + 1) * C + T - 1) / T) - 1; }

// Partial-tile slot of CTA c for tile t: a CTA shares at most its first and its last tile.
__device__ __forceinline__ i64 partial_slot(int c, int t, i64 T, int C, int KU) {
    return 2 * (i64)c + (t == (int)(unit_begin(c, T, C) / KU) ? 0 : 1);
}

template <int NT>
__device__ __forceinline__ void store_tile(const float (&v)[NT / 2], bf16_t* __restrict__ y, int tile, int M, int N) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < NT / 2; ++r) {
        const int n = tile * WG_ROWS + 16 * warp + (lane >> 2) + 8 * ((r & 3) >> 1);
        const int m = 8 * (r >> 2) + 2 * (lane & 3) + (r & 1);
        if (n < N && m < M) y[(i64)m * N + n] = float_to_bf16(v[r]);
    }
}

template <int NT, int STAGES, int KPU>
__global__ void __launch_bounds__(128) fp8_gemm_wgmma(const fp8_t* __restrict__ x, const float* __restrict__ sx,
                                                      const fp8_t* __restrict__ w, const float* __restrict__ sw,
                                                      bf16_t* __restrict__ y, float* __restrict__ ws,
                                                      int* __restrict__ counters, int M, int N, int K, int Mp) {
    constexpr int A_BYTES = WG_ROWS * 128, B_BYTES = NT * 128, BLOCK_BYTES = A_BYTES + B_BYTES;
    constexpr int STAGE_BYTES = KPU * BLOCK_BYTES;
    constexpr int R = NT / 2;  // accumulator registers per thread
    // FP8 wgmma accumulates with reduced precision (about 14 mantissa bits, not FP32), so the four k32 MMAs of a
    // 128-wide K block go into separate accumulators (as many as registers allow) that are summed in FP32: with
    // four, no tensor-core sum spans more than 32 products. Measured: one accumulator per block averaged 0.3-0.43
    // bf16 ulp of error against the exact product, with outliers of thousands of ulp on outputs near zero.
    constexpr int ACCS = NT <= 32 ? 4 : (NT == 64 ? 2 : 1);
    extern __shared__ unsigned char smem_raw[];
    // Swizzle atoms need 1024-byte alignment; the launch asks for 1 KB of slack.
    const unsigned raw = smem_u32(smem_raw);
    unsigned char* smem = smem_raw + (((raw + 1023u) & ~1023u) - raw);
    float* s_x = reinterpret_cast<float*>(smem + STAGES * STAGE_BYTES);  // [STAGES][KPU][NT] activation scales
    float* s_w = s_x + STAGES * KPU * NT;                                // [STAGES][KPU] weight scales
    __shared__ int s_last;

    const int tid = threadIdx.x;
    const int KB = K >> 7, KU = KB / KPU, tiles = (N + WG_ROWS - 1) / WG_ROWS, C = gridDim.x, c = blockIdx.x;
    const i64 T = (i64)tiles * KU;
    const i64 u0 = unit_begin(c, T, C);
    const int units = (int)(unit_begin(c + 1, T, C) - u0);
    const unsigned base = smem_u32(smem);

    // Load cursor: the next unit to fetch, as (tile, unit in tile), stepped without divisions. Every call commits a
    // cp.async group (empty past the range) so the wait counts stay uniform.
    int ld_tile = (int)(u0 / KU), ld_ku = (int)(u0 - (i64)ld_tile * KU), loaded = 0;
    auto load_next = [&]() {
        if (loaded < units) {
            const int buf = loaded % STAGES;
            const int ch = tid & 7;  // 16-byte chunk of the 128-byte row
#pragma unroll
            for (int sub = 0; sub < KPU; ++sub) {
                const int kb = ld_ku * KPU + sub;
                const unsigned a = base + buf * STAGE_BYTES + sub * BLOCK_BYTES, b = a + A_BYTES;
#pragma unroll
                for (int i = 0; i < WG_ROWS / 16; ++i) {
                    const int r = (tid >> 3) + 16 * i, n = ld_tile * WG_ROWS + r;
                    const bool ok = n < N;
                    cp_async16(a + sw128_offset(r, ch), w + (i64)(ok ? n : 0) * K + kb * 128 + ch * 16, ok);
                }
#pragma unroll
                for (int i = 0; i < (NT * 8 + 127) / 128; ++i) {
                    const int idx = tid + 128 * i, r = idx >> 3;
                    if (r < NT) {
                        const bool ok = r < M;
                        cp_async16(b + sw128_offset(r, ch), x + (i64)(ok ? r : 0) * K + kb * 128 + ch * 16, ok);
                    }
                }
                const int sb = buf * KPU + sub;
                if (tid < NT) cp_async4(smem_u32(s_x + sb * NT + tid), sx + (i64)kb * Mp + (tid < M ? tid : 0), tid < M);
                if (tid == 0) cp_async4(smem_u32(s_w + sb), sw + (i64)(ld_tile >> 1) * KB + kb, true);
            }
            if (++ld_ku == KU) {
                ld_ku = 0;
                ++ld_tile;
            }
        }
        ++loaded;
        cp_async_commit();
    };

    float total[R], acc[ACCS][R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        total[r] = 0.f;
#pragma unroll
        for (int q = 0; q < ACCS; ++q) acc[q][r] = 0.f;
    }

#pragma unroll
    for (int j = 0; j < STAGES - 1; ++j) load_next();

    int tile = (int)(u0 / KU), ku = (int)(u0 - (i64)tile * KU);
    bool whole = ku == 0;        // the segment being accumulated started at the tile's first K block
    int shared_tiles[2], n_shared = 0;  // tiles this CTA only partly covers (its first and/or last)
    const int lane = tid & 31;
    for (int j = 0; j < units; ++j) {
        cp_async_wait<STAGES - 2>();
        fence_proxy_async();
        __syncthreads();  // unit j landed for every thread; unit j-1's buffer is no longer read by anyone
        load_next();      // refill that buffer while this unit computes

        const int buf = j % STAGES;
#pragma unroll
        for (int sub = 0; sub < KPU; ++sub) {  // one 128-wide K block at a time: MMA into acc, then promote
            const unsigned a = base + buf * STAGE_BYTES + sub * BLOCK_BYTES, b = a + A_BYTES;
            wgmma_fence();
#pragma unroll
            for (int k = 0; k < 4; ++k)
                wgmma_e4m3<NT>(acc[k % ACCS], desc_sw128(a + 32 * k), desc_sw128(b + 32 * k), k >= ACCS);
            wgmma_commit();
            wgmma_wait_all();
#pragma unroll
            for (int q = 0; q < ACCS; ++q) fence_regs(acc[q]);

            const int sb = buf * KPU + sub;
            const float swv = s_w[sb];
            const float* sxb = s_x + sb * NT;
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
        }

        if (ku == KU - 1 || j == units - 1) {  // end of this CTA's segment of `tile`
            if (whole && ku == KU - 1) {
                store_tile<NT>(total, y, tile, M, N);
            } else {  // a shared tile: park the partial sum; tiles are settled once, after the loop
                float* p = ws + partial_slot(c, tile, T, C, KU) * (WG_ROWS * NT);
#pragma unroll
                for (int r = 0; r < R; ++r) p[r * 128 + tid] = total[r];  // [register][thread]: coalesced
                shared_tiles[n_shared++] = tile;
            }
#pragma unroll
            for (int r = 0; r < R; ++r) total[r] = 0.f;
            whole = true;
        }
        if (++ku == KU) {
            ku = 0;
            ++tile;
        }
    }
    if (n_shared == 0) return;  // uniform across the CTA

    // Settle shared tiles: publish this CTA's partials (one fence, with the pipeline already drained), count
    // arrivals per tile, and let the last arrival sum every share in CTA order and reset the counter.
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        int last = 0;
        for (int i = 0; i < n_shared; ++i) {
            const int t = shared_tiles[i];
            const int c_lo = unit_owner((i64)t * KU, T, C), c_hi = unit_owner((i64)t * KU + KU - 1, T, C);
            if (atomicAdd(&counters[t], 1) == c_hi - c_lo) last |= 1 << i;
        }
        s_last = last;
    }
    __syncthreads();
    for (int i = 0; i < n_shared; ++i) {
        if (!(s_last >> i & 1)) continue;
        __threadfence();
        const int t = shared_tiles[i];
        const int c_lo = unit_owner((i64)t * KU, T, C), c_hi = unit_owner((i64)t * KU + KU - 1, T, C);
        float* sum = acc[0];
#pragma unroll
        for (int r = 0; r < R; ++r) sum[r] = 0.f;
        for (int cc = c_lo; cc <= c_hi; ++cc) {
            const float* q = ws + partial_slot(cc, t, T, C, KU) * (WG_ROWS * NT);
#pragma unroll
            for (int r = 0; r < R; ++r) sum[r] += __ldcg(q + r * 128 + tid);
        }
        store_tile<NT>(acc[0], y, t, M, N);
        if (tid == 0) counters[t] = 0;  // ready for the next launch (graph replays included)
    }
}
