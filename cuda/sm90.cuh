// Hopper (sm_90a) building blocks: shared-memory addresses, cp.async with zero fill, the async-proxy fence, wgmma
// descriptors for 128-byte-swizzled K-major tiles, mbarriers and bulk (TMA) copies, named barriers, FP8 wgmma for
// every token-tile width the GEMM uses, and ldmatrix + bf16 mma.sync for decode attention.
// Self-contained (inline PTX only), like common.cuh.
#pragma once
#include "common.cuh"

typedef unsigned long long u64;

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16 bytes global -> shared through L2 only (.cg: weights are read once); zero-filled when !valid (src not read).
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

__device__ __forceinline__ void cp_async4(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// cp.async writes through the generic proxy; wgmma reads shared memory through the async proxy.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// The same for global memory: generic-proxy writes this thread has observed (e.g. acquired from other CTAs) are
// ordered before its later async-proxy (bulk copy) reads of them.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

// ldmatrix: four 8x8 b16 matrices from shared memory, lanes 8j..8j+7 giving matrix j's row addresses; `trans`
// transposes each (thread t gets stored rows 2(t%4), 2(t%4)+1 of column t/4 instead of row t/4, columns 2(t%4)..+1).
__device__ __forceinline__ void ldmatrix_x4(unsigned addr, unsigned (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned addr, unsigned (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}

// d[8 x 8] += A[8 x 16] B[16 x 8] on the tensor cores (mma.m16n8k16, bf16 in, FP32 accumulate) for operands of only
// eight rows: rows 8-15 of A are zero, so their half of the accumulator stays zero and is not kept. a_lo / a_hi: this
// thread's A pair at columns 2(t%4).. and 8 + 2(t%4).. of row t/4; b0 / b1: its B pairs (rows 2(t%4).., 8 + 2(t%4)..
// of column t/4); d: its accumulator pair, row t/4, columns 2(t%4)..
__device__ __forceinline__ void mma_bf16_rows8(float (&d)[2], unsigned a_lo, unsigned a_hi, unsigned b0, unsigned b1) {
    float z0 = 0.f, z1 = 0.f;
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(z0), "+f"(z1)
        : "r"(a_lo), "r"(0u), "r"(a_hi), "r"(0u), "r"(b0), "r"(b1));
}

// Two floats as a bf16 pair (round to nearest even), x in the low half: the element of lower index in an MMA operand.
__device__ __forceinline__ unsigned pack_bf16x2(float x, float y) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(y), "f"(x));
    return r;
}

// Matrix descriptor of a K-major tile whose rows are 128 bytes, 8-row atoms 1024 bytes apart (stride byte offset),
// 128-byte swizzle (chunk c of row r stored at chunk c ^ (r % 8)); the atoms must be 1024-byte aligned. A K slice
// starting k bytes into the rows is the same descriptor with the start address advanced by k. The high word is the
// same for every such tile, and the low word holds the address / 16 in bits 0-13 (bit 16 is the leading byte offset,
// unused with this swizzle): for addresses below 256 KB (all of shared memory) the low word of a + d is the low word
// of a plus d / 16 for any multiple d of 16, so loops keep one 32-bit low word per tile and add offsets to it
// (desc_sw128_lo / desc_of) instead of rebuilding 64-bit descriptors per MMA.
#define DESC_SW128_HI ((1024u >> 4) | (1u << 30))
__device__ __forceinline__ unsigned desc_sw128_lo(unsigned saddr) { return ((saddr & 0x3FFFF) >> 4) | (1u << 16); }
__device__ __forceinline__ u64 desc_of(unsigned lo) { return ((u64)DESC_SW128_HI << 32) | lo; }

// Byte offset of 16-byte chunk c of row r in such a tile (the 128-byte swizzle these descriptors describe).
__device__ __forceinline__ unsigned sw128_offset(int r, int c) { return r * 128 + ((c ^ (r & 7)) << 4); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }

// Keeps the compiler from touching accumulator registers across the asynchronous MMA.
template <int R>
__device__ __forceinline__ void fence_regs(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// A consumer's FP32 total and tensor-core accumulators, zeroed (a K block's first MMA overwrites acc, but the asm
// reads every accumulator register it names).
template <int R, int ACCS>
__device__ __forceinline__ void zero_accumulators(float (&total)[R], float (&acc)[ACCS][R]) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
        total[r] = 0.f;
#pragma unroll
        for (int q = 0; q < ACCS; ++q) acc[q][r] = 0.f;
    }
}

// ---- mbarriers and bulk copies (the TMA engine, 1-D: no tensor map needed for contiguous sources)

// Next stage of a ring of n mbarrier-guarded stages: the phase parity a waiter expects flips on each wrap.
__device__ __forceinline__ void ring_next(int& s, int& phase, int n) {
    if (++s == n) {
        s = 0;
        phase ^= 1;
    }
}

