"""Where the token-major GEMM's time goes in a PDL chain: variants of `cuda/fp8_gemm_wgmma_tm.cu` with one part taken
out or moved, edited in memory (the repository file is untouched), each timed like the kernel bench (CUDA-graph
replay of a chain of calls over weight copies rotated past the L2, programmatic dependent launch on).

Variants (outputs are wrong in the ones marked *; only their time is read):
  base            the kernel as committed
  no_math*        consumers wait for each stage and release it, no MMA, no promotion: the streaming skeleton with
                  the token ring, the sum and the store
  no_promote*     MMAs but no FP32 promotion
  tokens_early    the producer loads the first token stages before griddepcontrol.wait (the chain's tokens never
                  change, so the output stays right): what loading tokens after the wait costs
  trigger_late    dependents launch after this CTA's loop, not at its start: what the next GEMM's weight prefetch
                  costs this one
  no_store*       whole-K plans without the final store of the tile
  t_once*, w_once*
                  only the rings' first token / weight stages are loaded, later ones marked full without a copy
  acc1            one accumulator per K block (the rounding test's bound is not checked here)
  no_tail*        nothing after the loop (no warpgroup or pair sum, no cluster barrier, no store)
  no_pair*        each CTA of a pair stores its own half-K sum (no cluster barrier, no DSMEM read)
  split_tail      the sums spread over both warpgroups and both CTAs of a pair: column group j is summed and stored
                  by warpgroup j % 2 (and, S = 2, rank j / 2 % 2), reading the other warpgroup's total from shared
                  memory and the peer's from distributed shared memory (same additions, same bits: checked)
  trigger_after_loads
                  dependents launch once this CTA's producer has issued its last load (the ring holds this CTA's
                  last blocks): the next GEMM prefetches during this one's tail only
  *_st10          the same with 10 weight stages and 4 token stages (the planner's cap lifted): a deeper
                  prefetch, when it no longer competes with this GEMM's loop

    python bench/probes/gemm_tm_ablation.py OUT [token counts, default 32,64] [variants, default all]  # GPU

Prints one line per variant, layer and token count, and writes OUT/gemm-tm-ablation.json.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import torch
from kernel_patch import gemm_source

from rtts import kernels
from rtts.bench.kernels import S2_GEMMS, packed_weights, time_plan
from rtts.kernels import _jit

KERNEL = "fp8_gemm_wgmma_tm.cu"
MMA = "        tm_mma_block<WN, ACCS>(acc, tdesc + t * (TM_TOKEN_BYTES / 16), wdesc + s * (W_BYTES / 16));\n"
PROMOTE = "        tm_promote<WN, ACCS>(total, acc, x0, x1, s_w[2 * j], s_w[2 * j + 1], split);\n"
TOKENS = ("            pdl_wait();  // tokens and their scales were written by the kernel ahead\n"
          "            for (int u = 0; u < tpre; ++u) load_tokens(u, kbeg + u);\n")
TRIGGER = "    pdl_launch_dependents();\n    if (tid >= TM_CONSUMERS) {"
AFTER_LOOP = "    // The tile's sum in a fixed order"
STORE = "        if (wg == 0) tm_store<WN>(total, y, n0, wn, M, N);\n"
LAST_LOAD = ("                ring_next(wsg, wph, stages);\n            }\n        }\n"
             "        if constexpr (S == 2) {")
AFTER_LOADS = [(TRIGGER, "    if (tid >= TM_CONSUMERS) {"),
               (LAST_LOAD, LAST_LOAD.replace("            }\n        }\n",
                                             "            }\n            pdl_launch_dependents();\n        }\n", 1))]
TRIGGER_LATE = [(TRIGGER, "    if (tid >= TM_CONSUMERS) {"),
                (AFTER_LOOP, "    if (tid == 0) pdl_launch_dependents();\n" + AFTER_LOOP)]
VARIANTS: dict[str, list[tuple[str, str]]] = {
    "base": [],
    "no_math": [(MMA, ""), (PROMOTE, "")],
    # one sum keeps every accumulator (and so every MMA) live without the promotion's work
    "no_promote": [(PROMOTE, "        fence_regs(acc[0]);\n        fence_regs(acc[1]);\n"
                             "        total[0] += acc[0][0] + acc[1][R - 1];\n")],
    "tokens_early": [(TOKENS, "            for (int u = 0; u < tpre; ++u) load_tokens(u, kbeg + u);\n"
                              "            pdl_wait();\n")],
    "trigger_late": TRIGGER_LATE,
    "no_store": [(STORE, "")],
    "trigger_after_loads": AFTER_LOADS,
    # only the first stages are loaded (wrong outputs): what streaming the rest of the tokens / weights costs
    "t_once": [("                    load_tokens(ts, kbeg + i + tstages);\n",
                "                    mbar_arrive(full_t + 8 * ts);\n")],
    "w_once": [("                    load_weights(wsg, kbeg + i + stages);\n",
                "                    mbar_arrive(full_w + 8 * wsg);\n")],
    "acc1": [("    constexpr int ACCS = 2;\n", "    constexpr int ACCS = 1;\n")],
    "trigger_late_st10": TRIGGER_LATE,
    "trigger_after_loads_st10": AFTER_LOADS,
}
PAIR_SYNC = ("        if constexpr (S == 2) {\n            __syncwarp();\n"
             "            cluster_sync();  // the pair's totals are in shared memory\n"
             "            cluster_sync();  // rank 0 has read rank 1's\n        }\n")
PAIR_SUM_BEGIN = "        if (wg == 0 && rank == 1) {\n"
SPLIT_TAIL = """    // (probe) split tail: column group j belongs to warpgroup j % 2 and, S = 2, rank j / 2 % 2
    float* sum = reinterpret_cast<float*>(smem);  // [R][256 threads]: both warpgroups' totals
    named_barrier(TM_BAR_SUM, TM_CONSUMERS);
