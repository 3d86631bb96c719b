"""What the codec's chunk decode costs on the GPU, and what lower precision would buy and lose: a probe.

    python bench/probes/codec_precision.py OUT [--batches 1,16,64] [--frames 8]

The release codec's shapes with random weights (rtts.tools.random_checkpoint.random_model). For each variant the
streaming decode is captured into CUDA graphs (engine/graphs/codec.CodecGraphRunner, as the server runs it) and
one chunk of `--frames` frames is timed per batch; then 48 frames of fixed random codes for 4 streams, and the codes
of 4 voice-like signals (harmonics on a wandering pitch, encoded by the float32 codec), are decoded in chunks of 8
and compared with the first variant's (SNR in dB over the whole waveform).
Variants (VARIANTS): precision (strict FP32, TF32 convolutions, bfloat16 or float16 weights and state) and, in
float16, the GPU rewrites of rtts/model/codec_conv.py (dilated convs by phases, conv biases in the kernels) on and
off. Also prints the top CUDA kernels of one eager chunk decode at the largest batch (torch.profiler) for the variant
the server runs (SERVED).
Writes OUT/codec-precision-<gpu>-<date>.json and .md.
"""

from __future__ import annotations

import argparse
import copy
import time
from dataclasses import dataclass
from typing import Any

import torch

from rtts import env
from rtts.bench.common import environment, write_results
from rtts.engine.graphs.codec import CodecGraphRunner
from rtts.model.codec import Codec, encode_audio
from rtts.tools.random_checkpoint import random_model


@dataclass(frozen=True)
class Variant:
    dtype: torch.dtype = torch.float32
    conv_tf32: bool = False
    matmul_tf32: bool = False
    snake_kernel: bool = True  # cuda/snake.cu; False: torch's expression (the reference kernels while it runs)
    cudnn_benchmark: bool = False
    phases: bool = True  # dilated convs as undilated convs over their phases (RTTS_CODEC_POLYPHASE)
    fused: bool = True  # residual units' conv biases added by the Snake / residual kernels (RTTS_CODEC_FUSED)
    channels_last: bool = True  # residual units' k7 convs channels last over phases (RTTS_CODEC_CHANNELS_LAST; served)
    tile_pairs: bool = False  # the phase kernels two elements per access (RTTS_CODEC_TILE_PAIRS)

    def apply(self) -> None:
        torch.backends.cudnn.allow_tf32 = self.conv_tf32
        torch.backends.cuda.matmul.allow_tf32 = self.matmul_tf32
        torch.backends.cudnn.benchmark = self.cudnn_benchmark
        env.change_kernel_switches(reference_kernels=not self.snake_kernel, codec_polyphase=self.phases,
                                   codec_fused=self.fused, codec_channels_last=self.channels_last,
                                   codec_tile_pairs=self.tile_pairs)


# (Measured once and left out since: torch's Snake, TF32 matmuls, cudnn.benchmark; bench/results/codec/.)
VARIANTS = {
    "fp32": Variant(),
    "tf32 convolutions": Variant(conv_tf32=True),
    "bf16": Variant(dtype=torch.bfloat16, conv_tf32=True),
    "fp16 as at 9e53161 (cuDNN's dilated convs, torch's bias adds)": Variant(dtype=torch.float16, phases=False,
                                                                             fused=False),
    "fp16, dilated convs by phases": Variant(dtype=torch.float16, fused=False),
    "fp16, biases in the kernels": Variant(dtype=torch.float16, phases=False),
    "fp16, both": Variant(dtype=torch.float16, channels_last=False),
    "fp16 (served: both + channels-last phases in place)": Variant(dtype=torch.float16),
    "fp16, served + phase kernels by pairs": Variant(dtype=torch.float16, tile_pairs=True),
}
SERVED = "fp16 (served: both + channels-last phases in place)"
PROFILED = (SERVED, "fp16, served + phase kernels by pairs")


