"""The live/HTTP wire format: what real clients send must parse, bad input must fail with a clear ProtocolError."""

from __future__ import annotations

import base64
import dataclasses
import json
from typing import Any

import ormsgpack
import pytest

from rtts.request import OPUS_AUTO, Limits, Prosody, Reference, TTSRequest
from rtts.ws.parse import ProtocolError, parse_request
from rtts.ws.protocol import (
    AlignedText,
    CancelEvent,
    FlushEvent,
    StartEvent,
    StopEvent,
    TextEvent,
    alignment_fields,
    audio_event,
    decode_client_message,
    decode_http_body,
    error_json,
    finish_event,
    server_event,
)


def pack(obj: Any) -> bytes:
    return ormsgpack.packb(obj)


def start(request: Any) -> bytes:
    return pack({"event": "start", "request": request})


def decode_start(request: Any, limits: Limits = Limits()) -> TTSRequest:
    event = decode_client_message(start(request), limits)
    assert isinstance(event, StartEvent)
    return event.request


# ---------------------------------------------------------------------------------------------- what real clients send


def test_new_sdk_start_with_all_defaults() -> None:
    from fishaudio.types.tts import StartEvent as SdkStart
    from fishaudio.types.tts import TTSRequest as SdkRequest

    wire = SdkStart(request=SdkRequest(text="")).model_dump()
    # The shape PROTOCOL §2.4 documents: nils for sample_rate/reference_id/prosody, opus_bitrate in kbps.
    assert list(wire["request"]) == [
        "text", "chunk_length", "format", "sample_rate", "mp3_bitrate", "opus_bitrate", "references", "reference_id",
        "normalize", "latency", "prosody", "top_p", "temperature", "max_new_tokens", "repetition_penalty",
        "min_chunk_length", "condition_on_previous_chunks", "early_stop_threshold",
    ]  # fmt: skip
    assert wire["request"]["prosody"] is None and wire["request"]["opus_bitrate"] == 32

    event = decode_client_message(pack(wire))
    assert isinstance(event, StartEvent)
    assert event.request == TTSRequest(opus_bitrate=32_000)


def test_new_sdk_start_with_references_and_speed() -> None:
    from fishaudio.types.tts import Prosody as SdkProsody
    from fishaudio.types.tts import ReferenceAudio
    from fishaudio.types.tts import StartEvent as SdkStart
    from fishaudio.types.tts import TTSRequest as SdkRequest

    sdk = SdkRequest(
        text="",
        chunk_length=100,
        format="pcm",
        sample_rate=24000,
        references=[ReferenceAudio(audio=b"RIFF0123", text="ref text")],
        reference_id="voice123",
        prosody=SdkProsody(speed=1.1),
    )
    req = decode_start(SdkStart(request=sdk).model_dump()["request"])
    assert req.chunk_length == 100 and req.format == "pcm" and req.sample_rate == 24000
    assert req.references == (Reference(audio=b"RIFF0123", text="ref text"),)
    assert req.reference_id == "voice123" and req.reference_ids == ("voice123",)
    assert req.prosody == Prosody(speed=1.1, volume=0.0, normalize_loudness=True)


def test_new_sdk_text_flush_stop_events() -> None:
    from fishaudio.types.tts import CloseEvent
    from fishaudio.types.tts import FlushEvent as SdkFlush
    from fishaudio.types.tts import TextEvent as SdkText

    assert decode_client_message(pack(SdkText(text="Hello, ").model_dump())) == TextEvent("Hello, ")
    assert decode_client_message(pack(SdkFlush().model_dump())) == FlushEvent()
    assert decode_client_message(pack(CloseEvent().model_dump())) == StopEvent()


