"""The voice-agent frameworks' own Fish Audio plugins, unmodified, against a real rtts server: LiveKit's
`livekit-plugins-fishaudio` (its TTS object, over HTTP and over the live WebSocket) and Pipecat's
`FishAudioTTSService` (run in a pipeline). Every assertion is on what the plugin yields: frames, their sample rate
and channels, and as much audio as the server generated (its frame counter on /metrics)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import httpx
import pytest
from conftest import REF_TEXT, metric
from livekit.agents import APIConnectOptions, APIStatusError
from livekit.plugins import fishaudio
from liveserver import LiveServer
from pipecat.frames.frames import EndFrame, ErrorFrame, Frame, TTSAudioRawFrame, TTSSpeakFrame, TTSStoppedFrame
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.fish.tts import FishAudioTTSService
from pipecat.services.openai.tts import OpenAITTSService
from pipecat.workers.runner import WorkerRunner

FRAME_SECONDS = 2048 / 44100  # one codec frame of the tiny checkpoint's codec
# A turn's short last pcm / wav message is lifted over Pipecat's 1024-byte floor with up to 513 samples of silence.
PAD_SECONDS = 513 / 24000
WAIT = 120.0  # seconds: a missing end fails the test instead of hanging it


def generated(srv: LiveServer) -> float:
    """Seconds of audio the server has generated so far."""
    return metric(srv, "rtts_frames_generated_total") * FRAME_SECONDS


@contextlib.asynccontextmanager
async def livekit_tts(srv: LiveServer, **options: object) -> AsyncIterator[fishaudio.TTS]:
    # The plugin takes the server's URL (base_url) and an aiohttp session (outside a LiveKit job there is no shared
    # http context). max_new_tokens keeps the random-weight model's turns short.
    async with aiohttp.ClientSession() as http:
        tts = fishaudio.TTS(api_key="local", base_url=srv.http, http_session=http, max_new_tokens=12,
                            **options)  # type: ignore[arg-type]
        try:
            yield tts
        finally:
            await tts.aclose()


def test_livekit_synthesize_over_http(srv: LiveServer) -> None:
    """`TTS.synthesize`: the plugin's ChunkedStream posts to /v1/tts and decodes the streamed WAV into frames."""

    async def run() -> list[fishaudio.tts.tts.SynthesizedAudio]:
        async with livekit_tts(srv) as tts:
            return [ev async for ev in tts.synthesize("Hello there.")]

    before = generated(srv)
    events = asyncio.run(asyncio.wait_for(run(), WAIT))
    frames = [ev.frame for ev in events]
    assert frames and {(f.sample_rate, f.num_channels) for f in frames} == {(24000, 1)}
    seconds = sum(f.samples_per_channel for f in frames) / 24000
    assert seconds == pytest.approx(generated(srv) - before, abs=0.005)
    srv.wait_idle()


@pytest.mark.parametrize("fmt,rate", [("wav", 24000), ("pcm", 16000), ("opus", 48000), ("mp3", 32000)])
def test_livekit_stream_over_the_websocket(srv: LiveServer, fmt: str, rate: int) -> None:
    """`TTS.stream`: text pushed in pieces, one flush per sentence on the live WebSocket, one segment of frames."""

    async def run() -> list[fishaudio.tts.tts.SynthesizedAudio]:
        async with livekit_tts(srv, output_format=fmt, sample_rate=rate) as tts:
            stream = tts.stream()
            for piece in ("Hello there. ", "This is the ", "second sentence."):
                stream.push_text(piece)
            stream.end_input()
            return [ev async for ev in stream]

    before = generated(srv)
    events = asyncio.run(asyncio.wait_for(run(), WAIT))
    frames = [ev.frame for ev in events]
    assert frames and {(f.sample_rate, f.num_channels) for f in frames} == {(rate, 1)}
    assert len({ev.segment_id for ev in events}) == 1 and events[-1].is_final
    seconds = sum(f.samples_per_channel for f in frames) / rate
    expected = generated(srv) - before
    if fmt in ("opus", "mp3"):
        # LiveKit's streaming Ogg decoder yields one 20 ms Opus frame less than the stream holds (PyAV and libsndfile
        # decode all of it); MP3 adds the encoder's delay; a sentence's held end may come out with the silence that
        # releases it.
        assert expected - 0.025 <= seconds <= expected + 0.5, (seconds, expected)
    else:
        assert expected - 0.005 <= seconds <= expected + 2 * PAD_SECONDS + 0.005, (seconds, expected)
    srv.wait_idle()


