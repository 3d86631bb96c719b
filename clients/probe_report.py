"""What a probe report says: per-session playback figures, a summary per concurrency, the markdown table, the plot and
the regression comparison of two reports.

A report (written by `clients/probe.py`) holds every session's raw audio arrivals; everything here is derived from
them, so an old report can be re-summarised or compared with a newer one:

    python clients/probe.py --compare OLD.json NEW.json     # exit 1 on a regression at c = 1, 16 or 64
    python clients/probe.py --replot REPORT.json            # rewrite REPORT.md and REPORT.png

Imports nothing from the server; matplotlib is optional (only the plot needs it).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BYTES_PER_SAMPLE = 2  # pcm s16le mono
FRAME_RATE = 44100 / 2048  # codec frames per second of audio (the S2 / S1 codec hop)
GATED_LEVELS = ("1", "16", "64")  # the concurrencies the regression gate compares
MAX_FPS_DROP = 0.05  # per-stream frames/s may fall by at most 5%
MAX_TTFA_RISE = 0.10  # TTFA p50 may rise by at most 10%


def playback(chunks: list[tuple[float, int]], rate: int) -> dict[str, float | bool | None]:
    """Playback from the first chunk: chunk i is late when it arrives after the audio before it has played out.

    `chunks` are (seconds since the session's first text, audio bytes). Returns the audio length, the worst lateness,
    whether the stream underran, and the stream's real-time factor (generation time / audio time)."""
    played, worst = 0.0, 0.0
    for t, nbytes in chunks:
        worst = max(worst, t - (chunks[0][0] + played))
        played += nbytes / BYTES_PER_SAMPLE / rate
    span = chunks[-1][0] - chunks[0][0]
    return {"audio_s": played, "max_lateness_s": worst, "underrun": worst > 0.0 and len(chunks) > 1,
            "rtf": span / played if played else None}


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


def max_gap(r: dict[str, Any]) -> float:
    """The longest wait between two audio messages of a session, in seconds (0 with fewer than two)."""
    ts = [t for t, _ in r.get("chunks", [])]
    return max((b - a for a, b in zip(ts, ts[1:])), default=0.0)


@dataclass
class LevelSummary:
    """The machine-readable figures of one concurrency level (the JSON report's `summary[c]`)."""

    concurrency: int
    sessions: int
    sessions_ok: int
    ttfa_p50_ms: float
    ttfa_p90_ms: float
    ttfa_p99_ms: float
    underruns: int
    max_lateness_ms: float
    max_chunk_gap_ms: float
    frames: float  # audio frames delivered by the level's sessions (audio seconds x FRAME_RATE)
    frames_per_s: float  # aggregate: frames / the level's wall time (first text sent -> last audio received)
    audio_s_per_s: float
    per_stream_frames_per_s: float  # mean over sessions of stream_rate()
    per_stream_frames_per_s_min: float
    rtf_mean: float  # generation time / audio time per session (below 1: faster than real time)


def stream_rate(r: dict[str, Any]) -> float:
    """A session's own delivery rate in frames/s: the frames after its first chunk over the time they took."""
    chunks = r["chunks"]
    after_first = r["audio_s"] * (1 - chunks[0][1] / sum(n for _, n in chunks))
    return after_first * FRAME_RATE / (chunks[-1][0] - chunks[0][0])


def summarize(c: int, runs: list[dict[str, Any]]) -> LevelSummary:
    ok = [r for r in runs if r.get("ok")]
    ttfa = [1000 * r["ttfa_s"] for r in ok]
    rtf = [r["rtf"] for r in ok if r.get("rtf") is not None]
    stream_fps = [stream_rate(r) for r in ok if len(r.get("chunks", [])) > 1 and r["chunks"][-1][0] > r["chunks"][0][0]]
    audio = sum(r.get("audio_s", 0.0) for r in ok)
    # Wall time of one round: sessions record when they sent their first text (`t_start_s`, seconds since their
    # round began); rounds run one after another, so the level's wall time is the sum of the rounds' spans. Reports
    # older than this field have no aggregate rate.
    spans: dict[int, tuple[float, float]] = {}
    for r in ok:
        if r.get("chunks") and "t_start_s" in r:
            lo, hi = spans.get(r.get("round", 0), (math.inf, -math.inf))
            spans[r.get("round", 0)] = (min(lo, r["t_start_s"]), max(hi, r["t_start_s"] + r["chunks"][-1][0]))
    wall = sum(hi - lo for lo, hi in spans.values()) if spans else float("nan")
    return LevelSummary(
        concurrency=c, sessions=len(runs), sessions_ok=len(ok),
        ttfa_p50_ms=pct(ttfa, 50), ttfa_p90_ms=pct(ttfa, 90), ttfa_p99_ms=pct(ttfa, 99),
        underruns=sum(1 for r in ok if r.get("underrun")),
        max_lateness_ms=1000 * max((r["max_lateness_s"] for r in ok), default=0.0),
        max_chunk_gap_ms=1000 * max((max_gap(r) for r in ok), default=0.0),
        frames=audio * FRAME_RATE,
        frames_per_s=audio * FRAME_RATE / wall if wall and wall > 0 else float("nan"),
        audio_s_per_s=audio / wall if wall and wall > 0 else float("nan"),
        per_stream_frames_per_s=statistics.mean(stream_fps) if stream_fps else float("nan"),
        per_stream_frames_per_s_min=min(stream_fps) if stream_fps else float("nan"),
        rtf_mean=statistics.mean(rtf) if rtf else float("nan"),
    )


def summaries(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The report's summary per concurrency, derived from its raw sessions; a summary-only report (a baseline) gives
    the one it stores."""
    if not report.get("levels"):
        return report["summary"]
    return {c: asdict(summarize(int(c), runs)) for c, runs in report["levels"].items()}


def full_gcs(d: dict[str, float] | None) -> str:
    """'N (T)': full (generation 2) collections the server ran during a level and their total milliseconds."""
    if not d:
        return "-"
    return f"{d.get('2 count', 0):.0f} ({1000 * d.get('2 sum', 0):.0f})"


STAGES = ("queue", "prefill", "frames", "codec_wait", "codec", "outbox")


def stage_means(hist: dict[str, float]) -> dict[str, float]:
    """{'<stage> sum' / '<stage> count'} gained during a level -> mean milliseconds per stage (first audios only)."""
    out = {}
    for stage in STAGES:
        n = hist.get(f"{stage} count", 0.0)
        if n > 0:
            out[stage] = 1000 * hist.get(f"{stage} sum", 0.0) / n
    return out


def stage_rows(report: dict[str, Any]) -> list[str]:
    """A table of the server's own TTFA split (rtts_ttfa_stage_seconds) per concurrency, when the server has one."""
    split = report.get("ttfa_stages_ms") or {}
    if not split:
        return []
    rows = ["", "Server-side way to first audio, mean ms per turn (rtts_ttfa_stage_seconds: queue = waiting for the "
            "prefill thread, frames = decode steps of the rest of the first chunk, outbox = waiting for the session):",
            "", "| concurrency | " + " | ".join(STAGES) + " | sum |", "|---|" + "---|" * (len(STAGES) + 1)]
    for c, means in split.items():
        rows.append(f"| {c} | " + " | ".join(f"{means.get(k, 0.0):.1f}" for k in STAGES)
                    + f" | {sum(means.values()):.1f} |")
    return rows


def markdown(report: dict[str, Any], name: str) -> str:
    rows = ["| concurrency | sessions ok | TTFA p50 ms | p90 ms | p99 ms | underruns | max lateness ms "
            "| max chunk gap ms | frames/s (aggregate) | audio s/s | per-stream frames/s mean (min) | RTF mean "
            "| server full GCs (ms) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c, s in summaries(report).items():
        rows.append(f"| {c} | {s['sessions_ok']}/{s['sessions']} | {s['ttfa_p50_ms']:.1f} | {s['ttfa_p90_ms']:.1f} "
                    f"| {s['ttfa_p99_ms']:.1f} | {s['underruns']} | {s['max_lateness_ms']:.1f} "
                    f"| {s['max_chunk_gap_ms']:.1f} | {s['frames_per_s']:.0f} | {s['audio_s_per_s']:.1f} "
                    f"| {s['per_stream_frames_per_s']:.0f} ({s['per_stream_frames_per_s_min']:.0f}) "
                    f"| {s['rtf_mean']:.3f} | {full_gcs(report.get('server_gc', {}).get(c))} |")
    head = [f"# {name}", "", f"- command: `{report.get('command', '')}`", f"- commit: `{report.get('commit', '')}`",
            f"- hardware: {report.get('hardware', '')}", f"- date: {report.get('date', '')}",
            f"- mode: {report.get('mode', 'ttfa')}"]
    if report.get("mode") == "throughput":
        frames = report.get("request", {}).get("max_new_tokens")
        head.append(f"- per session: {report.get('turns')} turns of up to {frames} frames, sessions opened over "
                    f"{report.get('stagger')} s")
    return "\n".join(head + ["", *rows, *stage_rows(report), ""])


def plot(report: dict[str, Any], path: Path) -> bool:
    """TTFA distribution per concurrency and throughput against concurrency, as a PNG. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    levels = sorted(report["levels"], key=int)
    summ = summaries(report)
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4.2))
    for c in levels:
        ttfa = sorted(1000 * r["ttfa_s"] for r in report["levels"][c] if r.get("ok"))
        if ttfa:
            ax0.step(ttfa, [(i + 1) / len(ttfa) for i in range(len(ttfa))], where="post", marker=".", ms=3,
                     label=f"c = {c}")
    ax0.set_xlabel("time to first audio (ms)")
    ax0.set_ylabel("fraction of sessions")
    ax0.set_title("TTFA distribution")
    ax0.grid(alpha=0.3)
    ax0.legend()
    xs = [int(c) for c in levels]
    ax1.plot(xs, [summ[c]["frames_per_s"] for c in levels], "o-", label="aggregate frames/s")
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(xs, [str(x) for x in xs])
    ax1.set_xlabel("concurrent sessions")
    ax1.set_ylabel("delivered audio frames/s")
    ax1.set_title("throughput")
    ax1.grid(alpha=0.3)
    ax2 = ax1.twinx()
    ax2.plot(xs, [summ[c]["per_stream_frames_per_s"] for c in levels], "s--", color="tab:orange",
             label="per-stream frames/s")
    ax2.axhline(FRAME_RATE, color="grey", lw=0.8, ls=":")
    ax2.set_ylabel("per-stream frames/s (dotted: real time)")
    fig.legend(loc="upper center", ncol=3, fontsize=8)
    fig.suptitle(f"{report.get('commit', '')} {report.get('hardware', '')}", fontsize=8, y=0.02)
    fig.tight_layout(rect=(0, 0.04, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def compare(old: dict[str, Any], new: dict[str, Any]) -> tuple[str, bool]:
    """A markdown table per concurrency and whether NEW regressed: at c = 1, 16 or 64 (where both have it),
    per-stream frames/s down by more than 5% or TTFA p50 up by more than 10%."""
    a, b = summaries(old), summaries(new)
    rows = ["| concurrency | per-stream frames/s old -> new | change | TTFA p50 ms old -> new | change | verdict |",
            "|---|---|---|---|---|---|"]
    regressed = False
    for c in sorted(set(a) & set(b), key=int):
        fps0, fps1 = a[c]["per_stream_frames_per_s"], b[c]["per_stream_frames_per_s"]
        t0, t1 = a[c]["ttfa_p50_ms"], b[c]["ttfa_p50_ms"]
        dfps = fps1 / fps0 - 1 if fps0 and not math.isnan(fps0) else float("nan")
        dttfa = t1 / t0 - 1 if t0 and not math.isnan(t0) else float("nan")
        bad = []
        if c in GATED_LEVELS:
            if math.isnan(fps1) or dfps < -MAX_FPS_DROP:
                bad.append("frames/s")
            if math.isnan(t1) or dttfa > MAX_TTFA_RISE:
                bad.append("TTFA")
        regressed |= bool(bad)
        verdict = ("REGRESSION: " + ", ".join(bad)) if bad else ("ok" if c in GATED_LEVELS else "not gated")
        rows.append(f"| {c} | {fps0:.1f} -> {fps1:.1f} | {100 * dfps:+.1f}% | {t0:.1f} -> {t1:.1f} "
                    f"| {100 * dttfa:+.1f}% | {verdict} |")
    return "\n".join(rows), regressed