def test_legacy_sdk_start() -> None:
    from fish_audio_sdk.schemas import StartEvent as LegacyStart
    from fish_audio_sdk.schemas import TTSRequest as LegacyRequest

    wire = LegacyStart(request=LegacyRequest(text="")).model_dump()
    assert len(wire["request"]) == 13  # up to temperature (PROTOCOL §2.4)
    req = decode_start(wire["request"])
    assert req == TTSRequest(opus_bitrate=32_000)


def test_new_sdk_http_body_exclude_none() -> None:
    from fishaudio.types.tts import TTSRequest as SdkRequest

    body = pack(SdkRequest(text="Hello world.", format="wav").model_dump(exclude_none=True))
    req = decode_http_body(body, "application/msgpack", Limits())
    assert req.text == "Hello world." and req.format == "wav" and req.sample_rate is None and req.prosody == Prosody()


def test_livekit_style_start() -> None:
    req = decode_start(
        {
            "text": "",
            "chunk_length": 100,
            "format": "wav",
            "sample_rate": 24000,
            "mp3_bitrate": 64,
            "opus_bitrate": 64000,
            "references": [],
            "reference_id": "933563129e564b19a115bedd57b7406a",
            "normalize": True,
            "latency": "low",
            "prosody": {"speed": 1.2},
            "top_p": 0.7,
            "temperature": 0.7,
            "features": ["quality-guard"],
        }
    )
    assert req.opus_bitrate == 64_000 and req.mp3_bitrate == 64 and req.latency == "low"
    assert req.prosody == Prosody(speed=1.2, volume=0.0, normalize_loudness=True)
    assert req.reference_id == "933563129e564b19a115bedd57b7406a"


def test_pipecat_style_minimal_start() -> None:
    req = decode_start(
        {
            "text": "",
            "sample_rate": 16000,
            "latency": "balanced",
            "format": "pcm",
            "normalize": True,
            "prosody": {"speed": 1.0, "volume": 0},
            "reference_id": None,
        }
    )
    assert req.sample_rate == 16000 and req.format == "pcm" and req.reference_id is None
    assert req.prosody.volume == 0.0 and isinstance(req.prosody.volume, float)
    assert req.chunk_length == 200 and req.min_chunk_length == 50  # defaults for the missing fields


def test_start_without_request_uses_defaults() -> None:
    assert decode_client_message(pack({"event": "start"})) == StartEvent(TTSRequest())


# ------------------------------------------------------------------------------------------- tolerance (PROTOCOL §2.7)


def test_nil_and_absent_mean_default() -> None:
    # Every field (the request's own names, plus the wire-only ones) sent as nil.
    wire_only = ["reference_id", "prosody", "features", "streaming"]
    nils = {name: None for name in [f.name for f in dataclasses.fields(TTSRequest)] + wire_only}
    assert parse_request(nils) == TTSRequest()
    assert parse_request({}) == TTSRequest()


def test_unknown_keys_ignored() -> None:
    req = parse_request(
        {
            "text": "hi",
            "streaming": True,
            "use_memory_cache": "on",
            "features": ["quality-guard"],
            "something_new": {"nested": [1, 2]},
        }
    )
    assert req == TTSRequest(text="hi")


@pytest.mark.parametrize(
    ("sent", "bps"),
    [(32, 32_000), (64, 64_000), (24000, 24_000), (64000, 64_000), (-1000, OPUS_AUTO), (None, OPUS_AUTO)],
)
def test_opus_bitrate_kbps_or_bps(sent: int | None, bps: int) -> None:
    assert parse_request({"opus_bitrate": sent}).opus_bitrate == bps


@pytest.mark.parametrize(
    ("sent", "ws", "http"),
    [(50, 100, 100), (100, 100, 100), (250, 250, 250), (300, 300, 300), (600, 300, 600), (5000, 300, 1000)],
)
def test_chunk_length_clamped(sent: int, ws: int, http: int) -> None:
    assert parse_request({"chunk_length": sent}).chunk_length == ws
    assert parse_request({"chunk_length": sent}, http=True).chunk_length == http