def random_codes(codec: Codec, b: int, t: int, seed: int) -> torch.Tensor:
    cfg = codec.config
    g = torch.Generator(device="cpu").manual_seed(seed)
    sem = torch.randint(0, cfg.semantic_codebook_size, (b, 1, t), generator=g)
    res = torch.randint(0, cfg.codebook_size, (b, cfg.n_codebooks, t), generator=g)
    return torch.cat([sem, res], dim=1).to(codec.device)


def voiced_codes(codec: Codec, b: int, seconds: float) -> torch.Tensor:
    """Codes of a voice-like signal (a wandering pitch with harmonics and a syllable-rate envelope), encoded by the
    float32 codec: code sequences shaped like speech's rather than uniform random ones. [b, num_codebooks, T]"""
    rate = codec.config.sample_rate
    t = torch.arange(int(seconds * rate), dtype=torch.float64) / rate
    out = []
    for i in range(b):
        f0 = 120 + 20 * i + 30 * torch.sin(2 * torch.pi * (0.5 + 0.2 * i) * t)
        phase = 2 * torch.pi * torch.cumsum(f0, 0) / rate
        envelope = 0.5 + 0.5 * torch.sin(2 * torch.pi * (3.5 + 0.3 * i) * t)
        x = envelope * sum(torch.sin(k * phase) / k for k in (1, 2, 3, 4, 6))
        out.append(encode_audio(codec, (0.2 * x).float().numpy()))
    n = min(c.shape[-1] for c in out)
    return torch.stack([c[..., :n] for c in out]).to(codec.device)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed_chunk(runner: CodecGraphRunner, codec: Codec, b: int, frames: int, reps: int) -> float:
    codes = random_codes(codec, b, frames, seed=1)
    slots = torch.arange(b, device=codec.device)
    for _ in range(3):
        runner.decode(codes, slots)
    sync(codec.device)
    t0 = time.perf_counter()  # the replays queue back to back: wall time over many of them is GPU time
    for _ in range(reps):
        runner.decode(codes, slots)
    sync(codec.device)
    return 1e3 * (time.perf_counter() - t0) / reps


def streamed(codec: Codec, runner: CodecGraphRunner, codes: torch.Tensor) -> torch.Tensor:
    slots = torch.arange(codes.shape[0], device=codec.device)
    runner.state.reset(torch.ones(runner.state.capacity, dtype=torch.bool, device=codec.device))
    out = [runner.decode(codes[:, :, i:i + 8], slots) for i in range(0, codes.shape[-1], 8)]
    return torch.cat(out, dim=-1).float()


def snr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    err = (x - ref).pow(2).sum().item()
    return float("inf") if err == 0 else 10 * torch.log10(ref.pow(2).sum() / err).item()


Ranked = list[tuple[str, float, int]]


