// What the wgmma GEMMs share: one block-scaled K block (MMAs and FP32 promotion), and stream-K bookkeeping
// (fp8_gemm_wgmma.cu: 128-row tiles, two consumer warpgroups;
// fp8_gemm_wgmma64.cu: 64-row tiles, one): which iterations a CTA streams, who owns an iteration, storing a tile, and
// (the 128-row kernel; the 64-row one bulk-copies the shares into shared memory instead) settling a tile split over
// several CTAs by reading the shares from global memory into registers.
//
// The grid is persistent and CTA c takes the contiguous iteration range [c*T/C, (c+1)*T/C) of the T = tiles * K/128
// iterations in tile-major order. A tile shared by several CTAs is summed by the one holding its first K block (always
// that CTA's last segment), in CTA order (the same bits on every launch): the others park their FP32 shares in slot c
// of a per-stream workspace (only a CTA's first segment can start inside a tile, so a share summed by another CTA is
// always its first tile's, and each CTA parks at most one) and count themselves in with a release add: on the tile's
// counter (128-row kernel), or on their own flag, counters[c], which the 64-row kernel's settling CTA polls share by
// share.
#pragma once
#include "sm90.cuh"

// One 128-wide K block of a consumer warpgroup: acc = A[64 x 128] * B[NT x 128]^T from the swizzled shared tiles
// whose descriptors' low words (desc_sw128_lo) are a and b, in four k32 MMAs spread over ACCS accumulators
// (fp8_gemm_wgmma.cu says why), waited for. A k step is 32 bytes on, its low words 2 on (sm90.cuh says why that
// holds): callers pass a low word built once plus the stage's offset / 16, not a shared address to rebuild each
// MMA's descriptor from (those rebuilds cost many of a K block's instructions, in loops whose issue rate counts).
template <int NT, int ACCS>
__device__ __forceinline__ void mma_block(float (&acc)[ACCS][NT / 2], unsigned a, unsigned b) {
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < 4; ++k) wgmma_e4m3<NT>(acc[k % ACCS], desc_of(a + 2 * k), desc_of(b + 2 * k), k >= ACCS);
    wgmma_commit();
    wgmma_wait_all();
#pragma unroll
    for (int q = 0; q < ACCS; ++q) fence_regs(acc[q]);
}

// Promote in FP32: total += acc * sw * sx (per 128-K block, so FP8 rounding never accumulates across blocks), the
// ACCS accumulators summed outside the tensor core. swv: the block's weight scale; sxb: its NT token scales.
template <int NT, int ACCS>
__device__ __forceinline__ void promote(float (&total)[NT / 2], const float (&acc)[ACCS][NT / 2], float swv,
                                        const float* sxb, int lane) {
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
}

// A share another CTA sums: parked in workspace slot `slot` ([NT / 2 registers][CONS threads], coalesced) and
// counted in with a release add on counters[counter] (the tile's count, or the parking CTA's own flag: the file
// comment says which kernel uses which). Mid-range (more iterations follow) the publisher warp does the add after
// barrier `bar_publish` and the consumers go on at once; at the end of the range the consumers wait for each
// other's stores (barrier `bar_consumers`) and thread 0 adds.
template <int NT, int CONS>
__device__ __forceinline__ void park_share(const float (&total)[NT / 2], float* __restrict__ ws,
                                           int* __restrict__ counters, int slot, int counter, bool mid_range,
                                           int bar_publish, int bar_consumers) {
    const int tid = threadIdx.x;
    float* p = ws + (i64)slot * (CONS / 2 * NT);
#pragma unroll
    for (int r = 0; r < NT / 2; ++r) p[r * CONS + tid] = total[r];
    if (mid_range) {
        named_barrier_arrive(bar_publish, CONS + 32);
    } else {
        named_barrier(bar_consumers, CONS);  // every share stored before the release below
        if (tid == 0) red_add_release(&counters[counter], 1);
    }
}

