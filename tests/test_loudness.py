"""Streaming loudness normalization (prosody.normalize_loudness): the BS.1770 meter, the causal gain, and its wiring."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rtts.audio import loudness as L
from rtts.audio.encode import OutputSpec, StreamEncoder
from rtts.session import output_spec
from rtts.ws.parse import parse_request

SR = 44100


def measure(x: np.ndarray, rate: int = SR) -> float:
    """Loudness of a whole signal with the module's meter (every 100 ms hop above -50 LUFS, as one block)."""
    hop = round(L.HOP_SECONDS * rate)
    w = L.effective_weights(L._k_weighting_power(rate, hop), hop)
    powers = [L.weighted_power(x[i:i + hop], w) for i in range(0, x.size - hop + 1, hop)]
    kept = [p for p in powers if L.lufs_of(p) >= L.GATE_LUFS]
    return L.lufs_of(sum(kept) / len(kept))


def speech(seconds: float, lufs: float, seed: int = 0, rate: int = SR) -> np.ndarray:
    """Speech-like test audio: low-passed noise in 4 Hz syllables, scaled to `lufs` by the meter."""
    rng = np.random.default_rng(seed)
    n = int(seconds * rate)
    x = np.convolve(rng.standard_normal(n), np.ones(6) / 6, mode="same")
    x *= 0.5 * (1 + np.sin(2 * np.pi * 4 * np.arange(n) / rate))
    x = x.astype(np.float32)
    return (x * np.float32(10 ** ((lufs - measure(x, rate)) / 20))).astype(np.float32)


@pytest.mark.parametrize("rate", [48000, 44100, 24000])
def test_meter_reads_a_full_scale_997_hz_sine_as_minus_3_lufs(rate: int) -> None:
    """BS.1770's calibration: a 0 dBFS 997 Hz sine reads -3.01 LUFS (the K-weighting's +0.69 dB there and the
    -0.691 offset cancel); a 100 Hz sine reads lower (the high-pass) and a 10 kHz one higher (the +4 dB shelf)."""
    t = np.arange(rate) / rate
    w = L.effective_weights(L._k_weighting_power(rate, rate), rate)

    def lufs(f: float) -> float:
        return L.lufs_of(L.weighted_power(np.sin(2 * np.pi * f * t).astype(np.float32), w))

    assert abs(lufs(997) + 3.01) < 0.05  # exact at 48 kHz; the bilinear design warps slightly at lower rates
    assert lufs(25) < lufs(997) - 8.0 and lufs(100) < lufs(997) - 0.5 and lufs(10000) > lufs(997) + 3.0


@pytest.mark.parametrize("level", [-33.0, -8.0])  # within MAX_GAIN_DB of the target
def test_quiet_and_loud_speech_reach_the_target(level: float) -> None:
    x = speech(6.0, level)
    n = L.LoudnessNormalizer(SR)
    y = n.push(x)
    assert abs(n.lufs - level) < 1.0  # the estimate tracks the input
    assert abs(measure(y[3 * SR:]) - L.TARGET_LUFS) < 1.0, measure(y[3 * SR:])
    assert np.abs(y).max() < 1.0


def test_output_does_not_depend_on_the_chunking() -> None:
    x = speech(3.0, -30.0, seed=1)
    whole = L.LoudnessNormalizer(SR).push(x)
    rng = np.random.default_rng(2)
    n, parts, i = L.LoudnessNormalizer(SR), [], 0
    while i < x.size:
        k = int(rng.integers(1, 9000))
        parts.append(n.push(x[i:i + k]))
        i += k
    assert np.array_equal(np.concatenate(parts), whole)


def test_pauses_hold_the_estimate_and_stay_silent() -> None:
    """Silence between sentences neither moves the estimate nor is amplified; speech after it continues at the
    gain it had."""
    n = L.LoudnessNormalizer(SR)
    n.push(speech(3.0, -32.0, seed=3))
    est, gain = n.lufs, n.gain_db
    assert abs(gain - 12.0) < 1.0  # settled by now
    quiet = n.push(np.zeros(2 * SR, np.float32))
    assert n.lufs == est and not quiet.any()
    n.push(speech(1.0, -32.0, seed=4))
    assert abs(n.gain_db - gain) < 1.0


