"""Bad inputs and capacity on `/v1/tts/live` (real server, tiny golden checkpoint, CPU): every kind of bad input
finishes with an error naming it while the socket stays usable and other sessions keep streaming, sessions that fail
by themselves (a context too small), the concurrency limit and slots given back. PROTOCOL.md §2, §10.
"""

from __future__ import annotations

import contextlib
import random
import string
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from conftest import (
    LONG_TEXT,
    MAX_MESSAGE,
    MAX_REF_SECONDS,
    MAX_SESSION_TEXT,
    MAX_TEXT,
    REF_TEXT,
    greedy,
    metric,
    tiny_config,
)
from liveserver import (
    FLUSH,
    STOP,
    LiveServer,
    Streamer,
    assert_usable,
    expect_error,
    pack,
    recv_event,
    reference_wav,
    session,
    start_msg,
    text_msg,
    until_finish,
)
from websockets.sync.client import ClientConnection

# --------------------------------------------------------------------------------------------------------- bad inputs


def _over_long_reference(golden: Path) -> bytes:
    return reference_wav(golden, seconds=MAX_REF_SECONDS + 1)


def _bad_cases(golden: Path) -> list[tuple[str, Callable[[ClientConnection], None], tuple[str, ...]]]:
    """(name, what the client sends, words the finish/error message must contain)."""

    def send(*msgs: bytes | str) -> Callable[[ClientConnection], None]:
        def go(ws: ClientConnection) -> None:
            for m in msgs:
                ws.send(m)
        return go

    def start_with(**req: Any) -> Callable[[ClientConnection], None]:
        return send(start_msg(**req))

    long_ref = _over_long_reference(golden)
    return [
        ("malformed msgpack", send(b"\xc1\x00\xff\x12"), ("MessagePack",)),
        ("JSON in a binary frame", send(b'{"event": "start", "request": {}}'), ("JSON",)),
        ("JSON text frame", send('{"event": "start", "request": {}}'), ("text frame",)),
        ("not a map", send(pack([1, 2, 3])), ("map",)),
        ("no event key", send(pack({"text": "hi"})), ("event",)),
        ("event not a string", send(pack({"event": 7})), ("event", "string")),
        ("text before start", send(text_msg("Hello.")), ("text", "before", "start")),
        ("flush before start", send(FLUSH), ("flush", "before", "start")),
        ("stop before start", send(STOP), ("stop", "before", "start")),
        ("start during a session", send(start_msg(), text_msg("Hi there"), start_msg()), ("start", "active")),
        ("unknown format", start_with(format="flac"), ("format", "flac")),
        ("pcm at 22050 Hz", start_with(format="pcm", sample_rate=22050), ("sample_rate", "22050", "pcm")),
        ("opus at 44100 Hz", start_with(format="opus", sample_rate=44100), ("sample_rate", "44100", "opus")),
        ("mp3 bitrate", start_with(format="mp3", mp3_bitrate=100), ("mp3_bitrate",)),
        ("wrong type", start_with(temperature="hot"), ("temperature",)),
        ("request not a map", send(pack({"event": "start", "request": [1]})), ("start.request", "map")),
        ("start text over the limit", start_with(text="a" * (MAX_TEXT + 1)), ("start.request.text", "limit")),
        ("text event over the limit", send(start_msg(), text_msg("b" * (MAX_TEXT + 1))), ("text", "limit")),
        ("unspoken text over the limit",
         send(start_msg(), *[text_msg("word " * (MAX_TEXT // 5)) for _ in range(MAX_SESSION_TEXT // MAX_TEXT + 1)]),
         ("unspoken text", "limit")),
        ("undecodable reference audio", start_with(references=[{"audio": b"this is not audio" * 8, "text": "x"}]),
         ("reference audio", "decode")),
        ("empty reference audio", start_with(references=[{"audio": b"", "text": "x"}]), ("audio", "empty")),
        ("over-long reference audio", start_with(references=[{"audio": long_ref, "text": REF_TEXT}]),
         ("reference audio", f"{MAX_REF_SECONDS + 1:.1f} s", "limit")),
        ("unknown reference_id", start_with(reference_id="no-such-voice"), ("unknown reference_id", "no-such-voice")),
        ("deeply nested msgpack", send(b"\x91" * 100_000 + b"\xc0"), ("nests", "deeply")),
        ("oversize message", send(text_msg("c" * (MAX_MESSAGE + 100))), ("bytes", "limit")),
    ]


def test_a_refused_start_is_its_sessions_only_finish(srv: LiveServer) -> None:
    """A refused `start` (unknown voice, unsupported rate or format) gets one finish/error: the text, flush and stop
    the client still sends for that session get none of their own (retrying the same request cannot succeed), so
    the next session on the socket reads only its own events."""
    refusals = [({"reference_id": "no-such-voice"}, "unknown reference_id"), ({"sample_rate": 22050}, "sample_rate"),
                ({"format": "flac"}, "format")]  # the last refused while decoding the start, the others after
    with srv.connect() as ws:
        for request, words in refusals:
            ws.send(start_msg(**request))
            ws.send(text_msg("Pipecat keeps talking."))
            ws.send(b"\xc1 not msgpack")  # a bad message for the refused session: dropped with it
            ws.send(FLUSH)
            ws.send(STOP)
            expect_error(ws, words)
            audio, fin = session(ws, ["A good one."], **greedy(max_new_tokens=4))
            assert fin == {"event": "finish", "reason": "stop"} and audio, request
    srv.wait_idle()


def test_a_session_ended_by_a_bad_message_resumes_at_the_next_flush(srv: LiveServer) -> None:
    """A bad message mid-session ends it with finish/error; what the client sends for it afterwards gets no finish
    of its own: its text and flush resume the session with the same start (a Pipecat call goes on), and a stop ends
    it quietly."""
    with srv.connect() as ws:
        ws.send(start_msg(**greedy(max_new_tokens=4)))
        ws.send(b"\xc1 not msgpack")
        expect_error(ws, "MessagePack")
        ws.send(text_msg("Pipecat keeps talking."))
        ws.send(FLUSH)
        ws.send(STOP)
        events, fin = until_finish(ws)
        assert fin == {"event": "finish", "reason": "stop"} and events
        ws.send(start_msg(**greedy(max_new_tokens=4)))
        ws.send(b"\xc1 not msgpack")
        expect_error(ws, "MessagePack")
        ws.send(STOP)  # the SDK's way after an error: nothing more comes
        assert_usable(ws)
    srv.wait_idle()


def test_bad_inputs_finish_with_error(srv: LiveServer, golden: Path) -> None:
    """Each bad input: finish/error with a message naming the problem, the same socket then runs a good session,
    and a good session on another socket keeps streaming throughout."""
    neighbour = Streamer(srv)
    neighbour.start()
    assert neighbour.first_audio.wait(30), "the neighbour session never streamed"
    t0 = time.monotonic()
    errors_before = metric(srv, "rtts_session_errors_total")
    cases = _bad_cases(golden)
    with srv.connect() as ws:
        for name, bad, words in cases:
            bad(ws)
            try:
                expect_error(ws, *words)
                assert_usable(ws)
            except AssertionError as e:
                raise AssertionError(f"{name}: {e}") from e
    t1 = time.monotonic()
    fin = neighbour.halt()
    assert fin == {"event": "finish", "reason": "stop"}, fin
    during = neighbour.audio_between(t0, t1)
    assert len(during) >= 3, f"the neighbour got {len(during)} audio events in {t1 - t0:.1f} s"
    gaps = np.diff([t0, *during, t1])
    assert gaps.max() < 5.0, f"the neighbour stalled for {gaps.max():.1f} s"
    assert metric(srv, "rtts_session_errors_total") - errors_before >= len(cases)
    # Nothing leaked: no session counted as active, no connection open, every slot free.
    deadline = time.monotonic() + 10
    while metric(srv, "rtts_active_sessions") or metric(srv, "rtts_open_connections"):
        assert time.monotonic() < deadline, httpx.get(srv.http + "/metrics").text
        time.sleep(0.05)
    srv.wait_idle()


# ----------------------------------------------------------------------------------- sessions that fail by themselves


# One 290-letter word: a segment of its own that no context of 96 positions holds (the tiny tokenizer spells it).
UNSPLITTABLE = "".join(random.Random(0).choice(string.ascii_lowercase) for _ in range(290))


@pytest.fixture(scope="module")
def small_ctx_srv(golden: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A context of 96 positions: a few turns fill it (the error a session can hit by itself)."""
    s = LiveServer(tiny_config(golden, tmp_path_factory.mktemp("voices"), max_running=2, max_ctx=96))
    yield s
    s.stop()


def test_a_session_that_failed_by_itself_frees_the_socket(small_ctx_srv: LiveServer) -> None:
    """A session ended by finish/error from synthesis (here: a segment longer than the whole context) before the
    client sent `stop`: the socket takes a new start right away, as after any finish."""
    with small_ctx_srv.connect() as ws:
        ws.send(start_msg(chunk_length=300, **greedy(max_new_tokens=30)))
        ws.send(text_msg(UNSPLITTABLE))
        ws.send(FLUSH)
        _, fin = until_finish(ws, timeout=60)
        assert fin["reason"] == "error" and "context" in fin["message"], fin
        assert metric(small_ctx_srv, "rtts_active_sessions") == 0  # ended at its finish, not at the next message
        audio, fin = session(ws, ["Hello."], **greedy(max_new_tokens=4))
        assert fin == {"event": "finish", "reason": "stop"} and audio
    with small_ctx_srv.connect() as ws:  # Pipecat: start once, then text + flush for the whole call, never a start
        ws.send(start_msg(chunk_length=300, **greedy(max_new_tokens=4)))
        ws.send(text_msg(UNSPLITTABLE))
        ws.send(FLUSH)
        assert until_finish(ws, timeout=60)[1]["reason"] == "error"
        ws.send(text_msg("Still there?"))  # resumes a session with the same start request
        ws.send(FLUSH)
        assert recv_event(ws)["event"] == "audio"
        ws.send(STOP)
        assert until_finish(ws)[1] == {"event": "finish", "reason": "stop"}
    small_ctx_srv.wait_idle()


def test_a_long_conversation_outlives_its_context(small_ctx_srv: LiveServer) -> None:
    """Pipecat keeps one session for a whole call: when the conversation leaves no room for the next turn and its
    audio, the turn starts again from the voice prompt instead of failing (96 positions hold about one turn here)."""
    with small_ctx_srv.connect() as ws:
        ws.send(start_msg(**greedy(max_new_tokens=30)))
        for i in range(8):
            ws.send(text_msg(f"Sentence number {i} is here."))
            ws.send(FLUSH)
        ws.send(STOP)
        events, fin = until_finish(ws, timeout=60)
        assert fin == {"event": "finish", "reason": "stop"}, fin
        assert len(events) >= 8
    small_ctx_srv.wait_idle()


def test_after_a_failed_session_the_client_decides(small_ctx_srv: LiveServer) -> None:
    """After the server ended a session with finish/error: the SDK's stop gets no second finish (the client would
    take it for its next session's); a start the client gets wrong replaces the failed session (its text and flush
    then belong to that refused start and get nothing: never a session resumed with the old request); a bad
    pipelined start does not cut the session still draining, which finishes first."""
    def fail(ws: ClientConnection) -> None:
        ws.send(start_msg(chunk_length=300, **greedy(max_new_tokens=4)))
        ws.send(text_msg(UNSPLITTABLE))
        ws.send(FLUSH)
        assert until_finish(ws, timeout=60)[1]["reason"] == "error"

    with small_ctx_srv.connect() as ws:
        fail(ws)
        ws.send(STOP)
        audio, fin = session(ws, ["Next."], **greedy(max_new_tokens=4))
        assert fin == {"event": "finish", "reason": "stop"} and audio  # the first finish after the stop is this one
        fail(ws)
        ws.send(start_msg(reference_id="no-such-voice"))
        expect_error(ws, "no-such-voice")
        ws.send(text_msg("Is anyone there?"))  # for the refused session: no finish of its own
        ws.send(FLUSH)
        ws.send(start_msg(**greedy(max_new_tokens=6)))
        ws.send(text_msg("Drain this."))
        ws.send(STOP)
        ws.send(start_msg(format="bogus"))
        events, fin = until_finish(ws)
        assert fin == {"event": "finish", "reason": "stop"} and events
        expect_error(ws, "format")
        assert_usable(ws)
    small_ctx_srv.wait_idle()


def test_http_synthesis_failures_are_not_200s_that_look_complete(small_ctx_srv: LiveServer) -> None:
    """POST /v1/tts failing before any audio answers a JSON error; failing mid-body breaks the chunked transfer
    (an incomplete read for the client) instead of ending it cleanly with truncated audio."""
    r = httpx.post(small_ctx_srv.http + "/v1/tts", json={"text": UNSPLITTABLE, "chunk_length": 300, "format": "pcm"},
                   timeout=60)
    assert r.status_code == 500 and "context" in r.json()["message"], r.text
    body = {"text": "Hello there. " + UNSPLITTABLE, "chunk_length": 300, "format": "pcm", **greedy(max_new_tokens=30)}
    with pytest.raises(httpx.RemoteProtocolError), \
            httpx.stream("POST", small_ctx_srv.http + "/v1/tts", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        for _ in resp.iter_bytes():
            pass
    small_ctx_srv.wait_idle()


# ----------------------------------------------------------------------------------------------------------- capacity


def test_too_many_sessions(srv: LiveServer) -> None:
    """max_running + 1 sessions at once: the extra one gets finish/error; the others stream; a freed slot is usable."""
    srv.wait_idle()
    with contextlib.ExitStack() as stack:  # every socket closed however the test ends
        conns = [stack.enter_context(srv.connect()) for _ in range(5)]
        for c in conns[:4]:
            c.send(start_msg(**greedy(max_new_tokens=8)))
        deadline = time.monotonic() + 10
        while srv.rt.scheduler.slots.free > 0:  # every session holds its slot before the extra one asks
            assert time.monotonic() < deadline, "the sessions did not take their slots"
            time.sleep(0.01)
        for c in conns[:4]:
            c.send(text_msg("Holding a slot."))
            c.send(FLUSH)
        conns[4].send(start_msg())
        expect_error(conns[4], "too many concurrent sessions")
        conns[4].send(text_msg("no session"))  # kept for a resumed session (at a flush; see test_pipecat_*)
        conns[4].send(STOP)  # the client gives up: it has its finish already, and gets nothing more
        conns[0].send(STOP)
        events, fin = until_finish(conns[0])
        assert fin["reason"] == "stop"
        conns[0].close()
        deadline = time.monotonic() + 10
        while srv.rt.scheduler.slots.free < 1:
            assert time.monotonic() < deadline, "closing a socket did not free its slot"
            time.sleep(0.02)
        audio, fin = session(conns[4], ["Now there is room."], **greedy(max_new_tokens=8))
        assert fin["reason"] == "stop" and audio
        for c in conns[1:4]:
            c.send(STOP)
            assert until_finish(c)[1]["reason"] == "stop"
    srv.wait_idle()


def test_idle_sockets_do_not_hold_capacity(srv: LiveServer) -> None:
    """Sockets that finished their sessions keep their streams (a pooled LiveKit socket reuses the voice) but not
    the capacity: with every slot held by idle sockets a new socket's session still starts, and an idle socket
    whose stream was taken back starts its next session too."""
    srv.wait_idle()
    slots = srv.rt.config.max_running
    with contextlib.ExitStack() as stack:  # every socket closed however the test ends
        conns = [stack.enter_context(srv.connect()) for _ in range(slots + 1)]
        for c in conns[:slots]:
            audio, fin = session(c, ["Then idle."], **greedy(max_new_tokens=4))
            assert fin["reason"] == "stop" and audio
        assert srv.rt.scheduler.slots.free == 0  # every idle socket kept its stream
        for c in (conns[slots], conns[0]):
            audio, fin = session(c, ["Room for me."], **greedy(max_new_tokens=4))
            assert fin["reason"] == "stop" and audio
    srv.wait_idle()


def test_voice_change_and_reconnect_at_capacity(golden: Path, tmp_path: Path, ref_wav: bytes) -> None:
    """One slot: a session with another voice on the socket, or a new socket right after a barge-in closed the old
    one, gets the slot just given back (freed asynchronously by the decode thread): never refused as busy. The
    release is slowed down here so the race is lost every time instead of now and then."""
    s = LiveServer(tiny_config(golden, tmp_path, max_running=1))
    slots = s.rt.scheduler.slots
    release = slots.release

    def slow_release(*args: Any) -> None:
        time.sleep(0.05)
        release(*args)

    slots.release = slow_release  # type: ignore[method-assign]
    try:
        for v in ("voice-1", "voice-2"):
            r = httpx.post(s.http + "/v1/references/add", data={"id": v, "text": REF_TEXT},
                           files={"audio": ("a.wav", ref_wav)}, timeout=60)
            assert r.status_code == 200, r.text
        with s.connect() as ws:
            for i in range(12):
                _, fin = session(ws, ["Okay."], reference_id=f"voice-{i % 2 + 1}", **greedy(max_new_tokens=2))
                assert fin == {"event": "finish", "reason": "stop"}, (i, fin)
        with s.connect() as holder, s.connect() as ws:  # no slot for a start: its later text resumes it
            holder.send(start_msg(**greedy(max_new_tokens=2)))
            ws.send(start_msg(**greedy(max_new_tokens=2)))
            expect_error(ws, "too many concurrent sessions")
            holder.send(STOP)
            assert until_finish(holder)[1]["reason"] == "stop"
            holder.close()
            ws.send(text_msg("Now there is room."))
            ws.send(FLUSH)
            assert recv_event(ws)["event"] == "audio"
            ws.send(STOP)
            assert until_finish(ws)[1] == {"event": "finish", "reason": "stop"}
        for _ in range(3):  # barge-in (Pipecat): stop and close mid-generation, reconnect, start at once
            with s.connect() as ws:
                ws.send(start_msg(**greedy(max_new_tokens=200)))
                ws.send(text_msg(LONG_TEXT))
                ws.send(FLUSH)
                assert recv_event(ws)["event"] == "audio"
                ws.send(STOP)
            with s.connect() as ws:
                _, fin = session(ws, ["Okay."], **greedy(max_new_tokens=2))
                assert fin == {"event": "finish", "reason": "stop"}, fin
    finally:
        s.stop()
