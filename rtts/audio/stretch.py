"""Streaming time-stretch (tempo change without pitch change) by WSOLA, in numpy.

WSOLA (waveform-similarity overlap-add): output frames of length N are laid down every Hs = N/2 samples with a
periodic Hann window (which sums to exactly 1 at 50 % overlap). Frame k is nominally read from the input at
k * Hs * speed; within +-`search` samples of that point we pick the start whose first half best matches the natural
continuation of the previous frame, so the overlapping halves are in phase and no pitch change or clicks occur.

The result depends only on the input signal, never on how it was chunked: a frame is processed as soon as every
sample it could look at has arrived, and all per-frame arithmetic has fixed sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

FRAME_SECONDS = 0.030  # ~30 ms frames: long enough for 2+ periods of low voices, short enough to track phonemes
SEARCH_SECONDS = 0.008  # +-8 ms covers a full period of a 62 Hz voice, so a good alignment always exists
_SILENCE = 1e-10  # template energy below this: nothing to align, stay on the nominal time grid


@dataclass(frozen=True)
class _Geometry:
    frame: int  # N, even
    hop_out: int  # Hs = N / 2
    hop_in: float  # Ha = Hs * speed (fractional; rounded per frame from k * Ha so it never drifts)
    search: int  # maximum offset from the nominal read position
    nfft: int  # FFT size for the similarity search (>= candidate region length)
    window: np.ndarray  # periodic Hann, length N
    first_window: np.ndarray  # frame 0: flat first half, because nothing overlaps it


def _geometry(speed: float, sample_rate: int) -> _Geometry:
    half = max(16, round(FRAME_SECONDS * sample_rate / 2))
    frame = 2 * half
    search = max(1, round(SEARCH_SECONDS * sample_rate))
    n = np.arange(frame)
    window = (0.5 - 0.5 * np.cos(2.0 * np.pi * n / frame)).astype(np.float32)
    first = window.copy()
    first[:half] = 1.0
    region = 2 * search + half
    nfft = 1 << (region - 1).bit_length()
    return _Geometry(frame, half, half * speed, search, nfft, window, first)


@dataclass
class _State:
    buf: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # input from absolute index `start`
    start: int = 0
    received: int = 0  # total input samples pushed
    k: int = 0  # index of the next output frame
    prev_pos: int = 0  # absolute input index where frame k-1 was read
    acc: np.ndarray | None = None  # overlap-add accumulator for output samples [k*Hs, k*Hs + N)
    emitted: int = 0
    finished: bool = False


class TimeStretcher:
    """Chunk-by-chunk WSOLA; output length after finish() is round(input_length / speed)."""

    def __init__(self, speed: float, sample_rate: int) -> None:
        if not (math.isfinite(speed) and 0.25 <= speed <= 2.0):
            raise ValueError(f"speed {speed!r} is outside 0.25..2")
        self.speed = float(speed)
        self.sample_rate = int(sample_rate)
        self._g = _geometry(self.speed, self.sample_rate)
        self._s = _State(acc=np.zeros(self._g.frame, np.float32))

    # ------------------------------------------------------------------ public

    def push(self, x: np.ndarray) -> np.ndarray:
        """Feed mono float32 input; returns the output samples that are final now (may be empty)."""
        s = self._s
        if s.finished:
            raise RuntimeError("TimeStretcher.push after finish")
        x = np.asarray(x, dtype=np.float32).reshape(-1)
        if x.size:
            s.buf = np.concatenate([s.buf, x])
            s.received += x.size
        out = []
        while self._frame_ready(s.received):
            out.append(self._process_frame())
        return np.concatenate(out) if out else np.zeros(0, np.float32)

    def finish(self) -> np.ndarray:
        """Pad with silence, run frames until round(total / speed) samples are out, return the rest."""
        s = self._s
        if s.finished:
            raise RuntimeError("TimeStretcher.finish called twice")
        s.finished = True
        target = round(s.received / self.speed)
        out = []
        done = s.emitted
        while done < target:
            # Pad so the next frame has everything it may look at (the padding is silence past the end).
            need = self._frame_need() - (s.start + s.buf.size)
            if need > 0:
                s.buf = np.concatenate([s.buf, np.zeros(need, np.float32)])
            piece = self._process_frame()
            out.append(piece)
            done += piece.size
        tail = np.concatenate(out) if out else np.zeros(0, np.float32)
        keep = max(0, target - (s.emitted - tail.size))
        return tail[:keep]

    # ------------------------------------------------------------------ internals

    def _nominal(self, k: int) -> int:
        return int(math.floor(k * self._g.hop_in + 0.5))

    def _frame_need(self) -> int:
        """Absolute input index one past the last sample frame k may read."""
        g, k = self._g, self._s.k
        if k == 0:
            return g.frame
        return self._nominal(k) + g.search + g.frame

    def _frame_ready(self, available: int) -> bool:
        return available >= self._frame_need()

    def _choose_position(self) -> int:
        """Start of the input segment for frame k: the best match to the natural continuation of frame k-1."""
        g, s = self._g, self._s
        if s.k == 0:
            return 0
        nominal = self._nominal(s.k)
        lo = max(nominal - g.search, 0)
        hi = nominal + g.search
        half = g.hop_out
        natural = s.prev_pos + half
        template = s.buf[natural - s.start : natural - s.start + half].astype(np.float64)
        t_energy = float(np.dot(template, template))
        if t_energy < _SILENCE:
            return nominal
        region = s.buf[lo - s.start : hi - s.start + half].astype(np.float64)
        # Cross-correlation of every candidate with the template through one FFT pair (region fits in nfft).
        spec = np.fft.rfft(region, g.nfft) * np.conj(np.fft.rfft(template, g.nfft))
        lags = region.size - half + 1
        corr = np.fft.irfft(spec, g.nfft)[:lags]
        csum = np.concatenate([[0.0], np.cumsum(region * region)])
        energy = csum[half : half + lags] - csum[:lags]
        score = corr / np.sqrt(np.maximum(energy, _SILENCE) * t_energy)
        return lo + int(np.argmax(score))

    def _process_frame(self) -> np.ndarray:
        g, s = self._g, self._s
        pos = self._choose_position()
        seg = s.buf[pos - s.start : pos - s.start + g.frame]
        acc = s.acc
        assert acc is not None
        acc += seg * (g.first_window if s.k == 0 else g.window)
        out = acc[: g.hop_out].copy()
        acc[: g.hop_out] = acc[g.hop_out :]
        acc[g.hop_out :] = 0.0
        s.prev_pos = pos
        s.k += 1
        s.emitted += out.size
        self._trim_input()
        return out

    def _trim_input(self) -> None:
        """Drop input no future frame can read: before both the next search window and the next template."""
        g, s = self._g, self._s
        keep_from = min(self._nominal(s.k) - g.search, s.prev_pos + g.hop_out)
        drop = keep_from - s.start
        if drop > 0:
            s.buf = s.buf[drop:]
            s.start = keep_from


def stretch(x: np.ndarray, speed: float, sample_rate: int) -> np.ndarray:
    """One-shot convenience wrapper (same result as any chunking of the streaming version)."""
    ts = TimeStretcher(speed, sample_rate)
    return np.concatenate([ts.push(x), ts.finish()])