def test_min_chunk_length_clamped_and_integral_floats_accepted() -> None:
    assert parse_request({"min_chunk_length": 500}).min_chunk_length == 100
    assert parse_request({"min_chunk_length": -3}).min_chunk_length == 0
    assert parse_request({"chunk_length": 150.0}).chunk_length == 150


def test_reference_id_scalar_or_list() -> None:
    req = parse_request({"reference_id": ["a", "b"]})
    assert req.reference_id == "a" and req.reference_ids == ("a", "b")
    assert parse_request({"reference_id": "x"}).reference_ids == ("x",)
    assert parse_request({"reference_id": ""}).reference_id is None
    assert parse_request({"reference_id": []}).reference_ids == ()


def test_references_multi_speaker_flattened_in_order() -> None:
    refs = [[{"audio": b"a0", "text": "t0"}, {"audio": b"a1", "text": "t1"}], [{"audio": b"b0", "text": "u0"}]]
    req = parse_request({"references": refs})
    assert [r.audio for r in req.references] == [b"a0", b"a1", b"b0"]
    assert [r.text for r in req.references] == ["t0", "t1", "u0"]
    assert [r.speaker for r in req.references] == [0, 0, 1]  # a list per speaker: its clips share the number
    flat = parse_request({"references": [{"audio": b"a", "text": "t"}, {"audio": b"b", "text": "u"}]})
    assert [r.speaker for r in flat.references] == [0, 1]  # a flat list: one speaker per reference


def test_reference_without_text_tolerated() -> None:
    assert parse_request({"references": [{"audio": b"x"}]}).references == (Reference(b"x", ""),)


def test_prosody_partial_and_int_volume() -> None:
    assert parse_request({"prosody": {"volume": 3}}).prosody == Prosody(speed=1.0, volume=3.0)
    assert parse_request({"prosody": {"speed": 2}}).prosody.speed == 2.0
    assert parse_request({"prosody": {"normalize_loudness": False}}).prosody.normalize_loudness is False
    assert parse_request({"prosody": {}}).prosody == Prosody()


def test_enums_case_insensitive_and_extensions() -> None:
    req = parse_request({"format": "PCM", "latency": "Normal", "top_k": 1, "seed": 42, "timestamps": True})
    assert (req.format, req.latency, req.top_k, req.seed, req.timestamps) == ("pcm", "normal", 1, 42, True)
    assert parse_request({"format": "mulaw", "sample_rate": 8000}).format == "mulaw"
    assert parse_request({"seed": 2**63 - 1}).seed == 2**63 - 1
    assert parse_request({"top_k": 0}).top_k == 0


def test_mp3_bitrate_bps_converted() -> None:
    assert parse_request({"mp3_bitrate": 192000}).mp3_bitrate == 192


# ------------------------------------------------------------------------------------------------- ProtocolError cases


def expect_error(data: bytes, *words: str, limits: Limits = Limits(), status: int = 400) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode_client_message(data, limits)
    message = str(info.value)
    for word in words:
        assert word in message, (word, message)
    assert info.value.status == status
    return info.value


def test_malformed_msgpack() -> None:
    expect_error(b"\xc1", "not valid MessagePack")
    expect_error(b"", "not valid MessagePack")
    expect_error(pack({"event": "text", "text": "hi"})[:-1], "not valid MessagePack")  # truncated


def test_json_text_is_named() -> None:
    # A JSON object's first byte '{' is a valid msgpack fixint: without the trailing-bytes check this decodes as 123.
    expect_error(json.dumps({"event": "stop"}).encode(), "JSON")
    expect_error(b'  ["stop"]', "JSON")


def test_text_frame_refused() -> None:
    with pytest.raises(ProtocolError, match="text frames"):
        decode_client_message('{"event": "stop"}')  # type: ignore[arg-type]


def test_not_a_map() -> None:
    expect_error(pack(["start", {}]), "map")
    expect_error(pack(5), "map")
    expect_error(pack(None), "map")