def test_phrases_with_pauses_reach_the_target() -> None:
    """Blocks straddling a pause measure the speech in them, not speech and silence averaged."""
    rng = np.random.default_rng(9)
    parts = []
    for k in range(12):
        parts += [speech(0.6, -30.0, seed=10 + k), np.zeros(int(0.4 * SR), np.float32)]
        parts[-1][:] = 1e-5 * rng.standard_normal(parts[-1].size)
    x = np.concatenate(parts)
    y = L.LoudnessNormalizer(SR).push(x)
    assert abs(measure(y[6 * SR:]) - L.TARGET_LUFS) < 1.0, measure(y[6 * SR:])


@pytest.mark.parametrize("burst", ["full-scale noise", "one huge sample", "nan and inf"])
def test_a_burst_never_locks_the_gain(burst: str) -> None:
    """A loud event (or garbage samples) moves the estimate only while it is in the horizon: quiet speech after it
    is normalized again."""
    x = speech(20.0, -33.0, seed=11)
    i = 3 * SR
    if burst == "full-scale noise":
        x[i:i + SR // 10] = np.random.default_rng(12).uniform(-1, 1, SR // 10)
    elif burst == "one huge sample":
        x[i] = 1e30
    else:
        x[i:i + 100] = np.nan
        x[i + 200] = np.inf
    n = L.LoudnessNormalizer(SR)
    y = np.concatenate([n.push(x[:4 * SR]), n.push(x[4 * SR:])])
    assert n.lufs is not None and math.isfinite(n.lufs)
    assert abs(measure(np.nan_to_num(y[15 * SR:])) - L.TARGET_LUFS) < 1.0
    if burst != "full-scale noise":  # garbage is metered as full scale at most: it hardly moves the estimate
        n = L.LoudnessNormalizer(SR)
        n.push(x[:4 * SR])
        assert abs(n.lufs + 33.0) < 2.0, n.lufs


def test_noise_before_the_speech_does_not_set_the_level() -> None:
    """Near-silence at a turn's start (below the gate) is not speech, and a quieter stretch before loud speech falls
    under the relative gate once the speech is measured."""
    n = L.LoudnessNormalizer(SR)
    n.push(speech(0.5, -55.0, seed=13))
    assert n.lufs is None and n.gain_db == 0.0
    n = L.LoudnessNormalizer(SR)
    n.push(speech(1.5, -35.0, seed=14))
    n.push(speech(2.0, -20.0, seed=15))
    assert abs(n.lufs + 20.0) < 1.0 and abs(n.gain_db) < 1.5, (n.lufs, n.gain_db)


@pytest.mark.parametrize("before,after", [(-30.0, -22.0), (-22.0, -30.0)])
def test_level_changes_are_followed(before: float, after: float) -> None:
    x = np.concatenate([speech(4.0, before, seed=16), speech(8.0, after, seed=17)])
    n = L.LoudnessNormalizer(SR)
    y = n.push(x)
    assert abs(measure(y[9 * SR:]) - L.TARGET_LUFS) < 1.0, measure(y[9 * SR:])


def test_gain_ramps_sample_by_sample() -> None:
    """The gain a session starts ramping at moves smoothly (no step at a hop boundary): consecutive samples'
    applied gains differ by at most one hop's slew spread over the hop."""
    x = speech(2.0, -35.0, seed=8)
    y = L.LoudnessNormalizer(SR).push(x)
    idx = np.flatnonzero((np.abs(x) > 1e-3) & (np.abs(y) <= L.KNEE))  # where y / x is the gain (no soft clip)
    gain_db = 20 * np.log10(np.abs(y[idx]) / np.abs(x[idx]))
    assert gain_db.max() > 10  # it did ramp up (by ~15 dB)
    per_sample = L.SLEW_YOUNG_DB / round(L.HOP_SECONDS * SR)
    assert (np.abs(np.diff(gain_db)) <= per_sample * np.diff(idx) + 1e-4).all()


def test_gain_moves_at_a_bounded_rate_within_its_range() -> None:
    n = L.LoudnessNormalizer(SR)
    gains = []
    for chunk in np.split(speech(4.0, -35.0, seed=5), 40):  # one hop per chunk
        n.push(chunk)
        gains.append(n.gain_db)
    steps = np.abs(np.diff([0.0] + gains))
    assert steps.max() <= L.SLEW_YOUNG_DB + 1e-9 and steps[:5].max() > L.SLEW_DB
    assert steps[L.YOUNG_HOPS + 4:].max() <= L.SLEW_DB + 1e-9  # after the first second of speech, going up
    assert max(abs(g) for g in gains) <= L.MAX_GAIN_DB
    n = L.LoudnessNormalizer(SR)
    n.push(speech(6.0, -40.0, seed=6))
    assert n.gain_db == pytest.approx(L.MAX_GAIN_DB)  # too quiet to reach the target: boosted by the cap only
    n = L.LoudnessNormalizer(SR)
    n.push(speech(2.0, -60.0, seed=6))
    assert n.lufs is None and n.gain_db == 0.0  # below the gate: not speech, left alone


def test_initial_loudness_starts_settled() -> None:
    n = L.LoudnessNormalizer(SR, initial_lufs=-30.0)
    y = n.push(np.full(10, 0.01, np.float32))
    assert np.allclose(y, 0.01 * 10 ** (10 / 20), rtol=1e-5)


def test_soft_clip_is_the_identity_below_the_knee_and_stays_below_full_scale() -> None:
    x = np.linspace(-4, 4, 8001, dtype=np.float32)
    y = L.soft_clip(x)
    low = np.abs(x) <= L.KNEE
    assert np.array_equal(y[low], x[low])
    assert np.abs(y).max() <= 1.0 and (np.diff(y) >= 0).all()


def test_encoder_normalizes_only_when_asked() -> None:
    """OutputSpec leaves levels alone by default (the encoder's other users); requests default to normalizing
    (Fish's prosody.normalize_loudness default), and false turns it off."""
    x = speech(4.0, -33.0, seed=7)

    def pcm(spec: OutputSpec) -> np.ndarray:
        enc = StreamEncoder(spec, SR)
        data = enc.push(x) + enc.finish()
        return np.frombuffer(data, np.int16).astype(np.float32) / 32767

    raw, normalized = pcm(OutputSpec("pcm", SR)), pcm(OutputSpec("pcm", SR, normalize_loudness=True))
    assert abs(measure(raw) + 33.0) < 0.2
    assert abs(measure(normalized[2 * SR:]) - L.TARGET_LUFS) < 1.0
    assert output_spec(parse_request({})).normalize_loudness is True
    assert output_spec(parse_request({"prosody": {"normalize_loudness": False}})).normalize_loudness is False


@pytest.mark.parametrize("n", [4410, 1601])
def test_folded_weights_measure_what_weighted_power_does(n: int) -> None:
    """The meter's weights folded with Parseval (effective_weights) give the K-weighted mean square that the half
    spectrum of a real FFT gives unfolded (every bin but DC counts twice, except an even length's Nyquist bin), for
    even and odd hop lengths."""
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32) * 0.1
    w = L._k_weighting_power(SR, n)
    spec = np.abs(np.fft.rfft(x.astype(np.float64))) ** 2 * w
    unfolded = (2 * spec.sum() - spec[0] - (spec[-1] if n % 2 == 0 else 0.0)) / (n * n)
    assert unfolded == pytest.approx(L.weighted_power(x, L.effective_weights(w, n)), rel=1e-12)
