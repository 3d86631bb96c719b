"""How long a prefill forward takes, bf16 against FP8 (S2-Pro shapes, random weights): a probe, not a benchmark.

    python bench/probes/prefill_time.py OUT [--profile]

One slot's prompt of 40 / 128 / 320 / 512 positions (a text turn up to a voice prompt's chunk) and a batch of 8
turns of 40, each timed as engine.prefill_batch between two synchronizations (median of 5 after a warm-up), first
with the bf16 model, then with the same weights quantized (FP8 linears over gemm.FP8_DENSE_ROWS rows run dense on
the dequantized weight), then quantized with every row through the decode GEMM's 128-token slices ("fp8-sliced", the
path before); with `--profile`, only a torch.profiler pass of 40 and 512 positions each (host vs GPU time; a run of
its own: CUPTI slows every launch after it) into OUT/prefill-profile*.json. Then 40-position turns at context
lengths not seen before (the first call per shape), with torch's default attention backend and with the
memory-efficient one forced. Writes OUT/prefill-time.json.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from rtts.engine.engine import Engine, PrefillItem
from rtts.tools.random_checkpoint import random_model


def time_prefill(eng: Engine, items: list[PrefillItem], reps: int = 5) -> float:
    times = []
    for _ in range(reps + 1):
        for it in items:
            eng.host_pos[it.slot] = 0
        torch.cuda.synchronize()
        t = time.perf_counter()
        eng.prefill_batch(items)
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times[1:])


def profile_prefill(eng: Engine, items: list[PrefillItem], name: str, out: Path) -> dict[str, float]:
    """One prefill under torch.profiler: host time in the Python ops and launches vs GPU kernel time, and the ops
    that cost the most host time (printed)."""
    from torch.profiler import ProfilerActivity, profile

    for it in items:
        eng.host_pos[it.slot] = 0
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        eng.prefill_batch(items)
        torch.cuda.synchronize()
        wall = 1e3 * (time.perf_counter() - t)
    ev = prof.key_averages()
    gpu = sum(e.self_device_time_total for e in ev) / 1e3
    print(f"profile {name}: wall {wall:.1f} ms, GPU kernels {gpu:.1f} ms")
    print(ev.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))
    prof.export_chrome_trace(str(out / f"prefill-profile-{name}.json"))
    return {"wall_ms": wall, "gpu_kernel_ms": gpu}


def text_columns(rows: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """A prompt piece of n random text tokens (codebook rows zero): [rows, n] int64 (also prefill_host.py's)."""
    c = torch.zeros(rows, n, dtype=torch.int64)
    c[0] = torch.randint(0, 1000, (n,), generator=gen)
    return c


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    lm, _ = random_model("s2-pro", dev, torch.bfloat16)
    rows = lm.config.num_codebooks + 1
    gen = torch.Generator().manual_seed(0)

    def cols(n: int) -> torch.Tensor:
        return text_columns(rows, n, gen)

    cases = {f"1 x {n}": [PrefillItem(0, cols(n))] for n in (40, 128, 320, 512)}
    cases["8 x 40"] = [PrefillItem(i, cols(40)) for i in range(8)]
    res: dict[str, dict[str, float]] = {}
    from rtts.kernels import gemm  # fp8_runs_dense reads gemm.FP8_DENSE_ROWS

    profiling = "--profile" in sys.argv
    dense_rows = gemm.FP8_DENSE_ROWS
    for kind in ("bf16", "fp8", "fp8-sliced"):
        if kind == "fp8":
            from rtts.model.quant import quantize_model_

            quantize_model_(lm.model)
            torch.cuda.empty_cache()
        # fp8-sliced: every prefill row through the decode GEMM in 128-token launches (before the dense path)
        gemm.FP8_DENSE_ROWS = 1 << 30 if kind == "fp8-sliced" else dense_rows
        eng = Engine(lm, max_slots=8, max_ctx=1024, prefill_chunk=512)
        if profiling:  # profile only: CUPTI stays attached after a profiler pass and slows every later launch
            if kind != "fp8-sliced":
                for name in ("1 x 40", "1 x 512"):
                    time_prefill(eng, cases[name], reps=1)  # warm
                    res[f"{kind} {name}"] = profile_prefill(eng, cases[name], f"{kind}-{name.split()[-1]}", out)
        else:
            res[kind] = {name: time_prefill(eng, items) for name, items in cases.items()}
        del eng
        torch.cuda.empty_cache()
    gemm.FP8_DENSE_ROWS = dense_rows
    if profiling:
        summary = {"gpu": torch.cuda.get_device_name(), "ms": res}
        (out / "prefill-profile.json").write_text(json.dumps(summary, indent=1))
        return
    # A turn's prefill at a context length never seen before (every turn is one): the first call per shape, with
    # torch's default attention backend choice and with the memory-efficient kernel forced.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fresh: dict[str, list[float]] = {}
    eng = Engine(lm, max_slots=8, max_ctx=1024, prefill_chunk=512)
    for kind, backends in (("default", None), ("efficient", [SDPBackend.EFFICIENT_ATTENTION])):
        fresh[kind] = []
        for p0 in range(101 if kind == "default" else 103, 900, 97):
            eng.host_pos[0] = p0
            torch.cuda.synchronize()
            t = time.perf_counter()
            if backends is None:
                eng.prefill_batch([PrefillItem(0, cols(40))])
            else:
                with sdpa_kernel(backends):
                    eng.prefill_batch([PrefillItem(0, cols(40))])
            torch.cuda.synchronize()
            fresh[kind].append(1e3 * (time.perf_counter() - t))
        print(f"fresh context lengths, {kind}: " + " ".join(f"{v:.0f}" for v in fresh[kind]) + " ms")
    (out / "prefill-time.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "ms": res,
                                                       "fresh_lengths_ms": fresh}, indent=1))
    for name in cases:
        print(f"{name:8s} bf16 {res['bf16'][name]:7.2f} ms   fp8 {res['fp8'][name]:7.2f} ms   fp8 sliced "
              f"{res['fp8-sliced'][name]:7.2f} ms")


if __name__ == "__main__":
    main()
