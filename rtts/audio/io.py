"""Reading reference audio (files or bytes) into mono float32 at the codec's sample rate, and writing WAV files."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr

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
    """Decode WAV/FLAC/OGG/MP3 (anything libsndfile reads) -> mono float32 in [-1, 1] at `sample_rate`."""
    name = "audio bytes" if isinstance(source, bytes) else str(source)
    if isinstance(source, (str, Path)) and not Path(source).is_file():
        raise AudioError(f"{name}: file not found")
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
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as e:
        raise AudioError(f"{name}: cannot decode audio ({e})") from None
    audio = to_mono(data)
    if audio.size == 0:
        raise AudioError(f"{name}: audio is empty")
    if max_seconds is not None and audio.size / rate > max_seconds:
        raise AudioError(f"{name}: audio is {audio.size / rate:.1f} s long, the limit is {max_seconds:g} s")
    if not np.isfinite(audio).all():
        raise AudioError(f"{name}: audio contains NaN or infinite samples")
    return resample(audio, int(rate), sample_rate)


def write_wav(path: str | Path, audio: np.ndarray, sample_rate: int) -> None:
    """Mono float audio -> 16-bit PCM WAV (clipped to [-1, 1] first; the reference's int16 cast wraps instead)."""
    # Quantize with the live server's converter (round(x * 32767)), not libsndfile's (floor(x * 32768)): the same
    # waveform then gives the same int16 samples from `rtts synth` and from a pcm/wav session.
    sf.write(str(path), float_to_s16(np.asarray(audio, dtype=np.float32)), sample_rate, subtype="PCM_16")
