"""Streaming loudness normalization (`prosody.normalize_loudness`): a causal gain control toward a target loudness.

The audio is sent while it is generated, so there is no look-ahead: the gain for a sample depends only on audio
before it. Loudness is measured as ITU-R BS.1770 does (K-weighted mean square over 400 ms blocks, in LUFS), every
100 ms at fixed positions of the stream (the mean of the last four 100 ms hops' K-weighted powers, each from one
FFT), so any chunking of the input gives the same output:

- a block counts when its newest hop is above -45 LUFS (pauses and near-silence at a turn's start don't), and is the
  mean of its hops above that gate (a block straddling a pause measures the speech, not the speech and the pause);
- the estimate is BS.1770's integrated loudness over the last HORIZON_HOPS counted blocks (5 s of speech): their
  mean, then the mean of those within 10 LU of it. A loud burst or an early quiet stretch moves it only while it is
  in the horizon and above the relative gate, never for the rest of the session;
- the gain goes toward TARGET_LUFS - estimate (within +-MAX_GAIN_DB) at a bounded rate, ramped linearly in dB within
  each 100 ms hop: 3 dB per hop for the first second of counted speech; after it 0.6 dB per hop up and 3 dB per hop down
  (a voice that gets louder is corrected fast, one that gets quieter slowly);
- samples above 0.9 go through a soft clipper (never past 1.0) instead of the encoder's hard clip. The meter reads the
  input clipped to [-1, 1] with NaN as 0, so no sample value can poison it.

Each session starts from unity gain: a session's audio never depends on what came before it (tests/test_server.py
holds the server to that), so no loudness is remembered across sessions. The first ~100 ms of a session are at the
model's own level, and a voice far from the target reaches it within a few hundred ms.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

TARGET_LUFS = -20.0  # speech peaks ~15-18 dB above its loudness: below full scale without a limiter
MAX_GAIN_DB = 15.0
GATE_LUFS = -45.0  # below: not speech (TTS output this quiet is silence, noise or a breath)
RELATIVE_GATE_LU = 10.0  # BS.1770's relative gate
HOP_SECONDS = 0.1
WINDOW_HOPS = 4  # 400 ms blocks (BS.1770 momentary loudness)
HORIZON_HOPS = 50  # counted blocks behind the estimate: 5 s of speech
YOUNG_HOPS = 10  # counted blocks (1 s of speech) before the gain slows down
SLEW_YOUNG_DB = 3.0  # per hop, either way, for the first second of speech
SLEW_DB = 0.6  # per hop after it, upward (a slow rise: no pumping on quiet words)
SLEW_DOWN_DB = 3.0  # per hop, downward at any time (too loud is corrected fast)
KNEE = 0.9  # soft clip above this magnitude
# The gates as mean squares: the meter compares powers, not logarithms (it runs for every 100 ms of every stream)
GATE_POWER = 10 ** ((GATE_LUFS + 0.691) / 10)
RELATIVE_GATE_FACTOR = 10 ** (-RELATIVE_GATE_LU / 10)
_DB_TO_LN = math.log(10) / 20  # amplitude = exp(dB * _DB_TO_LN)


def _k_weighting_power(rate: int, n: int) -> np.ndarray:
    """|H(f)|^2 of BS.1770's K-weighting (a +4 dB high shelf above ~1.7 kHz and a ~38 Hz high-pass), both biquads
    designed for `rate`, at the n // 2 + 1 bins of an n-point real FFT."""
    z = np.exp(-2j * np.pi * np.arange(n // 2 + 1) / n)  # e^{-jw} at the FFT's bins

    def biquad_power(b: tuple[float, float, float], a: tuple[float, float, float]) -> np.ndarray:
        return np.abs((b[0] + b[1] * z + b[2] * z * z) / (a[0] + a[1] * z + a[2] * z * z)) ** 2

    # The two stages in the bilinear form that reproduces BS.1770's 48 kHz coefficients at any rate: a high shelf
    # (f0 1681.97 Hz, +4 dB, Q 0.7072) and a high-pass (f0 38.14 Hz, Q 0.5003).
    k = math.tan(math.pi * 1681.974450955533 / rate)
    q, vh = 0.7071752369554196, 10 ** (3.999843853973347 / 20)
    vb = vh ** 0.4996667741545416
    shelf = biquad_power((vh + vb * k / q + k * k, 2 * (k * k - vh), vh - vb * k / q + k * k),
                         (1 + k / q + k * k, 2 * (k * k - 1), 1 - k / q + k * k))
    k, q = math.tan(math.pi * 38.13547087602444 / rate), 0.5003270373238773
    a0 = 1 + k / q + k * k  # the standard's high-pass numerator is 1, -2, 1 against the normalized denominator
    highpass = biquad_power((1.0, -2.0, 1.0), (1.0, 2 * (k * k - 1) / a0, (1 - k / q + k * k) / a0))
    return shelf * highpass


def effective_weights(weights: np.ndarray, n: int) -> np.ndarray:
    """Per-bin weights (|H|^2 at an n-point real FFT's bins) folded with Parseval's arithmetic for `weighted_power`:
    DC and an even length's Nyquist bin count once, every other bin twice (a real FFT holds half the spectrum), all
    over n^2."""
    w = 2.0 * weights
    w[0] = weights[0]
    if n % 2 == 0:
        w[-1] = weights[-1]
    return w / (n * n)


def weighted_power(x: np.ndarray, weights: np.ndarray) -> float:
    """K-weighted mean square of x from its FFT: |rfft(x)|^2 . weights, the weights folded by `effective_weights` for
    len(x)."""
    spec = np.fft.rfft(x.astype(np.float64))
    return float(np.dot(spec.real * spec.real + spec.imag * spec.imag, weights))


def lufs_of(power: float) -> float:
    return -0.691 + 10 * math.log10(max(power, 1e-20))


class LoudnessNormalizer:
    """Gain toward TARGET_LUFS for one mono float32 stream at `rate`; push() returns as many samples as it gets.
    `initial_lufs`: a loudness known in advance to start from, settled (None: unity gain until measured)."""

    def __init__(self, rate: int, initial_lufs: float | None = None, target_lufs: float = TARGET_LUFS) -> None:
        self.rate, self.target = int(rate), float(target_lufs)
        self.hop = max(1, round(HOP_SECONDS * self.rate))
        self._weights = effective_weights(_k_weighting_power(self.rate, self.hop), self.hop)
        self._hop_buf = np.zeros(self.hop, np.float32)  # the current hop's input so far
        self._hops: deque[float] = deque(maxlen=WINDOW_HOPS)  # K-weighted mean squares of the last 400 ms
        self._blocks: deque[float] = deque(maxlen=HORIZON_HOPS)  # counted blocks' powers
        self._counted = 0  # blocks counted so far (the slew's clock)
        self._est: float | None = None  # LUFS
        self._gain_start = self._gain_end = 0.0  # dB at the current hop's first sample and after its last
        if initial_lufs is not None and math.isfinite(initial_lufs):
            self._blocks.extend([10 ** ((initial_lufs + 0.691) / 10)] * YOUNG_HOPS)
            self._counted, self._est = YOUNG_HOPS, float(initial_lufs)
            self._gain_start = self._gain_end = self._target_gain()
        self._pos = 0  # samples of the current hop already passed
        self._ramp: np.ndarray | None = None  # the current hop's per-sample gain (None: constant, _scale)
        self._scale = np.float32(1.0)
        self._k = np.arange(1, self.hop + 1, dtype=np.float32)  # sample positions within a hop
        self._set_ramp()

    @property
    def lufs(self) -> float | None:
        """The running loudness estimate (None before any audio above the gate)."""
        return self._est

    @property
    def gain_db(self) -> float:
        return self._gain_end

    def push(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        out = np.empty_like(x)
        i = 0
        while i < x.size:
            take = min(x.size - i, self.hop - self._pos)
            seg = x[i:i + take]
            if self._ramp is None:
                np.multiply(seg, self._scale, out=out[i:i + take])
            else:  # by absolute position within the hop, so any chunking applies the same gains
                np.multiply(seg, self._ramp[self._pos:self._pos + take], out=out[i:i + take])
            self._hop_buf[self._pos:self._pos + take] = seg
            self._pos += take
            i += take
            if self._pos == self.hop:
                self._pos = 0
                self._measure()
        return soft_clip(out)

    def _set_ramp(self) -> None:
        """The current hop's gains: from its start gain to its end gain, linear in dB, sample by sample."""
        start, change = self._gain_start, self._gain_end - self._gain_start
        if change == 0.0:
            self._ramp, self._scale = None, np.float32(math.exp(start * _DB_TO_LN))
            return
        # dB linear in the position k = 1..hop, as amplitudes: exp((start + change * k / hop) * ln(10) / 20)
        ramp = self._k * np.float32(change * _DB_TO_LN / self.hop)
        ramp += np.float32(start * _DB_TO_LN)
        self._ramp = np.exp(ramp, out=ramp)

    def _measure(self) -> None:
        """End of a hop: count its block if it is speech, re-estimate, and set the next hop's gain ramp."""
        hop = np.clip(self._hop_buf, -1.0, 1.0)
        power = weighted_power(hop, self._weights)
        if not math.isfinite(power):  # NaN samples read as silence (checked only when the power shows one)
            hop[np.isnan(hop)] = 0.0
            power = weighted_power(hop, self._weights)
        self._hops.append(power)
        if power >= GATE_POWER:
            speech = [p for p in self._hops if p >= GATE_POWER]
            self._blocks.append(sum(speech) / len(speech))
            self._counted += 1
            # BS.1770's relative gate, on powers: blocks within RELATIVE_GATE_LU of the mean (all are above the gate)
            floor = sum(self._blocks) / len(self._blocks) * RELATIVE_GATE_FACTOR
            kept = [p for p in self._blocks if p >= floor]
            self._est = lufs_of(sum(kept) / len(kept))
        self._gain_start = self._gain_end
        if self._est is not None:
            up = SLEW_YOUNG_DB if self._counted <= YOUNG_HOPS else SLEW_DB
            down = max(SLEW_YOUNG_DB, SLEW_DOWN_DB) if self._counted <= YOUNG_HOPS else SLEW_DOWN_DB
            self._gain_end += min(max(self._target_gain() - self._gain_end, -down), up)
        self._set_ramp()

    def _target_gain(self) -> float:
        return 0.0 if self._est is None else min(max(self.target - self._est, -MAX_GAIN_DB), MAX_GAIN_DB)


def soft_clip(x: np.ndarray) -> np.ndarray:
    """Identity up to KNEE, then a tanh knee that approaches 1.0 (continuous, with a continuous slope)."""
    mag = np.abs(x)
    over = mag > KNEE
    if not over.any():
        return x
    y = x.copy()
    room = 1.0 - KNEE
    y[over] = np.sign(x[over]) * (KNEE + room * np.tanh((mag[over] - KNEE) / room))
    return y
