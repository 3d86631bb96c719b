"""Where a turn's time to first audio goes inside the scheduler (random weights): a probe, not a benchmark.

    python bench/probes/turn_latency.py OUT [--preset s2-pro] [--fp8] [--concurrency 1,16] [--no-prefill-graphs]

Runs the scheduler bench's measurement (rtts.bench.scheduler.measure, codec none) and stamps, per turn: speak ->
the prefill thread's batch start -> the batch's forward done -> frame 0 handed to the codec stage -> first audio
chunk ready. Prints the medians of each leg and writes OUT/turn-latency.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from rtts.bench.scheduler import NullCodec, measure
from rtts.engine.engine import Engine
from rtts.pingpong import prefill as prefill_mod
from rtts.pingpong.scheduler import Scheduler, SchedulerConfig
from rtts.tools.random_checkpoint import random_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--preset", default="s2-pro")
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--prefill-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="turn prefills from CUDA graphs (PrefillRunner), as `rtts serve` does")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(args.device)
    lm, codec = random_model(args.preset, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
    if args.fp8:
        from rtts.model.quant import quantize_model_

        quantize_model_(lm.model)
    conc = [int(c) for c in args.concurrency.split(",")]
    eng = Engine(lm, max_slots=max(conc), max_ctx=2048)
    batches: list[tuple[float, float, int, int]] = []  # (start, end, jobs, widest)
    handed: dict[int, tuple[float, float]] = {}  # id(turn) -> (t_submit, frame 0 handed over)
    run, finish = prefill_mod.PrefillWorker._run, prefill_mod.PrefillWorker._finish_turn_prefill

    def timed_run(self: Any, batch: list[Any]) -> None:
        t = time.perf_counter()
        run(self, batch)
        batches.append((t, time.perf_counter(), len(batch), max(j.columns.shape[1] for j in batch)))

    def timed_finish(self: Any, job: Any, frame0: torch.Tensor) -> None:
        finish(self, job, frame0)
        handed[id(job.turn)] = (job.turn.t_submit, time.perf_counter())

    prefill_mod.PrefillWorker._run = timed_run  # type: ignore[method-assign]
    prefill_mod.PrefillWorker._finish_turn_prefill = timed_finish  # type: ignore[method-assign]
    res: dict[str, Any] = {}
    config = SchedulerConfig(cuda_graphs=dev.type == "cuda", prefill_graphs=args.prefill_graphs)
    sch = Scheduler(eng, NullCodec(codec.config), config).start()
    for c in conc:
        batches.clear()
        handed.clear()
        pt = measure(sch, c, "none", 1.5, 5.0, 215, 400)
        legs = [(h - s) * 1e3 for s, h in handed.values()]
        # the prefill batch that handed each turn over: the last batch that started before the hand-over
        starts = []
        for s, h in handed.values():
            b = [x for x in batches if x[0] <= h]
            if b:
                starts.append(((b[-1][0] - s) * 1e3, (b[-1][1] - b[-1][0]) * 1e3))
        r = {"turn_first_audio_ms_p50": pt.turn_first_audio_ms_p50,
             "speak_to_handover_ms_p50": statistics.median(legs) if legs else None,
             "speak_to_batch_start_ms_p50": statistics.median(x for x, _ in starts) if starts else None,
             "batch_ms_p50": statistics.median(y for _, y in starts) if starts else None,
             "batches": len(batches), "batch_jobs_mean": statistics.mean(b[2] for b in batches) if batches else 0,
             "batch_width_max": max((b[3] for b in batches), default=0)}
        res[str(c)] = r
        print(f"c={c}: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()))
    sch.stop()
    (out / "turn-latency.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
