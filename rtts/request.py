"""A synthesis request as the server understands it (validated from the wire by `rtts.ws.parse`).

A leaf module: the session layer and the transport both use these types, and it imports nothing from rtts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

OPUS_AUTO = -1000  # Fish's "let the encoder choose"


@dataclass(frozen=True)
class Reference:
    """One inline voice reference: encoded audio bytes (WAV/MP3/FLAC…, decoded later), its exact transcript and the
    speaker it voices (its position in a flat list; its list's position in a list of per-speaker lists)."""

    audio: bytes
    text: str
    speaker: int = 0


@dataclass(frozen=True)
class Prosody:
    speed: float = 1.0  # 0.5..2.0
    volume: float = 0.0  # dB, -20..20
    normalize_loudness: bool = True


@dataclass(frozen=True)
class TTSRequest:
    """A validated `start.request` / HTTP body. Defaults are chosen per missing field (docs/protocol.md)."""

    text: str = ""
    chunk_length: int = 200  # clamped to 100..300 (HTTP: 100..1000)
    min_chunk_length: int = 50  # clamped to 0..100
    format: str = "mp3"  # one of FORMATS, lower-case
    sample_rate: int | None = None  # None: the format's default (decided by the audio module)
    mp3_bitrate: int = 128  # kbps (a value >= 1000 is taken as bps and converted)
    opus_bitrate: int = OPUS_AUTO  # bps, or OPUS_AUTO; kbps values (0, 1000) from the SDK are converted
    references: tuple[Reference, ...] = ()  # in order; a multi-speaker list of lists flattened, speakers kept
    reference_id: str | None = None  # the first voice id
    reference_ids: tuple[str, ...] = ()  # all voice ids, in order (multi-speaker)
    normalize: bool = True
    latency: str = "balanced"  # normal | balanced | low
    prosody: Prosody = field(default_factory=Prosody)
    top_p: float = 0.7
    temperature: float = 0.7
    top_k: int | None = None  # extension; 1 = greedy, 0 = disabled, None = engine default
    seed: int | None = None  # extension
    max_new_tokens: int = 1024
    repetition_penalty: float = 1.2
    condition_on_previous_chunks: bool = True
    early_stop_threshold: float = 1.0
    timestamps: bool = False  # extension: alignment keys on plain /v1/tts/live audio events


@dataclass(frozen=True)
class Limits:
    """Size limits; all configurable by the server."""

    max_message_bytes: int = 64 << 20  # one WS frame or one HTTP body
    max_text_chars: int = 10_000  # one `text` event (and `start.request.text` on WS)
    max_session_text_chars: int = 100_000  # a session's text not yet spoken, and an HTTP request's text
    max_references: int = 8  # inline references after flattening; also caps reference_id lists
    max_reference_bytes: int = 20 << 20  # one reference's audio
    # A client that reads slower than the server generates: the audio a session holds generated and not yet taken by
    # its socket (float32 at the model's rate: 120 s is 21 MB at 44.1 kHz). Past it the session ends with an error.
    max_unsent_audio_seconds: float = 120.0
    # A client that stopped reading: its socket accepted none of one message for this long (its own buffers and the
    # kernel's are full). The session ends with an error and its slot is released.
    send_timeout_seconds: float = 30.0
