"""The OpenAI-compatible speech API (`POST /v1/audio/speech`, `GET /v1/models`) driven by the official `openai` client
against a real server on the tiny golden checkpoint (random weights: noise, but real audio in every format)."""

from __future__ import annotations

import base64
import io
import json
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import psutil
import pytest
import soundfile as sf
from conftest import LONG_TEXT, REF_TEXT, metric, tiny_config
from liveserver import LiveServer, post_json_head

from rtts.audio import ffmpeg
from rtts.audio.transcode import WideStretcher
from rtts.request import Limits

FRAME_SECONDS = 2048 / 44100  # one codec frame of the tiny checkpoint's codec
SENTENCES = " ".join(f"This is sentence number {i}, spoken as it is generated." for i in range(6))
# rtts extensions (the Fish request's fields) in extra_body: short turns keep the tests quick
SHORT = {"max_new_tokens": 12}


@pytest.fixture(scope="module")
def client(srv: LiveServer) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(api_key="anything", base_url=srv.http + "/v1", max_retries=0, timeout=120)
    yield c
    c.close()


def frames(srv: LiveServer) -> float:
    return metric(srv, "rtts_frames_generated_total")


def decode(data: bytes, fmt: str, rate: int) -> np.ndarray:
    """Audio bytes in `fmt` -> mono float32 samples, checking the stream's own rate where it states one."""
    if fmt == "pcm":
        assert len(data) % 2 == 0
        return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768
    if fmt in ("mp3", "opus", "wav"):
        samples, got = sf.read(io.BytesIO(data), dtype="float32")
        assert got == rate
        return samples
    # flac (a streamed FLAC has no length in its header, which libsndfile needs) and aac (ADTS): through ffmpeg
    exe = ffmpeg.ffmpeg_binary()
    assert exe is not None
    out = subprocess.run([exe, "-v", "error", "-i", "pipe:0", "-f", "f32le", "-ac", "1", "-ar", str(rate), "pipe:1"],
                         input=data, capture_output=True, check=True, timeout=60)
    return np.frombuffer(out.stdout, dtype="<f4")


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny-s2"] and models[0].owned_by == "rtts"
    assert client.models.retrieve("tiny-s2").id == "tiny-s2"
    with pytest.raises(openai.NotFoundError, match="tiny-s2"):
        client.models.retrieve("tts-1")


def test_audio_streams_while_it_is_generated(srv: LiveServer, client: openai.OpenAI) -> None:
    """Pieces of the body arrive while later sentences are still being generated, and the whole decodes to as much
    audio as the server generated."""
    before = frames(srv)
    pieces, at_first = [], None
    with client.audio.speech.with_streaming_response.create(model="tts-1", voice="default", input=SENTENCES,
                                                            response_format="pcm", extra_body={"max_new_tokens": 24},
                                                            ) as resp:
        assert resp.headers["content-type"] == "audio/pcm"
        for chunk in resp.iter_bytes():
            if at_first is None:
                at_first = frames(srv) - before
            pieces.append(chunk)
    total = frames(srv) - before
    assert at_first is not None and at_first < total, (at_first, total)
    assert len(pieces) > 1
    seconds = len(b"".join(pieces)) / 2 / 24000  # pcm: 16-bit, 24 kHz, as the OpenAI API defines it
    assert seconds == pytest.approx(total * FRAME_SECONDS, abs=0.01)


@pytest.mark.parametrize("fmt,rate", [("mp3", 44100), ("opus", 48000), ("aac", 44100), ("flac", 44100),
                                      ("wav", 24000)])
def test_formats(srv: LiveServer, client: openai.OpenAI, fmt: str, rate: int) -> None:
    before = frames(srv)
    with client.audio.speech.with_streaming_response.create(model="gpt-4o-mini-tts", voice="default",
                                                            input="Hello there.", response_format=fmt,
                                                            extra_body=SHORT) as resp:
        data = resp.read()
    seconds = decode(data, fmt, rate).size / rate
    expected = (frames(srv) - before) * FRAME_SECONDS
    assert expected > 0
    # Lossy codecs add their priming and end padding (AAC 1024 samples and up to a frame; MP3 and Opus less).
    assert expected - 0.01 <= seconds <= expected + 0.08, (seconds, expected)


