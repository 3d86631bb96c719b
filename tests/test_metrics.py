"""/metrics for balancers and autoscalers (rtts/metrics.py, docs/metrics.md): every exported metric is documented,
chunk lateness and underruns as a session measures them, refusals by reason."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from conftest import greedy, metric, tiny_config
from liveserver import FLUSH, LiveServer, session, start_msg, text_msg, until_finish
from prometheus_client.parser import text_string_to_metric_families

from rtts.pingpong.outbox import AudioChunk, TurnEnd
from rtts.session import Session, SessionMetrics
from rtts.types import FinishReason
from rtts.ws.parse import parse_request

DOCS = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"
SR = 44100


def exported(text: str) -> set[str]:
    """The metric names a scrape shows, as queries name them (counters with `_total`), without the client library's
    `_created` timestamps."""
    return {f.name + "_total" if f.type == "counter" else f.name for f in text_string_to_metric_families(text)
            if not f.name.endswith("_created")}


def test_every_metric_is_documented(srv: LiveServer) -> None:
    documented = set(re.findall(r"^\| `(rtts_[a-z_]+)`", DOCS.read_text(), re.M))
    assert exported(httpx.get(srv.http + "/metrics").text) == documented


def test_a_session_reports_chunk_lateness(srv: LiveServer) -> None:
    """Every chunk after a turn's first is measured (the tiny model on CPU may be late or not)."""
    before = metric(srv, "rtts_chunk_lateness_seconds_count")
    with srv.connect() as ws:
        _, fin = session(ws, ["A sentence long enough for several chunks of audio.", FLUSH],
                         **greedy(max_new_tokens=20, sample_rate=8000))
    assert fin == {"event": "finish", "reason": "stop"}
    assert metric(srv, "rtts_chunk_lateness_seconds_count") > before
    text = httpx.get(srv.http + "/metrics").text
    assert "# TYPE rtts_underruns_total counter" in text and 'rtts_chunk_lateness_seconds_bucket{le="0.0"}' in text


class PacedStream:
    """speak() -> an outbox per turn: for each (seconds, wait) a tone of that length after that wait."""

    def __init__(self, turns: list[list[tuple[float, Callable[[], Awaitable[None]] | None]]]) -> None:
        self.turns = list(turns)

    def speak(self, text: str, params: Any, **kw: Any) -> AsyncIterator[object]:
        chunks = self.turns.pop(0)

        async def outbox() -> AsyncIterator[object]:
            for seconds, wait in chunks:
                if wait is not None:
                    await wait()
                pcm = np.zeros(int(seconds * SR), np.float32)
                yield AudioChunk(pcm, SR, frames=1, first_frame=0, t_submit=time.perf_counter())
            yield TurnEnd(FinishReason.STOP, frames=len(chunks))

        return outbox()

    def cancel(self) -> None:
        pass


def test_lateness_is_how_long_a_playing_client_waited() -> None:
    """Turn 1: a 50 ms chunk, then one 300 ms later (late by 250 ms at least: an underrun), then one at once (in
    time: the client still plays the one before, 1 s long). Turn 2, whose text comes once the client has played
    everything: its first chunk is first audio (ttfa), not lateness; its second, at once, is in time."""
    late: list[float] = []

    async def pause() -> None:
        await asyncio.sleep(0.3)

    async def main() -> None:
        stream = PacedStream([[(0.05, None), (1.0, pause), (0.05, None)], [(0.05, None), (0.05, None)]])

        async def on_audio(audio: bytes, extra: dict[str, object]) -> None:
            pass

        async def on_finish(reason: str, message: str | None) -> None:
            pass

        req = parse_request({"format": "pcm", "prosody": {"normalize_loudness": False}})
        s = Session(req, stream, on_audio, on_finish, "s2", SR,  # type: ignore[arg-type]
                    metrics=SessionMetrics(lateness=late.append))
        s.start()
        s.text("One.")
        s.flush()
        deadline = time.monotonic() + 30
        while len(late) < 2:
            assert not s.done.is_set() and time.monotonic() < deadline, "the session ended or stalled"
            await asyncio.sleep(0.01)
        # Wait until the client has played turn 1 (its estimate: from the last audio sent), then speak again.
        await asyncio.sleep(max(0.0, s._play_end - time.perf_counter()) + 0.2)
        s.text("Two.")
        await asyncio.wait_for(s.stop(), 30)

    asyncio.run(main())
    assert len(late) == 3, late
    assert late[0] >= 0.25 and late[1] == 0.0 and late[2] == 0.0, late


def test_refusals_for_capacity_are_counted(golden: Path, tmp_path: Path) -> None:
    s = LiveServer(tiny_config(golden, tmp_path, max_running=1))
    try:
        refused = 'rtts_refused_sessions_total{reason="capacity"}'
        assert metric(s, refused) == 0 and metric(s, "rtts_slots") == 1
        with s.connect() as busy, s.connect() as second:
            busy.send(start_msg(**greedy(max_new_tokens=4, sample_rate=8000)))
            busy.send(text_msg("Holding the only slot."))
            busy.send(FLUSH)
            second.send(start_msg(**greedy(max_new_tokens=4, sample_rate=8000)))
            _, fin = until_finish(second)
            assert fin["reason"] == "error" and "too many" in fin["message"], fin
            assert metric(s, refused) == 1
    finally:
        s.stop()
