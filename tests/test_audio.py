"""Streaming output encoder: formats, rates, WAV header, mu-law, MP3/Opus decodability, prosody, message sizes."""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
import soundfile as sf
import soxr

from rtts.audio.containers import ogg_crc
from rtts.audio.encode import (
    DEFAULT_RATE,
    FORMATS,
    MAX_MESSAGE_BYTES,
    SAMPLE_RATES,
    TAIL_PAD_SECONDS,
    AudioFormatError,
    OutputSpec,
    Rechunker,
    StreamEncoder,
    float_to_s16,
    message_bytes_target,
    s16_to_mulaw,
    wav_stream_header,
)
from rtts.audio.stretch import TimeStretcher, stretch

SR = 44100
CHUNKINGS = ([2048, 4096, 16384, 2048], [1, 0, 2048, 3, 777, 8192, 0, 5000])


def tone(seconds: float = 1.0, freq: float = 440.0, amp: float = 0.5, rate: int = SR) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def rich(seconds: float = 1.0, rate: int = SR) -> np.ndarray:
    """Non-periodic tonal signal (three partials, slow AM) so codec delay can be found by cross-correlation."""
    t = np.arange(round(seconds * rate)) / rate
    env = 0.6 + 0.3 * np.sin(2 * np.pi * 2.3 * t)
    sig = np.sin(2 * np.pi * 310 * t) + 0.5 * np.sin(2 * np.pi * 470 * t) + 0.3 * np.sin(2 * np.pi * 1130 * t)
    return (0.35 * env * sig).astype(np.float32)


def encode(spec: OutputSpec, x: np.ndarray, sizes: list[int] | None = None, input_rate: int = SR) -> list[bytes]:
    """All byte chunks of one stream: one push per chunk size (cycled), then finish()."""
    enc = StreamEncoder(spec, input_rate)
    out: list[bytes] = []
    if sizes is None:
        out.append(enc.push(x))
    else:
        i = k = 0
        while i < x.size:
            n = sizes[k % len(sizes)]
            out.append(enc.push(x[i : i + n]))
            i, k = i + n, k + 1
    out.append(enc.finish())
    return out


def s16(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2").astype(np.int32)


def aligned_corr(decoded: np.ndarray, ref: np.ndarray, max_lag: int = 4000) -> tuple[float, int]:
    """Correlation of decoded vs reference after removing the codec delay (found by cross-correlation)."""
    probe = ref[2000:6000]
    search = decoded[: 2000 + max_lag + probe.size]
    lag = int(np.argmax(np.correlate(search, probe, "valid"))) - 2000
    lag = max(lag, 0)
    n = min(decoded.size - lag, ref.size)
    return float(np.corrcoef(decoded[lag : lag + n], ref[:n])[0, 1]), lag


def dominant_freq(y: np.ndarray, rate: int = SR) -> float:
    spec = np.abs(np.fft.rfft(y * np.hanning(y.size)))
    i = int(np.argmax(spec))
    a, b, c = np.log(spec[i - 1 : i + 2] + 1e-12)
    return (i + 0.5 * (a - c) / (a - 2 * b + c)) * rate / y.size


# ------------------------------------------------------------------------------------------------------ spec


def test_defaults_resolve_per_format() -> None:
    for fmt in FORMATS:
        spec = OutputSpec(fmt).validated()
        assert spec.sample_rate == DEFAULT_RATE[fmt]
    assert OutputSpec().validated().format == "mp3"
    assert OutputSpec(" PCM ").validated().format == "pcm"
    assert OutputSpec("opus", opus_bitrate=24).validated().opus_bitrate == 24000
    assert OutputSpec("opus", opus_bitrate=64000).validated().opus_bitrate == 64000
    assert OutputSpec("opus").validated().opus_bitrate == -1000
    assert OutputSpec("wav", 24000.0).validated().sample_rate == 24000  # type: ignore[arg-type]
    # A bitrate for another format is ignored: clients always send both (SDK defaults 128 / -1000).
    assert OutputSpec("pcm", mp3_bitrate=100, opus_bitrate=12345).validated().format == "pcm"


def test_content_types() -> None:
    assert {f: OutputSpec(f).content_type for f in FORMATS} == {
        "pcm": "audio/pcm", "wav": "audio/wav", "mp3": "audio/mpeg", "opus": "audio/ogg", "mulaw": "audio/basic",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        (OutputSpec("flac"), "'flac'"),
        (OutputSpec("pcm", 22050), "22050"),
        (OutputSpec("wav", 96000), "96000"),
        (OutputSpec("opus", 44100), "44100"),
        (OutputSpec("mp3", 16000), "16000"),
        (OutputSpec("mulaw", 16000), "16000"),
        (OutputSpec("mp3", mp3_bitrate=100), "100"),
        (OutputSpec("opus", opus_bitrate=12345), "12345"),
        (OutputSpec("opus", opus_bitrate=0), "0"),
        (OutputSpec("pcm", speed=3), "3"),
        (OutputSpec("pcm", speed=0.25), "0.25"),
        (OutputSpec("pcm", speed=float("nan")), "nan"),
        (OutputSpec("pcm", volume_db=40), "40"),
        (OutputSpec("pcm", volume_db=-21), "-21"),
        (OutputSpec("pcm", "24000"), "'24000'"),  # type: ignore[arg-type]
        (OutputSpec("pcm", 24000.5), "24000.5"),  # type: ignore[arg-type]
    ],
)
def test_invalid_values_raise_with_the_value(spec: OutputSpec, needle: str) -> None:
    with pytest.raises(AudioFormatError) as err:
        spec.validated()
    assert needle in str(err.value)
    with pytest.raises(AudioFormatError):
        StreamEncoder(spec)


