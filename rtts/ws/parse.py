"""The one request validator: the `request` map of a live `start`, the body of `POST /v1/tts`, and any route that
builds a `TTSRequest` itself (`validate_request`) -> a `TTSRequest` the engine can run (docs/protocol.md).

Parsing is deliberately permissive about *form*: nil or absent means the field's default, unknown keys are ignored,
and the known disagreements between the SDK, the docs and the framework plugins (opus bitrate units, chunk_length
range, scalar-or-list voices) are all accepted. What is refused is what cannot be meant: a value of the wrong type, or
one outside the range in `RANGES`, which is both what makes sense and what the engine can store (its per-slot
settings are float32 and int64 tensors: 1e300 or 2**63 would fail there, on a worker thread, not here). Strings and
lists are bounded too. Every refusal is a `ProtocolError` whose message names the field and the allowed values in
words a person can act on, never echoing more than a few dozen characters of what was sent.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from rtts.audio.encode import SAMPLE_RATES, AudioFormatError, OutputSpec
from rtts.request import OPUS_AUTO, Limits, Prosody, Reference, TTSRequest
from rtts.voices import VOICE_ID

__all__ = [
    "FORMATS",
    "LATENCIES",
    "RANGES",
    "ProtocolError",
    "Range",
    "as_str",
    "check_text",
    "decode_base64",
    "describe",
    "parse_request",
    "ranged",
    "validate_request",
]

FORMATS = frozenset({"pcm", "wav", "mp3", "opus", "mulaw"})  # mulaw: telephony extension
LATENCIES = ("normal", "balanced", "low")  # (in the order of their chunk sizes, as error messages list them)


class ProtocolError(ValueError):
    """A client message or request the server refuses. `str(e)` is user-facing and names the field.

    `status` is the HTTP status to answer with on `POST /v1/tts` (400 malformed/invalid, 413 too large, 415 bad content
    type); WebSocket sessions send the message in `finish` with `reason: "error"`.
    """

    def __init__(self, message: str, *, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.event: str | None = None  # "start" when the refused message was a start (its session's one finish)


# ------------------------------------------------------------------------------------------------------------- ranges


@dataclass(frozen=True)
class Range:
    """The values a numeric field accepts: [lo, hi] (an end may be open), optionally integers only."""

    lo: float
    hi: float
    integer: bool = False
    lo_open: bool = False
    hi_open: bool = False
    note: str = ""  # what a value means, appended to the refusal
    shown: str | None = None  # the bounds in words, where [lo, hi] would not help ("": only the kind is named)

    def contains(self, value: float) -> bool:
        ok_lo = value > self.lo if self.lo_open else value >= self.lo
        ok_hi = value < self.hi if self.hi_open else value <= self.hi
        return ok_lo and ok_hi  # NaN fails both comparisons

    def words(self) -> str:
        kind = "an integer" if self.integer else "a number"
        if self.shown is None:
            left, right = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
            text = f"{kind} in {left}{_num(self.lo)}, {_num(self.hi)}{right}"
        else:
            text = f"{kind} in {self.shown}" if self.shown else kind
        return f"{text} ({self.note})" if self.note else text


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


ANY_INT = Range(-math.inf, math.inf, integer=True, shown="")  # an integer field whose value is checked afterwards


# Every numeric request field and its accepted values (docs/protocol.md, request fields). The bounds keep the engine's
# float32 / int64 per-slot settings finite and exact; within them, each is what the field can usefully mean.
TOP_K_MAX = 65_536  # beyond any Fish codebook's size: a larger k keeps every code, as 0 does
RANGES: dict[str, Range] = {
    "temperature": Range(0.0, 2.0, hi_open=True, note="0 means greedy"),
    "top_p": Range(0.0, 1.0, note="0 means greedy"),
    "top_k": Range(0, TOP_K_MAX, integer=True, note="1 is greedy, 0 turns top-k off"),
    "seed": Range(0, 2**63 - 1, integer=True, shown="[0, 2**63)"),
    "max_new_tokens": Range(1, 4096, integer=True, note="codec frames per turn, 21.5 per second of audio"),
    "repetition_penalty": Range(0.5, 2.0, note="1 is no penalty"),
    "early_stop_threshold": Range(0.0, 1.0),
    "prosody.speed": Range(0.5, 2.0, note="1 is normal speed"),
    "prosody.volume": Range(-20.0, 20.0, note="dB"),
    # Clamped into their ranges rather than refused (the SDK, the docs and Fish Speech disagree), but integers.
    "chunk_length": ANY_INT,
    "min_chunk_length": ANY_INT,
}
CHUNK_LENGTH = (100, 300)  # WebSocket sessions
CHUNK_LENGTH_HTTP = (100, 1000)  # POST /v1/tts (Fish Speech's local server allows up to 1000)
MIN_CHUNK_LENGTH = (0, 100)
MP3_KBPS = (8, 320)  # which of these an MP3 encoder takes is the audio module's decision (64, 128, 192)
OPUS_BPS = (6_000, 512_000)  # the Opus encoder's range


# ---------------------------------------------------------------------------------------------------- field checking


def describe(value: Any) -> str:
    """A short, safe description of a bad value for an error message: never more than a few dozen characters, never
    audio bytes, never an object's repr (which would show a memory address)."""
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"binary ({len(value)} bytes)"
    if isinstance(value, Mapping):
        return "a map"
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)}"
    if isinstance(value, int):
        if value.bit_length() > 64:  # (str() of a long enough int even raises ValueError)
            return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
        return f"{value}"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        shown = repr(value[:37] + "..." if len(value) > 40 else value)
        return f"{shown} ({len(value)} characters)" if len(value) > 40 else shown
    return f"a value of type {type(value).__name__}"  # e.g. a MessagePack extension or timestamp


