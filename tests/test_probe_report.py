"""The probe's report arithmetic and its regression gate, on small synthetic reports (no server)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "clients"))
import probe_report  # noqa: E402

RATE = 44100
FRAME_BYTES = 2048 * 2  # one codec frame of pcm s16le at 44.1 kHz


def session(ttfa: float, frames: int, fps: float, start: float = 0.0, per_chunk: int = 4) -> dict[str, Any]:
    """A session whose audio arrives `per_chunk` frames at a time at `fps` frames per second after `ttfa`."""
    chunks = [(ttfa + i * per_chunk / fps, per_chunk * FRAME_BYTES) for i in range(frames // per_chunk)]
    rec = {"ok": True, "finish": "stop", "ttfa_s": ttfa, "chunks": chunks, "t_start_s": start, "round": 0}
    rec.update(probe_report.playback(chunks, RATE))
    return rec


def report(ttfa: float, fps: float, levels: tuple[int, ...] = (1, 16, 64)) -> dict[str, Any]:
    data: dict[str, Any] = {"levels": {str(c): [session(ttfa, 200, fps, start=0.01 * i) for i in range(c)]
                                       for c in levels}}
    data["summary"] = probe_report.summaries(data)
    return data


def test_summary_figures() -> None:
    s = probe_report.summarize(2, [session(0.05, 200, 100.0), session(0.10, 200, 50.0, start=0.5)])
    assert s.sessions_ok == 2 and s.underruns == 0
    assert s.ttfa_p50_ms == pytest.approx(50.0) or s.ttfa_p50_ms == pytest.approx(100.0)
    # Chunk i of 4 frames arrives i * 4 / fps after the first: the stream's own rate is exactly fps.
    assert s.per_stream_frames_per_s == pytest.approx(75.0, rel=1e-6)
    assert s.per_stream_frames_per_s_min == pytest.approx(50.0, rel=1e-6)
    # 400 frames over the round's wall time: first text at 0, last audio at 0.5 + 0.1 + 49 * 4 / 50.
    assert s.frames == pytest.approx(400.0)
    assert s.frames_per_s == pytest.approx(400.0 / (0.5 + 0.1 + 49 * 4 / 50), rel=1e-6)


def test_a_slow_stream_underruns() -> None:
    # 4 frames (186 ms of audio) every 250 ms: the second chunk is already late.
    rec = session(0.05, 40, 16.0)
    assert rec["underrun"] and rec["max_lateness_s"] > 0.05
    assert not session(0.05, 40, 30.0)["underrun"]


@pytest.mark.parametrize(("ttfa", "fps", "regressed"), [
    (0.050, 100.0, False),  # the same
    (0.054, 96.0, False),  # within the gate: +8% TTFA, -4% frames/s
    (0.050, 94.0, True),  # frames/s -6%
    (0.056, 100.0, True),  # TTFA +12%
    (0.030, 150.0, False),  # better
])
def test_compare_gate(ttfa: float, fps: float, regressed: bool) -> None:
    table, bad = probe_report.compare(report(0.050, 100.0), report(ttfa, fps))
    assert bad is regressed
    assert table.count("\n") == 4  # header, rule and one row per concurrency


def test_only_gated_levels_count() -> None:
    old, new = report(0.05, 100.0, (1, 8, 16, 64)), report(0.05, 100.0, (1, 8, 16, 64))
    new["levels"]["8"] = [session(0.5, 200, 10.0)]
    new["summary"] = probe_report.summaries(new)
    table, bad = probe_report.compare(old, new)
    assert not bad and "not gated" in table


def test_compare_cli_exit_status(tmp_path: Path) -> None:
    old, good, worse = tmp_path / "old.json", tmp_path / "good.json", tmp_path / "worse.json"
    old.write_text(json.dumps(report(0.05, 100.0)))
    good.write_text(json.dumps(report(0.05, 101.0)))
    worse.write_text(json.dumps(report(0.05, 80.0)))
    run = [sys.executable, str(ROOT / "clients" / "probe.py"), "--compare"]
    assert subprocess.run([*run, str(old), str(good)], capture_output=True).returncode == 0
    res = subprocess.run([*run, str(old), str(worse)], capture_output=True, text=True)
    assert res.returncode == 1 and "REGRESSION: frames/s" in res.stdout