#pragma unroll
    for (int r = 0; r < R; ++r) sum[r * 256 + tid] = total[r];
    named_barrier(TM_BAR_SUM, TM_CONSUMERS);
#pragma unroll
    for (int j = 0; j < WN / 8; ++j) {
        if ((j & 1) != wg) continue;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = 4 * j + e;
            total[r] = wg == 0 ? total[r] + sum[r * 256 + (tid ^ 128)] : sum[r * 256 + (tid ^ 128)] + total[r];
        }
    }
    if constexpr (S == 1) {
        tm_store_groups<WN>(total, y, n0, wn, M, N, wg, 2, 0);
    } else {
#pragma unroll
        for (int j = 0; j < WN / 8; ++j) {
            if ((j & 1) != wg || ((j >> 1) & 1) == rank) continue;  // the peer's groups: publish this CTA's sum
#pragma unroll
            for (int e = 0; e < 4; ++e) sum[(4 * j + e) * 256 + tid] = total[4 * j + e];
        }
        cluster_sync();
        const unsigned peer = mapa_shared(smem_u32(sum), (unsigned)(rank ^ 1));
#pragma unroll
        for (int j = 0; j < WN / 8; ++j) {
            if ((j & 1) != wg || ((j >> 1) & 1) != rank) continue;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = 4 * j + e;
                const float v = ld_cluster_f32(peer + 4u * (r * 256 + tid));
                total[r] = rank == 0 ? total[r] + v : v + total[r];
            }
        }
        tm_store_groups<WN>(total, y, n0, wn, M, N, wg, 2, rank);
        cluster_sync();
    }
}
"""
STORE_GROUPS = """// (probe) tm_store for the column groups j with j % 2 == wg and (pairs) j / 2 % 2 == rank
template <int WN>
__device__ __forceinline__ void tm_store_groups(const float (&v)[WN / 2], bf16_t* __restrict__ y, int n0, int wn, int M,
                                                int N, int wg, int per, int rank) {
    const int t = threadIdx.x & 127, lane = t & 31;
    const int m = 16 * (t >> 5) + (lane >> 2);
#pragma unroll
    for (int r = 0; r < WN / 2; r += 2) {
        const int j = r >> 2;
        if ((j & 1) != wg || ((j >> 1) & 1) != rank) continue;
        const int row = m + 8 * ((r & 3) >> 1), col = 8 * j + 2 * (lane & 3);
        if (row < M && col < wn) *reinterpret_cast<unsigned*>(y + (i64)row * N + n0 + col) = pack_bf16x2(v[r], v[r + 1]);
    }
}