def _is_number(value: Any) -> bool:
    # bool is an int subclass; `true` for a number is a client bug, not a 1.
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def ranged(value: Any, name: str, bounds: Range) -> float:
    """`value` checked against `bounds` (an int when bounds.integer: JSON clients may write 200.0); a ProtocolError
    naming `name` and the range otherwise. Huge ints and floats, NaN and infinities are refused, never overflowed."""
    if not _is_number(value):
        raise ProtocolError(f"{name} must be {bounds.words()}, got {describe(value)}")
    if bounds.integer and isinstance(value, float):
        if not (math.isfinite(value) and value.is_integer()):
            raise ProtocolError(f"{name} must be {bounds.words()}, got {describe(value)}")
        value = int(value)
    if not bounds.contains(value):  # exact: Python compares an int of any size with a float without converting it
        raise ProtocolError(f"{name} must be {bounds.words()}, got {describe(value)}")
    return int(value) if bounds.integer else float(value)


def _as_bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    raise ProtocolError(f"{name} must be a boolean (true or false), got {describe(value)}")


_SURROGATE = re.compile(r"[\ud800-\udfff]")


def as_str(value: Any, name: str, max_chars: int | None = None) -> str:
    """A string field: valid Unicode (a JSON body may escape a lone surrogate, which no tokenizer or encoder takes),
    at most `max_chars` characters (413 beyond)."""
    if not isinstance(value, str):
        raise ProtocolError(f"{name} must be a string, got {describe(value)}")
    if max_chars is not None and len(value) > max_chars:
        raise ProtocolError(f"{name} is {len(value)} characters, the limit is {max_chars}", status=413)
    check_text(value, name)
    return value


def check_text(value: str, name: str) -> None:
    bad = _SURROGATE.search(value)
    if bad is not None:
        raise ProtocolError(f"{name} is not valid Unicode: an unpaired surrogate (U+{ord(bad.group()):04X}) at "
                            f"character {bad.start()}")


def _clamp(value: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, value))