def test_error_lists_allowed_values() -> None:
    with pytest.raises(AudioFormatError, match="8000, 16000, 24000, 32000, 44100, 48000"):
        OutputSpec("pcm", 22050).validated()
    with pytest.raises(AudioFormatError, match="pcm, wav, mp3, opus, mulaw"):
        OutputSpec("flac").validated()
    assert issubclass(AudioFormatError, ValueError)


# --------------------------------------------------------------------------------------------- pcm, wav, mulaw


@pytest.mark.parametrize("rate", SAMPLE_RATES["pcm"])
def test_pcm_every_rate_matches_one_shot_resampling(rate: int) -> None:
    x = rich(0.6)
    ref = float_to_s16(soxr.resample(x, SR, rate, quality="HQ")).astype(np.int32)
    for sizes in (None, *CHUNKINGS):
        got = s16(b"".join(encode(OutputSpec("pcm", rate), x, sizes)))
        assert abs(got.size - ref.size) <= 2
        n = min(got.size, ref.size)
        assert np.abs(got[:n] - ref[:n]).max() <= 1


def test_pcm_samples_out_counts_output_samples() -> None:
    enc = StreamEncoder(OutputSpec("pcm", 16000))
    data = enc.push(rich(0.5)) + enc.finish()
    assert enc.samples_out == len(data) // 2
    assert enc.output_rate == 16000


@pytest.mark.parametrize("rate", [8000, 24000, 44100, 48000])
def test_wav_header_exact_then_pcm(rate: int) -> None:
    expected = struct.pack("<4sI4s4sIHHIIHH4sI", b"RIFF", 4294967076, b"WAVE", b"fmt ", 16, 1, 1, rate, rate * 2, 2,
                           16, b"data", 4294967040)  # fmt: skip
    assert wav_stream_header(rate) == expected and len(expected) == 44
    x = rich(0.4)
    chunks = encode(OutputSpec("wav", rate), x, CHUNKINGS[1])
    assert chunks[0][:44] == expected  # with the first push (1 sample: at most one sample follows)
    assert len(chunks[0]) <= 46
    stream = b"".join(chunks)
    assert stream.count(b"RIFF") == 1
    pcm = b"".join(encode(OutputSpec("pcm", rate), x, CHUNKINGS[1]))
    assert stream[44:] == pcm
    decoded, sr_ = sf.read(io.BytesIO(stream[:44] + stream[44:]), dtype="int16")  # placeholder sizes still parse
    assert sr_ == rate and decoded.size == len(pcm) // 2


