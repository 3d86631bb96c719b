"""Reading reference audio (files or bytes) into mono float32 at the codec's sample rate, and writing WAV files.

libsndfile reads WAV, FLAC, Ogg (Vorbis, Opus), MP3, AIFF and CAF in-process. What it cannot read, the formats phones
and browsers record (M4A/MP4 with AAC, WebM with Opus), goes through an ffmpeg binary (rtts/audio/ffmpeg.py). What
neither reads is refused with an error naming the format its leading bytes show.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr

from rtts.audio import ffmpeg
from rtts.audio.encode import float_to_s16


class AudioError(ValueError):
    """Audio that cannot be decoded or is unusable (empty, too long)."""


def to_mono(data: np.ndarray) -> np.ndarray:
    """[N] or [N, C] -> [N] float32 (channel mean, like the reference loader)."""
    data = np.asarray(data, dtype=np.float32)
    return data.mean(axis=1) if data.ndim == 2 else data


def resample(audio: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """One-shot high-quality resampling of a whole signal (mono float32)."""
    if from_rate == to_rate:
        return audio.astype(np.float32, copy=False)
    return soxr.resample(audio, from_rate, to_rate, quality="HQ").astype(np.float32, copy=False)


MAX_CHANNELS = 8  # reference audio is mixed to mono; more channels than this is not a voice recording


def read_audio(source: str | Path | bytes, sample_rate: int, max_seconds: float | None = None) -> np.ndarray:
    """Decode any audio libsndfile or ffmpeg reads -> mono float32 in [-1, 1] at `sample_rate`."""
    name = "audio bytes" if isinstance(source, bytes) else str(source)
    if isinstance(source, (str, Path)) and not Path(source).is_file():
        raise AudioError(f"{name}: file not found")
    try:
        audio, rate = _read_libsndfile(source, name, max_seconds)
    except _NotForLibsndfile:
        audio, rate = _read_ffmpeg(source, name, sample_rate, max_seconds), sample_rate
    if audio.size == 0:
        raise AudioError(f"{name}: audio is empty")
    if max_seconds is not None and audio.size / rate > max_seconds:
        raise AudioError(f"{name}: audio is {audio.size / rate:.1f} s long, the limit is {max_seconds:g} s")
    if not np.isfinite(audio).all():
        raise AudioError(f"{name}: audio contains NaN or infinite samples")
    return resample(audio, int(rate), sample_rate)


class _NotForLibsndfile(Exception):
    """libsndfile cannot decode this input: ffmpeg may."""


def _read_libsndfile(source: str | Path | bytes, name: str, max_seconds: float | None) -> tuple[np.ndarray, int]:
    try:
        f = io.BytesIO(source) if isinstance(source, bytes) else source
        if max_seconds is not None:
            # From the header, before decoding: a few hundred KB of compressed silence can claim minutes of
            # multichannel high-rate audio, gigabytes once decoded to float32.
            info = sf.info(f)
            if info.frames / info.samplerate > max_seconds:
                raise AudioError(f"{name}: audio is {info.frames / info.samplerate:.1f} s long, the limit is "
                                 f"{max_seconds:g} s")
            if info.channels > MAX_CHANNELS:
                raise AudioError(f"{name}: audio has {info.channels} channels, the limit is {MAX_CHANNELS}")
            if isinstance(f, io.BytesIO):
                f.seek(0)
        data, rate = sf.read(f, dtype="float32", always_2d=False)
    except AudioError:
        raise
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError):
        raise _NotForLibsndfile from None
    return to_mono(data), int(rate)


def _read_ffmpeg(source: str | Path | bytes, name: str, sample_rate: int, max_seconds: float | None) -> np.ndarray:
    """What libsndfile refused, through ffmpeg with the container its leading bytes name (mixed to mono, resampled
    and cut at one second past `max_seconds` by ffmpeg itself)."""
    if isinstance(source, bytes):
        head = source[:64]
    else:
        with open(source, "rb") as fh:
            head = fh.read(64)
    container = ffmpeg.sniff(head)
    if container is None:
        raise AudioError(f"{name}: cannot decode audio: {ffmpeg.describe_unknown(head)}")
    try:
        audio = ffmpeg.decode(source if isinstance(source, bytes) else Path(source), container, sample_rate,
                              max_seconds)
    except ffmpeg.FfmpegError as e:
        raise AudioError(f"{name}: cannot decode {container.name} audio: {e}") from None
    if max_seconds is not None and audio.size > max_seconds * sample_rate:  # (decoded up to a second past it)
        raise AudioError(f"{name}: audio is longer than the limit of {max_seconds:g} s")
    return audio


def write_wav(path: str | Path, audio: np.ndarray, sample_rate: int) -> None:
    """Mono float audio -> 16-bit PCM WAV (clipped to [-1, 1] first; the reference's int16 cast wraps instead)."""
    # Quantize with the live server's converter (round(x * 32767)), not libsndfile's (floor(x * 32768)): the same
    # waveform then gives the same int16 samples from `rtts synth` and from a pcm/wav session.
    sf.write(str(path), float_to_s16(np.asarray(audio, dtype=np.float32)), sample_rate, subtype="PCM_16")
