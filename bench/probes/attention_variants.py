"""Variants of the decode-attention kernel (cuda/decode_attention.cu) side by side, timed like the kernel bench
(CUDA graph of calls, KV caches rotated): pipeline depth and CTAs per SM, and where the splits are merged (by the
last split, or a second launch). Patched in memory (the repository file is untouched; an anchor that no longer
matches fails loudly), with the host constants the variant implies set alike.

    python bench/probes/attention_variants.py [variant ...]    # on the GPU machine, from the repository root

Variants: those in VARIANTS, and "sN" (N splits per stream and KV head, at most one per 64-key tile; merged where
kernels.attention_fuses says) or "sN-fused" / "sN-launched".
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from rtts import kernels
from rtts.bench.kernels import _calls, copies_for, time_graph
from rtts.kernels import _jit

KERNEL = "decode_attention.cu"
BOUND = "__launch_bounds__(WARPS * 32, 2) decode_attention_"


@dataclass
class Variant:
    edits: list[tuple[str, str]] = field(default_factory=list)  # (anchor, replacement), every occurrence
    fuse: bool | None = None  # None: the wrapper's choice (kernels.attention_fuses)
    stages: int = 2  # kernels._ATT_STAGES
    ctas_per_sm: int = 2  # kernels._ATT_CTAS_PER_SM
    splits: int | None = None  # None: kernels.attention_splits' choice; else this many (at most one per 64-key tile)


VARIANTS: dict[str, Variant] = {
    "auto": Variant(),
    "fused": Variant(fuse=True),
    "launched": Variant(fuse=False),
    # three CTAs per SM: 168 registers a thread, and the 128-dim instances spill (session 11: 64 x 2048 keys 159 us
    # against 124 at two)
    "3cta": Variant([(BOUND, BOUND.replace("2)", "3)"))], ctas_per_sm=3),
    # three 64-key stages (96 KB): two tiles in flight while one is used (session 11: as fast as two)
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


def forced_splits(n: int):  # type: ignore[no-untyped-def]
    """An attention_splits stand-in: n splits of whole 64-key tiles (fewer where the cache has fewer tiles)."""
    def rule(B: int, n_kv: int, L: int, sms: int = 0) -> tuple[int, int]:
        chunk = 64 * -(-(-(-L // 64)) // n)
        return -(-L // chunk), chunk
    return rule


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
    saved = kernels.attention_fuses, kernels._ATT_STAGES, kernels._ATT_CTAS_PER_SM
    split_rule = kernels.attention_splits
    for name in names:
        v = variant(name)
        kernels.attention_fuses = saved[0] if v.fuse is None else (  # type: ignore[assignment]
            lambda B, n_kv, S, sms=0, fuse=v.fuse: fuse)
        kernels.attention_splits = split_rule if v.splits is None else forced_splits(v.splits)  # type: ignore
        kernels._ATT_STAGES, kernels._ATT_CTAS_PER_SM = v.stages, v.ctas_per_sm
        _jit.source = patched(v.edits)  # type: ignore[assignment]
        _jit._module.cache_clear()
        _jit.function.cache_clear()
        _jit._SMEM_SET.clear()
        kernels.warmup(dev)
        for B, L, n, caches, q, slots, lens, reps in cases:
            ref = kernels.reference.decode_attention(q, *caches[0], slots, lens).float()
            err = float((kernels.decode_attention(q, *caches[0], slots, lens).float() - ref).abs().max())
            if err >= 2e-2:
                print(f"{name} {B}x{L}: max error {err}")

            def call(i: int, n: int = n, caches: list = caches, q: torch.Tensor = q, slots: torch.Tensor = slots,
                     lens: torch.Tensor = lens) -> torch.Tensor:
                k, v = caches[i % n]
                return kernels.decode_attention(q, k, v, slots, lens)

            res.setdefault(f"{B}x{L}", {})[name] = 1e6 * time_graph(_calls(call, reps))
    kernels.attention_fuses, kernels._ATT_STAGES, kernels._ATT_CTAS_PER_SM = saved  # type: ignore[assignment]
    kernels.attention_splits = split_rule  # type: ignore[assignment]
    print("| batch x context | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for k, row in res.items():
        print(f"| {k} | " + " | ".join(f"{row[v]:.1f}" for v in names) + " |")


if __name__ == "__main__":
    main()
