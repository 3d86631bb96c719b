"""The official Python SDK (fish-audio-sdk 1.3.0: new `fishaudio`, legacy `fish_audio_sdk`) against a real server.

A real uvicorn server on loopback serves the tiny golden checkpoint (random weights: the audio is noise, but real
audio in the requested format). PROTOCOL.md §1, §2, §5, §6.
"""

from __future__ import annotations

import asyncio
import io
import struct
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf
from fishaudio import AsyncFishAudio, FishAudio, FlushEvent, ReferenceAudio, TTSConfig
from fishaudio.exceptions import APIError, NotFoundError, WebSocketError
from liveserver import LiveServer, ShortLegacyRequest, decode_audio, short_legacy_websocket

TEXTS: list[Any] = ["Hello, ", "world. ", FlushEvent(), "Bye."]
SHORT = TTSConfig(max_new_tokens=12)


@pytest.fixture(scope="module")
def client(srv: LiveServer) -> Iterator[FishAudio]:
    c = FishAudio(api_key="anything", base_url=srv.http)
    yield c
    c.close()


def _config(fmt: str, rate: int | None) -> TTSConfig:
    return TTSConfig(format=fmt, sample_rate=rate, max_new_tokens=12)  # type: ignore[arg-type]


def check_audio(data: bytes, fmt: str, rate: int) -> None:
    """The bytes are valid audio in `fmt` at `rate`."""
    assert data, "no audio"
    if fmt == "pcm":
        assert len(data) % 2 == 0
        return
    if fmt == "wav":
        # Fish's streaming header: 44 bytes, placeholder sizes (PROTOCOL §4), then s16le PCM.
        assert data[:4] == b"RIFF" and data[8:16] == b"WAVEfmt "
        assert struct.unpack("<I", data[24:28])[0] == rate
        assert (len(data) - 44) % 2 == 0
        samples = np.frombuffer(data[44:], dtype="<i2")
        assert samples.size > 0
        return
    if fmt == "opus":
        assert data[:4] == b"OggS"
    samples, got = decode_audio(data)
    assert got == rate
    assert samples.size > 0


# ------------------------------------------------------------------------------------------- new SDK, sync, formats


@pytest.mark.parametrize(
    "fmt,rate,expected",
    [
        ("pcm", 16000, 16000),
        ("pcm", 24000, 24000),
        ("pcm", 8000, 8000),
        ("wav", None, 44100),
        ("wav", 16000, 16000),
        ("mp3", 32000, 32000),
        ("mp3", None, 44100),
        ("opus", None, 48000),
    ],
)
def test_sync_websocket_formats(client: FishAudio, fmt: str, rate: int | None, expected: int) -> None:
    chunks = list(client.tts.stream_websocket(iter(TEXTS), config=_config(fmt, rate), latency="balanced"))
    check_audio(b"".join(chunks), fmt, expected)
    if fmt == "wav":
        assert sum(c.startswith(b"RIFF") for c in chunks) == 1  # one header per session (LiveKit restarts on RIFF)


def test_wav_decodes_with_soundfile(client: FishAudio) -> None:
    """The streaming WAV (placeholder sizes) is readable as a file once the stream has ended."""
    data = b"".join(client.tts.stream_websocket(iter(TEXTS), config=_config("wav", 44100)))
    samples, rate = sf.read(io.BytesIO(data), dtype="int16")
    assert rate == 44100 and samples.size == (len(data) - 44) // 2


def test_sync_empty_text_stream_finishes(client: FishAudio) -> None:
    """No text at all: the server still ends with finish/stop (the SDK would hang forever otherwise)."""
    assert list(client.tts.stream_websocket(iter([]), format="pcm")) == []


def test_sync_speed_and_all_sdk_defaults(client: FishAudio) -> None:
    chunks = list(client.tts.stream_websocket(iter(["Quick test. "]), format="mp3", speed=1.5, config=SHORT))
    check_audio(b"".join(chunks), "mp3", 44100)


# ---------------------------------------------------------------------------------------------------- new SDK, async


def _contains(e: BaseException, kind: type[BaseException]) -> bool:
    if isinstance(e, kind):
        return True
    return any(_contains(sub, kind) for sub in getattr(e, "exceptions", ()))