class _Fields:
    """Typed access to one msgpack/JSON map; `None` (nil) and absent both yield the default."""

    def __init__(self, obj: Mapping[Any, Any], path: str) -> None:
        self.obj = obj
        self.path = path

    def name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def raw(self, key: str) -> Any:
        return self.obj.get(key)

    def number(self, key: str, default: float, bounds: Range | None = None) -> Any:
        value = self.obj.get(key)
        if value is None:
            return default
        return ranged(value, self.name(key), bounds or RANGES[key])

    def opt_int(self, key: str, bounds: Range | None = None) -> int | None:
        value = self.obj.get(key)
        return None if value is None else int(ranged(value, self.name(key), bounds or RANGES[key]))

    def get_bool(self, key: str, default: bool) -> bool:
        value = self.obj.get(key)
        return default if value is None else _as_bool(value, self.name(key))

    def get_str(self, key: str, default: str, max_chars: int | None = None) -> str:
        value = self.obj.get(key)
        return default if value is None else as_str(value, self.name(key), max_chars)

    def choice(self, key: str, default: str, allowed: Collection[str]) -> str:
        value = self.get_str(key, default)
        chosen = value.strip().lower()
        if chosen not in allowed:
            known = ", ".join(allowed if isinstance(allowed, tuple) else sorted(allowed))
            raise ProtocolError(f"{self.name(key)} must be one of {known}, got {describe(value)}")
        return chosen


# ----------------------------------------------------------------------------------------------------- request parsing


def parse_request(obj: Any, limits: Limits = Limits(), http: bool = False, *, path: str = "request") -> TTSRequest:
    """Validate a request map (already decoded) into a `TTSRequest`.

    http: the body of `POST /v1/tts` — chunk_length may go up to 1000 (Fish Speech's local limit), the text limit is the
    session limit, and reference audio may be a base64 string (JSON cannot carry binary).
    path: the prefix used in error messages (`start.request` for WebSocket sessions).
    """
    if obj is None:
        obj = {}
    if not isinstance(obj, Mapping):
        raise ProtocolError(f"{path or 'request'} must be a map, got {describe(obj)}")
    f = _Fields(obj, path)

    text = f.get_str("text", "", limits.max_session_text_chars if http else limits.max_text_chars)
    reference_ids = _parse_reference_ids(f.raw("reference_id"), f.name("reference_id"), limits)
    chunk_hi = CHUNK_LENGTH_HTTP if http else CHUNK_LENGTH
    fmt = f.choice("format", "mp3", FORMATS)
    req = TTSRequest(
        text=text,
        # Clamped, not refused: the docs default to 300, the SDK to 200, Fish Speech allows 1000.
        chunk_length=_clamp(int(f.number("chunk_length", 200)), *chunk_hi),
        min_chunk_length=_clamp(int(f.number("min_chunk_length", 50)), *MIN_CHUNK_LENGTH),
        format=fmt,
        sample_rate=_parse_sample_rate(f, fmt),
        mp3_bitrate=_parse_mp3_bitrate(f),
        opus_bitrate=_parse_opus_bitrate(f),
        references=_parse_references(f.raw("references"), f.name("references"), limits, allow_base64=http),
        reference_id=reference_ids[0] if reference_ids else None,
        reference_ids=reference_ids,
        normalize=f.get_bool("normalize", True),
        latency=f.choice("latency", "balanced", LATENCIES),
        prosody=_parse_prosody(f.raw("prosody"), f.name("prosody")),
        # 0 is allowed (the SDK's and Pipecat's ranges are 0..1) and means greedy (session.sampling_params).
        top_p=f.number("top_p", 0.7),
        temperature=f.number("temperature", 0.7),
        top_k=f.opt_int("top_k"),
        seed=f.opt_int("seed"),
        max_new_tokens=int(f.number("max_new_tokens", 1024)),
        repetition_penalty=f.number("repetition_penalty", 1.2),
        condition_on_previous_chunks=f.get_bool("condition_on_previous_chunks", True),
        early_stop_threshold=f.number("early_stop_threshold", 1.0),
        timestamps=f.get_bool("timestamps", False),
        # `features` (LiveKit's ["quality-guard"]), `streaming`, `use_memory_cache`: accepted and ignored.
    )
    _check_output(req, path)
    return req


