"""A synthesis request from the wire: the `request` map of a live `start` or the body of `POST /v1/tts` -> `TTSRequest`
(docs/protocol.md).

Parsing is deliberately permissive: nil or absent means the field's default, unknown keys are ignored, and the known
disagreements between the SDK, the docs and the framework plugins (opus bitrate units, chunk_length range,
scalar-or-list voices) are all accepted. What is refused is what cannot be meant: a value of the wrong type, or
a value outside the range the engine can honour. Every refusal is a `ProtocolError` whose message names the field, so
the session can send it verbatim in `finish` (reason "error") or in an HTTP 4xx body.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Mapping
from typing import Any

from rtts.request import OPUS_AUTO, Limits, Prosody, Reference, TTSRequest

__all__ = ["FORMATS", "LATENCIES", "ProtocolError", "as_str", "describe", "parse_request"]

FORMATS = frozenset({"pcm", "wav", "mp3", "opus", "mulaw"})  # mulaw: telephony extension
LATENCIES = frozenset({"normal", "balanced", "low"})


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


# ---------------------------------------------------------------------------------------------------- field validation


def describe(value: Any) -> str:
    """A short, safe description of a bad value for an error message (never dumps audio bytes)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"binary ({len(value)} bytes)"
    if isinstance(value, Mapping):
        return "a map"
    if isinstance(value, (list, tuple)):
        return "a list"
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{type(value).__name__} {text}"


def _is_number(value: Any) -> bool:
    # bool is an int subclass; `true` for a number is a client bug, not a 1.
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _as_int(value: Any, name: str) -> int:
    if _is_number(value):
        if isinstance(value, int):
            return value
        if math.isfinite(value) and value.is_integer():  # JSON clients may write 200.0
            return int(value)
    raise ProtocolError(f"{name} must be an integer, got {describe(value)}")


def _as_float(value: Any, name: str) -> float:
    if _is_number(value):
        return float(value)
    raise ProtocolError(f"{name} must be a number, got {describe(value)}")


def _as_bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    raise ProtocolError(f"{name} must be a boolean, got {describe(value)}")


def as_str(value: Any, name: str) -> str:
    if isinstance(value, str):
        return value
    raise ProtocolError(f"{name} must be a string, got {describe(value)}")


def _check_range(
    value: float, lo: float, hi: float, name: str, *, lo_open: bool = False, hi_open: bool = False
) -> None:
    ok_lo = value > lo if lo_open else value >= lo
    ok_hi = value < hi if hi_open else value <= hi
    if not (ok_lo and ok_hi):  # NaN fails both comparisons, so it is refused here too
        left, right = "(" if lo_open else "[", ")" if hi_open else "]"
        raise ProtocolError(f"{name} must be in {left}{lo:g}, {hi:g}{right}, got {value!r}")


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

    def get_int(self, key: str, default: int) -> int:
        value = self.obj.get(key)
        return default if value is None else _as_int(value, self.name(key))

    def opt_int(self, key: str) -> int | None:
        value = self.obj.get(key)
        return None if value is None else _as_int(value, self.name(key))

    def get_float(self, key: str, default: float) -> float:
        value = self.obj.get(key)
        return default if value is None else _as_float(value, self.name(key))

    def get_bool(self, key: str, default: bool) -> bool:
        value = self.obj.get(key)
        return default if value is None else _as_bool(value, self.name(key))

    def get_str(self, key: str, default: str) -> str:
        value = self.obj.get(key)
        return default if value is None else as_str(value, self.name(key))


# ----------------------------------------------------------------------------------------------------- request parsing


