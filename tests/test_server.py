"""The live server end to end: a real uvicorn server on loopback (tiny golden checkpoint, CPU) and raw clients.

Covers the wire protocol (PROTOCOL.md §1-§3, §10): formats and rates, flush, socket reuse, every kind of bad input
(finish/error with a message, the socket stays usable, other sessions keep streaming), the concurrency limit, auth,
the `cancel` extension, the timestamp endpoint, HTTP `/v1/tts`, health and metrics, greedy equality with
`rtts synth`, graceful shutdown and pings during synthesis. The official SDK clients are in test_sdk.py.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import random
import string
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import httpx_ws
import numpy as np
import ormsgpack
import pytest
import soundfile as sf
import websockets
from liveserver import (
    CANCEL,
    FLUSH,
    STOP,
    LiveServer,
    ShortLegacyRequest,
    Streamer,
    assert_usable,
    expect_error,
    free_port,
    pack,
    recv_event,
    reference_wav,
    session,
    short_legacy_websocket,
    start_msg,
    text_msg,
    until_finish,
)
from websockets.sync.client import ClientConnection

from rtts.__main__ import main as rtts_main
from rtts.audio.encode import MIN_LAST_RAW_SAMPLES
from rtts.engine.engine import DEFAULT_PREFILL_ROWS
from rtts.ws.protocol import Limits
from rtts.ws.runtime import ServerConfig

MAX_TEXT = 2000
MAX_SESSION_TEXT = 5000
MAX_MESSAGE = 1 << 20
MAX_REFERENCE = 1 << 20  # bytes of one reference clip (the golden one is far smaller): body limits hit cheaply
MAX_REF_SECONDS = 3.0
REF_TEXT = "The quick brown fox jumps over the lazy dog."
LONG_TEXT = " ".join(f"Sentence number {i} keeps the model busy for a while." for i in range(12))


def tiny_config(golden: Path, tmp: Path, **kw: Any) -> ServerConfig:
    base: dict[str, Any] = dict(checkpoint=str(golden / "tiny-s2"), port=free_port(), max_running=4, max_ctx=2048,
                                voices_dir=str(tmp))
    return ServerConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def srv(golden: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """Open server (no API keys) with lowered limits, so every limit can be hit cheaply."""
    s = LiveServer(tiny_config(
        golden, tmp_path_factory.mktemp("voices"), max_reference_seconds=MAX_REF_SECONDS,
        limits=Limits(max_text_chars=MAX_TEXT, max_session_text_chars=MAX_SESSION_TEXT, max_message_bytes=MAX_MESSAGE,
                      max_reference_bytes=MAX_REFERENCE),
    ))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def auth_srv(golden: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    s = LiveServer(tiny_config(golden, tmp_path_factory.mktemp("voices"), api_keys=("secret",)))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def ref_wav(golden: Path) -> bytes:
    return reference_wav(golden)


@pytest.fixture
def ws(srv: LiveServer) -> Iterator[ClientConnection]:
    with srv.connect() as c:
        yield c
    srv.wait_idle()


def greedy(**kw: Any) -> dict[str, Any]:
    return {"top_k": 1, "temperature": 0.7, "top_p": 0.7, "seed": 0, "max_new_tokens": 40, **kw}


def s16(data: bytes) -> np.ndarray:
    assert len(data) % 2 == 0
    return np.frombuffer(data, dtype="<i2")


# ------------------------------------------------------------------------------------------------ health, metrics


def test_health_and_info(srv: LiveServer) -> None:
    r = httpx.get(srv.http + "/v1/health")
    assert r.status_code == 200
    assert r.json()["status"] == "ok" and r.json()["free_slots"] == 4
    info = httpx.get(srv.http + "/v1/info").json()
    assert info["sample_rate"] == 44100 and info["max_running"] == 4


def test_metrics(srv: LiveServer, ws: ClientConnection) -> None:
    audio, fin = session(ws, ["Metrics please.", FLUSH], **greedy(max_new_tokens=8))
    assert fin["reason"] == "stop" and audio
    text = httpx.get(srv.http + "/metrics").text
    for name in ("rtts_active_sessions", "rtts_open_connections", "rtts_free_slots", "rtts_ttfa_seconds_bucket",
                 "rtts_frames_generated_total", "rtts_session_errors_total"):
        assert name in text, name
    count = next(line for line in text.splitlines() if line.startswith("rtts_ttfa_seconds_count"))
    assert float(count.split()[-1]) >= 1
    frames = next(line for line in text.splitlines() if line.startswith("rtts_frames_generated_total"))
    assert float(frames.split()[-1]) >= 1
    steps = next(line for line in text.splitlines() if line.startswith("rtts_decode_steps_total"))
    assert float(steps.split()[-1]) >= 1 and "# TYPE rtts_decode_steps_total counter" in text
    import gc

    gc.collect()  # a full pass: the server times every collection of its process
    text = httpx.get(srv.http + "/metrics").text
    full = next(line for line in text.splitlines() if line.startswith('rtts_gc_pause_seconds_count{generation="2"}'))
    assert float(full.split()[-1]) >= 1


# ------------------------------------------------------------------------------------------------- formats, rates


def test_pcm_rate_is_honoured_exactly(ws: ClientConnection) -> None:
    """The same greedy audio at several rates: sample counts scale with the requested rate (a resample, not a
    relabel; up to MIN_LAST_RAW_SAMPLES of silence may end the turn, see test_pipecat_never_gets_a_short_message),
    and every audio message stays at or below 64 KiB."""
    lengths = {}
    for rate in (44100, 24000, 16000, 8000):
        ws.send(start_msg(sample_rate=rate, **greedy(max_new_tokens=20)))
        ws.send(text_msg("Rates are honoured."))
        ws.send(STOP)
        events, fin = until_finish(ws)
        assert fin["reason"] == "stop"
        assert all(len(ev["audio"]) <= 64 * 1024 for ev in events)
        lengths[rate] = s16(b"".join(ev["audio"] for ev in events)).size
    assert lengths[44100] > 0
    for rate in (24000, 16000, 8000):
        assert abs(lengths[rate] - lengths[44100] * rate / 44100) <= 2 + MIN_LAST_RAW_SAMPLES, lengths


@pytest.mark.parametrize("rate", [24000, 16000, 8000])
def test_pipecat_never_gets_a_short_message(srv: LiveServer, rate: int) -> None:
    """Pipecat's session (pcm, one start, text + flush per sentence) drops audio events of 1024 bytes or less:
    every message, a turn's last included, is longer; the silence that lifts a short last one is under 513 samples
    and the session's timeline counts it."""
    sentences = [f"Sentence number {i} is spoken now." for i in range(6)]
    with srv.connect() as ws:
        ws.send(start_msg(sample_rate=rate, **greedy(max_new_tokens=12)))
        for text in sentences:
            ws.send(text_msg(text + " "))
            ws.send(FLUSH)
        ws.send(STOP)
        events, fin = until_finish(ws, timeout=120)
    assert fin["reason"] == "stop" and events
    sizes = [len(ev["audio"]) for ev in events]
    assert min(sizes) > 1024, sizes
    srv.wait_idle()


