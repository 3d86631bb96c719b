// The attention block's step between the QKV projection and attention, in one kernel (the torch form is ~40 for the
// q and k heads of a QK-norm model): per token,
//   q heads: optional RMSNorm over the head (q_norm), RoPE              -> q_out [T, H, D]
//   k heads: optional RMSNorm (k_norm), RoPE, stored into the KV cache  -> kc[row, pos, h, :]
//   v heads: stored into the KV cache                                   -> vc[row, pos, h, :]
// with the model's roundings: the norm as rmsnorm.cu (float32, cast to bf16, times the bf16 weight), RoPE on
// adjacent pairs in float32 with every product and sum rounded on its own (no FMA contraction: torch runs them as
// separate ops), cast to bf16. Tables are bf16 (cos, sin) pairs [rope_rows, S, D/2, 2]; rope_rows is B or 1 (one
// table row shared by every batch row).
// Grid (T = B*S tokens, ceil((H + 2*KV) / WARPS)): one warp per head, lanes over adjacent (2j, 2j+1) pairs.
#include "common.cuh"

#define ROPE_WARPS 8

template <bool NORM>
__device__ __forceinline__ void rope_head(const bf16_t* __restrict__ src, const bf16_t* __restrict__ nw, float eps,
                                          const bf16_t* __restrict__ cs, bf16_t* __restrict__ dst, int D, int lane) {
    float rs = 1.f;
    if (NORM) {
        float ss = 0.f;
        for (int i = lane; i < D; i += 32) {
            const float v = bf16_to_float(src[i]);
            ss += v * v;
        }
        rs = rsqrtf(warp_sum(ss) * (1.0f / (float)D) + eps);
    }
    for (int j = lane; j < D / 2; j += 32) {
        float x0 = bf16_to_float(src[2 * j]), x1 = bf16_to_float(src[2 * j + 1]);
        if (NORM) {
            x0 = bf16_to_float(float_to_bf16(__fmul_rn(bf16_to_float(float_to_bf16(__fmul_rn(x0, rs))),
                                                       bf16_to_float(nw[2 * j]))));
            x1 = bf16_to_float(float_to_bf16(__fmul_rn(bf16_to_float(float_to_bf16(__fmul_rn(x1, rs))),
                                                       bf16_to_float(nw[2 * j + 1]))));
        }
        const float c = bf16_to_float(cs[2 * j]), s = bf16_to_float(cs[2 * j + 1]);
        dst[2 * j] = float_to_bf16(__fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s)));
        dst[2 * j + 1] = float_to_bf16(__fadd_rn(__fmul_rn(x1, c), __fmul_rn(x0, s)));
    }
}

// qkv bf16 [T, (H + 2*KV) * D] contiguous (token t = b * S + s); qw / kw: bf16 [D] norm weights or null (no norm);
// rope bf16 [rope_rows, S, D/2, 2]; rows int64 [B] (cache row of batch row b); pos int64 [B, S];
// caches bf16 [n_rows, ctx, KV, D]. Rows outside [0, n_rows) and positions outside [0, ctx) are not stored (the host
// guarantees they never occur; a bad index must not write outside the caches).
extern "C" __global__ void __launch_bounds__(ROPE_WARPS * 32)
    qkv_rope_store(const bf16_t* __restrict__ qkv, const bf16_t* __restrict__ qw, const bf16_t* __restrict__ kw,
                   float eps, const bf16_t* __restrict__ rope, int rope_rows, const i64* __restrict__ rows,
                   const i64* __restrict__ pos, bf16_t* __restrict__ q_out, bf16_t* __restrict__ kc,
                   bf16_t* __restrict__ vc, int S, int H, int KV, int D, int ctx, int n_rows) {
    const int t = blockIdx.x, lane = threadIdx.x & 31;
    const int head = blockIdx.y * ROPE_WARPS + (threadIdx.x >> 5);
    pdl_trigger();
    pdl_depend();
    if (head >= H + 2 * KV) return;
    const int b = t / S, s = t - b * S;
    const bf16_t* src = qkv + ((i64)t * (H + 2 * KV) + head) * D;
    const bf16_t* cs = rope + ((i64)(rope_rows == 1 ? 0 : b) * S + s) * D;  // D/2 (cos, sin) pairs
    if (head < H) {
        bf16_t* dst = q_out + ((i64)t * H + head) * D;
        if (qw != nullptr) rope_head<true>(src, qw, eps, cs, dst, D, lane);
        else rope_head<false>(src, qw, eps, cs, dst, D, lane);
        return;
    }
    const i64 p = pos[t], row = rows[b];
    if (p < 0 || p >= ctx || row < 0 || row >= n_rows) return;
    const int kvh = head < H + KV ? head - H : head - H - KV;
    const i64 at = ((row * ctx + p) * KV + kvh) * D;
    if (head < H + KV) {
        if (kw != nullptr) rope_head<true>(src, kw, eps, cs, kc + at, D, lane);
        else rope_head<false>(src, kw, eps, cs, kc + at, D, lane);
    } else {
        for (int i = lane; i < D; i += 32) vc[at + i] = src[i];
    }
}
