"""Where a DualAR training step's time goes (the demo voice's stage ran at 0.27-0.37 s a step, ~8-17 TFLOP/s on an
H200: far from its compute, so something else bounds it). A probe:

    python bench/probes/train_step_profile.py OUT [--preset h200] [--workdir train/work/h200] [--steps 20]

Needs the tokens the DualAR stage trains on (WORKDIR/tokens: on the GPU machine after `train/run_h200.sh` spoke and
encoded them), or `--synthetic N`: the first N sentences of train/sentences.txt.gz with random codes, as many frames
as flite speaks for text of that length (~15 characters a second), so a fresh machine can run it in about a minute:
the step's shapes and work are those of real data. Builds the stage's model and batches exactly as `rtts.train
dualar` does (`--compile`: its compile=1), warms up, then times `--steps` steps three ways: wall time per step, the
batch wait (the prefetch thread's queue), and the step under torch.profiler, ranked by device time and by host time (a
launch-bound step shows host time per op near its device time and many small kernels).
Writes OUT/train-step-profile-<gpu>-<date>.json and .md.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rtts.bench.common import environment, write_results
from rtts.model.prompt import PromptBuilder
from rtts.model.tokenizer import load_tokenizer
from rtts.train.__main__ import TRAIN_DIR
from rtts.train.dualar_train import build, main_token_ids, optimize, optimizer
from rtts.train.loop import pick_device
from rtts.train.presets import FRAME_LENGTH, PRESETS, SAMPLE_RATE, Preset
from rtts.train.sentences import read_lines
from rtts.train.sequences import SequenceMaker, batches, prefetched
from rtts.train.tokens import Tokens

CHARS_PER_SECOND = 15.0  # flite's cmu_us_rms on the training sentences, roughly


def synthetic_tokens(preset: Preset, count: int, seed: int = 0) -> Tokens:
    """Real sentences with random codes of a plausible length for each (the step's cost depends only on shapes)."""
    texts = read_lines(TRAIN_DIR / "sentences.txt.gz")[:count]
    rng = np.random.default_rng(seed)
    rate = SAMPLE_RATE / FRAME_LENGTH
    utts = [rng.integers(0, preset.codebook_size, (preset.num_codebooks, max(4, round(len(t) / CHARS_PER_SECOND
                                                                                        * rate))))
            for t in texts]
    return Tokens.of(texts, utts)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--preset", default="h200", choices=sorted(PRESETS))
    p.add_argument("--workdir", default=None, help="default: train/work/<preset>")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--device", default=None)
    p.add_argument("--compile", action="store_true", help="the blocks through torch.compile (the stage's compile=1)")
    p.add_argument("--batch-positions", type=int, default=0, help="override the preset's padded positions per batch")
    p.add_argument("--synthetic", type=int, default=0, help="random codes for this many sentences (no tokens needed)")
    args = p.parse_args()
    preset = PRESETS[args.preset]
    cfg = dataclasses.replace(preset.dualar_training, compile=args.compile,
                              batch_positions=args.batch_positions or preset.dualar_training.batch_positions)
    workdir = Path(args.workdir or f"train/work/{preset.name}")
    device = pick_device(args.device)
    model, _, ckpt = build(preset, workdir / "profile", device)
    tok = load_tokenizer(ckpt, "fish_qwen3_omni")
    opt = optimizer(model, cfg)
    tokens = synthetic_tokens(preset, args.synthetic) if args.synthetic else Tokens.load(workdir / "tokens")
    maker = SequenceMaker(PromptBuilder(tok, model.config.num_codebooks, "s2", model.config.codebook_size), tokens)
    main_ids = main_token_ids(tok).to(device)
    stream = prefetched(maker, batches(maker, cfg.batch_positions, cfg.max_frames, cfg.multi_turn, 0))
    model.train()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    waits: list[float] = []

    def step() -> None:
        t = time.perf_counter()
        batch = next(stream)
        waits.append(time.perf_counter() - t)
        optimize(model, opt, batch.to(device), main_ids, cfg, cfg.guided_weight, device)

    for _ in range(args.warmup):
        step()
    sync()
    waits.clear()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    wall = (time.perf_counter() - t0) / args.steps
    wait = sum(waits) / len(waits)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        sync()
    events = prof.key_averages()
    dev_key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"

    def ranked(key: str) -> list[dict[str, Any]]:
        rows = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:25]
        return [{"op": e.key, "calls_per_step": e.count / args.steps,
                 "device_us_per_step": getattr(e, "self_device_time_total", 0.0) / args.steps,
                 "host_us_per_step": e.self_cpu_time_total / args.steps} for e in rows]

    by_device, by_host = ranked(dev_key), ranked("self_cpu_time_total")
    kernels = sum(e.count for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    device_us = sum(getattr(e, "self_device_time_total", 0.0) for e in events) / args.steps
    summary = {"wall_ms_per_step": 1e3 * wall, "batch_wait_ms_per_step": 1e3 * wait,
               "device_ms_per_step_profiled": device_us / 1e3, "device_kernels_per_step": kernels / args.steps,
               "batch_positions": cfg.batch_positions, "parameters_m": sum(q.numel() for q in model.parameters()) / 1e6}
    print(summary, flush=True)
    md = ["| measure | value |", "|---|---|"] + [f"| {k} | {v:.2f} |" for k, v in summary.items()]
    for title, rows in (("device", by_device), ("host", by_host)):
        md += ["", f"Top ops by {title} time per step:", "", "| op | calls | device us | host us |",
               "|---|---|---|---|"]
        md += [f"| `{r['op'][:90]}` | {r['calls_per_step']:.1f} | {r['device_us_per_step']:.0f} "
               f"| {r['host_us_per_step']:.0f} |" for r in rows]
    data = {"env": environment(), "config": vars(args), "summary": summary, "by_device": by_device,
            "by_host": by_host}
    jp, mp = write_results(args.out, "train-step-profile", data, "\n".join(md))
    print("\n".join(md))
    print(f"wrote {jp} and {mp}")


if __name__ == "__main__":
    main()