def test_mulaw_raw_client(srv: LiveServer) -> None:
    """mulaw (telephony extension, not in the SDK's types) at 8 kHz: G.711 of the same greedy audio as pcm at 8 kHz."""
    out = {}
    for fmt in ("mulaw", "pcm"):
        with srv.connect() as ws:
            out[fmt], fin = session(ws, ["Telephony audio."], format=fmt, sample_rate=8000,
                                    **greedy(max_new_tokens=20))
            assert fin["reason"] == "stop" and out[fmt]
    # pcm's turn may end with silence over Pipecat's floor (MIN_LAST_RAW_SAMPLES); mulaw's does not
    assert 0 <= len(out["pcm"]) // 2 - len(out["mulaw"]) < MIN_LAST_RAW_SAMPLES
    decoded, rate = sf.read(io.BytesIO(out["mulaw"]), format="RAW", subtype="ULAW", samplerate=8000, channels=1,
                            dtype="int16")
    assert rate == 8000 and decoded.size == len(out["mulaw"])
    # G.711 keeps the sign and each magnitude within its segment's step (at most 1/16 of the magnitude, >= 8).
    ref = s16(out["pcm"])[:decoded.size].astype(np.int32)
    err = np.abs(decoded.astype(np.int32) - ref)
    assert (err <= np.maximum(8, np.abs(ref) // 16)).all(), err.max()
    srv.wait_idle()


# --------------------------------------------------------------------------------------------- flush, socket reuse


def test_flush_mid_stream(ws: ClientConnection) -> None:
    """`flush` makes the buffered text speak before `stop`; later text keeps going in the same session."""
    ws.send(start_msg(**greedy(max_new_tokens=12)))
    ws.send(text_msg("First part without an end"))
    ws.send(FLUSH)
    ev = recv_event(ws)
    assert ev["event"] == "audio" and ev["audio"]  # before any stop was sent
    ws.send(text_msg("Second part."))
    ws.send(FLUSH)
    ws.send(text_msg("Third part."))
    ws.send(STOP)
    events, fin = until_finish(ws)
    assert fin == {"event": "finish", "reason": "stop"}
    assert events


def test_socket_reuse(ws: ClientConnection) -> None:
    """start…stop → finish, then a new start on the same socket works — also immediately, many times in a row."""
    a, fin = session(ws, ["First session."], **greedy(max_new_tokens=8))
    assert fin["reason"] == "stop" and a
    b, fin = session(ws, ["Second session."], format="wav", **greedy(max_new_tokens=8))
    assert fin["reason"] == "stop" and b[:4] == b"RIFF"
    for _ in range(10):  # each start is sent the moment the previous finish arrives
        assert session(ws, [])[1] == {"event": "finish", "reason": "stop"}
    c, fin = session(ws, ["Third session."], **greedy(max_new_tokens=8))
    assert fin["reason"] == "stop" and c


@pytest.mark.parametrize("fmt", ["mp3", "opus"])
def test_flushed_turn_ends_without_waiting_for_more_audio(srv: LiveServer, fmt: str) -> None:
    """MP3 / Opus after a `flush` with nothing following (a voice agent's last sentence before it listens): the
    whole turn arrives without a `stop`, the codec's held end released with a little silence."""
    rate = 44100 if fmt == "mp3" else 48000
    with srv.connect() as ws:
        pcm, _ = session(ws, ["One sentence, then the agent listens.", FLUSH], format="pcm", sample_rate=rate,
                         **greedy(max_new_tokens=20))
        ws.send(start_msg(format=fmt, sample_rate=rate, **greedy(max_new_tokens=20)))
        ws.send(text_msg("One sentence, then the agent listens."))
        ws.send(FLUSH)
        data = b""
        while True:  # everything that comes before the client goes quiet for a second
            try:
                ev = recv_event(ws, timeout=1.0)
            except TimeoutError:
                break
            assert ev["event"] == "audio"
            data += ev["audio"]
        ws.send(STOP)
        rest, fin = until_finish(ws)
        assert fin["reason"] == "stop"
    srv.wait_idle()
    got, r = sf.read(io.BytesIO(data))  # what came before `stop` (MP3 frames and Ogg pages decode as a prefix)
    ref = s16(pcm) / 32768

    def speech_end(y: np.ndarray) -> float:  # the end of the last 10 ms frame with energy (a lossy codec's
        frames = y[: y.size // 480 * 480].reshape(-1, 480)  # samples differ, its frames' energy does not)
        rms = np.sqrt((frames**2).mean(1))
        return float(np.flatnonzero(rms > 0.05 * rms.max())[-1] + 1) * 0.01

    assert r == rate and speech_end(got) >= speech_end(ref) - 0.01, (speech_end(got), speech_end(ref))


def test_reused_socket_session_equals_fresh_socket(srv: LiveServer) -> None:
    """A session's audio does not depend on what the socket said before: the second session on a socket (which
    reuses the stream and its prefilled voice) gives the same greedy PCM as the first."""
    with srv.connect() as ws:
        runs = [session(ws, ["The same sentence."], **greedy(max_new_tokens=20))[0] for _ in range(3)]
    srv.wait_idle()
    first = s16(runs[0]).astype(np.int32)
    assert first.size
    for later in runs[1:]:
        assert s16(later).size == first.size
        assert np.abs(s16(later).astype(np.int32) - first).max() <= 1


def test_empty_session_and_unknown_events_ignored(ws: ClientConnection) -> None:
    ws.send(start_msg())
    ws.send(pack({"event": "log", "message": "from a newer client"}))
    ws.send(STOP)
    assert until_finish(ws) == ([], {"event": "finish", "reason": "stop"})


def test_many_segments_in_one_session(srv: LiveServer) -> None:
    """Text without limit in one session (Pipecat: text + flush per sentence, stop only at disconnect; a long text
    then stop): more segments than a stream queues turns, all spoken, in order, finish/stop; HTTP alike."""
    n = 24  # beyond the scheduler's 16 queued turns per stream
    with srv.connect() as ws:
        ws.send(start_msg(**greedy(max_new_tokens=3)))
        for i in range(n):
            ws.send(text_msg(f"Sentence {i}."))
            ws.send(FLUSH)
        ws.send(STOP)
        events, fin = until_finish(ws, timeout=120)
        assert fin == {"event": "finish", "reason": "stop"}, fin
        assert len(events) >= n  # a flush sends its turn's audio at once: at least one event per sentence
    srv.wait_idle()
    body = {"text": " ".join(f"This is sentence number {i}, long enough to be a segment of its own." for i in range(n)),
            "format": "pcm", "sample_rate": 8000, **greedy(max_new_tokens=3)}
    full = httpx.post(srv.http + "/v1/tts", json=body, timeout=120)
    half = httpx.post(srv.http + "/v1/tts", json={**body, "text": body["text"][: len(body["text"]) // 2]},
                      timeout=120)
    assert full.status_code == half.status_code == 200
    assert len(full.content) > 1.5 * len(half.content)  # every segment spoke: nothing cut at the queue limit


def test_a_session_may_say_more_than_the_text_limit(ws: ClientConnection) -> None:
    """The session text limit bounds text not yet spoken, not a long call's total (Pipecat keeps one session)."""
    ws.send(start_msg(**greedy(max_new_tokens=2)))
    sentence = "A sentence of a long call. "
    said = 0
    while said <= 2 * MAX_SESSION_TEXT:
        text = sentence * (MAX_TEXT // len(sentence))
        ws.send(text_msg(text))
        ws.send(FLUSH)
        said += len(text)
        with contextlib.suppress(TimeoutError):  # until it is spoken: a second without audio
            while True:
                assert recv_event(ws, 1.0)["event"] == "audio"
    ws.send(STOP)
    _, fin = until_finish(ws, timeout=120)
    assert fin == {"event": "finish", "reason": "stop"}, fin


@pytest.mark.parametrize("rate", [8000, 16000, 24000])
def test_flush_delivers_the_whole_turn(srv: LiveServer, rate: int) -> None:
    """After text + flush every sample of the turn arrives without waiting for more text (Pipecat may send none for
    a long while): nothing is left for the stop."""
    with srv.connect() as ws:
        ws.send(start_msg(sample_rate=rate, **greedy(max_new_tokens=6)))
        ws.send(text_msg("One sentence."))
        ws.send(FLUSH)
        got = 0
        with contextlib.suppress(TimeoutError):  # everything that comes before a second of silence
            while True:
                ev = recv_event(ws, 1.0)
                assert ev["event"] == "audio"
                got += len(ev["audio"])
        ws.send(STOP)
        events, fin = until_finish(ws)
        assert fin == {"event": "finish", "reason": "stop"} and got
        assert sum(len(e["audio"]) for e in events) == 0, "audio held back until stop"
    srv.wait_idle()


def test_late_events_and_pipelined_start(ws: ClientConnection) -> None:
    """After `stop` the session finishes what it has: a stray text does not abort it, and a `start` sent before
    the finish (pipelined) begins the next session once the first one's finish is out."""
    ws.send(start_msg(**greedy(max_new_tokens=8)))
    ws.send(text_msg("Before the stop."))
    ws.send(STOP)
    ws.send(text_msg("A stray text after the stop."))
    ws.send(start_msg(**greedy(max_new_tokens=8)))
    ws.send(text_msg("The second session."))
    ws.send(STOP)
    for _ in range(2):
        events, fin = until_finish(ws)
        assert fin == {"event": "finish", "reason": "stop"} and events, fin
    assert_usable(ws)


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
        assert _metric(small_ctx_srv, "rtts_active_sessions") == 0  # ended at its finish, not at the next message
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


def test_a_deleted_voice_is_not_reused_by_an_open_socket(srv: LiveServer, ref_wav: bytes) -> None:
    """A socket keeps its prefilled voice for the next session with the same reference_id, but not once that voice
    was deleted (or overwritten: the stored voice's version is part of the match)."""
    with httpx.Client(base_url=srv.http, timeout=60) as h:
        assert h.post("/v1/references/add", data={"id": "fleeting", "text": REF_TEXT},
                      files={"audio": ("a.wav", ref_wav)}).status_code == 200
        with srv.connect() as ws:
            assert session(ws, ["Hi."], reference_id="fleeting", **greedy(max_new_tokens=2))[1]["reason"] == "stop"
            assert h.request("DELETE", "/v1/references/delete", json={"id": "fleeting"}).status_code == 200
            ws.send(start_msg(reference_id="fleeting"))
            expect_error(ws, "unknown reference_id", "fleeting")
    srv.wait_idle()


def test_a_client_leaving_is_not_a_failed_session(srv: LiveServer) -> None:
    before = _metric(srv, "rtts_session_errors_total")
    for _ in range(3):
        with srv.connect() as ws:
            ws.send(start_msg(**greedy(max_new_tokens=40)))
            ws.send(text_msg(LONG_TEXT))
            ws.send(FLUSH)
            assert recv_event(ws)["event"] == "audio"
    srv.wait_idle()
    assert _metric(srv, "rtts_session_errors_total") == before


@pytest.mark.parametrize("voice", ["933563129e564b19a115bedd57b7406a", "8ef4a238714b45718ce04243307c57a7"])
def test_a_plugins_default_hosted_voice_gets_the_default_voice(ws: ClientConnection, voice: str) -> None:
    """LiveKit's fish plugin (and older releases, Fish's examples) name a hosted voice by default; not stored here,
    it speaks with the default voice rather than failing every session of a default-configured agent."""
    audio, fin = session(ws, ["Hello."], reference_id=voice, **greedy(max_new_tokens=4))
    assert fin == {"event": "finish", "reason": "stop"} and audio


def test_unknown_paths_and_methods_answer_json_errors(srv: LiveServer) -> None:
    """The API's JSON error body ({status, message}) for any path or method it does not serve: the legacy SDK
    parses error bodies as JSON."""
    r = httpx.get(srv.http + "/wallet/self/api-credit")
    assert r.status_code == 404 and r.json()["status"] == 404 and "/wallet/self/api-credit" in r.json()["message"]
    r = httpx.put(srv.http + "/v1/tts")
    assert r.status_code == 405 and r.json()["status"] == 405 and r.headers["allow"] == "POST"
    for path, methods in (("/model", {"GET", "HEAD", "POST"}), ("/model/some-id", {"GET", "HEAD", "PATCH", "DELETE"})):
        r = httpx.put(srv.http + path)  # a path several handlers serve: the Allow header lists them all
        assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == methods, r.headers


def test_reference_id_lists_voice_every_speaker(srv: LiveServer, ref_wav: bytes) -> None:
    """reference_id as a list (multi-speaker): every id is a speaker's voice, so every id must exist."""
    with httpx.Client(base_url=srv.http, timeout=60) as h:
        r = h.post("/v1/references/add", data={"id": "speaker-a", "text": REF_TEXT},
                   files={"audio": ("a.wav", ref_wav)})
        assert r.status_code == 200, r.text
    with srv.connect() as ws:
        ws.send(start_msg(reference_id=["speaker-a", "no-such-voice"]))
        expect_error(ws, "no-such-voice")
        audio, fin = session(ws, ["<|speaker:0|>Hi. <|speaker:1|>Hello."], reference_id=["speaker-a", "speaker-a"],
                             **greedy(max_new_tokens=6))
        assert fin == {"event": "finish", "reason": "stop"} and audio
    srv.wait_idle()


# ---------------------------------------------------------------------------------------------------- bad inputs


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
    errors_before = _metric(srv, "rtts_session_errors_total")
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
    assert _metric(srv, "rtts_session_errors_total") - errors_before >= len(cases)
    # Nothing leaked: no session counted as active, no connection open, every slot free.
    deadline = time.monotonic() + 10
    while _metric(srv, "rtts_active_sessions") or _metric(srv, "rtts_open_connections"):
        assert time.monotonic() < deadline, httpx.get(srv.http + "/metrics").text
        time.sleep(0.05)
    srv.wait_idle()


def _metric(srv: LiveServer, name: str) -> float:
    text = httpx.get(srv.http + "/metrics").text
    return float(next(line for line in text.splitlines() if line.startswith(name + " ")).split()[-1])


def test_too_many_sessions(srv: LiveServer) -> None:
    """max_running + 1 sessions at once: the extra one gets finish/error; the others stream; a freed slot is usable."""
    srv.wait_idle()
    conns = [srv.connect() for _ in range(5)]
    try:
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
    finally:
        for c in conns:
            c.close()
    srv.wait_idle()


def test_idle_sockets_do_not_hold_capacity(srv: LiveServer) -> None:
    """Sockets that finished their sessions keep their streams (a pooled LiveKit socket reuses the voice) but not
    the capacity: with every slot held by idle sockets a new socket's session still starts, and an idle socket
    whose stream was taken back starts its next session too."""
    srv.wait_idle()
    slots = srv.rt.config.max_running
    conns = [srv.connect() for _ in range(slots + 1)]
    try:
        for c in conns[:slots]:
            audio, fin = session(c, ["Then idle."], **greedy(max_new_tokens=4))
            assert fin["reason"] == "stop" and audio
        assert srv.rt.scheduler.slots.free == 0  # every idle socket kept its stream
        for c in (conns[slots], conns[0]):
            audio, fin = session(c, ["Room for me."], **greedy(max_new_tokens=4))
            assert fin["reason"] == "stop" and audio
    finally:
        for c in conns:
            c.close()
    srv.wait_idle()


def test_voice_prompt_prefilled_at_start(srv: LiveServer, ref_wav: bytes) -> None:
    """The voice is prefilled the moment a session starts, before any text: its stream's KV holds the voice prompt
    while the client has sent only `start`."""
    srv.wait_idle()
    with srv.connect() as ws:
        ws.send(start_msg(references=[{"audio": ref_wav, "text": REF_TEXT}], **greedy(max_new_tokens=4)))
        deadline = time.monotonic() + 30
        while not any(st.voice_len > 0 for st in list(srv.rt.scheduler.streams.values())):
            assert time.monotonic() < deadline, "no stream prefilled its voice before any text"
            time.sleep(0.01)
        ws.send(text_msg("Now the text."))
        ws.send(STOP)
        events, fin = until_finish(ws)
        assert fin["reason"] == "stop" and events
    srv.wait_idle()


def test_browser_demo_is_served(srv: LiveServer) -> None:
    """The demo page at `/` and the scripts it loads from /web (not the "not installed" fallback)."""
    page = httpx.get(srv.http + "/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "not installed" not in page.text
    for script in ("app.js", "msgpack.js"):
        assert script in page.text
        r = httpx.get(f"{srv.http}/web/{script}")
        assert r.status_code == 200 and len(r.content) > 100, script


def test_latency_probe_writes_a_report(srv: LiveServer, tmp_path: Path) -> None:
    """clients/probe.py (the TTFA probe behind latency_reports/) against a real server: a JSON report with every
    session's raw chunk times, TTFA as the first chunk's, the audio it played and its real-time factor, and the
    readable table beside it."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, str(repo / "clients" / "probe.py"), "--url", srv.ws, "--concurrency", "1,2", "--rounds", "1",
           "--max-new-tokens", "8", "--settle", "0.1", "--name", "t", "--commit", "test", "--out", str(tmp_path)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    report = json.loads(next(tmp_path.glob("*_test_t.json")).read_text())
    assert set(report["levels"]) == {"1", "2"} and "--concurrency 1,2" in report["command"]
    for c, runs in report["levels"].items():
        assert len(runs) == int(c)
        for r in runs:
            assert r["ok"] and r["finish"] == "stop", r
            times = [t for t, _ in r["chunks"]]
            assert r["ttfa_s"] == times[0] > 0 and times == sorted(times)
            assert r["audio_s"] == pytest.approx(sum(n for _, n in r["chunks"]) / 2 / 44100)
            assert r["rtf"] == pytest.approx((times[-1] - times[0]) / r["audio_s"])
    table = next(tmp_path.glob("*_test_t.md")).read_text()
    assert "| 1 | 1/1 |" in table and "| 2 | 2/2 |" in table
    srv.wait_idle()


# ------------------------------------------------------------------------------------------------ cancel extension


def test_cancel_extension(ws: ClientConnection) -> None:
    """`{"event": "cancel"}` after the first audio: finish/cancelled promptly (PROTOCOL.md's reply for the extension),
    then the socket takes a new start."""
    ws.send(start_msg(sample_rate=16000, max_new_tokens=200))
    ws.send(text_msg(LONG_TEXT))
    ws.send(FLUSH)
    assert recv_event(ws)["event"] == "audio"
    t = time.monotonic()
    ws.send(CANCEL)
    events, fin = until_finish(ws, timeout=10)
    elapsed = time.monotonic() - t
    assert fin == {"event": "finish", "reason": "cancelled"}
    assert elapsed < 3.0, f"cancel took {elapsed:.2f} s"
    # Far less audio than the 12 sentences would have made (at most what was already in flight).
    assert sum(len(e["audio"]) for e in events) < 16000 * 2 * 4
    audio, fin = session(ws, ["After the cancel."], **greedy(max_new_tokens=8))
    assert fin["reason"] == "stop" and audio


def test_cancel_while_draining_after_stop(ws: ClientConnection) -> None:
    """A cancel after `stop` (the session is finishing what it has) drops the rest of the audio and the finish says
    "cancelled"; the socket takes a new start."""
    ws.send(start_msg(sample_rate=16000, max_new_tokens=200))
    ws.send(text_msg(LONG_TEXT))
    ws.send(STOP)
    assert recv_event(ws)["event"] == "audio"
    ws.send(CANCEL)
    events, fin = until_finish(ws, timeout=10)
    assert fin == {"event": "finish", "reason": "cancelled"}
    assert sum(len(e["audio"]) for e in events) < 16000 * 2 * 4
    audio, fin = session(ws, ["After the cancel."], **greedy(max_new_tokens=8))
    assert fin["reason"] == "stop" and audio


def _wait_generation_stopped(srv: LiveServer, timeout: float = 5.0) -> float:
    """Until no stream holds a slot or sits in the decode batch; -> seconds waited."""
    t = time.monotonic()
    while srv.rt.scheduler.slots.free < srv.config.max_running or _metric(srv, "rtts_running_streams"):
        assert time.monotonic() - t < timeout, httpx.get(srv.http + "/metrics").text
        time.sleep(0.02)
    return time.monotonic() - t


def test_client_close_mid_generation_stops_work(srv: LiveServer) -> None:
    """Interrupting by closing the socket (Pipecat, LiveKit): the generation stops and the slot is freed at once."""
    srv.wait_idle()
    with srv.connect() as ws:
        ws.send(start_msg(sample_rate=8000, max_new_tokens=400))
        ws.send(text_msg(LONG_TEXT))
        ws.send(FLUSH)
        assert recv_event(ws)["event"] == "audio"
    assert _wait_generation_stopped(srv) < 3.0


def test_http_client_disconnect_stops_work(srv: LiveServer) -> None:
    srv.wait_idle()
    req = {"text": LONG_TEXT, "format": "pcm", "sample_rate": 8000, "max_new_tokens": 400}
    with httpx.Client(base_url=srv.http, timeout=30) as h:
        with h.stream("POST", "/v1/tts", json=req) as r:
            assert r.status_code == 200
            assert next(r.iter_raw())
    assert _wait_generation_stopped(srv) < 3.0


# ------------------------------------------------------------------------------------------------------ timestamps


def _check_timestamp_events(events: list[dict[str, Any]], rate: int) -> None:
    """PROTOCOL §3: a chunk (here one turn) keeps its chunk_seq over its events, each carrying the chunk's offset on
    the session timeline and a cumulative alignment relative to it; offset + alignment = where the audio really
    is."""
    assert events
    seqs = [ev["chunk_seq"] for ev in events]
    assert seqs == sorted(seqs) and seqs[0] == 0 and set(seqs) == set(range(seqs[-1] + 1))
    received = 0.0  # seconds of audio before each event
    for i, ev in enumerate(events):
        assert isinstance(ev["content"], str)
        al = ev["alignment"]
        assert isinstance(al["audio_duration"], float) and isinstance(ev["chunk_audio_offset_sec"], float)
        for seg in al["segments"]:
            assert isinstance(seg["text"], str) and seg["text"]
            assert 0 <= seg["start"] <= seg["end"] <= al["audio_duration"] + 1e-9
        if i == 0 or seqs[i] != seqs[i - 1]:  # a chunk starts where the audio so far ends
            assert abs(ev["chunk_audio_offset_sec"] - received) < 0.01, (ev["chunk_audio_offset_sec"], received)
        else:
            assert ev["chunk_audio_offset_sec"] == events[i - 1]["chunk_audio_offset_sec"]
            assert al["audio_duration"] >= events[i - 1]["alignment"]["audio_duration"]
        received += len(ev["audio"]) / 2 / rate
        if i + 1 == len(events) or seqs[i + 1] != seqs[i]:  # its last event: the whole chunk is out
            assert abs(ev["chunk_audio_offset_sec"] + al["audio_duration"] - received) < 0.01, (ev, received)


def test_live_with_timestamp(srv: LiveServer) -> None:
    with srv.connect("/v1/tts/live/with-timestamp") as ws:
        ws.send(start_msg(**greedy(max_new_tokens=10)))
        ws.send(text_msg("Hello there. "))
        ws.send(FLUSH)
        ws.send(text_msg("How are you today?"))
        ws.send(STOP)
        events, fin = until_finish(ws)
        assert fin == {"event": "finish", "reason": "stop"}
        _check_timestamp_events(events, 44100)
        chunks = {ev["chunk_seq"]: [s["text"] for s in ev["alignment"]["segments"]] for ev in events}
        assert chunks == {0: ["Hello there."], 1: ["How are you today?"]}
        assert {ev["content"] for ev in events} <= {"Hello there.", "How are you today?", ""}
        # After finish, a new start on the same socket (the timestamp docs promise it); seq restarts per session.
        ws.send(start_msg(**greedy(max_new_tokens=6)))
        ws.send(text_msg("Again."))
        ws.send(STOP)
        events, fin = until_finish(ws)
        assert fin["reason"] == "stop"
        _check_timestamp_events(events, 44100)


def test_timestamps_extension_on_plain_endpoint(ws: ClientConnection) -> None:
    ws.send(start_msg(timestamps=True, **greedy(max_new_tokens=6)))
    ws.send(text_msg("Aligned."))
    ws.send(STOP)
    events, fin = until_finish(ws)
    assert fin["reason"] == "stop"
    _check_timestamp_events(events, 44100)


# ------------------------------------------------------------------------------------------------------------ HTTP


def test_http_tts_msgpack_and_json(srv: LiveServer, ref_wav: bytes) -> None:
    req = {"text": "Hello over HTTP, in several chunks.", "format": "pcm", **greedy()}
    with httpx.Client(base_url=srv.http, timeout=30) as h:
        with h.stream("POST", "/v1/tts", content=ormsgpack.packb(req),
                      headers={"content-type": "application/msgpack", "model": "s2-pro"}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("audio/pcm")
            assert r.headers.get("transfer-encoding") == "chunked"
            chunks = [c for c in r.iter_raw() if c]
        via_msgpack = b"".join(chunks)
        # Streamed as a chunked body (above); how many reads the client needed depends on its timing (one, under
        # CPU load), so the check is on the audio: whole samples, more than the 2 frames of the first chunk.
        assert len(via_msgpack) % 2 == 0 and len(via_msgpack) > 2 * 2048 * 2

        r = h.post("/v1/tts", json=req)
        assert r.status_code == 200 and r.content == via_msgpack  # greedy: the same audio both ways

        # JSON carries reference audio as base64.
        ref = {"audio": base64.b64encode(ref_wav).decode(), "text": REF_TEXT}
        r = h.post("/v1/tts", json={**req, "format": "wav", "references": [ref]})
        assert r.status_code == 200 and r.content[:4] == b"RIFF"
        r = h.post("/v1/tts", content=ormsgpack.packb({**req, "format": "mp3",
                                                        "references": [{"audio": ref_wav, "text": REF_TEXT}]}),
                   headers={"content-type": "application/msgpack"})
        assert r.status_code == 200
        assert sf.info(io.BytesIO(r.content)).samplerate == 44100


@pytest.mark.parametrize(
    "content,ctype,status,words",
    [
        (b'{"text": "hi"}', "text/plain", 415, ("Content-Type",)),
        (b'{"text": "hi"', "application/json", 400, ("JSON",)),
        (b"\xc1\xc1", "application/msgpack", 400, ("MessagePack",)),
        (json.dumps({"text": "hi", "format": "flac"}).encode(), "application/json", 400, ("format",)),
        (json.dumps({"text": "hi", "format": "pcm", "sample_rate": 22050}).encode(), "application/json", 400,
         ("sample_rate",)),
        (json.dumps({"text": "  "}).encode(), "application/json", 400, ("text",)),
        (json.dumps({"text": "hi", "reference_id": "nobody"}).encode(), "application/json", 400, ("nobody",)),
        (json.dumps({"text": "hi", "references": [{"audio": "bm90IGF1ZGlv", "text": "x"}]}).encode(),
         "application/json", 400, ("reference audio",)),
        (json.dumps({"text": "x" * (MAX_SESSION_TEXT + 1)}).encode(), "application/json", 413, ("text", "limit")),
        (b"0" * (MAX_MESSAGE + 1), "application/json", 413, ("bytes",)),
        (b"[" * 100_000 + b"]" * 100_000, "application/json", 400, ("nests", "deeply")),
    ],
)
def test_http_errors(srv: LiveServer, content: bytes, ctype: str, status: int, words: tuple[str, ...]) -> None:
    r = httpx.post(srv.http + "/v1/tts", content=content, headers={"content-type": ctype}, timeout=30)
    assert r.status_code == status, r.text
    body = r.json()
    assert body["status"] == status and isinstance(body["message"], str)
    for w in words:
        assert w.lower() in body["message"].lower(), (w, body)


def test_references_http_errors(srv: LiveServer) -> None:
    with httpx.Client(base_url=srv.http, timeout=30) as h:
        r = h.post("/v1/references/add", data={"id": "bad id!", "text": "x"}, files={"audio": ("a.wav", b"xx")})
        assert r.status_code == 400 and "id" in r.json()["message"]
        r = h.post("/v1/references/add", data={"id": "v", "text": "x"}, files={"audio": ("a.wav", b"not audio")})
        assert r.status_code == 400 and "decode" in r.json()["message"]
        r = h.post("/v1/references/add", content=b"\xc1", headers={"content-type": "application/msgpack"})
        assert r.status_code == 400
        r = h.post("/v1/references/add", content=b"--x\r\nnot a part", headers={
            "content-type": "multipart/form-data; boundary=x"})
        assert r.status_code == 400 and r.json()["status"] == 400  # JSON, like every other error
        r = h.post("/v1/references/add", content=ormsgpack.packb({"id": None, "audio": b"x", "text": "t"}),
                   headers={"content-type": "application/msgpack"})
        assert r.status_code == 400 and "id must be a string" in r.json()["message"]
        big = b"{" + b" " * (2 * srv.config.limits.max_reference_bytes) + b"}"
        r = h.post("/v1/references/add", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413
        r = h.request("DELETE", "/v1/references/delete")
        assert r.status_code == 400 and "id" in r.json()["message"]


def test_model_routes_refuse_bad_requests_cleanly(srv: LiveServer, ref_wav: bytes) -> None:
    """/model (the SDK's voice management) beyond the SDK's own calls: msgpack bodies carry the voice files as bytes,
    JSON cannot (a clear 422); bad paging, unknown ids, oversized files and malformed bodies get their JSON error and
    store nothing."""
    with httpx.Client(base_url=srv.http, timeout=30) as h:
        before = h.get("/model", params={"page_size": 100}).json()["total"]
        body = ormsgpack.packb({"title": "Packed", "type": "tts", "train_mode": "fast", "voices": [ref_wav],
                                "texts": ["The quick brown fox."], "tags": "single", "visibility": "public"})
        r = h.post("/model", content=body, headers={"content-type": "application/msgpack"})
        assert r.status_code == 201, r.text
        made = r.json()
        assert made["title"] == "Packed" and made["tags"] == ["single"] and made["visibility"] == "public"
        refused = [
            (h.post("/model", json={"title": "J", "voices": ["UklGRg=="], "texts": ["x"]}), 422, "file"),
            (h.post("/model", content=b"\xc1", headers={"content-type": "application/msgpack"}), 400, "body"),
            (h.post("/model", json=[1, 2]), 422, "map"),
            (h.post("/model", files={"voices": ("a.wav", ref_wav)}, data={"texts": "x"}), 422, "title"),
            (h.post("/model", files={"voices": ("a.wav", ref_wav)}, data={"title": "T", "type": "svc", "texts": "x"}),
             422, "tts"),
            (h.post("/model", files={"voices": ("a.wav", b"not audio")}, data={"title": "T", "texts": "x"}), 422, ""),
            (h.post("/model", files={"voices": ("a.wav", b"\0" * (srv.rt.config.limits.max_reference_bytes + 1))},
                    data={"title": "T", "texts": "x"}), 413, "bytes"),
            (h.get("/model", params={"page_size": 0}), 422, "page_size"),
            (h.get("/model", params={"page_number": "two"}), 422, "integers"),
            (h.get("/model/nobody"), 404, "nobody"),
            (h.patch("/model/nobody", data={"title": "x"}), 404, "nobody"),
            (h.patch(f"/model/{made['_id']}", data={"visibility": "everyone"}), 422, "visibility"),
            (h.delete("/model/nobody"), 404, "nobody"),
        ]
        for r, status, words in refused:
            assert r.status_code == status, (r.request.method, r.request.url, r.text)
            assert r.json()["status"] == status and words in r.json()["message"], r.text
        assert h.get("/model", params={"page_size": 100}).json()["total"] == before + 1  # only the good one
        r = h.patch(f"/model/{made['_id']}", json={"description": "Edited", "tags": ["a", "b"]})
        assert r.status_code == 200 and r.json() == {"status": 200, "message": "ok"}
        got = h.get(f"/model/{made['_id']}").json()
        assert (got["description"], got["tags"], got["title"]) == ("Edited", ["a", "b"], "Packed")  # title kept
        assert h.patch(f"/model/{made['_id']}", json={"tags": []}).status_code == 200  # an empty list clears them
        assert h.get(f"/model/{made['_id']}").json()["tags"] == []
        r = h.patch(f"/model/{made['_id']}", json={"title": "  "})
        assert r.status_code == 422 and "blank" in r.json()["message"]
        assert len(h.get("/model", params={"page_size": 500}).json()["items"]) <= 100  # served, capped
        assert h.delete(f"/model/{made['_id']}").status_code == 200


def test_form_and_body_limits_hold_for_chunked_and_nested_bodies(srv: LiveServer, ref_wav: bytes) -> None:
    """A form body without Content-Length (chunked) is cut off at the route's limit while it streams in, not parsed
    whole first (Starlette's parser alone takes any size, spooling files to disk); deeply nested JSON is a 400, not
    a 500, for /model and /v1/references/*; a delete's body is bounded too."""
    limits = srv.rt.config.limits
    with httpx.Client(base_url=srv.http, timeout=60) as h:
        before = h.get("/model", params={"page_size": 100}).json()["total"]
        big = b"\0" * limits.max_reference_bytes
        for path, files, data in (
            ("/model", [("voices", ("a.wav", big))] * (limits.max_references + 3), {"title": "T"}),
            ("/v1/references/add", [("audio", ("a.wav", big + big + big))], {"id": "chunky", "text": "x"}),
        ):
            built = h.build_request("POST", path, files=files, data=data)

            def body(raw: bytes = built.read()) -> Iterator[bytes]:
                for i in range(0, len(raw), 1 << 18):
                    yield raw[i:i + (1 << 18)]

            r = h.post(path, content=body(), headers={"content-type": built.headers["content-type"]})
            assert r.status_code == 413 and r.json()["status"] == 413, (path, r.text)
        for method, path in (("POST", "/model"), ("POST", "/v1/references/add"), ("PATCH", f"/model/{'x' * 8}"),
                             ("DELETE", "/v1/references/delete")):
            r = h.request(method, path, content=b"[" * 100_000, headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["status"] == 400, (path, r.text)
        r = h.request("DELETE", "/v1/references/delete", content=b" " * (MAX_MESSAGE + 1),
                      headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["status"] == 413
        assert h.get("/model", params={"page_size": 100}).json()["total"] == before  # nothing stored


# ------------------------------------------------------------------------------------------------------------ auth


def test_auth(auth_srv: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    from fish_audio_sdk import WebSocketSession
    from fishaudio import FishAudio, TTSConfig

    short_legacy_websocket(monkeypatch)
    # Wrong or missing key: the upgrade is refused with HTTP 401 (the SDK raises WebSocketUpgradeError).
    for key in ("wrong", None):
        with pytest.raises(websockets.exceptions.InvalidStatus) as exc:
            auth_srv.connect(key=key)
        assert exc.value.response.status_code == 401
        assert json.loads(exc.value.response.body or b"{}")["status"] == 401
    c = FishAudio(api_key="wrong", base_url=auth_srv.http)
    with pytest.raises(httpx_ws.WebSocketUpgradeError) as up:
        list(c.tts.stream_websocket(iter(["Hello."]), format="pcm"))
    assert up.value.response.status_code == 401
    with WebSocketSession("wrong", base_url=auth_srv.http) as legacy, pytest.raises(httpx_ws.WebSocketUpgradeError):
        list(legacy.tts(ShortLegacyRequest(text="", format="pcm"), iter(["Hello."])))
    for path in ("/v1/tts/live", "/v1/tts/live/with-timestamp"):
        with pytest.raises(websockets.exceptions.InvalidStatus):
            auth_srv.connect(path, key="nope")

    # HTTP routes: 401 JSON.
    with httpx.Client(base_url=auth_srv.http, timeout=30) as h:
        for method, path in (("POST", "/v1/tts"), ("GET", "/v1/references/list"), ("POST", "/v1/references/add"),
                             ("DELETE", "/v1/references/delete"), ("GET", "/model"), ("POST", "/model"),
                             ("GET", "/model/x"), ("PATCH", "/model/x"), ("DELETE", "/model/x")):
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "secret"},
                            {"authorization": "secret Bearer"}):
                r = h.request(method, path, json={"text": "hi"}, headers=headers)
                assert r.status_code == 401, (method, path, headers)
                assert r.json()["status"] == 401 and r.json()["message"]
        assert h.get("/v1/health").status_code == 200  # probes need no key

    # The right key works everywhere.
    good = FishAudio(api_key="secret", base_url=auth_srv.http)
    short = TTSConfig(format="pcm", max_new_tokens=8)
    pcm = b"".join(good.tts.stream_websocket(iter(["Authorized."]), config=short))
    assert pcm and len(pcm) % 2 == 0
    assert good.tts.convert(text="Authorized HTTP.", config=short)
    with WebSocketSession("secret", base_url=auth_srv.http) as legacy:
        assert b"".join(legacy.tts(ShortLegacyRequest(text="", format="pcm"), iter(["Legacy."])))
    with auth_srv.connect(key="secret") as ws:
        assert session(ws, ["Raw."], max_new_tokens=4)[1]["reason"] == "stop"
    for scheme in ("Bearer", "bearer", "BEARER"):  # the auth scheme is case-insensitive (RFC 7235)
        r = httpx.get(auth_srv.http + "/v1/references/list", headers={"authorization": f"{scheme} secret"})
        assert r.status_code == 200 and r.json()["reference_ids"] == []


# ------------------------------------------------------------------------------------------- greedy == rtts synth


@pytest.mark.parametrize("voice", [False, True], ids=["no-voice", "reference-audio"])
def test_greedy_live_equals_synth(srv: LiveServer, golden: Path, tmp_path: Path, ref_wav: bytes,
                                  voice: bool) -> None:
    """One short sentence, top_k 1: the live session's PCM equals `rtts synth --top-k 1` (±1 LSB) with the streaming
    loudness normalization off (`rtts synth` writes the model's own level)."""
    text = "Hello there, this is a tiny test."
    refs: dict[str, Any] = {"references": [{"audio": ref_wav, "text": REF_TEXT}]} if voice else {}
    with srv.connect() as ws:
        live, fin = session(ws, [text, FLUSH], sample_rate=44100, prosody={"normalize_loudness": False}, **greedy(),
                            **refs)
    assert fin == {"event": "finish", "reason": "stop"}
    srv.wait_idle()

    out = tmp_path / "out.wav"
    argv = ["synth", text, "-o", str(out), "--checkpoint", str(golden / "tiny-s2"), "--top-k", "1",
            "--temperature", "0.7", "--top-p", "0.7", "--seed", "0", "--max-frames", "40"]
    if voice:
        (tmp_path / "ref.wav").write_bytes(ref_wav)
        argv += ["--reference-audio", str(tmp_path / "ref.wav"), "--reference-text", REF_TEXT]
    rtts_main(argv)
    offline, rate = sf.read(out, dtype="int16")
    assert rate == 44100
    got = s16(live)
    # The live turn may end with silence that lifts its last message over Pipecat's floor (MIN_LAST_RAW_SAMPLES).
    assert 0 <= got.size - offline.size < MIN_LAST_RAW_SAMPLES, (got.size, offline.size)
    assert offline.size > 0 and not got[offline.size:].any()
    assert np.abs(got[:offline.size].astype(np.int32) - offline.astype(np.int32)).max() <= 1


# --------------------------------------------------------------------------------------------------------- pings


def test_pings_answered_during_synthesis(srv: LiveServer) -> None:
    """A client pinging every 0.1 s gets every pong within 1 s while a long synthesis streams."""
    with srv.connect(ping_interval=None) as ws:
        ws.send(start_msg(sample_rate=8000, max_new_tokens=200))
        ws.send(text_msg(LONG_TEXT))
        ws.send(FLUSH)
        assert recv_event(ws)["event"] == "audio"
        pongs, audio, t_end = 0, 0, time.monotonic() + 2.0
        while time.monotonic() < t_end:
            waiter, sent = ws.ping(), time.monotonic()
            # Keep reading audio meanwhile (a full receive queue would stall the socket), at least 0.1 s per ping.
            while not waiter.is_set() or time.monotonic() - sent < 0.1:
                assert waiter.is_set() or time.monotonic() - sent < 1.0, "no pong within 1 s during synthesis"
                try:
                    audio += recv_event(ws, 0.02)["event"] == "audio"
                except TimeoutError:
                    pass
            pongs += 1
        assert pongs >= 10 and audio >= 2, (pongs, audio)
        ws.send(CANCEL)
        assert until_finish(ws)[1]["reason"] == "cancelled"
    srv.wait_idle()


# ------------------------------------------------------------------------------------------------------ shutdown


def test_graceful_shutdown(golden: Path, tmp_path: Path) -> None:
    """Server stopping with a session streaming: the client gets finish/error + message, then a close; nothing hangs."""
    s = LiveServer(tiny_config(golden, tmp_path))
    stopped = False
    try:
        with s.connect() as ws, s.connect() as idle:
            ws.send(start_msg(sample_rate=8000, max_new_tokens=200))
            ws.send(text_msg(LONG_TEXT))
            ws.send(FLUSH)
            assert recv_event(ws)["event"] == "audio"
            t = time.monotonic()
            s.server.should_exit = True
            events, fin = until_finish(ws, timeout=15)
            assert fin["reason"] == "error" and "shutting down" in fin["message"], fin
            with pytest.raises(websockets.exceptions.ConnectionClosed):
                while True:
                    recv_event(ws, 15)
            with pytest.raises(websockets.exceptions.ConnectionClosed):  # a socket without a session just closes
                recv_event(idle, 15)
            s.thread.join(30)
            stopped = not s.thread.is_alive()
            assert stopped, "the server did not stop"
            assert time.monotonic() - t < 15
    finally:
        if not stopped:
            s.stop()


def test_runtime_freezes_startup_objects_for_the_garbage_collector(golden: Path, tmp_path: Path) -> None:
    """With freeze_gc (what `rtts serve` sets), everything alive after start-up leaves the cyclic collector's view,
    so a full collection while serving no longer walks the model, modules and graphs with every thread stopped."""
    import gc

    from rtts.ws.runtime import Runtime

    rt = Runtime(tiny_config(golden, tmp_path, warmup=False, freeze_gc=True))
    try:
        rt.start()
        assert gc.get_freeze_count() > 10_000  # modules, torch, the model: far more than a handful of objects
        assert rt.ready
    finally:
        rt.stop()
        gc.unfreeze()  # give the test process its collector back


def test_runtime_batches_prompts_as_configured(golden: Path, tmp_path: Path) -> None:
    from rtts.ws.runtime import Runtime

    rt = Runtime(tiny_config(golden, tmp_path, warmup=False, prefill_rows=3))
    assert rt.engine.prefill_rows == 3 and rt.engine.fast_kv_prefill.k.shape[1] == 3


def test_rtts_serve_freezes_the_garbage_collector(golden: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import rtts.ws.server

    seen: list[ServerConfig] = []
    monkeypatch.setattr(rtts.ws.server, "serve", lambda config, rt=None: seen.append(config))
    for name in ("RTTS_CODEC_GRAPHS", "RTTS_PREFILL_GRAPHS", "RTTS_CODEC_TF32"):  # the defaults, whatever the shell
        monkeypatch.delenv(name, raising=False)
    rtts_main(["serve", "--checkpoint", str(golden / "tiny-s2"), "--port", "0"])
    assert len(seen) == 1 and seen[0].freeze_gc and seen[0].codec_graphs and seen[0].prefill_graphs
    assert seen[0].codec_tf32
    rtts_main(["serve", "--checkpoint", str(golden / "tiny-s2"), "--port", "0", "--no-codec-graphs",
               "--no-prefill-graphs", "--no-codec-tf32"])
    assert not seen[1].codec_graphs and not seen[1].prefill_graphs and not seen[1].codec_tf32
    monkeypatch.setenv("RTTS_CODEC_GRAPHS", "0")
    monkeypatch.setenv("RTTS_PREFILL_GRAPHS", "off")
    monkeypatch.setenv("RTTS_CODEC_TF32", "no")
    rtts_main(["serve", "--checkpoint", str(golden / "tiny-s2"), "--port", "0"])
    assert not seen[2].codec_graphs and not seen[2].prefill_graphs and not seen[2].codec_tf32
    rtts_main(["serve", "--checkpoint", str(golden / "tiny-s2"), "--port", "0", "--codec-tf32"])  # the flag wins
    assert seen[3].codec_tf32 and not seen[3].codec_graphs
    assert seen[3].prefill_rows == DEFAULT_PREFILL_ROWS == 16
    rtts_main(["serve", "--checkpoint", str(golden / "tiny-s2"), "--port", "0", "--prefill-rows", "5"])
    assert seen[4].prefill_rows == 5
    with pytest.raises(SystemExit):  # the CLI prints the ValueError's message and exits 2
        rtts_main(["serve", "--checkpoint", str(golden / "tiny-s2"), "--port", "0", "--prefill-rows", "0"])
    assert len(seen) == 5
