"""Edge cases of `/v1/tts/live`: a client leaving while its session still streams (on a real server with the tiny
golden checkpoint on CPU, and a Session over a stand-in stream), a message that cannot be decoded at all arriving
out of a session, and a bad start or message after a session the server ended."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import ormsgpack
import pytest
from conftest import LONG_TEXT, MAX_MESSAGE, metric
from liveserver import (
    FLUSH,
    STOP,
    LiveServer,
    expect_error,
    recv_event,
    session,
    start_msg,
    text_msg,
    until_finish,
)
from websockets.sync.client import ClientConnection

from rtts.pingpong.outbox import AudioChunk, TurnEnd
from rtts.session import ClientGone, Session
from rtts.types import FinishReason
from rtts.ws.parse import parse_request


def _wait_released(srv: LiveServer, timeout: float = 10.0) -> None:
    """Until no connection, session or stream is left and every slot is free (closing is asynchronous)."""
    deadline = time.monotonic() + timeout
    names = ("rtts_open_connections", "rtts_active_sessions", "rtts_open_streams", "rtts_running_streams")
    while any(metric(srv, name) for name in names):
        assert time.monotonic() < deadline, {name: metric(srv, name) for name in names}
        time.sleep(0.02)
    srv.wait_idle(timeout)


# ------------------------------------------------------------------------------------ a client leaving mid-stream


@pytest.mark.parametrize("pipelined", [False, True], ids=["plain", "pipelined-start"])
def test_a_client_leaving_mid_stream_ends_its_session_quietly(srv: LiveServer, caplog: pytest.LogCaptureFixture,
                                                                pipelined: bool) -> None:
    """Closing the socket is how clients interrupt: no "session failed" traceback, no error counted, and the slot,
    stream and gauges are released as after a normal end. Pipelined (LiveKit: the next utterance's start before the
    last one's finish), the socket's reader waits for the session to drain, so its sender, not the reader, is the
    one that finds the socket closed: its send raises there."""
    caplog.set_level(logging.INFO)
    _wait_released(srv)
    errors_before = metric(srv, "rtts_session_errors_total")
    for _ in range(3):
        with srv.connect() as ws:
            ws.send(start_msg(sample_rate=8000, max_new_tokens=200))
            ws.send(text_msg(LONG_TEXT))
            ws.send(FLUSH)
            if pipelined:
                ws.send(STOP)
                ws.send(start_msg(sample_rate=8000, max_new_tokens=4))
            assert recv_event(ws)["event"] == "audio"
        _wait_released(srv)
    failed = [r for r in caplog.records if r.getMessage() == "session failed" or r.exc_info]
    assert not failed, [(r.name, r.getMessage(), r.exc_info) for r in failed]
    assert metric(srv, "rtts_session_errors_total") == errors_before


class ToneStream:
    """speak() -> an outbox of a 0.1 s tone, then the turn's end."""

    def __init__(self) -> None:
        self.cancelled = False

    def speak(self, text: str, params: Any, **kw: Any) -> AsyncIterator[object]:
        async def outbox() -> AsyncIterator[object]:
            pcm = (0.3 * np.sin(2 * np.pi * 440 * np.arange(4410) / 44100)).astype(np.float32)
            yield AudioChunk(pcm, 44100, frames=1, first_frame=0, t_submit=time.perf_counter())
            yield TurnEnd(FinishReason.STOP, frames=1)

        return outbox()

    def cancel(self) -> None:
        self.cancelled = True


@pytest.mark.parametrize(
    ("raised", "finish", "logged"),
    [
        (ClientGone("connection closed"), ("error", "connection closed"), False),
        (RuntimeError("a bug"), ("error", "internal error: a bug"), True),
    ],
    ids=["client-gone", "bug"],
)
def test_only_a_bug_fails_a_session_loudly(caplog: pytest.LogCaptureFixture, raised: Exception,
                                           finish: tuple[str, str], logged: bool) -> None:
    """The transport's ClientGone ends the session quietly (its turns cancelled, its finish for the bookkeeping);
    any other exception from sending is a bug: "session failed" with its traceback."""
    finishes: list[tuple[str, str | None]] = []

    async def on_audio(audio: bytes, extra: dict[str, object]) -> None:
        raise raised

    async def on_finish(reason: str, message: str | None) -> None:
        finishes.append((reason, message))

    async def main() -> ToneStream:
        stream = ToneStream()
        req = parse_request({"format": "pcm", "prosody": {"normalize_loudness": False}})
        session = Session(req, stream, on_audio, on_finish, "s2", 44100)  # type: ignore[arg-type]
        session.start()
        session.text("Hello.")
        await asyncio.wait_for(session.stop(), 10)
        return stream

    caplog.set_level(logging.INFO)
    stream = asyncio.run(main())
    assert finishes == [finish]
    assert stream.cancelled  # its turns are not generated for nobody, nor past a bug
    failed = [r for r in caplog.records if r.getMessage() == "session failed"]
    assert len(failed) == logged and all(r.exc_info for r in failed)


# ------------------------------------------------------------------------- an undecodable message out of a session


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        (b"\xc1 not msgpack", ("MessagePack",)),
        # a start whose inline reference makes it too large: the size is checked before anything is decoded
        (start_msg(references=[{"audio": b"\0" * MAX_MESSAGE, "text": "x"}]), ("bytes", "limit")),
        ('{"event": "start", "request": {}}', ("text frame",)),  # a WebSocket text frame
    ],
    ids=["not-msgpack", "oversized", "text-frame"],
)
def test_an_undecodable_message_out_of_a_session_is_a_refused_start(srv: LiveServer, bad: bytes | str,
                                                                     words: tuple[str, ...]) -> None:
    """Out of a session the only valid message is a start: one that cannot be decoded at all is refused like a bad
    start. Its error is the one finish for it and the text, flush and stop the client sends next; the next start on
    the socket reads only its own events."""
    assert isinstance(bad, str) or len(bad) > MAX_MESSAGE or bad.startswith(b"\xc1")
    with srv.connect() as ws:
        ws.send(bad)
        ws.send(text_msg("Pipecat keeps talking."))
        ws.send(FLUSH)
        ws.send(STOP)
        expect_error(ws, *words)
        with pytest.raises(TimeoutError):  # nothing more for any of that
            ws.recv(timeout=1.0)
        audio, fin = session(ws, ["A good one."], sample_rate=8000, max_new_tokens=4)
        assert fin == {"event": "finish", "reason": "stop"} and audio
    _wait_released(srv)