"""


def tail_edits(kind: str) -> list[tuple[str, str]]:
    """Edits replacing everything after the consumer loop (built from the kernel text, which ends with the tail)."""
    text = _jit.source(KERNEL)
    tail = text[text.index(AFTER_LOOP):]
    if kind == "no_tail":
        keep = ("    float z = 0.f;  // (probe) keeps the loop's results live; M is never negative\n"
                "#pragma unroll\n    for (int r = 0; r < R; ++r) z += total[r];\n"
                "    if (M < 0) y[tid] = float_to_bf16(z);\n}\n")
        return [(PAIR_SYNC, ""), (tail, keep)]
    if kind == "no_pair":
        pair = text[text.index(PAIR_SUM_BEGIN):text.rindex("    }\n}")]
        return [(PAIR_SYNC, ""), (pair, "        if (wg == 0) tm_store<WN>(total, y, n0, wn, M, N);\n")]
    return [(tail, SPLIT_TAIL), ("// xmap: tensor map over x fp8", STORE_GROUPS + "// xmap: tensor map over x fp8")]


VARIANTS.update({k: tail_edits(k) for k in ("no_tail", "no_pair", "split_tail")})
CHECKED = ("split_tail",)  # variants whose output must equal the base kernel's, bit for bit
STAGES = {"trigger_late_st10": 10, "trigger_after_loads_st10": 10}  # weight ring depth (others: the planner's)


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    ms = [int(m) for m in sys.argv[2].split(",")] if len(sys.argv) > 2 else [32, 64]
    dev = torch.device("cuda")
    sms = kernels._sm_count(0)
    original = _jit.source
    cases = []
    for name, N, K in S2_GEMMS:
        R, packed = packed_weights(N, K)
        for M in ms:
            try:  # the planner's token-major plan, or w2's forced cluster-pair one
                plan = kernels.wgmma_tm_plan(M, N, K, sms)
            except ValueError:
                try:
                    plan = kernels.wgmma_tm_plan(M, N, K, sms, split=2)
                except ValueError:
                    continue
            xq, sx = kernels.quantize_1x128(torch.randn(M, K, device=dev, dtype=torch.bfloat16))
            cases.append((name, M, N, K, plan, xq, sx, packed, R))
    gemm_plan = importlib.import_module("rtts.kernels.gemm_plan")  # the package's gemm_plan name is a function
    gemm_plan._TM_MAX_STAGES = max(gemm_plan._TM_MAX_STAGES, *STAGES.values())
    res: dict[str, float] = {}
    base_out: dict[tuple[str, int], torch.Tensor] = {}
    only = sys.argv[3].split(",") if len(sys.argv) > 3 else list(VARIANTS)
    for variant, edits in VARIANTS.items():
        if variant not in only and variant != "base":
            continue
        _jit.source = gemm_source(edits, "gemm_tm_ablation.py", original=original, kernel=KERNEL)  # type: ignore
        _jit._module.cache_clear()
        _jit.function.cache_clear()
        _jit._SMEM_SET.clear()
        kernels.warmup(dev)
        for name, M, N, K, plan, xq, sx, packed, R in cases:
            if variant == "no_store" and plan.cluster != 1:
                continue
            if variant in STAGES:
                plan = kernels.wgmma_tm_plan(M, N, K, sms, STAGES[variant], plan.cluster, tstages=4)
            if variant in CHECKED:  # the base output of this case, from the first variant's run
                wp, sw = packed[0]
                got = kernels.launch_wgmma(plan, xq, sx, wp, sw)
                if not torch.equal(got, base_out[(name, M)]):
                    print(f"{variant} {name} M={M}: OUTPUT DIFFERS from base", flush=True)
                    res[f"{variant} {name} M={M} differs"] = 1.0
            elif variant == "base":
                wp, sw = packed[0]
                base_out[(name, M)] = kernels.launch_wgmma(plan, xq, sx, wp, sw)
            us = time_plan(plan, xq, sx, packed, R)
            key = f"{variant} {name} M={M} (wn={plan.rows} S={plan.cluster} st={plan.stages}/{plan.tstages})"
            res[key] = us
            print(f"{key}: {us:.2f} us", flush=True)
    _jit.source = original  # type: ignore[assignment]
    (out / "gemm-tm-ablation.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
