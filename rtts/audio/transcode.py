"""Streaming output in every format of the OpenAI speech API (mp3, opus, aac, flac, wav, pcm) at tempos 0.25-4x.

Pipeline per push (stateful, so any chunking of the input gives the same stream):

    float32 @ input_rate -> time-stretch (one or two WSOLA stages) -> StreamEncoder (resample, clip, then mp3 /
        Ogg Opus / wav / pcm; flac and aac take its 16-bit pcm) -> FLAC (libsndfile, in-process) | AAC (ADTS, ffmpeg)

Every piece of output goes to an async `emit` callback as soon as it exists: AAC comes from ffmpeg's output, read by a
task of its own, so pushing and emitting are not one-to-one.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

import numpy as np
import soundfile as sf

from rtts.audio.containers import MemoryFile
from rtts.audio.encode import SAMPLE_RATES, OutputSpec, StreamEncoder
from rtts.audio.ffmpeg import AacStream
from rtts.audio.stretch import TimeStretcher

FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
# pcm is the OpenAI API's raw format, 24 kHz (clients hard-code the rate), and wav follows it; the compressed formats
# keep the model's 44.1 kHz (Opus: 48 kHz, its only rate), which their headers state.
DEFAULT_RATE = {"mp3": 44100, "opus": 48000, "aac": 44100, "flac": 44100, "wav": 24000, "pcm": 24000}
RATES: dict[str, tuple[int, ...]] = {**{f: SAMPLE_RATES[f] for f in ("mp3", "opus", "wav", "pcm")},
                                     "aac": SAMPLE_RATES["pcm"], "flac": SAMPLE_RATES["pcm"]}
CONTENT_TYPES = {"mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac", "flac": "audio/flac",
                 "wav": "audio/wav", "pcm": "audio/pcm"}
SPEED_RANGE = (0.25, 4.0)
_STAGE_MAX_SPEED = 2.0  # one WSOLA stage's range is 0.25..2; faster tempos take two stages of sqrt(speed)

Emit = Callable[[bytes], Awaitable[None]]


class WideStretcher:
    """Tempo change over 0.25..4: one TimeStretcher up to 2x, two of sqrt(speed) each above (a WSOLA stage skips at
    most half of each frame's input, so 4x in one stage would drop whole frames)."""

    def __init__(self, speed: float, sample_rate: int) -> None:
        if not (math.isfinite(speed) and SPEED_RANGE[0] <= speed <= SPEED_RANGE[1]):
            raise ValueError(f"speed {speed!r} is outside {SPEED_RANGE[0]:g}..{SPEED_RANGE[1]:g}")
        stages = 1 if speed <= _STAGE_MAX_SPEED else 2
        self.stages = [TimeStretcher(speed ** (1 / stages), sample_rate) for _ in range(stages)]

    def push(self, x: np.ndarray) -> np.ndarray:
        for stage in self.stages:
            x = stage.push(x)
        return x

    def finish(self) -> np.ndarray:
        x = np.zeros(0, np.float32)
        for stage in self.stages:
            x = np.concatenate([stage.push(x), stage.finish()]) if x.size else stage.finish()
        return x


class _FlacWriter:
    """16-bit FLAC by libsndfile into memory, handed out as written. The STREAMINFO block goes out first, before
    the length and checksum are known, so it says 0 (unknown) for both, as any streamed FLAC does."""

    def __init__(self, sample_rate: int) -> None:
        self._file = MemoryFile()
        self._sf = sf.SoundFile(self._file, mode="w", samplerate=sample_rate, channels=1, format="FLAC",
                                subtype="PCM_16")

    def write(self, pcm_s16: bytes) -> bytes:
        if pcm_s16:
            self._sf.write(np.frombuffer(pcm_s16, dtype="<i2"))  # int16 in, int16 coded: no second rounding
        return self._file.take()

    def close(self) -> bytes:
        self._sf.close()
        return self._file.take()


class SpeechEncoder:
    """One response's audio: `start()`, then `push()` model PCM as it arrives, then `finish()` once; `abort()` at any
    time stops it (an AAC encoder's process included)."""

    def __init__(self, fmt: str, sample_rate: int, speed: float, input_rate: int, emit: Emit) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
        if sample_rate not in RATES[fmt]:
            raise ValueError(f"sample rate {sample_rate} is not one of {RATES[fmt]} for {fmt}")
        self.format = fmt
        self.sample_rate = sample_rate
        self._emit = emit
        self._stretch = WideStretcher(speed, input_rate) if speed != 1.0 else None
        # flac and aac are encoded from StreamEncoder's 16-bit pcm at the output rate.
        base = fmt if fmt in ("mp3", "opus", "wav", "pcm") else "pcm"
        self._base = StreamEncoder(OutputSpec(format=base, sample_rate=sample_rate), input_rate)
        self._flac = _FlacWriter(sample_rate) if fmt == "flac" else None
        self._aac = AacStream(sample_rate, emit) if fmt == "aac" else None

    @property
    def content_type(self) -> str:
        return CONTENT_TYPES[self.format]

    async def start(self) -> None:
        if self._aac is not None:
            await self._aac.start()

    async def push(self, pcm: np.ndarray) -> None:
        """Mono float32 at the input rate."""
        x = np.asarray(pcm, dtype=np.float32).reshape(-1)
        if self._stretch is not None:
            x = self._stretch.push(x)
        await self._out(self._base.push(x))

    async def finish(self) -> None:
        """The end of the audio: out with everything each stage still holds."""
        tail = self._stretch.finish() if self._stretch is not None else np.zeros(0, np.float32)
        await self._out(self._base.push(tail) + self._base.finish())
        if self._flac is not None:
            await self._emit_some(self._flac.close())
        if self._aac is not None:
            await self._aac.finish()

    def abort(self) -> None:
        if self._aac is not None:
            self._aac.abort()

    async def _out(self, data: bytes) -> None:
        if self._flac is not None:
            data = self._flac.write(data)
        elif self._aac is not None:
            if data:
                await self._aac.push(data)
            return
        await self._emit_some(data)

    async def _emit_some(self, data: bytes) -> None:
        if data:
            await self._emit(data)
