"""Would an FP8 KV cache keep a trained voice's output? A CPU probe on the packaged demo voice (or --checkpoint).

An FP8 cache (half the bytes the 64-stream decode attention reads) is one of PERF.md's levers. Before building it,
this emulates it on the torch path: every key and value stored in the cache is rounded through float8_e4m3fn with one
scale per (position, KV head) (absmax / 448; the scale itself kept in float32), which is what a kernel storing FP8
rows with per-row scales would hold. Then, for the same held-out sentences and seeds, with and without it:

- token agreement: each sentence is synthesized (`Synthesizer`, server defaults, seed 1) both ways; the report gives
  the first frame whose column differs (main token or any codebook), and how many frames agree in all;
- intelligibility: `rtts.train evaluate`'s Whisper WER/CER through the live WebSocket, both ways, at the server's
  default seed and at `--seeds` (a different seed alone moves WER by sampling: the spread to read the cache's
  effect against).

    python bench/probes/fp8_kv_quality.py OUT [--count 20] [--threads 2] [--bundle train/bundle/flite]

Writes OUT/fp8-kv-quality-<device>-<date>.json and .md. (The demo voice's transformers have 2 KV heads of 64; the
release models' 8 of 128: a bound on one is a hint, not a proof, for the other.)
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from rtts.bench.common import environment, write_results
from rtts.kernels import reference

E4M3_MAX = 448.0


def fp8_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] rounded through float8_e4m3fn with one float32 scale per row (absmax / 448)."""
    scale = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
    return ((x.float() / scale).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)


@contextlib.contextmanager
def fp8_cache() -> Iterator[None]:
    """The torch path's cache store writes FP8-rounded keys and values while inside."""
    store: Callable[..., torch.Tensor] = reference.qkv_rope_store

    def rounded(qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                rope: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                positions: torch.Tensor, n_head: int) -> torch.Tensor:
        q = store(qkv, q_norm, k_norm, eps, rope, k_cache, v_cache, rows, positions, n_head)
        idx = (rows[:, None].expand_as(positions), positions)
        k_cache.index_put_(idx, fp8_rows(k_cache[idx]))  # [B, S, n_kv, D]: one scale per (position, head)
        v_cache.index_put_(idx, fp8_rows(v_cache[idx]))
        return q

    reference.qkv_rope_store = rounded
    try:
        yield
    finally:
        reference.qkv_rope_store = store


def columns(checkpoint: Path, texts: list[str], fp8: bool) -> list[torch.Tensor]:
    """Every sampled column [rows, N] of each sentence, one fresh conversation each, server defaults, seed 1."""
    from rtts.engine.engine import Engine
    from rtts.engine.synth import Synthesizer
    from rtts.model.loading import load_model
    from rtts.request import TTSRequest
    from rtts.session import sampling_params

    lm = load_model(checkpoint, device="cpu", dtype=torch.float32)
    synth = Synthesizer(Engine(lm, max_slots=1, max_ctx=1024))
    params = replace(sampling_params(TTSRequest(text="x"), lm.config.format), seed=1, max_frames=400)
    out = []
    with fp8_cache() if fp8 else contextlib.nullcontext():
        for text in texts:
            synth.start()
            out.append(synth.turn(text, params).columns)
    return out


def agreement(a: torch.Tensor, b: torch.Tensor) -> dict[str, int]:
    n = min(a.shape[1], b.shape[1])
    same = (a[:, :n] == b[:, :n]).all(dim=0)
    first = int((~same).nonzero()[0]) if not bool(same.all()) else n
    return {"frames_bf16": int(a.shape[1]), "frames_fp8": int(b.shape[1]), "first_difference": first,
            "identical": int(first == n and a.shape[1] == b.shape[1])}


def main() -> None:
    from rtts.tools.demo_voice import demo_voice_dir
    from rtts.train import evaluate, sentences
    from rtts.train.__main__ import TRAIN_DIR

    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--checkpoint", default=None, help="default: the packaged demo voice")
    p.add_argument("--count", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--bundle", default=None, help="a flite bundle (python -m rtts.train flite-bundle)")
    p.add_argument("--seeds", default="1,2", type=lambda v: [int(x) for x in v.split(",") if x],
                   help="also serve with these request seeds (the sampling's own spread beside the cache's effect)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ckpt = Path(args.checkpoint) if args.checkpoint else demo_voice_dir()
    texts = sentences.read_lines(TRAIN_DIR / "heldout.txt")[:args.count]  # the CI gate's sentences
    base, fp8 = columns(ckpt, texts, False), columns(ckpt, texts, True)
    agree: list[dict[str, Any]] = [{**agreement(a, b), "text": t} for a, b, t in zip(base, fp8, texts)]
    wers: dict[str, dict[str, Any]] = {}  # "cache, seed" -> the served summary
    for seed in [None, *args.seeds]:
        for name, ctx in (("bf16 cache", contextlib.nullcontext()), ("fp8 cache", fp8_cache())):
            key = f"{name}, seed {'default' if seed is None else seed}"
            where = Path(args.out) / f"evaluate-{key.replace(', ', '-').replace(' ', '-')}.json"
            with ctx:
                report = evaluate.evaluate(texts, where, checkpoint=ckpt,
                                           bundle=Path(args.bundle) if args.bundle else None, processes=args.threads,
                                           threads=args.threads, sampling=None if seed is None else {"seed": seed})
            wers[key] = report["server"]["summary"]
    firsts = sorted(a["first_difference"] for a in agree)
    md = [f"Checkpoint `{ckpt}`, {len(texts)} held-out sentences, server defaults (and the seeds named).", "",
          "| cache, seed | WER | CER |", "|---|---|---|"]
    md += [f"| {key} | {100 * w['wer']:.1f} % | {100 * w['cer']:.1f} % |" for key, w in wers.items()]
    mean = {c: sum(w["wer"] for k, w in wers.items() if k.startswith(c)) / (1 + len(args.seeds))
            for c in ("bf16 cache", "fp8 cache")}
    md += ["", f"Mean WER over the seeds: bf16 cache {100 * mean['bf16 cache']:.1f} %, fp8 cache "
               f"{100 * mean['fp8 cache']:.1f} %.",
           f"Sentences identical frame for frame (seed 1, `Synthesizer`): {sum(a['identical'] for a in agree)} of "
           f"{len(agree)}; first differing frame, sorted: {firsts}"]
    data = {"env": environment(), "config": vars(args), "agreement": agree, "wer": wers}
    jp, mp = write_results(args.out, "fp8-kv-quality", data, "\n".join(md))
    print("\n".join(md))
    print(f"wrote {jp} and {mp}")


if __name__ == "__main__":
    main()