def test_a_bad_text_out_of_a_session_is_not_a_refused_start(srv: LiveServer) -> None:
    """A text event with a bad field is known to be text, not a start: out of a session it gets its error and the
    flush after it gets its own (as a good text out of a session would), not the refused-start silence."""
    with srv.connect() as ws:
        ws.send(ormsgpack.packb({"event": "text", "text": 5}))
        expect_error(ws, "text")
        ws.send(FLUSH)
        expect_error(ws)
        audio, fin = session(ws, ["A good one."], sample_rate=8000, max_new_tokens=4)
        assert fin == {"event": "finish", "reason": "stop"} and audio
    _wait_released(srv)



# -------------------------------------------------------------------- refused starts after a session the server ended


def _nothing_more(ws: ClientConnection) -> None:
    with pytest.raises(TimeoutError):
        ws.recv(timeout=1.0)


def test_a_bad_start_mid_session_ends_it_and_its_stop_returns_to_it(srv: LiveServer) -> None:
    """A bad start while a session is active ends that session with the start's error (the one finish for both);
    the text and flush sent for the refused start get nothing. Once the client stops the refused start, the session
    it ended is one the server ended: a flush resumes it with its own start request."""
    with srv.connect() as ws:
        ws.send(start_msg(sample_rate=8000, max_new_tokens=4))
        ws.send(start_msg(format="flac"))
        expect_error(ws, "format")
        ws.send(text_msg("For the refused start."))
        ws.send(FLUSH)
        ws.send(STOP)
        _nothing_more(ws)
        ws.send(text_msg("The first session goes on."))
        ws.send(FLUSH)
        assert recv_event(ws)["event"] == "audio"
        ws.send(STOP)
        assert until_finish(ws)[1] == {"event": "finish", "reason": "stop"}
    _wait_released(srv)


def test_an_undecodable_message_after_an_ended_session_is_a_refused_start(srv: LiveServer) -> None:
    """After a session the server ended (here by a bad message) the socket is out of a session: a message naming no
    event is the client's start, refused, and what the client sends for it gets nothing until its stop."""
    with srv.connect() as ws:
        ws.send(start_msg(sample_rate=8000, max_new_tokens=4))
        ws.send(b"\xc1 not msgpack")
        expect_error(ws, "MessagePack")
        ws.send(b"\xc1 not msgpack")
        expect_error(ws, "MessagePack")
        ws.send(text_msg("For the refused start."))
        ws.send(FLUSH)
        ws.send(STOP)
        _nothing_more(ws)
        ws.send(FLUSH)  # out of a session now: an error of its own
        expect_error(ws, "flush", "before", "start")
        audio, fin = session(ws, ["A good one."], sample_rate=8000, max_new_tokens=4)
        assert fin == {"event": "finish", "reason": "stop"} and audio
    _wait_released(srv)