def test_livekit_unknown_voice_is_an_error(srv: LiveServer) -> None:
    async def run() -> None:
        async with livekit_tts(srv, voice_id="no-such-voice") as tts:
            stream = tts.stream(conn_options=APIConnectOptions(max_retry=0))  # a refusal is final: no retries
            stream.push_text("Hello there.")
            stream.end_input()
            async for _ in stream:
                pass

    with pytest.raises(APIStatusError) as e:
        asyncio.run(asyncio.wait_for(run(), WAIT))
    assert "no-such-voice" in str(e.value.body)  # the server's finish/error message, which the plugin keeps
    srv.wait_idle()


class Collect(FrameProcessor):
    """The end of the pipeline: keeps the TTS service's audio frames and errors, notes its stop frame."""

    def __init__(self) -> None:
        super().__init__()
        self.audio: list[TTSAudioRawFrame] = []
        self.errors: list[ErrorFrame] = []
        self.stopped = asyncio.Event()

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, TTSAudioRawFrame):
            self.audio.append(frame)
        elif isinstance(frame, ErrorFrame):
            self.errors.append(frame)
        elif isinstance(frame, TTSStoppedFrame):
            self.stopped.set()
        await self.push_frame(frame, direction)


def test_pipecat_fish_service_in_a_pipeline(srv: LiveServer) -> None:
    """FishAudioTTSService speaks one TTSSpeakFrame per sentence on one live session (start once, then text + flush
    per sentence, as it does in a call); its frames are 24 kHz mono pcm, none at or under Pipecat's 1024-byte
    floor, and they add up to the audio the server generated."""

    async def run() -> Collect:
        tts = FishAudioTTSService(api_key="local")
        # The service hard-codes Fish's hosted URL in this attribute (no base-URL option): the one patch, to the
        # local server. Everything else runs as shipped.
        tts._base_url = srv.ws + "/v1/tts/live"
        collect = Collect()
        worker = PipelineWorker(Pipeline([tts, collect]))
        runner = WorkerRunner(handle_sigint=False)
        await runner.add_workers(worker)
        running = asyncio.create_task(runner.run())
        for sentence in ("This is a test of the plugin.", "Here is another sentence."):
            collect.stopped.clear()
            await worker.queue_frame(TTSSpeakFrame(sentence))
            # The service ends an utterance's audio when none has come for its stop timeout (3 s by default).
            await collect.stopped.wait()
        await worker.queue_frame(EndFrame())
        await running
        return collect

    before = generated(srv)
    collect = asyncio.run(asyncio.wait_for(run(), WAIT))
    assert not collect.errors, collect.errors
    frames = collect.audio
    assert frames and {(f.sample_rate, f.num_channels) for f in frames} == {(24000, 1)}
    assert min(len(f.audio) for f in frames) > 1024
    seconds = sum(len(f.audio) for f in frames) / 2 / 24000
    expected = generated(srv) - before
    assert expected - 0.005 <= seconds <= expected + 2 * PAD_SECONDS + 0.005, (seconds, expected)
    srv.wait_idle()


def test_pipecat_openai_service_in_a_pipeline(srv: LiveServer, ref_wav: bytes) -> None:
    """Pipecat's OpenAITTSService (the `openai` client with its base_url) on POST /v1/audio/speech. It allows only
    OpenAI's voice names, so the voice is stored under one; it reads raw pcm as 24 kHz, which rtts sends."""
    r = httpx.post(srv.http + "/v1/references/add", files={"audio": ("a.wav", ref_wav, "audio/wav")},
                   data={"id": "alloy", "text": REF_TEXT})
    assert r.status_code == 200, r.text

    async def run() -> Collect:
        tts = OpenAITTSService(api_key="local", base_url=srv.http + "/v1", settings=OpenAITTSService.Settings(
            voice="alloy"))
        collect = Collect()
        worker = PipelineWorker(Pipeline([tts, collect]))
        runner = WorkerRunner(handle_sigint=False)
        await runner.add_workers(worker)
        running = asyncio.create_task(runner.run())
        await worker.queue_frame(TTSSpeakFrame("Good morning."))  # (a short turn of the tiny model in this voice)
        await collect.stopped.wait()
        await worker.queue_frame(EndFrame())
        await running
        return collect

    before = generated(srv)
    collect = asyncio.run(asyncio.wait_for(run(), WAIT))
    assert not collect.errors, collect.errors
    frames = collect.audio
    assert frames and {(f.sample_rate, f.num_channels) for f in frames} == {(24000, 1)}
    seconds = sum(len(f.audio) for f in frames) / 2 / 24000
    assert seconds == pytest.approx(generated(srv) - before, abs=0.005)
    srv.wait_idle()