@pytest.mark.parametrize("speed", [0.25, 0.5, 2.0, 4.0])
def test_speed(srv: LiveServer, client: openai.OpenAI, speed: float) -> None:
    before = frames(srv)
    data = client.audio.speech.create(model="tts-1", voice="default", input="Hi there.", response_format="pcm",
                                      speed=speed, extra_body=SHORT).read()
    seconds = len(data) / 2 / 24000
    assert seconds == pytest.approx((frames(srv) - before) * FRAME_SECONDS / speed, abs=0.01)


def test_wide_stretcher_lengths() -> None:
    x = np.sin(np.arange(44100) * 0.05).astype(np.float32)
    for speed in (0.25, 1.5, 3.0, 4.0):
        ts = WideStretcher(speed, 44100)
        y = np.concatenate([ts.push(x[:10000]), ts.push(x[10000:]), ts.finish()])
        assert abs(y.size - x.size / speed) <= 2, (speed, y.size)
    with pytest.raises(ValueError, match="outside"):
        WideStretcher(4.5, 44100)


def test_sse(srv: LiveServer, client: openai.OpenAI) -> None:
    """stream_format sse: speech.audio.delta events with base64 audio in the response format, then speech.audio.done
    with usage (text tokens in, audio frames out)."""
    before = frames(srv)
    with client.audio.speech.with_streaming_response.create(model="tts-1", voice="default", input="Hello there.",
                                                            response_format="wav", stream_format="sse",
                                                            extra_body=SHORT) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[len("data: "):]) for line in resp.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1) and len(events) > 1
    done = events[-1]
    assert done["type"] == "speech.audio.done"
    usage = done["usage"]
    assert usage["output_tokens"] == frames(srv) - before > 0
    assert usage["input_tokens"] > 0 and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert decode(audio, "wav", 24000).size == pytest.approx(usage["output_tokens"] * FRAME_SECONDS * 24000, abs=240)


def test_stored_voice_and_instructions(srv: LiveServer, client: openai.OpenAI, ref_wav: bytes) -> None:
    r = httpx.post(srv.http + "/v1/references/add", files={"audio": ("a.wav", ref_wav, "audio/wav")},
                   data={"id": "oai-voice", "text": REF_TEXT})
    assert r.status_code == 200, r.text
    for voice in ("oai-voice", {"id": "oai-voice"}):
        data = client.audio.speech.create(model="tts-1", voice=voice, input="Hi.",  # type: ignore[arg-type]
                                          response_format="mp3", instructions="Speak cheerfully.",
                                          extra_body=SHORT).read()
        assert decode(data, "mp3", 44100).size > 0