def _check_output(req: TTSRequest, path: str) -> None:
    """What a format takes of the audio settings (MP3 bitrates, Opus's, its sample rates) is the audio module's rule;
    applied here too, so a request this validator passes always has an encoder."""
    spec = OutputSpec(format=req.format, sample_rate=req.sample_rate, mp3_bitrate=req.mp3_bitrate,
                      opus_bitrate=req.opus_bitrate, speed=req.prosody.speed, volume_db=req.prosody.volume,
                      normalize_loudness=req.prosody.normalize_loudness)
    try:
        spec.validated()
    except AudioFormatError as e:  # its message begins with the field's name
        raise ProtocolError(f"{path}.{e}" if path else str(e)) from None


def validate_request(req: TTSRequest, limits: Limits = Limits(), http: bool = True, *, path: str = "") -> TTSRequest:
    """The same checks for a `TTSRequest` a route built from its own fields (e.g. an OpenAI-style body mapped onto
    rtts's): the request as `parse_request` would have produced it from the equivalent map (chunk lengths clamped,
    units normalised), or a ProtocolError naming the rtts field (`prosody.speed`, `top_k`, ...). Reference audio is
    binary here; each reference keeps its speaker number (references come out ordered by speaker)."""
    return parse_request(_as_map(req, limits, path), limits, http, path=path)


def _as_map(req: TTSRequest, limits: Limits, path: str) -> dict[str, Any]:
    by_speaker: list[list[dict[str, Any]]] = []
    for i, r in enumerate(req.references):
        if not (isinstance(r.speaker, int) and 0 <= r.speaker < limits.max_references):
            name = f"{path}.references" if path else "references"
            raise ProtocolError(f"{name}[{i}] voices speaker {describe(r.speaker)}; speakers are numbered 0 to "
                                f"{limits.max_references - 1}")
        while len(by_speaker) <= r.speaker:
            by_speaker.append([])
        by_speaker[r.speaker].append({"audio": r.audio, "text": r.text})
    ids: list[str] | None = list(req.reference_ids) or ([req.reference_id] if req.reference_id else None)
    return {
        "text": req.text, "chunk_length": req.chunk_length, "min_chunk_length": req.min_chunk_length,
        "format": req.format, "sample_rate": req.sample_rate, "mp3_bitrate": req.mp3_bitrate,
        "opus_bitrate": req.opus_bitrate, "references": by_speaker or None, "reference_id": ids,
        "normalize": req.normalize, "latency": req.latency,
        "prosody": {"speed": req.prosody.speed, "volume": req.prosody.volume,
                    "normalize_loudness": req.prosody.normalize_loudness},
        "top_p": req.top_p, "temperature": req.temperature, "top_k": req.top_k, "seed": req.seed,
        "max_new_tokens": req.max_new_tokens, "repetition_penalty": req.repetition_penalty,
        "condition_on_previous_chunks": req.condition_on_previous_chunks,
        "early_stop_threshold": req.early_stop_threshold, "timestamps": req.timestamps,
    }


def _parse_sample_rate(f: _Fields, fmt: str) -> int | None:
    value = f.raw("sample_rate")
    if value is None:
        return None  # the format's default (decided by the audio module)
    rate = ranged(value, f.name("sample_rate"), ANY_INT)
    if rate not in SAMPLE_RATES[fmt]:
        rates = ", ".join(str(r) for r in SAMPLE_RATES[fmt])
        raise ProtocolError(f"{f.name('sample_rate')} {describe(value)} is not supported for {fmt}; use one of "
                            f"{rates}")
    return int(rate)


