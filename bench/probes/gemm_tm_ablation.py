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
  no_pair*        each CTA of a pair stores its half of the tile from its own half-K sum (nothing pushed, nothing
                  waited for)
  (split_tail, in 3d1b920: the sums spread over both warpgroups and both CTAs of a pair; no faster)
  trigger_after_loads
                  dependents launch once this CTA's producer has issued its last load (the ring holds this CTA's
                  last blocks): the next GEMM prefetches during this one's tail only
  *_st10          the same with 10 weight stages and 4 token stages (the planner's cap lifted): a deeper
                  prefetch, when it no longer competes with this GEMM's loop
  ts4, ts4_st10   the kernel as committed, 4 token stages and 8 / 10 weight stages

    python bench/probes/gemm_tm_ablation.py OUT [token counts, default 32,64] [variants, default all]  # GPU

Prints one line per variant, layer and token count, and writes OUT/gemm-tm-ablation.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from kernel_patch import gemm_source

from rtts import kernels
from rtts.bench.kernels import S2_GEMMS, packed_weights, time_plan
from rtts.kernels import _jit
from rtts.kernels.common import sm_count
from rtts.kernels.gemm_plan import TM_MAX_STAGES, wgmma_tm_plan

KERNEL = "fp8_gemm_wgmma_tm.cu"
MMA = "        tm_mma_block<WN, ACCS>(acc, tdesc + t * (TM_TOKEN_BYTES / 16), wdesc + s * (W_BYTES / 16));\n"
PROMOTE = "        tm_promote<WN, ACCS>(total, acc, x0, x1, s_w[2 * j], s_w[2 * j + 1], split);\n"
TOKENS = ("            pdl_wait();  // tokens and their scales were written by the kernel ahead\n"
          "            for (int u = 0; u < tpre; ++u) load_tokens(u, kbeg + u);\n")
TRIGGER = "    pdl_launch_dependents();\n    if (tid >= TM_CONSUMERS) {"
AFTER_LOOP = "    // The tile's sum in a fixed order"
STORE = "    tm_store<WN>(total, smem + stages * W_BYTES, y, n0, wn, M, N, g0, g1);"
LAST_LOAD = ("                ring_next(wsg, wph, stages);\n            }\n        }\n"
             "        if constexpr (S == 2) cluster_wait();")
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
    "no_store": [(STORE, "    (void)g0;")],  # (S = 1 only)
    "trigger_after_loads": AFTER_LOADS,
    # only the first stages are loaded (wrong outputs): what streaming the rest of the tokens / weights costs
    "t_once": [("                    load_tokens(ts, kbeg + i + tstages);\n",
                "                    mbar_arrive(full_t + 8 * ts);\n")],
    "w_once": [("                    load_weights(wsg, kbeg + i + stages);\n",
                "                    mbar_arrive(full_w + 8 * wsg);\n")],
    "acc1": [("    constexpr int ACCS = 2;\n", "    constexpr int ACCS = 1;\n")],
    "trigger_late_st10": TRIGGER_LATE,
    "trigger_after_loads_st10": AFTER_LOADS,
    "ts4": [],  # the kernel as committed with 4 token stages and 8 weight stages
    "ts4_st10": [],  # ... and 10 weight stages
}
PUSH = "            st_async_f32x4("
RECV_WAIT = "        mbar_wait(recv_bar, 0);\n"


def tail_edits(kind: str) -> list[tuple[str, str]]:
    """Edits replacing everything after the consumer loop (built from the kernel text, which ends with the tail)."""
    text = _jit.source(KERNEL)
    tail = text[text.index(AFTER_LOOP):]
    if kind == "no_tail":
        keep = ("    float z = 0.f;  // (probe) keeps the loop's results live; M is never negative\n"
                "#pragma unroll\n    for (int r = 0; r < R; ++r) z += total[r];\n"
                "    if (M < 0) y[tid] = float_to_bf16(z);\n"
                "    if constexpr (S == 2) cluster_wait();\n}\n")
        return [(tail, keep)]
    # no_pair: nothing pushed, nothing waited for (each rank adds whatever its receive buffer holds)
    return [(PUSH, "            if (M < 0) st_async_f32x4("), (RECV_WAIT, "")]


VARIANTS.update({k: tail_edits(k) for k in ("no_tail", "no_pair")})
STAGES = {"trigger_late_st10": 10, "trigger_after_loads_st10": 10, "ts4": 8, "ts4_st10": 10}  # weight ring depth
# (others: the planner's)


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    ms = [int(m) for m in sys.argv[2].split(",")] if len(sys.argv) > 2 else [32, 64]
    dev = torch.device("cuda")
    sms = sm_count(0)
    original = _jit.source
    cases = []
    for name, N, K in S2_GEMMS:
        R, packed = packed_weights(N, K)
        for M in ms:
            try:  # the planner's token-major plan, or w2's forced cluster-pair one
                plan = wgmma_tm_plan(M, N, K, sms)
            except ValueError:
                try:
                    plan = wgmma_tm_plan(M, N, K, sms, split=2)
                except ValueError:
                    continue
            xq, sx = kernels.quantize_1x128(torch.randn(M, K, device=dev, dtype=torch.bfloat16))
            cases.append((name, M, N, K, plan, xq, sx, packed, R))
    res: dict[str, float] = {}
    only = sys.argv[3].split(",") if len(sys.argv) > 3 else list(VARIANTS)
    for variant, edits in VARIANTS.items():
        if variant not in only and variant != "base":
            continue
        _jit.source = gemm_source(edits, "gemm_tm_ablation.py", original=original, kernel=KERNEL)  # type: ignore
        _jit.forget_compiled()
        kernels.warmup(dev)
        for name, M, N, K, plan, xq, sx, packed, R in cases:
            if variant == "no_store" and plan.cluster != 1:
                continue
            if variant in STAGES:
                plan = wgmma_tm_plan(M, N, K, sms, STAGES[variant], plan.cluster, tstages=4,
                                     max_stages=max(TM_MAX_STAGES, STAGES[variant]))
            us = time_plan(plan, xq, sx, packed, R)
            key = f"{variant} {name} M={M} (wn={plan.rows} S={plan.cluster} st={plan.stages}/{plan.tstages})"
            res[key] = us
            print(f"{key}: {us:.2f} us", flush=True)
    _jit.source = original  # type: ignore[assignment]
    (out / "gemm-tm-ablation.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