def test_no_event() -> None:
    expect_error(pack({"text": "hi"}), "no 'event'")
    expect_error(pack({"event": None}), "no 'event'")
    expect_error(pack({"event": 3}), "event", "string")


def test_unknown_event_ignored() -> None:
    assert decode_client_message(pack({"event": "ping"})) is None
    assert decode_client_message(pack({"event": "close"})) is None  # the SDK's class is CloseEvent, the literal "stop"


def test_cancel_extension() -> None:
    assert decode_client_message(pack({"event": "cancel"})) == CancelEvent()
    assert decode_client_message(pack({"event": "clear"})) == CancelEvent()


def test_text_event_types() -> None:
    assert decode_client_message(pack({"event": "text"})) == TextEvent("")
    expect_error(pack({"event": "text", "text": b"bytes"}), "text must be a string", "binary")
    expect_error(pack({"event": "text", "text": 5}), "text must be a string")


@pytest.mark.parametrize(
    ("request_", "words"),
    [
        ({"temperature": "hot"}, ["start.request.temperature", "number", "'hot'"]),
        ({"format": 5}, ["start.request.format", "string"]),
        ({"chunk_length": "200"}, ["start.request.chunk_length", "integer"]),
        ({"chunk_length": 150.5}, ["chunk_length", "integer"]),
        ({"normalize": "yes"}, ["start.request.normalize", "boolean"]),
        ({"top_p": True}, ["top_p", "number"]),
        ({"references": "abc"}, ["start.request.references", "list"]),
        ({"references": {"audio": b"x", "text": "t"}}, ["references", "list"]),
        ({"references": [b"x"]}, ["start.request.references[0]", "map"]),
        ({"references": [{"audio": "UklGRg==", "text": "t"}]}, ["references[0].audio", "binary"]),
        ({"references": [{"audio": b"", "text": "t"}]}, ["references[0].audio", "empty"]),
        ({"references": [{"text": "t"}]}, ["references[0].audio", "missing"]),
        ({"references": [{"audio": b"x", "text": 1}]}, ["references[0].text", "string"]),
        ({"references": [[{"audio": b"x", "text": "t"}, "y"]]}, ["references[0][1]", "map"]),
        ({"reference_id": 7}, ["start.request.reference_id", "string"]),
        ({"reference_id": ["a", 7]}, ["reference_id[1]", "string"]),
        ({"reference_id": ["a", ""]}, ["reference_id[1]", "non-empty"]),
        ({"prosody": 1.2}, ["start.request.prosody", "map"]),
        ({"prosody": {"speed": "fast"}}, ["start.request.prosody.speed", "number"]),
        ({"sample_rate": "24000"}, ["sample_rate", "integer"]),
        ({"timestamps": 1}, ["timestamps", "boolean"]),
        ([1, 2], ["start.request", "map"]),
    ],
)
def test_wrong_types(request_: Any, words: list[str]) -> None:
    expect_error(start(request_), *words)


@pytest.mark.parametrize(
    ("request_", "words"),
    [
        ({"temperature": 2.0}, ["temperature"]),
        ({"temperature": -1}, ["temperature"]),
        ({"temperature": float("nan")}, ["temperature"]),
        ({"top_p": 1.5}, ["top_p"]),
        ({"max_new_tokens": 0}, ["max_new_tokens", "[1, 4096]"]),
        ({"max_new_tokens": 5000}, ["max_new_tokens"]),
        ({"prosody": {"speed": 0.4}}, ["prosody.speed", "[0.5, 2]"]),
        ({"prosody": {"speed": 2.5}}, ["prosody.speed"]),
        ({"prosody": {"volume": 21}}, ["prosody.volume", "[-20, 20]"]),
        ({"prosody": {"volume": -20.5}}, ["prosody.volume"]),
        ({"latency": "fast"}, ["latency", "normal, balanced, low", "'fast'"]),
        ({"format": "flac"}, ["format", "'flac'"]),
        ({"top_k": -1}, ["top_k", "[0, 65536]"]),
        ({"seed": -1}, ["seed"]),
        ({"seed": 2**63}, ["seed"]),
        ({"repetition_penalty": 0}, ["repetition_penalty"]),
        ({"early_stop_threshold": 1.5}, ["early_stop_threshold"]),
        ({"opus_bitrate": 0}, ["opus_bitrate"]),
        ({"opus_bitrate": 1_000_000}, ["opus_bitrate"]),
        ({"sample_rate": 0}, ["sample_rate"]),
        ({"mp3_bitrate": -64}, ["mp3_bitrate"]),
    ],
)
def test_out_of_range(request_: dict[str, Any], words: list[str]) -> None:
    expect_error(start(request_), *words)


