"""The live WebSocket protocol end to end on a real server (tiny golden checkpoint, CPU) with raw clients.

PROTOCOL.md §1-§3: formats and rates, flush, socket reuse, the `cancel` extension, clients leaving, timestamps, pings
and greedy equality with `rtts synth`. Bad inputs and capacity are in test_ws_errors.py, the official SDK clients in
test_sdk.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf
from conftest import LONG_TEXT, MAX_SESSION_TEXT, MAX_TEXT, REF_TEXT, greedy, metric, s16
from liveserver import (
    CANCEL,
    FLUSH,
    STOP,
    LiveServer,
    assert_usable,
    pack,
    recv_event,
    session,
    start_msg,
    text_msg,
    until_finish,
)
from websockets.sync.client import ClientConnection

from rtts.__main__ import main as rtts_main
from rtts.audio.encode import MIN_LAST_RAW_SAMPLES

# ----------------------------------------------------------------------------------------------------- formats, rates


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


# ------------------------------------------------------------------------------------------------ flush, socket reuse


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
        # Until it is spoken: a pause without audio, long enough that a loaded machine's stall between two chunks
        # is not taken for the end (more than MAX_SESSION_TEXT left unspoken is refused, rightly).
        with contextlib.suppress(TimeoutError):
            while True:
                event = recv_event(ws, 2.5)
                assert event["event"] == "audio", event
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


@pytest.mark.parametrize("voice", ["933563129e564b19a115bedd57b7406a", "8ef4a238714b45718ce04243307c57a7"])
def test_a_plugins_default_hosted_voice_gets_the_default_voice(ws: ClientConnection, voice: str) -> None:
    """LiveKit's fish plugin (and older releases, Fish's examples) name a hosted voice by default; not stored here,
    it speaks with the default voice rather than failing every session of a default-configured agent."""
    audio, fin = session(ws, ["Hello."], reference_id=voice, **greedy(max_new_tokens=4))
    assert fin == {"event": "finish", "reason": "stop"} and audio


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
    # the server's own split of its first-audio time, read from /metrics around each level: one mean per stage
    for c in ("1", "2"):
        split = report["ttfa_stages_ms"][c]
        assert set(split) == {"queue", "prefill", "frames", "codec_wait", "codec", "outbox"}
        assert split["prefill"] > 0 and split["codec"] > 0 and min(split.values()) >= 0
    assert "Server-side way to first audio" in table
    srv.wait_idle()


# ---------------------------------------------------------------------------------- cancel extension, clients leaving


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


def test_a_client_leaving_is_not_a_failed_session(srv: LiveServer) -> None:
    before = metric(srv, "rtts_session_errors_total")
    for _ in range(3):
        with srv.connect() as ws:
            ws.send(start_msg(**greedy(max_new_tokens=40)))
            ws.send(text_msg(LONG_TEXT))
            ws.send(FLUSH)
            assert recv_event(ws)["event"] == "audio"
    srv.wait_idle()
    assert metric(srv, "rtts_session_errors_total") == before


def _wait_generation_stopped(srv: LiveServer, timeout: float = 5.0) -> float:
    """Until no stream holds a slot or sits in the decode batch; -> seconds waited."""
    t = time.monotonic()
    while srv.rt.scheduler.slots.free < srv.config.max_running or metric(srv, "rtts_running_streams"):
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


# --------------------------------------------------------------------------------------------------------- timestamps


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


# ----------------------------------------------------------------------------------------------- greedy == rtts synth


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


# -------------------------------------------------------------------------------------------------------------- pings


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
