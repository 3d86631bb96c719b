"""Where a prefill's host time goes (S2-Pro shapes, random weights): a probe, not a benchmark.

    python bench/probes/prefill_host.py OUT

A 40-position prefill is host-bound on the H200 (bench/results/traces/prefill-time-*: ~27 ms bf16 for ~5-8 ms of
GPU kernels). This runs it under cProfile (bf16, then FP8) and prints the functions with the most own time, then
times the host side of single calls (no synchronization inside the loop): each rtts kernel wrapper a prefill layer
calls, next to the torch op it sits beside. Writes OUT/prefill-host.json.
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from prefill_time import text_columns

from rtts.engine.engine import Engine, PrefillItem
from rtts.tools.random_checkpoint import random_model


def host_us(fn: Callable[[], Any], n: int = 300) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = time.perf_counter() - t
    torch.cuda.synchronize()
    return 1e6 * host / n


def profile(eng: Engine, items: list[PrefillItem], name: str) -> dict[str, Any]:
    for _ in range(2):
        for it in items:
            eng.host_pos[it.slot] = 0
        eng.prefill_batch(items)
    torch.cuda.synchronize()
    for it in items:
        eng.host_pos[it.slot] = 0
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    eng.prefill_batch(items)
    torch.cuda.synchronize()
    prof.disable()
    wall = 1e3 * (time.perf_counter() - t)
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf).sort_stats("tottime")
    stats.print_stats(28)
    print(f"== {name}: {wall:.1f} ms under cProfile")
    print("\n".join(line[:150] for line in buf.getvalue().splitlines()[6:40]))
    top = sorted(((v[2], f"{k[0].split('/')[-1]}:{k[1]}({k[2]})", v[1]) for k, v in stats.stats.items()),  # type: ignore[attr-defined]
                 reverse=True)[:40]
    return {"wall_ms": wall, "top_tottime": [{"fn": f, "s": s, "calls": c} for s, f, c in top]}


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    from rtts import kernels
    from rtts.kernels import norm_rope

    dev = torch.device("cuda")
    lm, _ = random_model("s2-pro", dev, torch.bfloat16)
    items = [PrefillItem(0, text_columns(lm.config.num_codebooks + 1, 40, torch.Generator().manual_seed(0)))]
    res: dict[str, Any] = {}
    eng = Engine(lm, max_slots=8, max_ctx=1024, prefill_chunk=512)
    res["bf16"] = profile(eng, items, "bf16 1 x 40")
    del eng
    from rtts.model.quant import quantize_model_

    quantize_model_(lm.model)
    torch.cuda.empty_cache()
    eng = Engine(lm, max_slots=8, max_ctx=1024, prefill_chunk=512)
    res["fp8"] = profile(eng, items, "fp8 1 x 40")

    # Host time of single calls at prefill shapes (40 rows of S2-Pro's slow model).
    blk = lm.model.layers[0]
    x = torch.randn(40, 2560, device=dev, dtype=torch.bfloat16)
    w = blk.attention_norm.weight
    xq, sx = kernels.quantize_1x128(x)
    wqkv = blk.attention.wqkv
    wb = torch.randn(6144, 2560, device=dev, dtype=torch.bfloat16)
    calls: dict[str, Callable[[], Any]] = {
        "torch.empty": lambda: torch.empty(40, 2560, device=dev, dtype=torch.bfloat16),
        "torch linear bf16 6144x2560": lambda: torch.nn.functional.linear(x, wb),
        "torch rms_norm": lambda: torch.nn.functional.rms_norm(x, (2560,), w, 1e-6),
        "kernels.quantize_1x128": lambda: kernels.quantize_1x128(x),
        "norm_rope.rmsnorm": lambda: norm_rope.rmsnorm(x, w, 1e-6),
        "norm_rope.rmsnorm_quant": lambda: norm_rope.rmsnorm_quant(x, w, 1e-6),
        "kernels.fp8_gemm wqkv": lambda: kernels.fp8_gemm(xq, sx, wqkv.weight, wqkv.weight_scale),
        "FP8Linear wqkv (bf16 rows)": lambda: wqkv(x),
    }
    res["host_us"] = {}
    for name, fn in calls.items():
        res["host_us"][name] = host_us(fn)
        print(f"host {name:32s} {res['host_us'][name]:7.1f} us")
    (out / "prefill-host.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