def _parse_mp3_bitrate(f: _Fields) -> int:
    value = f.raw("mp3_bitrate")
    if value is None:
        return 128
    name = f.name("mp3_bitrate")
    kbps = int(ranged(value, name, ANY_INT))
    if kbps >= 1000:  # symmetric with opus: someone wrote bps
        kbps //= 1000
    lo, hi = MP3_KBPS
    if not lo <= kbps <= hi:
        raise ProtocolError(f"{name} must be a bitrate of {lo}-{hi} kbps (64, 128 or 192 for MP3; values from 1000 "
                            f"are read as bps), got {describe(value)}")
    return kbps


def _parse_opus_bitrate(f: _Fields) -> int:
    """-> bps or OPUS_AUTO. The SDK sends kbps (32), the docs bps (24000): values in (0, 1000) are kbps."""
    value = f.raw("opus_bitrate")
    if value is None:
        return OPUS_AUTO
    name = f.name("opus_bitrate")
    given = int(ranged(value, name, ANY_INT))
    if given == OPUS_AUTO:
        return given
    bps = given * 1000 if 0 < given < 1000 else given
    lo, hi = OPUS_BPS
    if not lo <= bps <= hi:
        raise ProtocolError(f"{name} must be -1000 (auto), {lo // 1000}-{hi // 1000} kbps or {lo}-{hi} bps, got "
                            f"{describe(value)}")
    return bps


def _parse_prosody(value: Any, name: str) -> Prosody:
    if value is None:
        return Prosody()
    if not isinstance(value, Mapping):
        raise ProtocolError(f"{name} must be a map with speed/volume, got {describe(value)}")
    f = _Fields(value, name)
    return Prosody(
        speed=f.number("speed", 1.0, RANGES["prosody.speed"]),
        volume=f.number("volume", 0.0, RANGES["prosody.volume"]),  # Pipecat sends an int: accepted
        normalize_loudness=f.get_bool("normalize_loudness", True),
    )


_VOICE_ID_WORDS = "1-128 letters, digits, '_', '-' or '.', starting with a letter or digit"


