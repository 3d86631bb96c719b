"""Where one decode step's GPU time goes (S2-Pro shapes, random weights): a probe, not a benchmark.

    python bench/probes/step_profile.py OUT [--fp8] [--batches 1,64] [--ctx 1000] [--preset s2-pro] [--device cuda]

For each batch size: the step replayed from its CUDA graph (median us over replays, as the scheduler runs it), then
the same step run eagerly under torch.profiler with every stage of the step labelled (slow transformer, slow head,
the draws, fast transformer, ...): the GPU time and kernel count of each label, the kernel count
and summed kernel time of one graph replay, and the kernels that take the most time. Writes
OUT/step-profile-<dtype>.json.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from rtts.engine import sampling
from rtts.engine.engine import Engine
from rtts.engine.graphs.decode import DecodeRunner
from rtts.kernels import draw
from rtts.tools.random_checkpoint import random_model


def _arg(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def labelled(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
    def run(*a: Any, **k: Any) -> Any:
        with record_function(label):
            return fn(*a, **k)

    return run


def label_stages(eng: Engine) -> None:
    m = eng.model
    m.embed = labelled(m.embed, "embed")  # type: ignore[method-assign]
    m.forward_slow = labelled(m.forward_slow, "slow_transformer")  # type: ignore[method-assign]
    m.slow_head = labelled(m.slow_head, "slow_head")  # type: ignore[method-assign]
    m.forward_fast = labelled(m.forward_fast, "fast_transformer")  # type: ignore[method-assign]
    eng._commit = labelled(eng._commit, "commit")  # type: ignore[method-assign]
    # The draw: labelled where the engine calls it (wrapping eng.noise would send the draw down the torch path).
    draw.sample = labelled(draw.sample, "sample")  # type: ignore[assignment]
    sampling.ras_choice = labelled(sampling.ras_choice, "ras_choice")  # type: ignore[assignment]


def _dev_us(evt: Any) -> float:
    for attr in ("device_time_total", "cuda_time_total"):
        if hasattr(evt, attr):
            return float(getattr(evt, attr))
    return 0.0


def kernels_of(prof: Any) -> list[tuple[str, float]]:
    """(name, us) of every GPU kernel the profiler saw."""
    out = []
    for e in prof.events():
        if str(getattr(e, "device_type", "")).endswith("CUDA") and e.name not in ("", None):
            out.append((e.name, float(getattr(e, "device_time", 0.0) or _dev_us(e))))
    return out


def profile_step(eng: Engine, B: int, runner: DecodeRunner, labels: list[str]) -> dict[str, Any]:
    slots = torch.arange(B, device=eng.device)
    res: dict[str, Any] = {"batch": B}
    if not runner.graphs:  # (a CPU smoke run of the probe itself)
        return res | eager_profile(eng, slots, labels)
    # Graph replay: what the scheduler runs.
    g = runner.graphs[(runner.bucket_for(B), runner.kv_buckets[-1])].graph
    runner.slots_dev[:B].copy_(slots)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(30):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    res["graph_step_us"] = statistics.median(times)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
    ks = kernels_of(prof)
    res["graph_kernels_per_step"] = len(ks) / 3
    res["graph_kernel_us_per_step"] = sum(t for _, t in ks) / 3
    return res | eager_profile(eng, slots, labels)


def eager_profile(eng: Engine, slots: torch.Tensor, labels: list[str]) -> dict[str, Any]:
    """The step run eagerly with its stages labelled: GPU time per label, kernel count, the costliest kernels."""
    res: dict[str, Any] = {}
    for _ in range(2):
        eng.decode_step(slots, eng.max_ctx + 1)
    reps = 3
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if eng.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(reps):
            with record_function("step"):
                eng.decode_step(slots, eng.max_ctx + 1)
        if eng.device.type == "cuda":
            torch.cuda.synchronize()
    per_label: dict[str, dict[str, float]] = {}
    for e in prof.key_averages():
        if e.key in labels + ["step"]:
            per_label[e.key] = {"gpu_us_per_step": _dev_us(e) / reps, "calls_per_step": e.count / reps}
    ks = kernels_of(prof)
    res["eager_kernels_per_step"] = len(ks) / reps
    res["eager_kernel_us_per_step"] = sum(t for _, t in ks) / reps
    res["labels"] = per_label
    by_name: dict[str, list[float]] = defaultdict(list)
    for name, t in ks:
        by_name[name].append(t)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:30]
    res["top_kernels"] = [{"name": n[:160], "us_per_step": sum(v) / reps, "count_per_step": len(v) / reps}
                          for n, v in top]
    return res


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    fp8 = "--fp8" in sys.argv
    batches = [int(b) for b in _arg("--batches", "1,64").split(",")]
    ctx = int(_arg("--ctx", "1000"))
    dev = torch.device(_arg("--device", "cuda"))
    preset = _arg("--preset", "s2-pro")
    t0 = time.perf_counter()
    lm, _ = random_model(preset, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
    if fp8:
        from rtts.model.quant import quantize_model_

        quantize_model_(lm.model)
        torch.cuda.empty_cache()
    eng = Engine(lm, max_slots=max(batches), max_ctx=2048)
    # Every slot mid-utterance at `ctx` positions, running.
    eng.state.pos[:-1] = ctx
    eng.state.max_frames[:] = 1 << 30
    eng.state.temperature[:] = 0.8
    eng.state.top_p[:] = 0.8
    eng.state.top_k[:] = 1 << 30
    eng.state.ras_on[:] = True
    runner = DecodeRunner(eng)
    if dev.type == "cuda":
        runner.capture()
    build = time.perf_counter() - t0
    labels = ["embed", "slow_transformer", "slow_head", "fast_transformer", "sample", "commit", "ras_choice"]
    label_stages(eng)
    gpu = torch.cuda.get_device_name() if dev.type == "cuda" else "none"
    results = {"preset": preset, "fp8": fp8, "ctx": ctx, "build_and_capture_s": build, "gpu": gpu,
               "torch": torch.__version__, "steps": [profile_step(eng, B, runner, labels) for B in batches]}
    name = f"step-profile-{'fp8' if fp8 else 'bf16'}.json"
    (out / name).write_text(json.dumps(results, indent=1))
    for s in results["steps"]:
        print(f"B={s['batch']}: graph {s.get('graph_step_us', 0):.0f} us, {s.get('graph_kernels_per_step', 0):.0f} "
              f"kernels ({s.get('graph_kernel_us_per_step', 0):.0f} us of kernels); eager "
              f"{s['eager_kernels_per_step']:.0f} kernels {s['eager_kernel_us_per_step']:.0f} us")
        for k, v in s["labels"].items():
            print(f"   {k:18s} {v['gpu_us_per_step']:9.0f} us  x{v['calls_per_step']:.0f}")
        for k in s["top_kernels"][:12]:
            print(f"   {k['us_per_step']:8.0f} us x{k['count_per_step']:4.0f}  {k['name'][:100]}")


if __name__ == "__main__":
    main()