def parse_request(obj: Any, limits: Limits = Limits(), http: bool = False, *, path: str = "request") -> TTSRequest:
    """Validate a `TTSRequest` map (already decoded) into a `TTSRequest`.

    http: the body of `POST /v1/tts` — chunk_length may go up to 1000 (Fish Speech's local limit), the text limit is the
    session limit, and reference audio may be a base64 string (JSON cannot carry binary).
    path: the prefix used in error messages (`start.request` for WebSocket sessions).
    """
    if obj is None:
        obj = {}
    if not isinstance(obj, Mapping):
        raise ProtocolError(f"{path or 'request'} must be a map, got {describe(obj)}")
    f = _Fields(obj, path)

    text = f.get_str("text", "")
    max_chars = limits.max_session_text_chars if http else limits.max_text_chars
    if len(text) > max_chars:
        raise ProtocolError(f"{f.name('text')} is {len(text)} characters, the limit is {max_chars}", status=413)

    reference_ids = _parse_reference_ids(f.raw("reference_id"), f.name("reference_id"), limits)
    return TTSRequest(
        text=text,
        # Clamped, not refused: the docs default to 300, the SDK to 200, Fish Speech allows 1000.
        chunk_length=_clamp(f.get_int("chunk_length", 200), 100, 1000 if http else 300),
        min_chunk_length=_clamp(f.get_int("min_chunk_length", 50), 0, 100),
        format=_parse_format(f),
        sample_rate=_parse_sample_rate(f),
        mp3_bitrate=_parse_mp3_bitrate(f),
        opus_bitrate=_parse_opus_bitrate(f),
        references=_parse_references(f.raw("references"), f.name("references"), limits, allow_base64=http),
        reference_id=reference_ids[0] if reference_ids else None,
        reference_ids=reference_ids,
        normalize=f.get_bool("normalize", True),
        latency=_parse_latency(f),
        prosody=_parse_prosody(f.raw("prosody"), f.name("prosody")),
        # 0 is allowed (the SDK's and Pipecat's ranges are 0..1) and means greedy (session.sampling_params).
        top_p=_ranged_float(f, "top_p", 0.7, 0.0, 1.0),
        temperature=_ranged_float(f, "temperature", 0.7, 0.0, 2.0, hi_open=True),
        top_k=_parse_top_k(f),
        seed=_parse_seed(f),
        max_new_tokens=_ranged_int(f, "max_new_tokens", 1024, 1, 4096),
        repetition_penalty=_parse_repetition_penalty(f),
        condition_on_previous_chunks=f.get_bool("condition_on_previous_chunks", True),
        early_stop_threshold=_ranged_float(f, "early_stop_threshold", 1.0, 0.0, 1.0),
        timestamps=f.get_bool("timestamps", False),
        # `features` (LiveKit's ["quality-guard"]), `streaming`, `use_memory_cache`: accepted and ignored.
    )


def _ranged_float(
    f: _Fields, key: str, default: float, lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False
) -> float:
    value = f.get_float(key, default)
    _check_range(value, lo, hi, f.name(key), lo_open=lo_open, hi_open=hi_open)
    return value


def _ranged_int(f: _Fields, key: str, default: int, lo: int, hi: int) -> int:
    value = f.get_int(key, default)
    _check_range(value, lo, hi, f.name(key))
    return value


def _parse_format(f: _Fields) -> str:
    fmt = f.get_str("format", "mp3").strip().lower()
    if fmt not in FORMATS:
        known = ", ".join(sorted(FORMATS))
        raise ProtocolError(f"{f.name('format')} must be one of {known}, got {f.raw('format')!r}")
    return fmt


def _parse_sample_rate(f: _Fields) -> int | None:
    rate = f.opt_int("sample_rate")
    if rate is not None and rate <= 0:
        raise ProtocolError(f"{f.name('sample_rate')} must be a positive number of Hz, got {rate}")
    return rate  # which rates a format supports is the audio module's decision


def _parse_mp3_bitrate(f: _Fields) -> int:
    kbps = f.get_int("mp3_bitrate", 128)
    if kbps >= 1000:  # symmetric with opus: someone wrote bps
        kbps //= 1000
    if kbps <= 0:
        raise ProtocolError(f"{f.name('mp3_bitrate')} must be a positive bitrate in kbps, got {f.raw('mp3_bitrate')}")
    return kbps


def _parse_opus_bitrate(f: _Fields) -> int:
    """-> bps or OPUS_AUTO. The SDK sends kbps (32), the docs bps (24000): values in (0, 1000) are kbps."""
    value = f.get_int("opus_bitrate", OPUS_AUTO)
    if value == OPUS_AUTO:
        return value
    bps = value * 1000 if 0 < value < 1000 else value
    if not 6_000 <= bps <= 512_000:  # the Opus encoder's range
        raise ProtocolError(
            f"{f.name('opus_bitrate')} must be -1000 (auto), 6..512 kbps or 6000..512000 bps, got {value}"
        )
    return bps


def _parse_latency(f: _Fields) -> str:
    latency = f.get_str("latency", "balanced").strip().lower()
    if latency not in LATENCIES:
        raise ProtocolError(f"{f.name('latency')} must be one of normal, balanced, low, got {f.raw('latency')!r}")
    return latency


def _parse_top_k(f: _Fields) -> int | None:
    top_k = f.opt_int("top_k")
    if top_k is not None and top_k < 0:
        raise ProtocolError(f"{f.name('top_k')} must be >= 0 (1 = greedy, 0 = disabled), got {top_k}")
    return top_k