def test_wav_header_with_first_empty_push_and_without_any_push() -> None:
    enc = StreamEncoder(OutputSpec("wav", 16000))
    assert enc.push(np.zeros(0, np.float32)) == wav_stream_header(16000)
    assert enc.push(np.zeros(0, np.float32)) == b""
    enc = StreamEncoder(OutputSpec("wav", 16000))
    assert enc.finish() == wav_stream_header(16000)


def test_mulaw_table_matches_libsndfile_for_every_int16() -> None:
    s = np.arange(-32768, 32768, dtype=np.int16)
    buf = io.BytesIO()
    sf.write(buf, s, 8000, format="RAW", subtype="ULAW")
    assert np.array_equal(s16_to_mulaw(s), np.frombuffer(buf.getvalue(), np.uint8))
    assert s16_to_mulaw(np.array([0], np.int16))[0] == 0xFF


def test_mulaw_stream_chunked_equals_one_shot_and_decodes() -> None:
    x = rich(0.8)
    one = b"".join(encode(OutputSpec("mulaw"), x))
    for sizes in CHUNKINGS:
        assert b"".join(encode(OutputSpec("mulaw"), x, sizes)) == one
    ref = soxr.resample(x, SR, 8000, quality="HQ")
    assert abs(len(one) - ref.size) <= 2
    decoded, _ = sf.read(io.BytesIO(one), samplerate=8000, channels=1, format="RAW", subtype="ULAW", dtype="float32")
    n = min(decoded.size, ref.size)
    assert np.corrcoef(decoded[:n], ref[:n])[0, 1] > 0.999


def test_clipping_saturates_instead_of_wrapping() -> None:
    x = np.array([1.5, -1.5, 1.0, -1.0, 0.5, 100.0, -100.0, np.nan], np.float32)
    got = s16(b"".join(encode(OutputSpec("pcm", SR), x)))
    assert got.tolist() == [32767, -32767, 32767, -32767, 16384, 32767, -32767, 0]
    mu = b"".join(encode(OutputSpec("mulaw"), np.full(4410, 3.0, np.float32)))
    assert set(mu[100:-100]) == {0x80}  # mu-law full-scale positive, not a wrapped negative code


def test_volume_gain_in_db() -> None:
    x = tone(0.2, amp=0.25)
    base = s16(b"".join(encode(OutputSpec("pcm", SR), x)))
    up = s16(b"".join(encode(OutputSpec("pcm", SR, volume_db=6.0), x)))
    down = s16(b"".join(encode(OutputSpec("pcm", SR, volume_db=-20.0), x)))
    assert np.abs(up - np.rint(base * 10 ** (6 / 20))).max() <= 2
    assert np.abs(down - np.rint(base * 0.1)).max() <= 1
    loud = s16(b"".join(encode(OutputSpec("pcm", SR, volume_db=20.0), x)))
    assert loud.max() == 32767 and loud.min() == -32767  # gain first, then clip


def test_tiny_and_empty_pushes() -> None:
    x = rich(0.3)
    enc = StreamEncoder(OutputSpec("pcm", 24000))
    parts = [enc.push(np.zeros(0, np.float32))]
    parts += [enc.push(x[i : i + 1]) for i in range(x.size)]
    parts.append(enc.finish())
    assert b"".join(parts) == b"".join(encode(OutputSpec("pcm", 24000), x))
    with pytest.raises(RuntimeError):
        enc.push(x)
    with pytest.raises(RuntimeError):
        enc.finish()