def test_errors(srv: LiveServer, client: openai.OpenAI) -> None:
    def refused(status: type[openai.APIStatusError], param: str | None, *words: str, **kw: object) -> None:
        args: dict[str, object] = {"model": "tts-1", "voice": "default", "input": "Hi.", **kw}
        with pytest.raises(status) as e:
            client.audio.speech.create(**args).read()  # type: ignore[arg-type]
        body = e.value.body
        assert isinstance(body, dict) and body["type"] == "invalid_request_error" and body["param"] == param, body
        for w in words:
            assert w in body["message"], body

    refused(openai.BadRequestError, "voice", "'alloy'", "built-in", "'default'", "rtts voices add alloy", voice="alloy")
    refused(openai.BadRequestError, "voice", "'nobody' is a voice id this server does not have", voice="nobody")
    refused(openai.BadRequestError, "response_format", "mp3, opus, aac, flac, wav, pcm", response_format="ogg")
    refused(openai.BadRequestError, "speed", "[0.25, 4]", speed=5.0)
    refused(openai.BadRequestError, "input", "empty", input="  ")
    refused(openai.BadRequestError, "stream_format", "audio, sse", stream_format="json")
    refused(openai.BadRequestError, "sample_rate", "24000", response_format="pcm", extra_body={"sample_rate": 22050})
    refused(openai.BadRequestError, "top_p", "top_p", "1", extra_body={"top_p": 2})  # the Fish fields validator
    # Values the engine's float32 / int64 settings cannot hold: refused by the same ranges as on /v1/tts.
    refused(openai.BadRequestError, "repetition_penalty", "repetition_penalty must be a number in [0.5, 2]",
            "got 1e+300", extra_body={"repetition_penalty": 1e300})
    refused(openai.BadRequestError, "top_k", "top_k must be an integer in [0, 65536]", "got 9223372036854775808",
            extra_body={"top_k": 2**63})
    refused(openai.BadRequestError, "seed", "seed must be an integer in [0, 2**63)", extra_body={"seed": 2**63})
    # The validator's own field names become the speech request's.
    refused(openai.BadRequestError, "voice", "voice must be a voice id (1-128 letters", voice="no such/voice")
    lone_surrogate = b'{"model": "tts-1", "voice": "default", "input": "Hi \\ud800"}'  # (a JSON escape)
    r = httpx.post(srv.http + "/v1/audio/speech", content=lone_surrogate, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "input" and "input is not valid Unicode" in r.json()["error"]["message"]
    r = httpx.post(srv.http + "/v1/audio/speech", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    srv.wait_idle()
    # Nothing refused set anything in motion: the server still speaks.
    assert len(client.audio.speech.create(model="tts-1", voice="default", input="Hi.", response_format="pcm",
                                          extra_body=SHORT).read()) > 0


def test_aac_without_ffmpeg(srv: LiveServer, client: openai.OpenAI, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ffmpeg, "ffmpeg_binary", lambda: None)
    with pytest.raises(openai.BadRequestError, match="needs ffmpeg"):
        client.audio.speech.create(model="tts-1", voice="default", input="Hi.", response_format="aac")


def test_api_key(golden: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    s = LiveServer(tiny_config(golden, tmp_path_factory.mktemp("voices"), api_keys=("sk-local",), warmup=False))
    try:
        bad = openai.OpenAI(api_key="wrong", base_url=s.http + "/v1", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.models.list()
        assert isinstance(e.value.body, dict) and e.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            bad.audio.speech.create(model="tts-1", voice="default", input="Hi.")
        good = openai.OpenAI(api_key="sk-local", base_url=s.http + "/v1", max_retries=0)
        assert len(good.audio.speech.create(model="tts-1", voice="default", input="Hi.", response_format="wav",
                                            extra_body=SHORT).read()) > 44
    finally:
        s.stop()


def _ffmpeg_children() -> list[int]:
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "ffmpeg" in p.name() and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p.pid)
        except psutil.NoSuchProcess:  # (ended while listed)
            pass
    return found


@pytest.mark.parametrize("fmt", ["pcm", "aac"])
def test_a_client_that_leaves_mid_stream_frees_everything(srv: LiveServer, fmt: str) -> None:
    """Its slot goes back, and an AAC response's ffmpeg process ends."""
    request = {"model": "tts-1", "voice": "default", "input": SENTENCES, "response_format": fmt}
    # The encoder's ffmpeg is watched from before the request: on an idle machine the whole reply may be generated
    # (and ffmpeg done) before the client reads its first chunk.
    seen: set[int] = set()
    watching = threading.Event()
    watching.set()

    def watch() -> None:
        while watching.is_set():
            seen.update(_ffmpeg_children())
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with httpx.stream("POST", srv.http + "/v1/audio/speech", json=request, timeout=60) as r:
            assert r.status_code == 200
            next(r.iter_raw())
    finally:
        watching.clear()
        watcher.join()
    assert bool(seen) == (fmt == "aac")
    srv.wait_idle(timeout=30)
    deadline = time.monotonic() + 30
    while _ffmpeg_children():
        assert time.monotonic() < deadline, "the AAC encoder's ffmpeg is still running"
        time.sleep(0.05)


# ------------------------------------------------------------------------------------------------ a client not reading

SEND_TIMEOUT = 2.0
SLOW_WAIT = 240.0  # generous: a loaded 2-core CI machine generates the tiny model's audio slowly


def _unread_socket(srv: LiveServer) -> socket.socket:
    """A connection to `srv` that holds little unread: a small receive buffer here and a small, fixed kernel send
    buffer at the server's end, so a client that stops reading shows after tens of KB instead of megabytes (the
    server's own bounds, what is tested, do not depend on it; docs/security.md)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window scale is agreed then
    s.settimeout(30)
    s.connect(("127.0.0.1", srv.port))
    me = ("127.0.0.1", s.getsockname()[1])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        conn = next((c for c in list(srv.server.server_state.connections) if getattr(c, "client", None) == me), None)
        if conn is not None:
            conn.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
            return s
        time.sleep(0.01)
    raise AssertionError("the server did not accept the connection")


@pytest.fixture(scope="module")
def slow_srv(golden: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    s = LiveServer(tiny_config(golden, tmp_path_factory.mktemp("voices"),
                               limits=Limits(send_timeout_seconds=SEND_TIMEOUT)))
    yield s
    s.stop()


# Much audio quickly: quarter speed (four times the samples per generated frame), greedy, long turns.
@pytest.mark.parametrize("fmt,rate,stream", [("pcm", 48000, "audio"), ("aac", 48000, "audio"), ("wav", 48000, "sse")])
def test_a_client_that_stops_reading(slow_srv: LiveServer, fmt: str, rate: int, stream: str) -> None:
    """Its body holds a bounded backlog; once its socket has taken nothing for send_timeout_seconds its session ends
    with an error and its slot comes back while its connection is still open, a neighbour completing meanwhile.
    Reading again, it finds the audio that was on its way, then a body that breaks off (the encoder of an AAC
    response, whose output a reader task hands on, ends the same way)."""
    srv = slow_srv
    errors = metric(srv, "rtts_session_errors_total")
    sock = _unread_socket(srv)
    try:
        body = json.dumps({"model": "tts-1", "voice": "default", "input": LONG_TEXT, "response_format": fmt,
                           "sample_rate": rate, "speed": 0.25, "stream_format": stream, "top_k": 1,
                           "max_new_tokens": 1024}).encode()
        head = post_json_head(sock, "/v1/audio/speech", body)
        assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower(), head
        # It reads nothing more. A neighbour's request completes; the stuck session ends by itself, its slot back.
        with openai.OpenAI(api_key="x", base_url=srv.http + "/v1", max_retries=0, timeout=SLOW_WAIT) as neighbour:
            audio = neighbour.audio.speech.create(model="tts-1", voice="default", input="Hello there.",
                                                  response_format="pcm", extra_body=SHORT).read()
        assert len(audio) > 0
        deadline = time.monotonic() + SLOW_WAIT
        while metric(srv, "rtts_session_errors_total") == errors:
            assert time.monotonic() < deadline, "the stuck request's session never ended"
            time.sleep(0.1)
        srv.wait_idle(timeout=30)  # every slot back, the stuck connection still open
        rest = b""
        while data := sock.recv(65536):
            rest += data
        assert len(rest) > 0
        if stream == "sse":  # the events that were on their way, the last of them saying why
            last = json.loads(rest.rsplit(b"data: ", 1)[1].split(b"\n", 1)[0])
            assert last["type"] == "error" and "client is not reading audio" in last["error"]["message"], last
        else:  # no terminating chunk: the client cannot take it for the whole of its audio
            assert not rest.endswith(b"0\r\n\r\n")
    finally:
        sock.close()
    srv.wait_idle(timeout=30)