def test_oversize_message() -> None:
    limits = Limits(max_message_bytes=1024)
    expect_error(pack({"event": "text", "text": "x" * 2000}), "bytes", "1024", limits=limits, status=413)


def test_oversize_text() -> None:
    limits = Limits(max_text_chars=10)
    expect_error(pack({"event": "text", "text": "x" * 11}), "text", "10", limits=limits, status=413)
    expect_error(start({"text": "x" * 11}), "start.request.text", limits=limits, status=413)
    assert decode_client_message(pack({"event": "text", "text": "x" * 10}), limits) == TextEvent("x" * 10)


def test_too_many_references() -> None:
    limits = Limits(max_references=2)
    ref = {"audio": b"x", "text": "t"}
    expect_error(start({"references": [ref, ref, ref]}), "3 references", "2", limits=limits, status=413)
    expect_error(start({"references": [[ref, ref], [ref]]}), "3 references", limits=limits, status=413)
    expect_error(start({"reference_id": ["a", "b", "c"]}), "reference_id", limits=limits, status=413)
    assert len(decode_start({"references": [[ref], [ref]]}, limits).references) == 2


def test_reference_too_large() -> None:
    limits = Limits(max_reference_bytes=4)
    expect_error(start({"references": [{"audio": b"12345", "text": "t"}]}), "5 bytes", limits=limits, status=413)


# --------------------------------------------------------------------------------------------------------- HTTP bodies


def test_http_json_body_with_base64_reference() -> None:
    audio = b"RIFF\x00\x01\x02binary"
    body = json.dumps(
        {
            "text": "Hello.",
            "format": "wav",
            "chunk_length": 800,
            "references": [{"audio": base64.b64encode(audio).decode(), "text": "ref"}],
            "prosody": {"speed": 1.5},
        }
    ).encode()
    req = decode_http_body(body, "application/json; charset=utf-8", Limits())
    assert req.references == (Reference(audio, "ref"),)
    assert req.chunk_length == 800 and req.text == "Hello." and req.prosody.speed == 1.5


def test_http_base64_variants() -> None:
    audio = bytes(range(200))
    b64 = base64.b64encode(audio).decode()
    for encoded in (
        b64.rstrip("="),
        f"data:audio/wav;base64,{b64}",
        "\n".join([b64[:60], b64[60:]]),
        base64.urlsafe_b64encode(audio).decode(),
    ):
        body = json.dumps({"text": "x", "references": [{"audio": encoded, "text": "t"}]}).encode()
        assert decode_http_body(body, "application/json", Limits()).references[0].audio == audio


def test_http_bad_base64() -> None:
    body = json.dumps({"text": "x", "references": [{"audio": "not base64!!", "text": "t"}]}).encode()
    with pytest.raises(ProtocolError, match=r"references\[0\]\.audio is not valid base64"):
        decode_http_body(body, "application/json", Limits())