def test_passthrough_rate_is_bit_exact() -> None:
    x = rich(0.3)
    assert b"".join(encode(OutputSpec("pcm", SR), x, CHUNKINGS[1])) == float_to_s16(x).tobytes()


# ------------------------------------------------------------------------------------------------- mp3, opus


def decode(stream: bytes) -> tuple[np.ndarray, int]:
    data, rate = sf.read(io.BytesIO(stream), dtype="float32")
    return data, rate


@pytest.mark.parametrize(("rate", "kbps"), [(44100, 128), (44100, 64), (32000, 192), (32000, 64)])
def test_mp3_stream_is_one_valid_cbr_file(rate: int, kbps: int) -> None:
    x = rich(1.5)
    chunks = encode(OutputSpec("mp3", rate, mp3_bitrate=kbps), x, CHUNKINGS[0])
    assert any(chunks[:-1])  # frames come out while streaming, not only at finish
    stream = b"".join(chunks)
    assert stream[0] == 0xFF and stream[1] & 0xE0 == 0xE0 and any(stream[4:40])  # a real frame, no empty Info frame
    decoded, got_rate = decode(stream)
    assert got_rate == rate
    assert abs(decoded.size / rate - x.size / SR) < 0.060
    corr, lag = aligned_corr(decoded, soxr.resample(x, SR, rate, quality="HQ"))
    assert corr > 0.95 and lag < 0.04 * rate
    assert abs(len(stream) * 8 / (decoded.size / rate) / 1000 - kbps) < 0.08 * kbps  # CBR at the asked bitrate
    assert b"".join(encode(OutputSpec("mp3", rate, mp3_bitrate=kbps), x, CHUNKINGS[1])) == stream


@pytest.mark.parametrize("bitrate", [-1000, 24, 64000])
def test_opus_stream_is_one_valid_ogg_file(bitrate: int) -> None:
    x = rich(1.5)
    chunks = encode(OutputSpec("opus", opus_bitrate=bitrate), x, CHUNKINGS[0])
    assert chunks[0].startswith(b"OggS") and sum(map(len, chunks[:-1])) > 2000  # pages flow while streaming
    stream = b"".join(chunks)
    decoded, rate = decode(stream)
    assert rate == 48000
    assert abs(decoded.size / rate - x.size / SR) < 0.060
    corr, _ = aligned_corr(decoded, soxr.resample(x, SR, 48000, quality="HQ"))
    assert corr > 0.95
    assert b"".join(encode(OutputSpec("opus", opus_bitrate=bitrate), x, CHUNKINGS[1])) == stream  # deterministic


def test_opus_bitrate_is_applied_and_pages_are_valid() -> None:
    x = rich(2.0)
    low = b"".join(encode(OutputSpec("opus", opus_bitrate=24), x))
    high = b"".join(encode(OutputSpec("opus", opus_bitrate=64), x))
    assert len(high) > 1.8 * len(low)
    # Every page carries the fixed serial and a correct checksum.
    pos = pages = 0
    while pos < len(high):
        assert high[pos : pos + 4] == b"OggS"
        nseg = high[pos + 26]
        size = 27 + nseg + sum(high[pos + 27 : pos + 27 + nseg])
        page = bytearray(high[pos : pos + size])
        crc = int.from_bytes(page[22:26], "little")
        page[22:26] = bytes(4)
        assert ogg_crc(bytes(page)) == crc
        pos, pages = pos + size, pages + 1
    assert pos == len(high) and pages > 20  # ~50 ms pages, not one page per second


@pytest.mark.parametrize("fmt", ["mp3", "opus"])
def test_compressed_empty_stream_finishes(fmt: str) -> None:
    enc = StreamEncoder(OutputSpec(fmt))
    enc.push(np.zeros(0, np.float32))
    enc.finish()  # no crash; nothing to decode is fine


# ---------------------------------------------------------------------------------------------------- speed


