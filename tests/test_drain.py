"""Graceful drain (rtts.ws.server): after SIGTERM (or Server.request_drain) the server refuses new sessions with a
reason, answers /v1/health with 503 draining (liveness stays 200), lets every accepted session finish, new text
included, with all its audio, ends what is left after --drain-grace with finish/error, and exits 0.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import websockets
from conftest import greedy, metric, s16, tiny_config
from liveserver import FLUSH, STOP, LiveServer, free_port, recv_event, start_msg, text_msg, until_finish
from websockets.sync.client import ClientConnection, connect

from rtts.__main__ import main as rtts_main
from rtts.runtime import ServerConfig

TURNS = ("The first turn of the session, spoken before the drain.", "The second turn, sent while the server drains.")
LIVE = greedy(max_new_tokens=30, sample_rate=8000, timestamps=True)  # (timestamps: each event names its turn)
HTTP = {"text": "An HTTP request accepted before the drain. Its second sentence is still to come.", "format": "pcm",
        **greedy(max_new_tokens=50, sample_rate=8000)}


def wait_for(what: str, check: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def health(url: str, query: str = "") -> tuple[int, dict[str, Any]]:
    r = httpx.get(url + "/v1/health" + query, timeout=10)
    return r.status_code, r.json()


def same_pcm(got: bytes, ref: bytes) -> None:
    """Greedy audio is reproducible (±1 LSB): the whole of it arrived."""
    assert len(got) == len(ref) and ref, (len(got), len(ref))
    assert np.abs(s16(got).astype(np.int32) - s16(ref).astype(np.int32)).max() <= 1


def speech(pcm: bytes) -> np.ndarray:
    """A turn's samples without the silence that may end it: how a turn's audio is cut into messages depends on
    timing, and a short last message gets a pad of silence (Pipecat's floor)."""
    x = s16(pcm).astype(np.int32)
    loud = np.flatnonzero(np.abs(x) > 1)
    return x[: loud[-1] + 1] if loud.size else x[:0]


def same_turns(got: list[dict[str, Any]], ref: list[dict[str, Any]]) -> None:
    """The same greedy speech, turn by turn (±1 LSB): every turn's audio arrived whole."""
    def turns(events: list[dict[str, Any]]) -> list[np.ndarray]:
        by_turn: dict[int, bytes] = {}
        for e in events:
            by_turn[e["chunk_seq"]] = by_turn.get(e["chunk_seq"], b"") + e["audio"]
        assert sorted(by_turn) == list(range(len(TURNS))), sorted(by_turn)
        return [speech(by_turn[i]) for i in range(len(TURNS))]

    for a, b in zip(turns(got), turns(ref)):
        assert b.size and abs(a.size - b.size) <= 2, (a.size, b.size)
        n = min(a.size, b.size)
        assert np.abs(a[:n] - b[:n]).max() <= 1


def live_reference(url: str) -> list[dict[str, Any]]:
    """The audio events of the test's two-turn session, undisturbed."""
    with connect(url + "/v1/tts/live", max_size=None, open_timeout=10, proxy=None) as ws:
        ws.send(start_msg(**LIVE))
        for t in TURNS:
            ws.send(text_msg(t))
            ws.send(FLUSH)
        ws.send(STOP)
        events, fin = until_finish(ws)
    assert fin == {"event": "finish", "reason": "stop"}
    return events


def first_turn(ws: ClientConnection) -> dict[str, Any]:
    """Start the session and speak its first turn; -> its first audio event (the session is open: it waits for
    more)."""
    ws.send(start_msg(**LIVE))
    ws.send(text_msg(TURNS[0]))
    ws.send(FLUSH)
    ev = recv_event(ws)
    assert ev["event"] == "audio", ev
    return ev


def finish_session(ws: ClientConnection, first: dict[str, Any], pipelined_start: bool = False
                   ) -> list[dict[str, Any]]:
    """The second turn and stop (then, optionally, a pipelined start); -> the session's audio events, its finish
    checked."""
    ws.send(text_msg(TURNS[1]))
    ws.send(FLUSH)
    ws.send(STOP)
    if pipelined_start:
        ws.send(start_msg(**LIVE))
    events, fin = until_finish(ws)
    assert fin == {"event": "finish", "reason": "stop"}, fin
    return [first, *events]


def expect_close(ws: ClientConnection, code: int = 1001) -> None:
    with pytest.raises(websockets.exceptions.ConnectionClosed) as closed:
        while True:
            recv_event(ws)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == code, closed.value


class HttpReader(threading.Thread):
    """POST /v1/tts, streamed: `started` once the status and first audio are in, then the rest of the body."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.started = threading.Event()
        self.body = b""
        self.status = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/tts", json=HTTP, timeout=60) as r:
                self.status = r.status_code
                for chunk in r.iter_raw():
                    self.body += chunk
                    self.started.set()
        except BaseException as e:
            self.error = e
        finally:
            self.started.set()

    def result(self) -> bytes:
        self.join(60)
        assert not self.is_alive() and self.error is None, self.error
        assert self.status == 200
        return self.body


def test_a_drain_finishes_every_accepted_session_and_refuses_new_ones(golden: Path, tmp_path: Path) -> None:
    s = LiveServer(tiny_config(golden, tmp_path, drain_grace=120.0))
    try:
        ref_live = live_reference(s.ws)
        ref_http = httpx.post(s.http + "/v1/tts", json=HTTP, timeout=60).content
        s.wait_idle()
        assert metric(s, "rtts_draining") == 0
        with s.connect() as ws, s.connect() as idle:
            first = first_turn(ws)
            reader = HttpReader(s.http)
            reader.start()
            assert reader.started.wait(60) and reader.body, reader.error
            s.server.request_drain()
            wait_for("health to say draining", lambda: health(s.http)[0] == 503)
            assert health(s.http) == (503, {"status": "draining"})
            assert s.rt.http_requests == 1, "the HTTP request ended before the drain began: nothing tested"
            # Liveness stays up: a probe must not kill a worker finishing its sessions.
            assert health(s.http, "?live=1") == (200, {"status": "draining"})
            assert metric(s, "rtts_draining") == 1

            # New sessions are refused with a reason: a socket before its upgrade, an HTTP request with 503.
            with pytest.raises(websockets.exceptions.InvalidStatus) as denied:
                s.connect()
            assert denied.value.response.status_code == 503
            assert "draining" in json.loads(denied.value.response.body or b"{}")["message"]
            r = httpx.post(s.http + "/v1/tts", json=HTTP, timeout=30)
            assert r.status_code == 503 and "draining" in r.json()["message"]
            # A socket without a session is closed: the client's next session goes to another worker.
            expect_close(idle)

            # The open session goes on (new text included) and gets all its audio; a start pipelined after its
            # stop is refused with finish/error, then the socket closes.
            same_turns(finish_session(ws, first, pipelined_start=True), ref_live)
            _, refused = until_finish(ws)
            assert refused["reason"] == "error" and "draining" in refused["message"], refused
            expect_close(ws)
            same_pcm(reader.result(), ref_http)
        # Nothing is left: the server stops by itself, long before the grace ends.
        s.thread.join(30)
        assert not s.thread.is_alive(), "the drained server did not stop"
        refused_n = s.rt.metrics.registry.get_sample_value("rtts_refused_sessions_total", {"reason": "draining"})
        assert refused_n == 3  # the socket, the HTTP request, the pipelined start
    finally:
        s.stop()


def test_what_is_left_after_the_grace_gets_finish_error(golden: Path, tmp_path: Path) -> None:
    """A session still open when the grace ends (its client never stops) is told, then its socket closes."""
    s = LiveServer(tiny_config(golden, tmp_path, drain_grace=1.0))
    try:
        with s.connect() as ws:
            first_turn(ws)
            s.server.request_drain()
            _, fin = until_finish(ws)
            assert fin["reason"] == "error" and "shutting down" in fin["message"], fin
            expect_close(ws)
        s.thread.join(30)
        assert not s.thread.is_alive(), "the server did not stop after its grace"
    finally:
        s.stop()


def test_rtts_serve_drains_on_sigterm_and_exits_0(golden: Path, tmp_path: Path) -> None:
    """The real command: SIGTERM mid-session, the session completes with all its audio; a second SIGTERM ends the
    drain at once (the session still open gets finish/error); the process exits 0."""
    port = free_port()
    url, ws_url = f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "rtts", "serve", "--checkpoint", str(golden / "tiny-s2"), "--port", str(port),
           "--max-running", "2", "--max-ctx", "2048", "--drain-grace", "120", "--voices-dir", str(tmp_path / "v")]
    with log.open("wb") as out:
        env = {**os.environ, "RTTS_HOME": str(tmp_path)}
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        def up() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return health(url)[0] == 200
            except httpx.TransportError:
                return False

        wait_for("rtts serve to start", up, timeout=180)
        ref = live_reference(ws_url)
        with connect(ws_url + "/v1/tts/live", max_size=None, open_timeout=10, proxy=None) as ws, \
                connect(ws_url + "/v1/tts/live", max_size=None, open_timeout=10, proxy=None) as lingering:
            first, _ = first_turn(ws), first_turn(lingering)
            proc.send_signal(signal.SIGTERM)
            wait_for("health to say draining", lambda: health(url)[0] == 503)
            same_turns(finish_session(ws, first), ref)
            expect_close(ws)
            assert proc.poll() is None  # the drain waits for the session still open
            proc.send_signal(signal.SIGTERM)
            _, fin = until_finish(lingering)
            assert fin["reason"] == "error" and "shutting down" in fin["message"], fin
            expect_close(lingering)
        assert proc.wait(timeout=60) == 0, log.read_text()
        assert "drain ended with 1 session(s) still open" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_drain_grace_flag(golden: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import rtts.ws.server

    seen: list[ServerConfig] = []
    monkeypatch.setattr(rtts.ws.server, "serve", lambda config, rt=None: seen.append(config))
    base = ["serve", "--checkpoint", str(golden / "tiny-s2"), "--port", "0"]
    rtts_main(base)
    rtts_main([*base, "--drain-grace", "300"])
    assert [c.drain_grace for c in seen] == [30.0, 300.0]
    for bad in ("-1", "nan"):
        with pytest.raises(SystemExit) as e:
            rtts_main([*base, "--drain-grace", bad])
        assert e.value.code == 2
    assert len(seen) == 2
