"""What a soak run says: the server log's tracebacks, the machine, percentiles, the RSS slope, the markdown summary.
Used by soak.py (beside it)."""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import socket
import statistics
import subprocess
from pathlib import Path
from typing import Any


def tracebacks(log: Path | None, offset: int) -> list[str]:
    """Each traceback in the server's log since `offset` (its size when the soak began), as its first three lines."""
    if log is None:
        return []
    with open(log, "rb") as f:
        f.seek(offset)
        lines = f.read().decode("utf-8", "replace").splitlines()
    return [" | ".join(lines[i:i + 3])[:300] for i, line in enumerate(lines) if "Traceback" in line]


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=False, cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def machine(hardware: str) -> dict[str, Any]:
    info: dict[str, Any] = {"host": socket.gethostname(), "platform": platform.platform(),
                            "python": platform.python_version(), "cpus": os.cpu_count(), "notes": hardware}
    try:
        gpus = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10, check=False).stdout.strip()
        if gpus:
            info["gpus"] = gpus.splitlines()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def percentile(xs: list[float], q: float) -> float:
    return round(sorted(xs)[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else 0.0


def markdown(r: dict[str, Any]) -> str:
    rows = [f"# Soak: {r['name']}", "", f"`{r['command']}`", "",
            f"commit {r['commit']}, {r['date']}, {r['machine']['platform']}, {r['machine']['cpus']} CPUs"
            + (f", {', '.join(r['machine']['gpus'])}" if r['machine'].get("gpus") else "")
            + (f" ({r['machine']['notes']})" if r['machine']['notes'] else ""), "",
            f"{r['params']['concurrency']} clients for {r['params']['warmup']} s of warm-up and "
            f"{r['params']['duration']} s measured against {r['server']}: "
            f"{r['total_operations']} operations, {len(r['failures'])} failed. "
            f"**{'PASSED' if r['passed'] else 'FAILED'}**", "",
            "| check | ok | detail |", "|---|---|---|"]
    rows += [f"| {name} | {'yes' if c['ok'] else '**no**'} | {c['detail']} |" for name, c in r["checks"].items()]
    rows += ["", "| operation | count | outcomes | p50 s | p95 s |", "|---|---|---|---|---|"]
    for kind, o in r["operations"].items():
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(o["outcomes"].items()))
        rows.append(f"| {kind} | {o['count']} | {outcomes} | {o['p50_s']} | {o['p95_s']} |")
    rss = r["rss"]
    if rss.get("baseline_mb") is not None:
        rows += ["", f"Server RSS (MB): at the start {rss['start_mb']}, idle after the warm-up {rss['baseline_mb']}, "
                     f"peak under load {rss['peak_mb']}, idle after the run {rss['end_mb']}: growth "
                     f"{rss['growth_mb']} (bound {rss['bound_mb']}); slope over the second half of the samples "
                     f"{rss['slope_mb_per_min']} MB/min."]
    if r["failures"]:
        rows += ["", "First failures:", ""] + [f"- {f}" for f in r["failures"][:20]]
    return "\n".join(rows) + "\n"


def slope(samples: list[tuple[float, float]]) -> float:
    """Least-squares MB per minute over the second half of the samples (a leak keeps climbing; a plateau is ~0)."""
    half = samples[len(samples) // 2:]
    if len(half) < 3:
        return 0.0
    ts, ms = [t for t, _ in half], [m for _, m in half]
    mt, mm = statistics.fmean(ts), statistics.fmean(ms)
    den = sum((t - mt) ** 2 for t in ts)
    return round(60 * sum((t - mt) * (m - mm) for t, m in zip(ts, ms)) / den, 2) if den else 0.0


def recorded_command(args: argparse.Namespace) -> str:
    words = ["python", "clients/soak.py"]
    for k, v in vars(args).items():
        if v is not None and k != "api_key":
            words += [f"--{k.replace('_', '-')}", str(v)]
    return shlex.join(words)
