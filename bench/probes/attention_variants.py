"""Variants of the decode-attention kernel (cuda/decode_attention.cu) side by side, timed like the kernel bench
(CUDA graph of calls, KV caches rotated): pipeline depth and CTAs per SM, and where the splits are merged (by the
last split, or a second launch). Patched in memory (the repository file is untouched; an anchor that no longer
matches fails loudly), each variant launched with the plan it implies (attention.launch_attention).

    python bench/probes/attention_variants.py [variant ...]    # on the GPU machine, from the repository root

Variants: those in VARIANTS, and "sN" (N splits per stream and KV head, at most one per 64-key tile; merged where
attention.attention_fuses says) or "sN-fused" / "sN-launched".
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from rtts import kernels
from rtts.bench.kernels import copies_for, graph_calls, time_graph
from rtts.kernels import _jit, attention
from rtts.kernels import reference as ref
from rtts.kernels.attention import AttentionPlan
from rtts.kernels.common import sm_count

KERNEL = "decode_attention.cu"
BOUND = "__launch_bounds__(WARPS * 32, 2) decode_attention_"


@dataclass
class Variant:
    edits: list[tuple[str, str]] = field(default_factory=list)  # (anchor, replacement), every occurrence
    fuse: bool | None = None  # None: the planner's choice (attention.attention_fuses)
    stages: int = attention.STAGES
    ctas_per_sm: int = attention.CTAS_PER_SM
    splits: int | None = None  # None: attention.attention_splits' choice; else this many (at most one per 64-key tile)

    def plan(self, B: int, n_kv: int, L: int, D: int, sms: int) -> AttentionPlan:
        """The plan this variant launches (decode_attention's, with this variant's choices in place of its own)."""
        if self.splits is None:
            S, chunk = attention.attention_splits(B, n_kv, L, sms, self.ctas_per_sm)
        else:
            S, chunk = forced_splits(self.splits, L)
        fuse = attention.attention_fuses(B, n_kv, S, sms, self.ctas_per_sm) if self.fuse is None else self.fuse
        return AttentionPlan(S, chunk, S > 1 and fuse, attention.attention_smem_bytes(D, self.stages))


VARIANTS: dict[str, Variant] = {
    "auto": Variant(),
    "fused": Variant(fuse=True),
    "launched": Variant(fuse=False),
    # three CTAs per SM: 168 registers a thread, and the 128-dim instances spill (64 x 2048 keys 159 us against 124
    # at two)
    "3cta": Variant([(BOUND, BOUND.replace("2)", "3)"))], ctas_per_sm=3),
    # three 64-key stages (96 KB): two tiles in flight while one is used (as fast as two)
    "3st": Variant([("#define STAGES 2", "#define STAGES 3")], stages=3),
}
SIZES = [(1, 512), (1, 2048), (16, 512), (16, 2048), (64, 512), (64, 2048)]
ORIGINAL = _jit.source


def patched(edits: list[tuple[str, str]]):  # type: ignore[no-untyped-def]
    def source(name: str) -> str:
        text = ORIGINAL(name)
        if name != KERNEL:
            return text
        for a, b in edits:
            if a not in text:
                raise SystemExit(f"anchor not found (update bench/probes/attention_variants.py): {a!r}")
            text = text.replace(a, b)
        return text
    return source


def forced_splits(n: int, L: int) -> tuple[int, int]:
    """(splits, keys per split) for n splits of whole 64-key tiles (fewer where the cache has fewer tiles)."""
    chunk = 64 * -(-(-(-L // 64)) // n)
    return -(-L // chunk), chunk


def variant(name: str) -> Variant:
    """A named variant, or "sN" / "sN-fused" / "sN-launched": N splits (capped at one per 64-key tile)."""
    if name in VARIANTS:
        return VARIANTS[name]
    n, _, merge = name[1:].partition("-")
    return Variant(splits=int(n), fuse={"": None, "fused": True, "launched": False}[merge])


def main() -> None:
    dev = torch.device("cuda")
    names = sys.argv[1:] or list(VARIANTS)
    n_kv, G, D = 8, 4, 128
    cases = []
    for B, L in SIZES:
        kv_bytes = 2 * B * L * n_kv * D * 2
        n = min(copies_for(kv_bytes), 4)
        caches = [(torch.randn(B, L, n_kv, D, device=dev, dtype=torch.bfloat16),
                   torch.randn(B, L, n_kv, D, device=dev, dtype=torch.bfloat16)) for _ in range(n)]
        q = torch.randn(B, n_kv * G, D, device=dev, dtype=torch.bfloat16)
        cases.append((B, L, n, caches, q, torch.arange(B, device=dev), torch.full((B,), L, device=dev),
                      copies_for(kv_bytes)))
    res: dict[str, dict[str, float]] = {}
    sms = sm_count(0)
    for name in names:
        v = variant(name)
        _jit.source = patched(v.edits)  # type: ignore[assignment]
        _jit.forget_compiled()
        kernels.warmup(dev)
        for B, L, n, caches, q, slots, lens, reps in cases:
            plan = v.plan(B, n_kv, L, D, sms)
            want = ref.decode_attention(q, *caches[0], slots, lens).float()
            err = float((attention.launch_attention(plan, q, *caches[0], slots, lens).float() - want).abs().max())
            if err >= 2e-2:
                print(f"{name} {B}x{L}: max error {err}")

            def call(i: int, n: int = n, caches: list = caches, q: torch.Tensor = q, slots: torch.Tensor = slots,
                     lens: torch.Tensor = lens, plan: AttentionPlan = plan) -> torch.Tensor:
                k, v = caches[i % n]
                return attention.launch_attention(plan, q, k, v, slots, lens)

            res.setdefault(f"{B}x{L}", {})[name] = 1e6 * time_graph(graph_calls(call, reps))
    _jit.source = ORIGINAL  # type: ignore[assignment]
    print("| batch x context | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for k, row in res.items():
        print(f"| {k} | " + " | ".join(f"{row[v]:.1f}" for v in names) + " |")


if __name__ == "__main__":
    main()