def _parse_seed(f: _Fields) -> int | None:
    seed = f.opt_int("seed")
    if seed is not None and not 0 <= seed < 2**63:
        raise ProtocolError(f"{f.name('seed')} must be in [0, 2**63), got {seed}")
    return seed


def _parse_repetition_penalty(f: _Fields) -> float:
    value = f.get_float("repetition_penalty", 1.2)
    if not (math.isfinite(value) and value > 0.0):
        raise ProtocolError(f"{f.name('repetition_penalty')} must be a finite number > 0, got {value!r}")
    return value


def _parse_prosody(value: Any, name: str) -> Prosody:
    if value is None:
        return Prosody()
    if not isinstance(value, Mapping):
        raise ProtocolError(f"{name} must be a map with speed/volume, got {describe(value)}")
    f = _Fields(value, name)
    return Prosody(
        speed=_ranged_float(f, "speed", 1.0, 0.5, 2.0),
        volume=_ranged_float(f, "volume", 0.0, -20.0, 20.0),  # Pipecat sends an int; _as_float accepts it
        normalize_loudness=f.get_bool("normalize_loudness", True),
    )


def _parse_reference_ids(value: Any, name: str, limits: Limits) -> tuple[str, ...]:
    """str | list[str] | nil -> ids in order. "" (some clients' 'no voice') counts as absent."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,) if value.strip() else ()
    if not isinstance(value, (list, tuple)):
        raise ProtocolError(f"{name} must be a string or a list of strings, got {describe(value)}")
    if len(value) > limits.max_references:
        raise ProtocolError(f"{name} has {len(value)} voices, the limit is {limits.max_references}", status=413)
    ids: list[str] = []
    for i, item in enumerate(value):
        # An empty id inside a list is refused rather than dropped: list positions are speaker numbers.
        if not isinstance(item, str) or not item.strip():
            raise ProtocolError(f"{name}[{i}] must be a non-empty string, got {describe(item)}")
        ids.append(item)
    return tuple(ids)


def _parse_references(value: Any, name: str, limits: Limits, *, allow_base64: bool) -> tuple[Reference, ...]:
    """list[{audio, text}] | list[list[{audio, text}]] (multi-speaker) | nil -> flattened references, in order. In a
    flat list reference i voices speaker i (Fish's numbering); in a list of lists every reference of list i does."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise ProtocolError(f"{name} must be a list of {{audio, text}} maps, got {describe(value)}")
    items: list[tuple[str, Any, int]] = []
    for i, item in enumerate(value):
        if isinstance(item, (list, tuple)):  # one speaker's references
            items.extend((f"{name}[{i}][{j}]", sub, i) for j, sub in enumerate(item))
        else:
            items.append((f"{name}[{i}]", item, i))
    if len(items) > limits.max_references:
        raise ProtocolError(f"{name} has {len(items)} references, the limit is {limits.max_references}", status=413)
    return tuple(_parse_reference(item, where, limits, speaker, allow_base64=allow_base64)
                 for where, item, speaker in items)


def _parse_reference(value: Any, name: str, limits: Limits, speaker: int, *, allow_base64: bool) -> Reference:
    if not isinstance(value, Mapping):
        raise ProtocolError(f"{name} must be a map with audio and text, got {describe(value)}")
    f = _Fields(value, name)
    audio = _reference_audio(value.get("audio"), f.name("audio"), allow_base64=allow_base64)
    if not audio:
        raise ProtocolError(f"{f.name('audio')} is missing or empty")
    if len(audio) > limits.max_reference_bytes:
        raise ProtocolError(
            f"{f.name('audio')} is {len(audio)} bytes, the limit is {limits.max_reference_bytes}", status=413
        )
    # A missing transcript is tolerated (the engine may refuse or transcribe); a wrong type is not.
    return Reference(audio=audio, text=f.get_str("text", ""), speaker=speaker)


def _reference_audio(value: Any, name: str, *, allow_base64: bool) -> bytes:
    if value is None:
        return b""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str) and allow_base64:
        return _b64decode(value, name)
    expected = "binary (msgpack bin) or a base64 string" if allow_base64 else "binary (msgpack bin)"
    raise ProtocolError(f"{name} must be {expected}, got {describe(value)}")


def _b64decode(value: str, name: str) -> bytes:
    text = value.strip()
    if text.startswith("data:") and "," in text:  # data URI: data:audio/wav;base64,....
        text = text.split(",", 1)[1]
    text = "".join(text.split())  # line-wrapped base64
    text += "=" * (-len(text) % 4)  # tolerate stripped padding
    try:
        if "-" in text or "_" in text:
            return base64.urlsafe_b64decode(text)
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError(f"{name} is not valid base64") from None

