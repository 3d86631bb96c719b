"""Streaming audio output: speed, volume, resampling and encoding of model PCM into the session's format.

Pipeline per push (all stateful, so any chunking of the input gives the same byte stream):

    float32 @ input_rate -> loudness normalization (prosody.normalize_loudness, rtts/audio/loudness.py)
        -> time-stretch (prosody.speed) -> soxr stream resample -> gain (prosody.volume) -> clip
        -> pcm s16le | wav (44-byte streaming header + s16le) | G.711 mu-law | MP3 (LAME) | Ogg Opus

MP3 and Ogg Opus are encoded by libsndfile (through soundfile) writing into an in-memory file object; every push
returns the bytes libsndfile has written since the previous call, so the concatenation of all pushes plus finish()
is one valid file. See docs/protocol.md (audio formats, latency modes and chunk sizing).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, replace

import numpy as np
import soundfile as sf
import soxr

from rtts.audio.containers import MemoryFile, OggSerialRewriter, mp3_info_placeholder_length
from rtts.audio.loudness import LoudnessNormalizer
from rtts.audio.stretch import TimeStretcher

FORMATS = ("pcm", "wav", "mp3", "opus", "mulaw")
_PCM_RATES = (8000, 16000, 24000, 32000, 44100, 48000)
SAMPLE_RATES: dict[str, tuple[int, ...]] = {
    "pcm": _PCM_RATES,
    "wav": _PCM_RATES,
    "mp3": (32000, 44100),
    "opus": (48000,),
    "mulaw": (8000,),
}
DEFAULT_RATE = {"pcm": 44100, "wav": 44100, "mp3": 44100, "opus": 48000, "mulaw": 8000}
CONTENT_TYPES = {
    "pcm": "audio/pcm",
    "wav": "audio/wav",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "mulaw": "audio/basic",
}
MP3_BITRATES = (64, 128, 192)  # kbps
OPUS_AUTO = -1000
OPUS_BITRATES = (24000, 32000, 48000, 64000)  # bps
SPEED_RANGE = (0.5, 2.0)
VOLUME_RANGE_DB = (-20.0, 20.0)

# MP3 and Ogg Opus hold the end of what was pushed (a partial codec frame, the encoder's look-ahead, an unfinished
# Ogg page) until more audio comes; drain() cannot flush them and go on. This much silence (output time) releases it:
# tests/test_audio.py checks it over turn lengths, 64-192 kbps MP3 at 32 / 44.1 kHz, Opus, and speeds 0.5-2 (MP3 at
# 64 kbps, 32 kHz needs the most: 150 ms; Opus 90 ms).
HELD_TAIL_FORMATS = ("mp3", "opus")
TAIL_PAD_SECONDS = 0.2

MAX_MESSAGE_BYTES = 64 * 1024  # websockets clients cap messages at 1 MiB; stay far below
MIN_RAW_MESSAGE_BYTES = 2048  # Pipecat drops audio events <= 1024 bytes; 2 KiB leaves room
# A turn's last message is whatever is left at its end; Pipecat (which always asks for pcm) would drop it if it were
# <= 1024 bytes, so pcm and wav lift a shorter one with silence to this many samples (1026 bytes).
MIN_LAST_RAW_SAMPLES = 513
MIN_COMPRESSED_MESSAGE_BYTES = 1152  # compressed clients (PyAV) take any size; still stay above Pipecat's floor
# One codec frame (2048 samples at 44.1 kHz: 46.4 ms) must fill a message by itself: a turn's first frame is its time to
# first audio, and at 50 ms the first message waited for the codec's second chunk (docs/protocol.md: >= 40 ms).
MIN_MESSAGE_SECONDS = 0.040

# Fish's streaming WAV header: placeholder sizes because the length is unknown (RIFF size = data size + 36).
WAV_RIFF_SIZE = 0xFFFFFF24
WAV_DATA_SIZE = 0xFFFFFF00

DEFAULT_OGG_SERIAL = 0x72747473  # "rtts"; one logical stream per file, so any fixed value is valid

# libsndfile commands not wrapped by soundfile (sndfile.h).
_SFC_SET_OGG_PAGE_LATENCY_MS = 0x1302
_OGG_PAGE_LATENCY_MS = 50.0  # libsndfile's minimum; its default (1000 ms) would hold a second of audio per page


class AudioFormatError(ValueError):
    """An output format, rate or prosody value the server does not support."""


# ---------------------------------------------------------------------------------------------------------- spec


def _as_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer():
        raise AudioFormatError(f"{name} {value!r} is not an integer")
    return int(value)


def _as_float(name: str, value: object, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise AudioFormatError(f"{name} {value!r} is not a number")
    if not lo <= value <= hi:
        raise AudioFormatError(f"{name} {value!r} is outside the allowed range {lo:g}..{hi:g}")
    return float(value)


def _opus_bps(value: object) -> int:
    """-1000 (auto) stays; (0, 1000) is kbps (SDK), larger is bps (docs); only 24/32/48/64 kbps are offered."""
    rate = _as_int("opus_bitrate", value)
    if rate == OPUS_AUTO:
        return rate
    bps = rate * 1000 if 0 < rate < 1000 else rate
    if bps not in OPUS_BITRATES:
        allowed = ", ".join(str(b // 1000) for b in OPUS_BITRATES)
        raise AudioFormatError(
            f"opus_bitrate {value!r} is not supported; use -1000 (auto) or {allowed} kbps (or the same in bps)"
        )
    return bps


@dataclass(frozen=True)
class OutputSpec:
    """What a session asked for. Bitrates are only checked for the format that uses them (clients send both)."""

    format: str = "mp3"
    sample_rate: int | None = None  # None -> DEFAULT_RATE[format]
    mp3_bitrate: int = 128  # kbps: 64, 128, 192
    opus_bitrate: int = OPUS_AUTO  # -1000 auto; (0, 1000) kbps; larger bps
    speed: float = 1.0  # prosody.speed: tempo without pitch change
    volume_db: float = 0.0  # prosody.volume
    normalize_loudness: bool = False  # prosody.normalize_loudness (requests default to true; this class to false)

    def validated(self) -> OutputSpec:
        """Resolve defaults and normalise units (opus_bitrate -> bps); raise AudioFormatError on anything else."""
        fmt = self.format.strip().lower() if isinstance(self.format, str) else self.format
        if fmt not in FORMATS:
            raise AudioFormatError(f"format {self.format!r} is not supported; use one of {', '.join(FORMATS)}")
        rate = DEFAULT_RATE[fmt] if self.sample_rate is None else _as_int("sample_rate", self.sample_rate)
        if rate not in SAMPLE_RATES[fmt]:
            allowed = ", ".join(str(r) for r in SAMPLE_RATES[fmt])
            raise AudioFormatError(f"sample_rate {self.sample_rate!r} is not supported for {fmt}; use one of {allowed}")
        mp3 = self.mp3_bitrate
        if fmt == "mp3":
            mp3 = _as_int("mp3_bitrate", mp3)
            if mp3 not in MP3_BITRATES:
                allowed = ", ".join(str(b) for b in MP3_BITRATES)
                raise AudioFormatError(f"mp3_bitrate {self.mp3_bitrate!r} is not supported; use one of {allowed} kbps")
        opus = _opus_bps(self.opus_bitrate) if fmt == "opus" else self.opus_bitrate
        speed = _as_float("speed", self.speed, *SPEED_RANGE)
        volume = _as_float("volume", self.volume_db, *VOLUME_RANGE_DB)
        return replace(
            self, format=fmt, sample_rate=rate, mp3_bitrate=mp3, opus_bitrate=opus, speed=speed, volume_db=volume
        )

    @property
    def content_type(self) -> str:
        fmt = self.format.strip().lower() if isinstance(self.format, str) else ""
        return CONTENT_TYPES.get(fmt, "application/octet-stream")

    @property
    def rate(self) -> int:
        """The output sample rate with the default resolved (the spec need not be validated)."""
        if self.sample_rate is not None:
            return self.sample_rate
        return DEFAULT_RATE.get(self.format.strip().lower() if isinstance(self.format, str) else "", 44100)


# ------------------------------------------------------------------------------------------------- sample codecs


def float_to_s16(x: np.ndarray) -> np.ndarray:
    """[-1, 1] float -> int16 with clipping and rounding (the reference's plain cast wraps around instead)."""
    y = np.clip(x, -1.0, 1.0) * 32767.0
    return np.rint(y).astype(np.int16)


def _build_mulaw_table() -> np.ndarray:
    """G.711 mu-law code for every int16 value (ITU-T G.711 / Sun g711.c: bias 0x84, clip 32635, inverted bits)."""
    s = np.arange(-32768, 32768, dtype=np.int32)
    sign = np.where(s < 0, 0x80, 0x00)
    mag = np.minimum(np.abs(s), 32635) + 0x84
    # Segment = position of the highest set bit above bit 7 (0..7); mantissa = the 4 bits below it.
    exponent = np.floor(np.log2(mag >> 7)).astype(np.int32)
    mantissa = (mag >> (exponent + 3)) & 0x0F
    return (~(sign | (exponent << 4) | mantissa) & 0xFF).astype(np.uint8)


_MULAW = _build_mulaw_table()


def s16_to_mulaw(x: np.ndarray) -> np.ndarray:
    return _MULAW[x.astype(np.int32) + 32768]


def wav_stream_header(sample_rate: int) -> bytes:
    """44-byte RIFF/WAVE header, PCM 16-bit mono, Fish's placeholder sizes (the stream length is unknown)."""
    # fmt fields: PCM, mono, rate, bytes per second, block align, bits per sample.
    fmt_chunk = struct.pack("<HHIIHH", 1, 1, sample_rate, sample_rate * 2, 2, 16)
    return (
        struct.pack("<4sI4s4sI", b"RIFF", WAV_RIFF_SIZE, b"WAVE", b"fmt ", 16)
        + fmt_chunk
        + struct.pack("<4sI", b"data", WAV_DATA_SIZE)
    )


# ---------------------------------------------------------------------------------------------------------- sinks


class _Sink:
    """Turns clipped float32 samples at the output rate into bytes."""

    def encode(self, x: np.ndarray) -> bytes:
        raise NotImplementedError

    def close(self) -> bytes:
        return b""


class _PcmSink(_Sink):
    def __init__(self, header: bytes = b"") -> None:
        self._header = header

    def start(self) -> bytes:
        header, self._header = self._header, b""
        return header

    def encode(self, x: np.ndarray) -> bytes:
        return self.start() + (float_to_s16(x).astype("<i2", copy=False).tobytes() if x.size else b"")

    def close(self) -> bytes:
        return self.start()  # a stream with no audio still gets its header


class _MulawSink(_Sink):
    def encode(self, x: np.ndarray) -> bytes:
        return s16_to_mulaw(float_to_s16(x)).tobytes() if x.size else b""


class _SoundFileSink(_Sink):
    """MP3 (LAME CBR) or Ogg Opus through libsndfile, streamed out of an in-memory file."""

    def __init__(self, spec: OutputSpec, ogg_serial: int) -> None:
        self._file = MemoryFile()
        self._mp3 = spec.format == "mp3"
        self._first = True
        self._ogg = None if self._mp3 else OggSerialRewriter(ogg_serial)
        rate = spec.rate
        if self._mp3:
            # libsndfile's CBR mapping for MPEG-1: kbps = int(320 - level * 288); +0.5 kbps guards the truncation.
            level = (320.0 - spec.mp3_bitrate - 0.5) / 288.0
            self._sf = sf.SoundFile(
                self._file,
                mode="w",
                samplerate=rate,
                channels=1,
                format="MP3",
                subtype="MPEG_LAYER_III",
                compression_level=level,
                bitrate_mode="CONSTANT",
            )
        else:
            level = None
            if spec.opus_bitrate != OPUS_AUTO:
                # libsndfile's Opus mapping: bps = int((1 - level) * 250000 + 6000).
                level = 1.0 - (spec.opus_bitrate - 6000 + 0.5) / 250000.0
            self._sf = sf.SoundFile(
                self._file, mode="w", samplerate=rate, channels=1, format="OGG", subtype="OPUS", compression_level=level
            )
            _set_ogg_page_latency(self._sf, _OGG_PAGE_LATENCY_MS)

    def encode(self, x: np.ndarray) -> bytes:
        if x.size:
            self._sf.write(x)
        return self._take()

    def close(self) -> bytes:
        self._sf.close()
        data = self._take()
        return data + self._ogg.close() if self._ogg is not None else data

    def _take(self) -> bytes:
        data = self._file.take()
        if self._first and data:
            self._first = False
            if self._mp3:
                data = data[mp3_info_placeholder_length(data) :]
        return self._ogg.feed(data) if self._ogg is not None else data


def _set_ogg_page_latency(f: sf.SoundFile, ms: float) -> None:
    """Ask libsndfile to close an Ogg page every `ms` of audio (best effort: uses soundfile's private handles)."""
    try:
        from soundfile import _ffi, _snd  # type: ignore[attr-defined]

        value = _ffi.new("double*", ms)
        _snd.sf_command(f._file, _SFC_SET_OGG_PAGE_LATENCY_MS, value, _ffi.sizeof("double"))  # type: ignore[attr-defined]
    except (ImportError, AttributeError):  # pragma: no cover - older soundfile: pages then hold up to 1 s
        pass


def _make_sink(spec: OutputSpec, ogg_serial: int) -> _Sink:
    if spec.format == "pcm":
        return _PcmSink()
    if spec.format == "wav":
        return _PcmSink(wav_stream_header(spec.rate))
    if spec.format == "mulaw":
        return _MulawSink()
    return _SoundFileSink(spec, ogg_serial)


# -------------------------------------------------------------------------------------------------------- encoder


@dataclass
class _Stages:
    stretch: TimeStretcher | None
    resampler: soxr.ResampleStream | None
    gain: float
    sink: _Sink
    finished: bool = False


class StreamEncoder:
    """Stateful encoder for one output stream: push() model PCM as it arrives, finish() once at the end."""

    def __init__(self, spec: OutputSpec, input_rate: int = 44100, ogg_serial: int = DEFAULT_OGG_SERIAL) -> None:
        self.spec = spec.validated()
        self.input_rate = int(input_rate)
        self.output_rate = self.spec.rate
        self.samples_out = 0  # output samples (at output_rate) handed to the format so far
        self.loudness = LoudnessNormalizer(self.input_rate) if self.spec.normalize_loudness else None
        gain = 10.0 ** (self.spec.volume_db / 20.0)
        self._st = _Stages(self._new_stretcher(), self._new_resampler(), gain, _make_sink(self.spec, ogg_serial))

    @property
    def content_type(self) -> str:
        return self.spec.content_type

    def push(self, pcm: np.ndarray) -> bytes:
        """Mono float32 at input_rate, any length; returns the encoded bytes ready now (possibly b"")."""
        st = self._check_open()
        x = _as_mono(pcm)
        if self.loudness is not None:  # no delay: it needs no draining at a flush
            x = self.loudness.push(x)
        if st.stretch is not None:
            x = st.stretch.push(x)
        if st.resampler is not None and x.size:
            x = st.resampler.resample_chunk(x)
        return self._encode(x)

    def drain(self) -> bytes:
        """Everything pushed so far, encoded as at the end of the stream, but the stream goes on: the time stretcher
        and the resampler finish their current runs and start new ones. For a flush boundary, where the client waits
        for the end of the turn: their filter delay (8-54 ms of PCM at 8-48 kHz) would otherwise come out only with
        the next turn's audio, which a Pipecat call may not send for a long while. Compressed formats keep their
        codec's own frame buffer (an MP3 or Opus stream cannot flush a partial frame and go on)."""
        st = self._check_open()
        x = np.zeros(0, np.float32)
        if st.stretch is not None:
            x = st.stretch.finish()
            st.stretch = self._new_stretcher()
        if st.resampler is not None:
            x = st.resampler.resample_chunk(x, last=True)
            st.resampler = self._new_resampler()
        return self._encode(x)

    @property
    def holds_tail(self) -> bool:
        """Whether drain() leaves the end of the pushed audio inside the codec (release_tail lets it out)."""
        return self.spec.format in HELD_TAIL_FORMATS

    def last_message_pad(self, pending_bytes: int) -> int:
        """Samples of silence (at the output rate) that lift a turn's last message of `pending_bytes` to
        MIN_LAST_RAW_SAMPLES: pcm and wav only (0 for other formats, or where nothing is left)."""
        if self.spec.format not in ("pcm", "wav") or pending_bytes <= 0:
            return 0
        return max(0, MIN_LAST_RAW_SAMPLES - pending_bytes // 2)

    def silence(self, samples: int) -> bytes:
        """`samples` of silence at the output rate, encoded (no stretch or resampling in between)."""
        return self._encode(np.zeros(samples, np.float32))

    def release_tail(self) -> tuple[bytes, float]:
        """Silence through the stream until the codec has emitted everything pushed before it: (the bytes, the
        seconds of output the silence adds). The silence is TAIL_PAD_SECONDS of output whatever the speed."""
        n = round(TAIL_PAD_SECONDS * self.spec.speed * self.input_rate)
        data = self.push(np.zeros(n, np.float32)) + self.drain()
        return data, n / self.input_rate / self.spec.speed

    def finish(self) -> bytes:
        """Flush the stretch, resampler and codec tails; the encoder cannot be used afterwards."""
        st = self._check_open()
        st.finished = True
        x = st.stretch.finish() if st.stretch is not None else np.zeros(0, np.float32)
        if st.resampler is not None:
            x = st.resampler.resample_chunk(x, last=True)
        return self._encode(x) + st.sink.close()

    # ------------------------------------------------------------------ internals

    def _new_stretcher(self) -> TimeStretcher | None:
        return TimeStretcher(self.spec.speed, self.input_rate) if self.spec.speed != 1.0 else None

    def _new_resampler(self) -> soxr.ResampleStream | None:
        if self.output_rate == self.input_rate:
            return None
        return soxr.ResampleStream(self.input_rate, self.output_rate, 1, dtype="float32", quality="HQ")

    def _check_open(self) -> _Stages:
        if self._st.finished:
            raise RuntimeError("StreamEncoder used after finish()")
        return self._st

    def _encode(self, x: np.ndarray) -> bytes:
        x = np.asarray(x, dtype=np.float32)
        if x.size:
            if self._st.gain != 1.0:
                x = x * np.float32(self._st.gain)
            # Clip here (all formats): LAME/Opus would distort on overs, and NaN would become arbitrary codes.
            x = np.clip(np.nan_to_num(x, nan=0.0), -1.0, 1.0)
            self.samples_out += x.size
        return self._st.sink.encode(x)


def _as_mono(pcm: np.ndarray) -> np.ndarray:
    x = np.asarray(pcm, dtype=np.float32)
    if x.ndim == 2 and 1 in x.shape:
        x = x.reshape(-1)
    if x.ndim != 1:
        raise ValueError(f"expected mono audio, got an array of shape {x.shape}")
    return np.ascontiguousarray(x)


# ------------------------------------------------------------------------------------------------------ messaging


def message_bytes_target(spec: OutputSpec) -> int:
    """Minimum payload per audio message: > Pipecat's 1024-byte floor and >= MIN_MESSAGE_SECONDS (40 ms) of audio;
    a turn's last message may be shorter (flushed at its end; StreamEncoder.last_message_pad keeps raw ones over
    Pipecat's floor)."""
    spec = spec.validated()
    rate = spec.rate
    if spec.format in ("pcm", "wav", "mulaw"):
        width = 1 if spec.format == "mulaw" else 2
        samples = max(math.ceil(MIN_MESSAGE_SECONDS * rate), math.ceil(MIN_RAW_MESSAGE_BYTES / width))
        return samples * width
    if spec.format == "mp3":
        bps = spec.mp3_bitrate * 1000
    else:
        bps = spec.opus_bitrate if spec.opus_bitrate != OPUS_AUTO else 48000
    return max(MIN_COMPRESSED_MESSAGE_BYTES, math.ceil(MIN_MESSAGE_SECONDS * bps / 8))


class Rechunker:
    """Buffers encoded bytes and releases pieces of min_bytes..max_bytes; flush() releases the remainder."""

    def __init__(self, min_bytes: int, max_bytes: int = MAX_MESSAGE_BYTES) -> None:
        if not 0 < min_bytes <= max_bytes:
            raise ValueError(f"need 0 < min_bytes <= max_bytes, got {min_bytes} and {max_bytes}")
        self.min_bytes = min_bytes
        self.max_bytes = max_bytes
        self._buf = bytearray()

    @property
    def pending(self) -> int:
        return len(self._buf)

    def push(self, data: bytes) -> list[bytes]:
        """Add bytes; returns the pieces now ready (each min_bytes..max_bytes long)."""
        self._buf += data
        out: list[bytes] = []
        while len(self._buf) >= self.min_bytes:
            # Whole samples stay whole: encoders emit whole samples and both limits are even for 16-bit formats.
            n = min(len(self._buf), self.max_bytes)
            out.append(bytes(self._buf[:n]))
            del self._buf[:n]
        return out

    def flush(self) -> list[bytes]:
        """Everything still buffered, as at most one piece (shorter than min_bytes)."""
        if not self._buf:
            return []
        out = [bytes(self._buf)]
        self._buf.clear()
        return out