__device__ __forceinline__ void mbar_init(unsigned bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

// Arrive and announce `bytes` of async-copy traffic that will complete this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// Block until the phase with the given parity has completed.
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    asm volatile(
        "{\n.reg .pred done;\nwait_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra wait_%=;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}

// bytes (a multiple of 16, 16-byte aligned both sides) global -> shared by the TMA engine; completes on `bar`.
__device__ __forceinline__ void bulk_copy_g2s(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// A tensor map (CUtensorMap: 128 opaque bytes the driver encodes, cuTensorMapEncodeTiled) passed by value as a
// __grid_constant__ kernel parameter; the TMA engine reads it through its generic address.
struct __align__(64) TensorMap {
    u64 opaque[16];
};

// One box of a 2-D tensor map at element coordinates (c0 innermost, c1) -> shared memory, completing on `bar`. The
// map's swizzle mode decides the shared layout; elements outside the tensor are written as zeros (and still count
// toward the transaction bytes: the full box always lands).
__device__ __forceinline__ void tma_load_2d(unsigned dst, const TensorMap* map, int c0, int c1, unsigned bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
        ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(bar) : "memory");
}

// Fetch a tensor map into the TMA unit's descriptor cache ahead of its first load (the map is a kernel parameter, a
// constant: allowed before griddepcontrol.wait), so that load does not start with a descriptor fetch from memory.
__device__ __forceinline__ void prefetch_tensor_map(const TensorMap* map) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(map) : "memory");
}

// Programmatic dependent launch (PDL): let the next kernel on the stream start launching now; wait until the
// kernels before this one have completed and their writes are visible (a no-op when launched without PDL).
__device__ __forceinline__ void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// GPU-scope add with release semantics and no result (fire and forget): this thread's earlier writes, and those
// ordered before it by a CTA barrier, are visible to whoever acquires the new value.
__device__ __forceinline__ void red_add_release(int* p, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ int load_acquire(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Barrier over `threads` threads of the CTA only (id 0 is __syncthreads); whole warps. bar.sync and bar.arrive are
// .aligned (every thread of the warp must execute them together), and callers reach them right after per-thread
// branches (a spin by one thread, a loop with `continue`), so the warp reconverges explicitly first.
__device__ __forceinline__ void named_barrier(int id, int threads) {
    __syncwarp();
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Count this warp in at barrier `id` without waiting for it; whole warps.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    __syncwarp();
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Thread-block clusters (sm_90): rank in the cluster, cluster size, a peer CTA's copy of a shared-memory address,
// loads from it (distributed shared memory), and the cluster-wide barrier: arrive releases this thread's prior
// writes (shared memory included) and wait acquires every other thread's, so after it every CTA of the cluster can
// read what the others wrote before it. All threads of every CTA of the cluster must take part (.aligned: whole warps).
__device__ __forceinline__ unsigned cluster_ctarank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ unsigned cluster_nctarank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ unsigned mapa_shared(unsigned addr, unsigned rank) {
    unsigned r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
    return r;
}
__device__ __forceinline__ float ld_cluster_f32(unsigned addr) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ void cluster_sync() {
    __syncwarp();  // .aligned: the warp reconverges first (see named_barrier)
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// The cluster barrier split in two: arrive (relaxed: orders nothing but what a preceding fence orders) early, wait
// later, so the barrier's latency overlaps other work. Used to publish mbarrier inits to the cluster: the initializing
// thread's fence_mbarrier_init_cluster, then every thread's arrive; a peer may signal those mbarriers after its wait.
__device__ __forceinline__ void cluster_arrive_relaxed() {
    __syncwarp();
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
    __syncwarp();
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
}
__device__ __forceinline__ void fence_mbarrier_init_cluster() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// 16 bytes (16-byte aligned) into a peer CTA's shared memory (addr, bar: its shared::cluster addresses from
// mapa_shared), counted as transaction bytes on the peer's mbarrier `bar`: the peer waits on its own barrier, no
// cluster barrier needed.
__device__ __forceinline__ void st_async_f32x4(unsigned addr, float a, float b, float c, float d, unsigned bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];"
                 ::"r"(addr), "r"(__float_as_uint(a)), "r"(__float_as_uint(b)), "r"(__float_as_uint(c)),
                 "r"(__float_as_uint(d)), "r"(bar) : "memory");
}

// D[64 x NT] (+)= A[64 x 32] * B[NT x 32]^T, e4m3 in, FP32 accumulate; accumulate == 0 overwrites D.
// Accumulator layout (thread t of the warpgroup, warp w = t / 32, lane l): d[4i + e] is row 16w + l/4 + 8(e >> 1),
// column 8i + 2(l % 4) + (e & 1).
template <int NT>
__device__ __forceinline__ void wgmma_e4m3(float (&d)[NT / 2], u64 da, u64 db, int accumulate);

template <>
__device__ __forceinline__ void wgmma_e4m3<8>(float (&d)[4], u64 da, u64 db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {"
        "%0, %1, %2, %3"
        "}, %4, %5, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "l"(da), "l"(db), "r"(accumulate));
}

template <>
__device__ __forceinline__ void wgmma_e4m3<16>(float (&d)[8], u64 da, u64 db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {"
        "%0, %1, %2, %3, %4, %5, %6, %7"
        "}, %8, %9, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "l"(da), "l"(db), "r"(accumulate));
}

template <>
__device__ __forceinline__ void wgmma_e4m3<32>(float (&d)[16], u64 da, u64 db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
        "}, %16, %17, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(da), "l"(db), "r"(accumulate));
}

template <>
__device__ __forceinline__ void wgmma_e4m3<64>(float (&d)[32], u64 da, u64 db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, %32, %33, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(accumulate));
}

template <>
__device__ __forceinline__ void wgmma_e4m3<128>(float (&d)[64], u64 da, u64 db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(accumulate));
}