def profile_eager(codec: Codec, b: int, frames: int) -> tuple[Ranked, Ranked]:
    """One eager chunk decode under torch.profiler -> (top CUDA kernels, top torch ops with their input shapes by
    the device time they launched themselves): kernel names say what ran, the ops say which line of the codec
    asked for it (a copy, a cat, a non-contiguous elementwise pass)."""
    from torch.profiler import ProfilerActivity, profile

    if codec.device.type != "cuda":
        return [], []
    state = codec.new_stream_state(b)
    codes = random_codes(codec, b, frames, seed=2)
    with torch.inference_mode():
        codec.decode_stream(codes, state)
        sync(codec.device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:  # kernels only
            codec.decode_stream(codes, state)
            sync(codec.device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as by_ops:
            codec.decode_stream(codes, state)
            sync(codec.device)
    kernels, ops = [], []
    for e in prof.key_averages():
        us = float(getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", None) or 0.0)
        if us > 0:
            kernels.append((e.key[:110], us, e.count))
    for e in by_ops.key_averages(group_by_input_shape=True):
        self_us = float(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", None) or 0.0)
        if self_us > 0 and e.key.startswith("aten::"):
            ops.append((f"{e.key} {str(e.input_shapes)[:90]}", self_us, e.count))
    kernels.sort(key=lambda r: -r[1])
    ops.sort(key=lambda r: -r[1])
    return kernels[:25], ops[:25]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--frames", type=int, default=8)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run (no graphs, no TF32, no profile)")
    args = p.parse_args()
    batches = [int(x) for x in args.batches.split(",")]
    dev = torch.device(args.device)
    _, base = random_model("s2-pro", dev)
    base.eval()
    torch.backends.cudnn.allow_tf32 = False
    check = random_codes(base, 4, 48, seed=3)
    voiced = voiced_codes(base, 4, 2.3)
    voiced = voiced[..., : voiced.shape[-1] // 8 * 8]
    ref: torch.Tensor | None = None
    ref_voiced: torch.Tensor | None = None
    results: dict[str, Any] = {}
    for name, v in VARIANTS.items():
        v.apply()
        codec = base if v.dtype == torch.float32 else copy.deepcopy(base).to(v.dtype)
        top = max(*batches, check.shape[0])
        state = codec.new_stream_state(top + 1)  # the last row is the graphs' scratch slot
        chunks = tuple(sorted({args.frames, 8, 1}, reverse=True))
        runner = CodecGraphRunner(codec, state, top, top, chunks=chunks)
        t0 = time.perf_counter()
        if dev.type == "cuda":  # (a CPU smoke run decodes eager)
            runner.capture()
        cap = time.perf_counter() - t0
        ms = {b: timed_chunk(runner, codec, b, args.frames, args.reps) for b in batches}
        audio = streamed(codec, runner, check)
        audio_voiced = streamed(codec, runner, voiced)
        if ref is None or ref_voiced is None:
            ref, ref_voiced = audio, audio_voiced
        results[name] = {"chunk_ms": ms, "capture_s": cap, "snr_db": snr_db(ref, audio),
                         "snr_voiced_db": snr_db(ref_voiced, audio_voiced), "peak": audio.abs().max().item(),
                         "finite": bool(torch.isfinite(audio).all() and torch.isfinite(audio_voiced).all())}
        print(name, results[name], flush=True)
        del runner, state
        if codec is not base:
            del codec
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    rows = ["| variant | " + " | ".join(f"ms per {args.frames}-frame chunk, batch {b}" for b in batches)
            + " | us per frame at the largest batch | SNR vs the first dB (random codes) | SNR, voiced codes |",
            "|---|" + "---|" * len(batches) + "---|---|---|"]
    for name, r in results.items():
        per_frame = 1e3 * r["chunk_ms"][max(batches)] / (max(batches) * args.frames)
        rows.append(f"| {name} | " + " | ".join(f"{r['chunk_ms'][b]:.2f}" for b in batches)
                    + f" | {per_frame:.1f} | {r['snr_db']:.1f} | {r['snr_voiced_db']:.1f} |")
    tops: dict[str, list[tuple[str, float, int]]] = {}
    top_ops: dict[str, list[tuple[str, float, int]]] = {}
    for name in PROFILED:  # where the time goes now, and with the opt-in layout
        v = VARIANTS[name]
        v.apply()
        codec = base if v.dtype == torch.float32 else copy.deepcopy(base).to(v.dtype)  # (the variant's own weights)
        ranked, by_op = profile_eager(codec, max(batches), args.frames)
        tops[name], top_ops[name] = ranked, by_op
        rows += ["", f"Top CUDA kernels, one eager chunk decode, {name} (batch {max(batches)}, {args.frames} frames):",
                 "", "| kernel | us total | calls |", "|---|---|---|"]
        rows += [f"| `{k}` | {us:.0f} | {n} |" for k, us, n in ranked]
        rows += ["", f"Top torch ops by the device time of their own kernels, {name}, by input shapes:",
                 "", "| op and input shapes | us total | calls |", "|---|---|---|"]
        rows += [f"| `{k}` | {us:.0f} | {n} |" for k, us, n in by_op]
    data = {"env": environment(), "config": vars(args), "results": results, "top_kernels": tops,
            "top_ops": top_ops}
    jp, mp = write_results(args.out, "codec-precision", data, "\n".join(rows))
    print("\n".join(rows))
    print(f"wrote {jp} and {mp}")


if __name__ == "__main__":
    main()