@pytest.mark.parametrize("speed", [0.5, 1.25, 2.0])
def test_speed_changes_duration_not_pitch(speed: float) -> None:
    x = tone(1.0, freq=220.0)
    y = s16(b"".join(encode(OutputSpec("pcm", SR, speed=speed), x, CHUNKINGS[0]))).astype(np.float64)
    assert abs(y.size - x.size / speed) <= 2
    assert abs(dominant_freq(y[2000:-2000]) - 220.0) < 0.03 * 220.0
    mid = y[2000:-2000] / 32767
    assert abs(np.sqrt(np.mean(mid**2)) - 0.5 / np.sqrt(2)) < 0.02  # level kept (windows sum to one)
    assert np.abs(np.diff(mid)).max() < 1.2 * 0.5 * 2 * np.pi * 220 / SR  # no clicks between frames or chunks


@pytest.mark.parametrize("speed", [0.5, 0.8, 1.25, 2.0])
def test_stretch_is_independent_of_chunking(speed: float) -> None:
    x = rich(0.7)
    one = stretch(x, speed, SR)
    assert one.size == round(x.size / speed)
    for sizes in CHUNKINGS:
        ts = TimeStretcher(speed, SR)
        parts, i, k = [], 0, 0
        while i < x.size:
            n = sizes[k % len(sizes)]
            parts.append(ts.push(x[i : i + n]))
            i, k = i + n, k + 1
        parts.append(ts.finish())
        assert np.array_equal(np.concatenate(parts), one)


def test_speed_with_resampling_and_short_input() -> None:
    x = rich(0.5)
    y = s16(b"".join(encode(OutputSpec("pcm", 24000, speed=1.25), x, CHUNKINGS[1])))
    assert abs(y.size - x.size / 1.25 * 24000 / SR) <= 3
    assert stretch(np.ones(10, np.float32) * 0.1, 0.5, SR).size == 20
    assert stretch(np.zeros(0, np.float32), 2.0, SR).size == 0


def test_speed_one_is_an_exact_passthrough() -> None:
    x = rich(0.4)
    enc = StreamEncoder(OutputSpec("pcm", SR, speed=1.0))
    assert enc._st.stretch is None
    assert enc.push(x) + enc.finish() == float_to_s16(x).tobytes()


# ------------------------------------------------------------------------------------------------- messaging


def test_message_bytes_target() -> None:
    assert message_bytes_target(OutputSpec("pcm", 8000)) == 2048
    assert message_bytes_target(OutputSpec("pcm", 24000)) == 2048  # 2 KB: 42.7 ms
    assert message_bytes_target(OutputSpec("wav", 44100)) == 3528  # 40 ms: one 2048-sample codec frame fills it
    assert message_bytes_target(OutputSpec("mulaw")) == 2048
    for fmt in FORMATS:
        for rate in SAMPLE_RATES[fmt]:
            target = message_bytes_target(OutputSpec(fmt, rate))
            assert 1024 < target <= MAX_MESSAGE_BYTES
            if fmt in ("pcm", "wav"):
                assert target % 2 == 0 and target >= 0.04 * rate * 2


def test_rechunker_sizes() -> None:
    rc = Rechunker(2048)
    rng = np.random.default_rng(0)
    sent, pieces = bytearray(), []
    for n in rng.integers(0, 9000, 300).tolist() + [200_000]:
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        sent += data
        pieces += rc.push(data)
    assert all(2048 <= len(p) <= 64 * 1024 for p in pieces)
    assert sum(len(p) == 64 * 1024 for p in pieces) >= 3  # the 200 kB push is split at the 64 KiB cap
    assert rc.pending < 2048
    rest = rc.flush()
    assert len(rest) <= 1 and b"".join(pieces + rest) == bytes(sent)
    assert rc.flush() == [] and rc.push(b"x" * 100) == [] and rc.flush() == [b"x" * 100]
    with pytest.raises(ValueError):
        Rechunker(0)