def test_http_msgpack_body() -> None:
    body = pack({"text": "Hi.", "references": [{"audio": b"\x00\x01", "text": "t"}], "latency": "normal"})
    for content_type in ("application/msgpack", "application/x-msgpack", "Application/MsgPack; q=1"):
        req = decode_http_body(body, content_type, Limits())
        assert req.references == (Reference(b"\x00\x01", "t"),) and req.latency == "normal"


def test_http_text_limit_is_the_session_limit() -> None:
    limits = Limits(max_text_chars=10, max_session_text_chars=100)
    assert decode_http_body(pack({"text": "x" * 50}), "application/msgpack", limits).text == "x" * 50
    with pytest.raises(ProtocolError) as info:
        decode_http_body(pack({"text": "x" * 101}), "application/msgpack", limits)
    assert info.value.status == 413 and "text" in str(info.value)


@pytest.mark.parametrize("content_type", ["text/plain", "multipart/form-data; boundary=x", "", "application/xml"])
def test_http_bad_content_type(content_type: str) -> None:
    with pytest.raises(ProtocolError, match="Content-Type") as info:
        decode_http_body(b"{}", content_type, Limits())
    assert info.value.status == 415


@pytest.mark.parametrize(
    ("body", "content_type", "words"),
    [
        (b"{not json", "application/json", "not valid JSON"),
        (b"\xc1", "application/msgpack", "not valid MessagePack"),
        (b"[1, 2]", "application/json", "must be a map"),
        (b'{"temperature": "hot"}', "application/json", "temperature must be a number"),
    ],
)
def test_http_bad_bodies(body: bytes, content_type: str, words: str) -> None:
    with pytest.raises(ProtocolError, match=words) as info:
        decode_http_body(body, content_type, Limits())
    assert info.value.status == 400
    assert "request." not in str(info.value)  # HTTP messages name the body's own keys


def test_http_oversize_body() -> None:
    with pytest.raises(ProtocolError) as info:
        decode_http_body(b"x" * 100, "application/json", Limits(max_message_bytes=10))
    assert info.value.status == 413


def test_error_json() -> None:
    assert error_json(401, "invalid api key") == {"status": 401, "message": "invalid api key"}


# ------------------------------------------------------------------------------------------------------- server events


def raw_types(data: bytes) -> dict[str, int]:
    """Map each top-level key of a msgpack map to the type byte of its value (to check BIN vs STR on the wire)."""
    import msgspec

    decoded = msgspec.msgpack.decode(data)
    assert isinstance(decoded, dict)
    out: dict[str, int] = {}
    for key in decoded:
        key_bytes = ormsgpack.packb(key)
        value_bytes = ormsgpack.packb(decoded[key])
        assert key_bytes + value_bytes in data
        out[key] = value_bytes[0]
    return out


def test_audio_event_bin_and_str() -> None:
    data = audio_event(b"\x00\x01" * 10, note="x")
    assert ormsgpack.unpackb(data) == {"event": "audio", "audio": b"\x00\x01" * 10, "note": "x"}
    types = raw_types(data)
    assert types["audio"] == 0xC4  # bin 8
    assert 0xA0 <= types["event"] <= 0xBF  # fixstr


def test_audio_event_accepts_bytearray_and_memoryview() -> None:
    assert ormsgpack.unpackb(audio_event(bytearray(b"ab")))["audio"] == b"ab"
    assert ormsgpack.unpackb(audio_event(memoryview(b"ab")))["audio"] == b"ab"
    assert ormsgpack.unpackb(audio_event(b""))["audio"] == b""  # trailing alignment-only event


def test_large_audio_event_is_bin32() -> None:
    data = audio_event(bytes(70_000))
    assert ormsgpack.unpackb(data)["audio"] == bytes(70_000)
    assert raw_types(data)["audio"] == 0xC6  # bin 32


