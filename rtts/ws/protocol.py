"""Framing of `/v1/tts/live`, `/v1/tts/live/with-timestamp` and `POST /v1/tts` (docs/protocol.md).

Client messages are one MessagePack map per binary WebSocket frame; server events are encoded the same way, with
audio as msgpack BIN and text as msgpack STR. A message that cannot be decoded, or whose fields `rtts.ws.parse`
refuses, is a `ProtocolError`.

Decoding uses msgspec (it rejects trailing bytes, which ormsgpack silently ignores, so a JSON text such as
`{"event": ...}` would otherwise decode as the integer 123); encoding uses ormsgpack.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import ormsgpack

from rtts.request import Limits, TTSRequest
from rtts.ws.parse import ProtocolError, as_str, describe, parse_request

__all__ = [
    "AlignedText",
    "CancelEvent",
    "ClientEvent",
    "FlushEvent",
    "StartEvent",
    "StopEvent",
    "TextEvent",
    "alignment_fields",
    "audio_event",
    "decode_body",
    "decode_client_message",
    "decode_http_body",
    "error_json",
    "finish_event",
    "public_message",
    "server_event",
]


# ------------------------------------------------------------------------------------------------------- client events


@dataclass(frozen=True)
class StartEvent:
    request: TTSRequest


@dataclass(frozen=True)
class TextEvent:
    text: str


@dataclass(frozen=True)
class FlushEvent:
    pass


@dataclass(frozen=True)
class StopEvent:
    pass


@dataclass(frozen=True)
class CancelEvent:
    """Extension (docs/protocol.md): drop buffered text and in-flight generation without closing the socket."""


ClientEvent = StartEvent | TextEvent | FlushEvent | StopEvent | CancelEvent

# "clear" is accepted as a synonym of "cancel" (Deepgram's name for the same thing).
_SIMPLE_EVENTS: dict[str, ClientEvent] = {
    "flush": FlushEvent(),
    "stop": StopEvent(),
    "cancel": CancelEvent(),
    "clear": CancelEvent(),
}


def decode_client_message(data: bytes | str, limits: Limits = Limits()) -> ClientEvent | None:
    """One binary WebSocket frame -> a client event.

    Returns None for an event name this server does not know: the protocol tells clients to ignore unknown server
    events for forward compatibility, and we extend clients the same courtesy (the session may log it). Everything
    else that is wrong — not msgpack, not a map, no `event`, wrong field types, too large — is a ProtocolError.
    """
    if isinstance(data, str):  # a text frame (the live endpoint routes those here too)
        raise ProtocolError("text frames are not supported: send one MessagePack map per binary frame")
    if len(data) > limits.max_message_bytes:
        raise ProtocolError(f"message is {len(data)} bytes, the limit is {limits.max_message_bytes}", status=413)
    obj = _unpack(bytes(data))
    if not isinstance(obj, Mapping):
        raise ProtocolError(f"message must be a MessagePack map with an 'event' key, got {describe(obj)}")
    event = obj.get("event")
    if event is None:
        raise ProtocolError("message has no 'event' key")
    if not isinstance(event, str):
        raise ProtocolError(f"event must be a string, got {describe(event)}")
    if event == "start":
        try:
            return StartEvent(parse_request(obj.get("request"), limits, path="start.request"))
        except ProtocolError as e:
            e.event = "start"
            raise
    if event == "text":
        try:
            return TextEvent(_text_event_text(obj.get("text"), limits))
        except ProtocolError as e:
            e.event = "text"  # known to be text, not a start (out of a session an unknown one is taken for one)
            raise
    return _SIMPLE_EVENTS.get(event)


def _text_event_text(value: Any, limits: Limits) -> str:
    if isinstance(value, str) and len(value) > limits.max_text_chars:
        raise ProtocolError(
            f"text is {len(value)} characters, the limit per text event is {limits.max_text_chars}", status=413
        )
    return "" if value is None else as_str(value, "text")


def _looks_like_json(data: bytes) -> bool:
    head = data.lstrip()[:1]
    return head in (b"{", b"[")


def _unpack(data: bytes) -> Any:
    try:
        return msgspec.msgpack.decode(data)
    except RecursionError:  # containers nested deeper than the decoder recurses: never a valid event
        raise ProtocolError("message nests containers too deeply") from None
    except msgspec.DecodeError as e:
        if _looks_like_json(data):
            raise ProtocolError("message looks like JSON; this endpoint expects MessagePack in binary frames") from None
        raise ProtocolError(f"message is not valid MessagePack ({e})") from None


def decode_body(body: bytes, msgpack: bool) -> Any:
    """An HTTP body as MessagePack or JSON; ProtocolError (400) when it does not decode, deep nesting included."""
    decode, what = (msgspec.msgpack.decode, "MessagePack") if msgpack else (msgspec.json.decode, "JSON")
    try:
        return decode(body)
    except RecursionError:
        raise ProtocolError("request body nests containers too deeply") from None
    except msgspec.DecodeError as e:
        raise ProtocolError(f"request body is not valid {what} ({e})") from None


def decode_http_body(body: bytes, content_type: str, limits: Limits = Limits()) -> TTSRequest:
    """The body of `POST /v1/tts`: `application/msgpack` (the SDKs) or `application/json` (the docs' examples)."""
    if len(body) > limits.max_message_bytes:
        raise ProtocolError(f"request body is {len(body)} bytes, the limit is {limits.max_message_bytes}", status=413)
    obj = decode_body(body, msgpack=_body_kind(content_type) == "msgpack")
    if not isinstance(obj, Mapping):
        raise ProtocolError(f"request body must be a map (object), got {describe(obj)}")
    return parse_request(obj, limits, http=True, path="")


_MSGPACK_TYPES = frozenset({"application/msgpack", "application/x-msgpack", "application/vnd.msgpack"})


def _body_kind(content_type: str) -> str:
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media in _MSGPACK_TYPES:
        return "msgpack"
    if media == "application/json" or media.endswith("+json"):
        return "json"
    shown = media or "none"
    raise ProtocolError(f"unsupported Content-Type {shown}: send application/msgpack or application/json", status=415)


# ------------------------------------------------------------------------------------------------------- server events


def server_event(event: str, **fields: Any) -> bytes:
    """Any server event as one msgpack map (`event` first). bytes pack as BIN, str as STR."""
    # numpy scalars/arrays can leak in from audio/alignment code; serialize them instead of failing mid-session.
    return ormsgpack.packb({"event": event, **fields}, option=ormsgpack.OPT_SERIALIZE_NUMPY)


def audio_event(audio: bytes | bytearray | memoryview, **extra: Any) -> bytes:
    """`{"event": "audio", "audio": <bin>, **extra}`; empty audio is allowed (a trailing alignment correction)."""
    return server_event("audio", audio=audio if isinstance(audio, bytes) else bytes(audio), **extra)


def finish_event(reason: str, message: str | None = None, **extra: Any) -> bytes:
    """`{"event": "finish", "reason": ..., ["message": ...], **extra}`. `reason` is always present: the legacy SDK
    indexes it and raises KeyError without it (docs/protocol.md, server events)."""
    if not isinstance(reason, str) or not reason:
        raise ValueError("finish needs a non-empty reason")
    fields: dict[str, Any] = {"reason": reason}
    if message is not None:
        fields["message"] = public_message(message)
    return server_event("finish", **fields, **extra)


def error_json(status: int, message: str) -> dict[str, Any]:
    """The JSON body of every HTTP error (401/403 before the WebSocket upgrade, 4xx/5xx on the HTTP routes)."""
    return {"status": status, "message": public_message(message)}


# `<_io.BytesIO object at 0x7f...>`, `<function f at 0x...>`: a library's message naming a Python object by its repr
# says nothing to a client and shows a memory address.
_OBJECT_REPR = re.compile(r"<[^<>]{0,200}? at 0x[0-9A-Fa-f]+>")
MAX_MESSAGE_CHARS = 1000


def public_message(message: str) -> str:
    """An error text as clients see it, whatever produced it: object reprs replaced by what they stand for (the data
    sent), at most MAX_MESSAGE_CHARS characters."""
    text = _OBJECT_REPR.sub("the data", str(message))
    if len(text) > MAX_MESSAGE_CHARS:
        text = text[: MAX_MESSAGE_CHARS - 3] + "..."
    return text


@dataclass(frozen=True)
class AlignedText:
    """A piece of text (usually a word) and where it is spoken, in seconds from the start of its chunk's audio."""

    text: str
    start: float
    end: float


def alignment_fields(
    segments: Iterable[AlignedText | tuple[str, float, float] | Mapping[str, Any]] | None,
    *,
    chunk_seq: int,
    chunk_audio_offset_sec: float,
    content: str,
    audio_duration: float | None = None,
    elapsed_ms: float | None = None,
) -> dict[str, Any]:
    """The extra keys of an `audio` event on `/v1/tts/live/with-timestamp` (docs/protocol.md), in the docs' order:

    `content`, `alignment: {segments: [{text, start, end}], audio_duration}` (cumulative for this chunk, replacing the
    previous snapshot with the same `chunk_seq`), `chunk_seq`, `chunk_audio_offset_sec` and, when given, `time` (ms
    since the session started, an int as in the docs' example). `segments=None` sends `alignment: nil`, which clients
    must treat as "keep the previous snapshot". `audio_duration` defaults to the last segment's end. A segment may be
    an `AlignedText`, a `(text, start, end)` tuple or a `{text, start, end}` map.
    """
    alignment: dict[str, Any] | None = None
    if segments is not None:
        items = [_aligned(s) for s in segments]
        if audio_duration is None:
            audio_duration = max((s.end for s in items), default=0.0)
        alignment = {
            "segments": [{"text": s.text, "start": _sec(s.start), "end": _sec(s.end)} for s in items],
            "audio_duration": _sec(audio_duration),
        }
    fields: dict[str, Any] = {
        "content": content,
        "alignment": alignment,
        "chunk_seq": int(chunk_seq),
        "chunk_audio_offset_sec": _sec(chunk_audio_offset_sec),
    }
    if elapsed_ms is not None:
        fields["time"] = int(round(elapsed_ms))
    return fields


def _aligned(item: AlignedText | tuple[str, float, float] | Mapping[str, Any]) -> AlignedText:
    if isinstance(item, AlignedText):
        return item
    if isinstance(item, Mapping):
        return AlignedText(str(item["text"]), float(item["start"]), float(item["end"]))
    text, start, end = item
    return AlignedText(text, start, end)


def _sec(value: float) -> float:
    # Millisecond precision: finer is below what any aligner resolves, and plain floats keep numpy types off the wire.
    return round(float(value), 3)