// The consumer loop's walk over its range: after iteration j (K block kb of `tile`), a finished segment starts the next
// one at a tile's first K block (only a CTA's first segment can start inside a tile) from a zero total, unless the
// range is over; then the next iteration's (tile, K block).
template <int R>
__device__ __forceinline__ void next_segment(float (&total)[R], bool& whole, bool more) {
    if (more) {
#pragma unroll
        for (int r = 0; r < R; ++r) total[r] = 0.f;
    }
    whole = true;
}

__device__ __forceinline__ void next_block(int& tile, int& kb, int KB) {
    if (++kb == KB) {
        kb = 0;
        ++tile;
    }
}

// 64-bit division is a long emulated sequence on the GPU (a settling CTA needs many, on its critical path), so both
// use 32-bit math whenever the products fit, as for every decode shape.
__device__ __forceinline__ i64 unit_begin(int c, i64 T, int C) {
    if (T * (C + 1) < (1ll << 32)) return (i64)((unsigned)c * (unsigned)T / (unsigned)C);
    return (i64)c * T / C;
}

// The CTA whose iteration range holds iteration u: the largest c with floor(c*T/C) <= u.
__device__ __forceinline__ int unit_owner(i64 u, i64 T, int C) {
    if ((T + u + 1) * (C + 1) < (1ll << 32))
        return (int)(((unsigned)(u + 1) * (unsigned)C + (unsigned)T - 1u) / (unsigned)T) - 1;
    return (int)(((u + 1) * C + T - 1) / T) - 1;
}

// A summing CTA's wait for the other shares of `tile` (those of CTAs c + 1 ... c + the returned count): thread 0
// spins until all are counted in; callers order every thread's reads of them after it with a barrier. Sharers publish
// without waiting, so this never waits on a CTA that waits, whether or not the whole grid is resident at once.
__device__ __forceinline__ int await_shares(const int* counters, int tile, int c, int KB, i64 T, int C) {
    const int want = unit_owner((i64)tile * KB + KB - 1, T, C) - c;
    if (threadIdx.x == 0)
        while (load_acquire(&counters[tile]) < want) {
        }
    return want;
}

// One warpgroup's accumulator tile (64 weight rows from row0, NT tokens) to y[M, N] as bf16; rows/tokens past N/M
// are dropped.
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

// Sum tile t, whose first K block is this CTA's (so c is its lowest sharer): `sum` holds this CTA's share and gets
// the others added in CTA order (so every launch gives the same bits); store y and reset the tile's counter. CONS
// consumer threads (ROWS = CONS / 2 weight rows per tile) hold [NT / 2 registers][CONS threads] floats each; shares
// are read GROUP at a time (each group costs one L2 round trip).
template <int NT, int GROUP, int CONS>
__device__ __forceinline__ void settle_tile(float (&sum)[NT / 2], const float* __restrict__ ws,
                                            int* __restrict__ counters, bf16_t* __restrict__ y, int c, int t, i64 T,
                                            int C, int KB, int M, int N) {
    constexpr int R = NT / 2, ROWS = CONS / 2;
    const int tid = threadIdx.x;
    const int c_hi = unit_owner((i64)t * KB + KB - 1, T, C);
    float buf[GROUP][R];
    for (int c0 = c + 1; c0 <= c_hi; c0 += GROUP) {
#pragma unroll
        for (int u = 0; u < GROUP; ++u) {
            if (c0 + u > c_hi) break;
            const float* q = ws + (i64)(c0 + u) * (ROWS * NT);
#pragma unroll
            for (int r = 0; r < R; ++r) buf[u][r] = __ldcg(q + r * CONS + tid);
        }
#pragma unroll
        for (int u = 0; u < GROUP; ++u) {
            if (c0 + u > c_hi) break;
#pragma unroll
            for (int r = 0; r < R; ++r) sum[r] += buf[u][r];
        }
    }
    store_tile<NT>(sum, y, t * ROWS + 64 * (tid >> 7), M, N);
    if (tid == 0) counters[t] = 0;  // ready for the next launch (graph replays included)
}
