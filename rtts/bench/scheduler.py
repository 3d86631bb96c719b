"""Scheduler throughput: aggregate and per-stream frames/s at several concurrencies, and the GPU's idle share.

Each of `c` streams opens with a voice prompt (random reference codes) and speaks turn after turn for the whole
measurement window, so the decode batch stays at `c`. Numbers:
- decode frames/s: frames sampled per second by the decode thread (all streams), the LLM's throughput;
- delivered frames/s: kept frames that reached the outboxes as audio (codec included);
- GPU idle share: on the decode stream, the time between the end of one step's GPU work and the start of the
  next, over the whole step period (CUDA events around each step) — the share the GPU waits on Python;
- turn first audio: speak -> the turn's first audio chunk ready. Turns are spoken at latency "low", whose first
  chunk is one frame (the scheduler's own first-frame latency, comparable with runs before the chunk ramp).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from rtts.bench.common import environment, write_results
from rtts.engine.engine import DEFAULT_PREFILL_ROWS, Engine
from rtts.env import CODEC_DTYPES
from rtts.model.codec import CodecConfig
from rtts.model.prompt import Reference
from rtts.pingpong import AudioChunk, Scheduler, SchedulerConfig, TurnEnd
from rtts.pingpong.slots import NoSlotError
from rtts.runtime import decode_codec
from rtts.startup import freeze_startup_objects, set_switch_interval
from rtts.tools.random_checkpoint import random_model
from rtts.types import FinishReason, SamplingParams

LATENCY = "low"  # first chunk = one frame (see the module docstring)
TEXT = ("The quick brown fox jumps over the lazy dog, and then it runs back home through the quiet evening streets "
        "while the city lights come on one by one.")


class NullCodec:
    """Stands in for the codec when only the LLM is measured: returns silence at once."""

    def __init__(self, config: CodecConfig) -> None:
        self.config = config
        self.device = torch.device("cpu")
        self.dtype = torch.float32

    def new_stream_state(self, capacity: int) -> Any:
        class _State:
            def __init__(self) -> None:
                self.capacity = capacity

            def reset(self, mask: torch.Tensor) -> None:
                pass

        return _State()

    def decode_stream(self, codes: torch.Tensor, state: Any, slots: torch.Tensor) -> torch.Tensor:
        return torch.zeros(codes.shape[0], codes.shape[2] * self.config.frame_length)


@dataclass
class Point:
    concurrency: int
    codec: str
    seconds: float
    decode_frames_per_s: float
    delivered_frames_per_s: float
    per_stream_frames_per_s_mean: float
    per_stream_frames_per_s_min: float
    steps_per_s: float
    mean_batch: float
    gpu_step_ms: float
    gpu_gap_ms: float
    gpu_idle_share: float
    realtime_factor_per_stream: float  # audio seconds produced per wall second, per stream
    # turns that ended in the window: how (finish reason -> count), their mean length, and the time from `speak` to
    # the turn's first audio for turns that started in the window (the next turn is spoken as soon as one ends)
    turn_ends: dict[str, int] = field(default_factory=dict)
    mean_frames_per_turn: float = 0.0
    turn_first_audio_ms_p50: float = 0.0
    turn_first_audio_ms_max: float = 0.0


def measure(sch: Scheduler, c: int, codec_name: str, warmup: float, seconds: float, ref_frames: int,
            max_frames: int) -> Point:
    gen = torch.Generator().manual_seed(c)
    n_sem = sch.engine.tokenizer.num_semantic
    handles, refs = [], []
    for _ in range(c):
        codes = torch.randint(0, min(1024, sch.engine.config.codebook_size), (10, ref_frames), generator=gen)
        codes[0] = torch.randint(0, n_sem, (ref_frames,), generator=gen)
        refs.append(Reference("A reference sentence for the voice of this stream.", codes))
        handles.append(sch.open([refs[-1]]))
    params = SamplingParams(temperature=0.8, top_p=0.8, top_k=30, max_frames=max_frames)
    outboxes = [h.speak(TEXT, params, latency=LATENCY) for h in handles]
    delivered = [0] * c
    dec = sch.decode
    window: list[float | None] = [None]  # the measured window's start while inside it
    ends: Counter[str] = Counter()
    turn_frames: list[int] = []
    first_audio: list[float] = []
    waiting = [True] * c  # no audio yet from the stream's current turn
    reopen: set[int] = set()  # streams whose session ended on a full context, waiting for a slot

    def pump() -> None:
        for i, ob in enumerate(outboxes):
            while i not in reopen and (item := ob.poll()) is not None:
                if isinstance(item, AudioChunk):
                    delivered[i] += item.frames
                    if waiting[i] and window[0] is not None and item.t_submit >= window[0]:
                        first_audio.append(1e3 * (item.t_ready - item.t_submit))
                    waiting[i] = False
                elif isinstance(item, TurnEnd):
                    if window[0] is not None:
                        ends[item.reason.name] += 1
                        turn_frames.append(item.frames)
                    if item.reason in (FinishReason.CONTEXT, FinishReason.ERROR):
                        # The stream's context is full (turn after turn of up to max_frames): a new session with the
                        # same voice, as a client would open, once the old one's slot is free.
                        handles[i].close()
                        reopen.add(i)
                        break
                    outboxes[i] = handles[i].speak(TEXT, params, latency=LATENCY)
                    waiting[i] = True
        for i in list(reopen):
            try:
                handles[i] = sch.open([refs[i]])
            except NoSlotError:
                continue
            reopen.discard(i)
            outboxes[i] = handles[i].speak(TEXT, params, latency=LATENCY)
            waiting[i] = True

    # Warm up until every stream has audio (all voice prompts and first turns prefilled), then `warmup` more.
    t_start = time.perf_counter()
    while min(delivered) == 0 and time.perf_counter() - t_start < 60:
        pump()
        time.sleep(0.001)
    t_end = time.perf_counter() + warmup
    while time.perf_counter() < t_end:
        pump()
        time.sleep(0.001)
    dec.profile = []
    steps0, rows0, d0 = dec.stats.steps, dec.stats.rows, list(delivered)
    t0 = time.perf_counter()
    window[0] = t0
    while time.perf_counter() - t0 < seconds:
        pump()
        time.sleep(0.001)
    dt = time.perf_counter() - t0
    window[0] = None
    steps, rows, prof = dec.stats.steps - steps0, dec.stats.rows - rows0, dec.profile
    dec.profile = None
    per = [(delivered[i] - d0[i]) / dt for i in range(c)]
    for i, h in enumerate(handles):
        if i not in reopen:
            h.close()
    step_ms = gap_ms = 0.0
    if prof and len(prof) > 2:
        prof[-1][1].synchronize()
        busy = [s.elapsed_time(e) for s, e in prof]
        gaps = [prof[i][1].elapsed_time(prof[i + 1][0]) for i in range(len(prof) - 1)]
        step_ms, gap_ms = sum(busy) / len(busy), sum(gaps) / len(gaps)
    deadline = time.monotonic() + 60
    while sch.slots.free < sch.engine.max_slots and time.monotonic() < deadline:
        time.sleep(0.01)
    frame_s = sch.codec.config.frame_length / sch.codec.config.sample_rate
    return Point(
        concurrency=c, codec=codec_name, seconds=dt, decode_frames_per_s=rows / dt,
        delivered_frames_per_s=sum(per), per_stream_frames_per_s_mean=sum(per) / c,
        per_stream_frames_per_s_min=min(per), steps_per_s=steps / dt, mean_batch=rows / max(steps, 1),
        gpu_step_ms=step_ms, gpu_gap_ms=gap_ms,
        gpu_idle_share=gap_ms / (step_ms + gap_ms) if step_ms + gap_ms > 0 else 0.0,
        realtime_factor_per_stream=sum(per) / c * frame_s,
        turn_ends=dict(ends), mean_frames_per_turn=statistics.fmean(turn_frames) if turn_frames else 0.0,
        turn_first_audio_ms_p50=statistics.median(first_audio) if first_audio else 0.0,
        turn_first_audio_ms_max=max(first_audio, default=0.0),
    )


def table(points: list[Point]) -> list[str]:
    """The readable table of a run's points (also rebuilds a result's .md from its JSON: Point(**row))."""
    base = next((pt.decode_frames_per_s for pt in points if pt.concurrency == 1 and pt.codec == "none"), None)
    rows = ["| codec | c | decode frames/s | delivered frames/s | per-stream frames/s (mean / min) | RTF/stream "
            "| steps/s | GPU step ms | GPU gap ms | GPU idle | vs c=1 | turn ends (frames/turn) "
            "| turn first audio ms p50 / max |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for pt in points:
        ratio = f"{pt.decode_frames_per_s / base:.1f}x" if base else "-"
        rows.append(f"| {pt.codec} | {pt.concurrency} | {pt.decode_frames_per_s:.0f} | {pt.delivered_frames_per_s:.0f} "
                    f"| {pt.per_stream_frames_per_s_mean:.1f} / {pt.per_stream_frames_per_s_min:.1f} "
                    f"| {pt.realtime_factor_per_stream:.2f} | {pt.steps_per_s:.0f} | {pt.gpu_step_ms:.2f} "
                    f"| {pt.gpu_gap_ms:.3f} | {100 * pt.gpu_idle_share:.1f}% | {ratio} "
                    f"| {' '.join(f'{k} {v}' for k, v in sorted(pt.turn_ends.items())) or '-'} "
                    f"({pt.mean_frames_per_turn:.0f}) "
                    f"| {pt.turn_first_audio_ms_p50:.0f} / {pt.turn_first_audio_ms_max:.0f} |")
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m rtts.bench scheduler")
    p.add_argument("--preset", default="s2-pro", choices=["s2-pro", "s1-mini", "tiny"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--codec", default="none", choices=["none", "real", "both"])
    p.add_argument("--codec-concurrency", default="1,64", help="concurrencies measured with the real codec")
    p.add_argument("--max-ctx", type=int, default=2048)
    p.add_argument("--prefill-rows", type=int, default=DEFAULT_PREFILL_ROWS,
                   help="prompts per prefill batch (Engine.prefill_rows)")
    p.add_argument("--ref-frames", type=int, default=215, help="voice prompt length (215 frames = 10 s)")
    p.add_argument("--max-frames", type=int, default=400)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--codec-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="the real codec's chunk decodes from CUDA graphs (as `rtts serve` does)")
    p.add_argument("--prefill-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="turn-sized prompt chunks from CUDA graphs (as `rtts serve` does)")
    p.add_argument("--codec-dtype", choices=CODEC_DTYPES, default="auto",
                   help="the real codec's decode precision (as `rtts serve --codec-dtype`)")
    p.add_argument("--codec-tf32", action=argparse.BooleanOptionalAction, default=True,
                   help="the real codec decodes with TF32 tensor cores (as `rtts serve` does); off: true float32")
    p.add_argument("--fp8", action="store_true", help="block-scaled FP8 transformer linears (rtts quantize format)")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)

    conc = [int(x) for x in args.concurrency.split(",")]
    device = torch.device(args.device)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    t0 = time.perf_counter()
    lm, real_codec = random_model(args.preset, device, dtype)
    if args.fp8:
        from rtts.model.quant import quantize_model_

        quantize_model_(lm.model)
        torch.cuda.empty_cache()
    build_s = time.perf_counter() - t0
    codec_conc = [int(x) for x in args.codec_concurrency.split(",")]
    # one KV slot per stream of the widest point measured (a real-codec point may be wider than the null-codec ones)
    measured = (conc if args.codec in ("none", "both") else []) + (codec_conc if args.codec in ("real", "both") else [])
    widest = max(measured)
    engine = Engine(lm, max_slots=widest, max_ctx=args.max_ctx, prefill_rows=args.prefill_rows)
    points: list[Point] = []
    capture: dict[str, float] = {}
    plans: list[tuple[str, Any, list[int]]] = []
    if args.codec in ("none", "both"):
        plans.append(("none", NullCodec(real_codec.config), conc))
    if args.codec in ("real", "both"):
        plans.append(("real" if args.codec_dtype == "auto" else f"real {args.codec_dtype}",
                      decode_codec(real_codec, args.codec_dtype), codec_conc))
    for name, codec, cs in plans:
        # (the null codec has nothing to capture)
        cfg = SchedulerConfig(cuda_graphs=not args.no_graphs, codec_graphs=args.codec_graphs and name != "none",
                              prefill_graphs=args.prefill_graphs, codec_tf32=args.codec_tf32)
        sch = Scheduler(engine, codec, cfg).start()  # type: ignore[arg-type]
        capture[name] = engine.decode_runner.capture_seconds if engine.decode_runner is not None else 0.0
        if engine.prefill_runner is not None:
            capture[f"{name} prefill"] = engine.prefill_runner.capture_seconds
        if sch.codec_worker.runner is not None:
            capture[f"{name} codec"] = sch.codec_worker.runner.capture_seconds
        freeze_startup_objects()  # as `rtts serve` does: no full garbage collection walks the model mid-measurement
        set_switch_interval()  # (RTTS_SWITCH_INTERVAL, as `rtts serve` reads it)
        for c in cs:
            pt = measure(sch, c, name, args.warmup, args.seconds, args.ref_frames, args.max_frames)
            print(pt, flush=True)
            points.append(pt)
        sch.stop()
        gc.unfreeze()
    rows = table(points)
    data = {
        "env": environment(),
        "config": {k: v for k, v in vars(args).items()},
        "model_build_seconds": build_s,
        "graph_capture_seconds": capture,
        "kv_cache_gb": engine.kv.nbytes() / 1e9,
        "points": [vars(pt) for pt in points],
    }
    name = f"scheduler-{args.preset}-{'fp8' if args.fp8 else args.dtype}"
    data["attention_kernel"] = engine.attention_kernel
    jp, mp = write_results(args.out, name, data, "\n".join(rows))
    print("\n".join(rows))
    print(f"wrote {jp} and {mp}")