def _voice_id(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ProtocolError(f"{name} must be a non-empty string, got {describe(value)}")
    if not VOICE_ID.fullmatch(value):  # no stored voice can have another id: say so rather than "unknown"
        raise ProtocolError(f"{name} must be a voice id ({_VOICE_ID_WORDS}), got {describe(value)}")
    return value


def _parse_reference_ids(value: Any, name: str, limits: Limits) -> tuple[str, ...]:
    """str | list[str] | nil -> ids in order. "" (some clients' 'no voice') counts as absent."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (_voice_id(value, name),) if value.strip() else ()
    if not isinstance(value, (list, tuple)):
        raise ProtocolError(f"{name} must be a string or a list of strings, got {describe(value)}")
    if len(value) > limits.max_references:
        raise ProtocolError(f"{name} has {len(value)} voices, the limit is {limits.max_references}", status=413)
    # An empty id inside a list is refused rather than dropped: list positions are speaker numbers.
    return tuple(_voice_id(item, f"{name}[{i}]") for i, item in enumerate(value))


def _parse_references(value: Any, name: str, limits: Limits, *, allow_base64: bool) -> tuple[Reference, ...]:
    """list[{audio, text}] | list[list[{audio, text}]] (multi-speaker) | nil -> flattened references, in order. In a
    flat list reference i voices speaker i (Fish's numbering); in a list of lists every reference of list i does."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise ProtocolError(f"{name} must be a list of {{audio, text}} maps, got {describe(value)}")
    count = sum(len(item) if isinstance(item, (list, tuple)) else 1 for item in value)
    if count > limits.max_references:
        raise ProtocolError(f"{name} has {count} references, the limit is {limits.max_references}", status=413)
    if len(value) > limits.max_references:  # empty per-speaker lists: speaker numbers past any voice
        raise ProtocolError(f"{name} lists {len(value)} speakers, the limit is {limits.max_references}", status=413)
    items: list[tuple[str, Any, int]] = []
    for i, item in enumerate(value):
        if isinstance(item, (list, tuple)):  # one speaker's references
            items.extend((f"{name}[{i}][{j}]", sub, i) for j, sub in enumerate(item))
        else:
            items.append((f"{name}[{i}]", item, i))
    return tuple(_parse_reference(item, where, limits, speaker, allow_base64=allow_base64)
                 for where, item, speaker in items)


def _parse_reference(value: Any, name: str, limits: Limits, speaker: int, *, allow_base64: bool) -> Reference:
    if not isinstance(value, Mapping):
        raise ProtocolError(f"{name} must be a map with audio and text, got {describe(value)}")
    f = _Fields(value, name)
    audio = _reference_audio(value.get("audio"), f.name("audio"), limits, allow_base64=allow_base64)
    if not audio:
        raise ProtocolError(f"{f.name('audio')} is missing or empty")
    if len(audio) > limits.max_reference_bytes:
        raise ProtocolError(
            f"{f.name('audio')} is {len(audio)} bytes, the limit is {limits.max_reference_bytes}", status=413
        )
    # A missing transcript is tolerated (the engine may refuse or transcribe); a wrong type is not.
    return Reference(audio=audio, text=f.get_str("text", "", limits.max_text_chars), speaker=speaker)


def _reference_audio(value: Any, name: str, limits: Limits, *, allow_base64: bool) -> bytes:
    if value is None:
        return b""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str) and allow_base64:
        if len(value) > 2 * limits.max_reference_bytes:  # (base64 is 4/3 of the audio: refused before decoding)
            raise ProtocolError(f"{name} is {len(value)} characters of base64, over the "
                                f"{limits.max_reference_bytes}-byte audio limit", status=413)
        return decode_base64(value, name)
    expected = "binary (msgpack bin) or a base64 string" if allow_base64 else "binary (msgpack bin)"
    raise ProtocolError(f"{name} must be {expected}, got {describe(value)}")


_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")
_BASE64_URL = re.compile(r"[A-Za-z0-9_-]*={0,2}")


def decode_base64(value: str, name: str) -> bytes:
    """Audio sent in JSON: standard or URL-safe base64, padded or not, line-wrapped or a `data:` URI. Anything else
    is refused with where it goes wrong (a JSON client that sent raw text or a file path learns it)."""
    text = value.strip()
    if text.startswith("data:"):  # data:audio/wav;base64,....
        head, comma, text = text.partition(",")
        if not comma or not head.endswith(";base64"):
            raise ProtocolError(f"{name} is a data: URI without ';base64,': send the audio base64-encoded")
    text = text.replace("\r", "").replace("\n", "")  # line-wrapped base64 (a space inside is an error, below)
    if not text:
        return b""
    urlsafe = "-" in text or "_" in text
    pattern = _BASE64_URL if urlsafe else _BASE64
    if not pattern.fullmatch(text):
        bad = next((i for i, c in enumerate(text) if not pattern.fullmatch(c) and c != "="), None)
        if bad is None:
            raise ProtocolError(f"{name} is not valid base64: '=' padding may only end it")
        raise ProtocolError(f"{name} is not valid base64: character {bad} is {describe(text[bad])}; send the audio "
                            "file's bytes base64-encoded (standard or URL-safe alphabet)")
    if len(text.rstrip("=")) % 4 == 1:
        raise ProtocolError(f"{name} is not valid base64: its length ({len(text)} characters) cannot be complete")
    text += "=" * (-len(text) % 4)  # tolerate stripped padding
    try:
        return base64.urlsafe_b64decode(text) if urlsafe else base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError(f"{name} is not valid base64 (misplaced '=' padding)") from None
