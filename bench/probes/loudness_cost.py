"""CPU cost of the streaming loudness normalizer (rtts/audio/loudness.py) per 100 ms hop of 44.1 kHz audio, against the
normalizer of an earlier commit (read from git), on the same speech-like input and chunking.

    python bench/probes/loudness_cost.py OUT [--ref da3db90~1] [--seconds 20] [--repeats 5]

The normalizer runs on the server's event loop for every stream with `normalize_loudness` (the default), so its cost
per hop, times the hops of all streams, is event-loop time holding the GIL. Medians over the repeats; the two are
timed alternately so a busy machine slows both alike.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from rtts.audio import loudness
from rtts.bench.common import environment, write_results

RATE = 44100
CHUNK = 8192  # samples per push: about the server's 4-frame chunk at 44.1 kHz


def load_ref(rev: str) -> ModuleType:
    src = subprocess.run(["git", "show", f"{rev}:rtts/audio/loudness.py"], capture_output=True, text=True,
                         check=True).stdout
    path = Path(tempfile.mkdtemp()) / "loudness_ref.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("loudness_ref", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def speech(seconds: float) -> np.ndarray:
    """Low-passed noise in 4 Hz syllables at a speech-like level (the normalizer slews its gain on it)."""
    rng = np.random.default_rng(0)
    n = int(seconds * RATE)
    x = np.convolve(rng.standard_normal(n), np.ones(6) / 6, mode="same")
    x *= 0.05 * (1 + np.sin(2 * np.pi * 4 * np.arange(n) / RATE))
    return x.astype(np.float32)


def run(mod: ModuleType, x: np.ndarray) -> tuple[float, np.ndarray]:
    """-> (microseconds per hop, output)."""
    n = mod.LoudnessNormalizer(RATE)
    t0 = time.perf_counter()
    out = [n.push(x[i:i + CHUNK]) for i in range(0, x.size, CHUNK)]
    hops = x.size / round(loudness.HOP_SECONDS * RATE)
    return 1e6 * (time.perf_counter() - t0) / hops, np.concatenate(out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--ref", default="da3db90~1", help="the commit whose normalizer to compare against")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    ref, x = load_ref(args.ref), speech(args.seconds)
    times: dict[str, list[float]] = {"ref": [], "now": []}
    outs: dict[str, np.ndarray] = {}
    for _ in range(args.repeats):
        for name, mod in (("ref", ref), ("now", loudness)):
            us, outs[name] = run(mod, x)
            times[name].append(us)
    med = {k: statistics.median(v) for k, v in times.items()}
    data: dict[str, Any] = {"env": environment(), "config": vars(args), "us_per_hop": times, "median_us": med,
                            "speedup": med["ref"] / med["now"],
                            "max_abs_diff": float(np.abs(outs["ref"] - outs["now"]).max())}
    table = "\n".join([
        f"| normalizer | us per 100 ms hop (median of {args.repeats}) |", "|---|---|",
        f"| {args.ref} | {med['ref']:.1f} |", f"| this commit | {med['now']:.1f} |", "",
        f"Speed-up {data['speedup']:.2f}x; largest output difference {data['max_abs_diff']:.2e} "
        f"({args.seconds:g} s of speech-like audio pushed {CHUNK} samples at a time)."])
    jp, mp = write_results(args.out, "loudness-cost", data, table)
    print(table)
    print(f"wrote {jp} and {mp}", file=sys.stderr)


if __name__ == "__main__":
    main()