def test_finish_event_always_has_reason() -> None:
    assert ormsgpack.unpackb(finish_event("stop")) == {"event": "finish", "reason": "stop"}
    err = ormsgpack.unpackb(finish_event("error", "start.request.temperature must be a number", code=400))
    assert err == {
        "event": "finish",
        "reason": "error",
        "message": "start.request.temperature must be a number",
        "code": 400,
    }
    assert list(ormsgpack.unpackb(finish_event("stop", time=5460))) == ["event", "reason", "time"]
    with pytest.raises(ValueError):
        finish_event("")


def test_legacy_and_new_sdk_read_our_finish() -> None:
    # Both SDKs index data["event"] / data["reason"] on the decoded map (PROTOCOL §2.6).
    data = ormsgpack.unpackb(finish_event("stop"))
    assert data["event"] == "finish" and data["reason"] == "stop"


def test_server_event_numpy_values() -> None:
    np = pytest.importorskip("numpy")
    data = ormsgpack.unpackb(server_event("log", level=np.int32(3), values=np.arange(2)))
    assert data == {"event": "log", "level": 3, "values": [0, 1]}


def test_alignment_fields_shape() -> None:
    fields = alignment_fields(
        [AlignedText("Hello", 0.0, 0.42), ("there.", 0.42, 0.8599999)],
        chunk_seq=0,
        chunk_audio_offset_sec=0,
        content="Hello there.",
        audio_duration=0.86,
        elapsed_ms=920.4,
    )
    assert fields == {
        "content": "Hello there.",
        "alignment": {
            "segments": [{"text": "Hello", "start": 0.0, "end": 0.42}, {"text": "there.", "start": 0.42, "end": 0.86}],
            "audio_duration": 0.86,
        },
        "chunk_seq": 0,
        "chunk_audio_offset_sec": 0.0,
        "time": 920,
    }
    event = ormsgpack.unpackb(audio_event(b"\x00" * 4, **fields))
    assert event["event"] == "audio" and event["alignment"]["segments"][1]["text"] == "there."
    assert list(event) == ["event", "audio", "content", "alignment", "chunk_seq", "chunk_audio_offset_sec", "time"]


def test_alignment_fields_defaults() -> None:
    fields = alignment_fields([("a", 0.1, 0.5)], chunk_seq=3, chunk_audio_offset_sec=2.5, content="a")
    assert fields["alignment"]["audio_duration"] == 0.5 and "time" not in fields
    as_maps = alignment_fields(
        [{"text": "a", "start": 0.1, "end": 0.5}], chunk_seq=3, chunk_audio_offset_sec=2.5, content="a"
    )
    assert as_maps == fields
    empty = alignment_fields(None, chunk_seq=3, chunk_audio_offset_sec=2.5, content="")
    assert empty["alignment"] is None  # "keep the previous snapshot"
    assert alignment_fields([], chunk_seq=0, chunk_audio_offset_sec=0, content="")["alignment"] == {
        "segments": [],
        "audio_duration": 0.0,
    }


def test_round_trip_client_events() -> None:
    for event, wire in [
        (TextEvent("héllo 世界"), {"event": "text", "text": "héllo 世界"}),
        (FlushEvent(), {"event": "flush"}),
        (StopEvent(), {"event": "stop"}),
        (CancelEvent(), {"event": "cancel"}),
    ]:
        assert decode_client_message(pack(wire)) == event
    # extra keys on any event are ignored
    assert decode_client_message(pack({"event": "flush", "id": 7})) == FlushEvent()


def test_zero_temperature_or_top_p_is_greedy() -> None:
    """The SDK and Pipecat allow temperature and top_p of 0 (their ranges are 0..1): accepted, and decoded greedily."""
    from rtts.session import sampling_params

    for fields in ({"temperature": 0.0}, {"top_p": 0}, {"temperature": 0, "top_p": 0.0}):
        p = sampling_params(parse_request(fields), "s2")
        p.validate()
        assert p.top_k == 1, fields
    assert sampling_params(parse_request({"temperature": 0.5}), "s2").top_k == 30