@pytest.mark.parametrize("rate,speed", [(8000, 1.0), (24000, 1.0), (44100, 1.25), (16000, 0.75)])
def test_drain_releases_the_filter_tails_and_the_stream_goes_on(rate: int, speed: float) -> None:
    """A flush boundary: drain() hands out every sample pushed so far (the resampler's and the stretcher's delay
    included), and the stream continues with the same totals as if each part had been a stream of its own."""
    x = np.sin(np.linspace(0, 400, 44100)).astype(np.float32) * 0.3
    enc = StreamEncoder(OutputSpec(format="pcm", sample_rate=rate, speed=speed))
    got = b"".join(enc.push(x[i:i + 2048]) for i in range(0, x.size, 2048)) + enc.drain()
    want = x.size / speed * rate / 44100
    assert abs(len(got) // 2 - want) <= 0.002 * want + 2, (len(got) // 2, want)
    more = enc.push(x) + enc.drain() + enc.finish()
    assert abs((len(got) + len(more)) // 2 - 2 * want) <= 0.004 * want + 4


@pytest.mark.parametrize("fmt,rate,kbps", [("mp3", 44100, 64), ("mp3", 44100, 128), ("mp3", 44100, 192),
                                           ("mp3", 32000, 64), ("mp3", 32000, 128), ("opus", 48000, 0)])
@pytest.mark.parametrize("speed", [0.5, 1.0, 2.0])
def test_release_tail_lets_out_what_a_compressed_codec_holds(fmt: str, rate: int, kbps: int, speed: float) -> None:
    """After drain() an MP3 / Opus stream still holds the last ~60 ms pushed; release_tail() lets all of it out
    (the signal ends where finish() would end it) and adds TAIL_PAD_SECONDS of output, at any turn length, bitrate
    and speed."""

    def signal_end(data: bytes) -> float:
        y, r = sf.read(io.BytesIO(data))
        loud = np.flatnonzero(np.abs(y) > 0.05)
        return (loud[-1] + 1) / r

    spec = OutputSpec(fmt, rate, mp3_bitrate=kbps or 128, speed=speed)
    for seconds in (0.4, 0.4131, 0.4262):
        x = (0.3 * np.sin(2 * np.pi * 440 * np.arange(int(seconds * SR)) / SR)).astype(np.float32)
        done = StreamEncoder(spec, SR)
        end = signal_end(done.push(x) + done.finish())
        enc = StreamEncoder(spec, SR)
        held = enc.push(x) + enc.drain()
        assert enc.holds_tail and signal_end(held) < end - 0.03  # drain alone leaves the end in the codec
        released, pad = enc.release_tail()
        assert signal_end(held + released) >= end - 0.01, (seconds, signal_end(held + released), end)
        assert pad == pytest.approx(TAIL_PAD_SECONDS, abs=1e-4)
    assert not StreamEncoder(OutputSpec("wav", 44100), SR).holds_tail


def test_last_message_pad_lifts_short_raw_messages_over_pipecats_floor() -> None:
    """A turn's last pcm / wav message of n bytes gets MIN_LAST_RAW_SAMPLES - n / 2 samples of silence when that
    is positive (Pipecat drops events of 1024 bytes or less); other formats and empty remainders get none."""
    from rtts.audio.encode import MIN_LAST_RAW_SAMPLES

    pcm = StreamEncoder(OutputSpec("pcm", 16000), SR)
    assert pcm.last_message_pad(446) == MIN_LAST_RAW_SAMPLES - 223
    assert (446 + 2 * pcm.last_message_pad(446)) > 1024
    assert pcm.last_message_pad(0) == 0 and pcm.last_message_pad(2 * MIN_LAST_RAW_SAMPLES) == 0
    assert StreamEncoder(OutputSpec("wav", 24000), SR).last_message_pad(100) == MIN_LAST_RAW_SAMPLES - 50
    for spec in (OutputSpec("mulaw", 8000), OutputSpec("mp3", 44100), OutputSpec("opus", 48000)):
        assert StreamEncoder(spec, SR).last_message_pad(100) == 0
    assert pcm.silence(10) == b"\0" * 20