def test_async_websocket(srv: LiveServer) -> None:
    async def texts() -> AsyncIterator[Any]:
        for t in TEXTS:
            yield t

    async def main() -> dict[str, bytes]:
        c = AsyncFishAudio(api_key="anything", base_url=srv.http)
        out: dict[str, bytes] = {}
        try:
            for fmt, rate in (("pcm", 24000), ("opus", None)):
                out[fmt] = b"".join([chunk async for chunk in c.tts.stream_websocket(texts(),
                                                                                     config=_config(fmt, rate))])
            out["http"] = await c.tts.convert(text="Hello there.", format="pcm", config=SHORT)
            # finish/error surfaces as WebSocketError (inside an ExceptionGroup from httpx_ws's task group).
            with pytest.raises(Exception) as exc:
                async for _ in c.tts.stream_websocket(texts(), reference_id="no-such-voice", format="pcm"):
                    pass
            assert _contains(exc.value, WebSocketError), exc.value
        finally:
            await c.close()
        return out

    out = asyncio.run(main())
    check_audio(out["pcm"], "pcm", 24000)
    check_audio(out["opus"], "opus", 48000)
    check_audio(out["http"], "pcm", 44100)


# ------------------------------------------------------------------------------------------------------------ legacy


def test_legacy_websocket_session(srv: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    from fish_audio_sdk import WebSocketSession

    short_legacy_websocket(monkeypatch)
    with WebSocketSession("anything", base_url=srv.http) as ws:
        pcm = b"".join(ws.tts(ShortLegacyRequest(text="", format="pcm", sample_rate=16000),
                              iter(["Hello, ", "world."]), backend="s1"))
        wav = b"".join(ws.tts(ShortLegacyRequest(text="", format="wav"), iter(["Second session."])))
    check_audio(pcm, "pcm", 16000)
    check_audio(wav, "wav", 44100)


def test_legacy_async_websocket_session(srv: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    from fish_audio_sdk import AsyncWebSocketSession

    short_legacy_websocket(monkeypatch)
    async def texts() -> AsyncIterator[str]:
        yield "Hello, "
        yield "async world."

    async def main() -> bytes:
        async with AsyncWebSocketSession("anything", base_url=srv.http) as ws:
            request = ShortLegacyRequest(text="", format="mp3", sample_rate=32000)
            return b"".join([c async for c in ws.tts(request, texts())])

    check_audio(asyncio.run(main()), "mp3", 32000)


def test_legacy_http_session(srv: LiveServer) -> None:
    from fish_audio_sdk import Session

    with Session("anything", base_url=srv.http) as s:
        data = b"".join(s.tts(ShortLegacyRequest(text="Legacy HTTP request.", format="wav")))
    check_audio(data, "wav", 44100)


def test_legacy_cloning_and_errors(srv: LiveServer, ref_wav: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """The legacy SDK clones from inline references over WebSocket and HTTP, and raises its own errors for a voice
    the server does not have (WebSocketErr from finish/error; HttpCodeErr with the JSON error's status)."""
    from fish_audio_sdk import HttpCodeErr, ReferenceAudio, Session, WebSocketErr, WebSocketSession

    short_legacy_websocket(monkeypatch)
    refs = [ReferenceAudio(audio=ref_wav, text="The quick brown fox jumps over the lazy dog.")]
    with WebSocketSession("anything", base_url=srv.http) as ws:
        pcm = b"".join(ws.tts(ShortLegacyRequest(text="", format="pcm", sample_rate=24000, references=refs),
                              iter(["Cloned by the legacy SDK."])))
        with pytest.raises(WebSocketErr):
            b"".join(ws.tts(ShortLegacyRequest(text="", format="pcm", reference_id="no-such-voice"),
                            iter(["Nobody."])))
    check_audio(pcm, "pcm", 24000)
    with Session("anything", base_url=srv.http) as s:
        check_audio(b"".join(s.tts(ShortLegacyRequest(text="Cloned over HTTP.", format="wav", references=refs))),
                    "wav", 44100)
        with pytest.raises(HttpCodeErr) as err:
            b"".join(s.tts(ShortLegacyRequest(text="Nobody.", format="wav", reference_id="no-such-voice")))
    assert err.value.status == 400  # (the legacy SDK reports the reason phrase, not the JSON message)


# -------------------------------------------------------------------------------------------------------------- HTTP


def test_http_convert_and_stream(client: FishAudio) -> None:
    check_audio(client.tts.convert(text="Hello from HTTP.", format="mp3", config=SHORT), "mp3", 44100)
    chunks = list(client.tts.stream(text="Streaming HTTP.", config=_config("opus", None)))
    check_audio(b"".join(chunks), "opus", 48000)


# ------------------------------------------------------------------------------------------------------------ voices


def test_inline_reference_cloning(srv: LiveServer, client: FishAudio, ref_wav: bytes,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Inline references clone over WebSocket and HTTP; the audio is encoded once, then comes from the content-hash
    cache (the same clip sent again costs no codec encode)."""
    audio = ref_wav + b"\0\0"  # a clip no other test sent (trailing bytes in the data chunk's slack)
    encodes: list[int] = []
    encoder = srv.rt.voices.encoder
    monkeypatch.setattr(srv.rt.voices, "encoder", lambda a: (encodes.append(len(a)), encoder(a))[1])
    refs = [ReferenceAudio(audio=audio, text="The quick brown fox jumps over the lazy dog.")]
    for _ in range(2):
        data = b"".join(client.tts.stream_websocket(iter(["Cloned voice. "]), references=refs,
                                                    config=_config("pcm", 24000)))
        check_audio(data, "pcm", 24000)
    check_audio(client.tts.convert(text="Cloned over HTTP.", references=refs, config=_config("wav", None)),
                "wav", 44100)
    assert encodes == [len(audio)]


def test_reference_id_lifecycle(srv: LiveServer, client: FishAudio, ref_wav: bytes) -> None:
    with httpx.Client(base_url=srv.http, timeout=30) as h:
        r = h.post("/v1/references/add", data={"id": "voice-1", "text": "The quick brown fox."},
                   files={"audio": ("ref.wav", ref_wav, "audio/wav")})
        assert r.status_code == 200, r.text
        assert r.json()["reference"]["id"] == "voice-1"
        assert r.json()["reference"]["frames"] == 22  # ceil(44100 / 2048)
        assert "voice-1" in h.get("/v1/references/list").json()["reference_ids"]

        data = b"".join(client.tts.stream_websocket(iter(["Stored voice. "]), reference_id="voice-1",
                                                    config=_config("pcm", 16000)))
        check_audio(data, "pcm", 16000)
        check_audio(client.tts.convert(text="Stored voice over HTTP.", reference_id="voice-1", config=SHORT),
                    "mp3", 44100)

        assert h.delete("/v1/references/delete", params={"id": "voice-1"}).status_code == 200
        assert "voice-1" not in h.get("/v1/references/list").json()["reference_ids"]
        r = h.delete("/v1/references/delete", params={"id": "voice-1"})
        assert r.status_code == 404 and "voice-1" in r.json()["message"]

    # The deleted (now unknown) voice: finish/error, which the SDK raises.
    with pytest.raises(WebSocketError):
        list(client.tts.stream_websocket(iter(["Nobody. "]), reference_id="voice-1", format="pcm"))


def test_sdk_voice_management(srv: LiveServer, client: FishAudio, ref_wav: bytes) -> None:
    """client.voices (GET/POST /model, GET/PATCH/DELETE /model/{id}) over the server's voice store: a voice cloned
    from two clips is listed, filtered, read, used as reference_id, edited and deleted; a clip without its
    transcript is refused (no speech recognition here); voices added through /v1/references/add are listed too."""
    voice = client.voices.create(title="Narrator", voices=[ref_wav, ref_wav],
                                 texts=["The quick brown fox.", "Jumps over the lazy dog."],
                                 description="Two clips", tags=["en", "calm"])
    assert len(voice.id) == 32 and voice.title == "Narrator" and voice.state == "trained"
    assert voice.tags == ["en", "calm"] and voice.visibility == "private" and voice.description == "Two clips"
    assert client.voices.get(voice.id).title == "Narrator"

    def ids(**filters: Any) -> list[str]:
        return [v.id for v in client.voices.list(page_size=100, **filters).items]

    assert voice.id in ids() and voice.id in ids(tags=["calm"]) and voice.id in ids(title="narr")
    assert voice.id not in ids(tags=["calm", "fr"]) and voice.id not in ids(title="zzz")
    check_audio(client.tts.convert(text="Cloned by the SDK.", reference_id=voice.id, config=SHORT), "mp3", 44100)

    client.voices.update(voice.id, title="Narrator 2", visibility="unlist")
    edited = client.voices.get(voice.id)
    assert (edited.title, edited.visibility, edited.tags) == ("Narrator 2", "unlist", ["en", "calm"])
    assert edited.updated_at >= edited.created_at

    with httpx.Client(base_url=srv.http, timeout=30) as h:
        r = h.post("/v1/references/add", data={"id": "listed-too", "text": "The quick brown fox."},
                   files={"audio": ("ref.wav", ref_wav, "audio/wav")})
        assert r.status_code == 200, r.text
    assert "listed-too" in ids() and client.voices.get("listed-too").title == "listed-too"
    page = client.voices.list(page_size=1, page_number=2)
    assert page.total >= 2 and len(page.items) == 1

    with pytest.raises(APIError) as bad:
        client.voices.create(title="No transcript", voices=[ref_wav])
    assert bad.value.status == 422 and "transcribe" in bad.value.message
    with pytest.raises(APIError) as bad:
        client.voices.update(voice.id, visibility="everyone")  # type: ignore[arg-type]
    assert bad.value.status == 422

    client.voices.delete(voice.id)
    client.voices.delete("listed-too")
    with pytest.raises(NotFoundError):
        client.voices.get(voice.id)
    with pytest.raises(NotFoundError):
        client.voices.delete(voice.id)
