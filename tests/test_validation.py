"""The request validator (rtts/ws/parse.py): every numeric field bounded by what the engine can store and what makes
sense, strings and lists bounded, refusals naming the field and its range; the same checks for a `TTSRequest` a route
builds itself (`validate_request`); error texts never show an object's repr. The live part: values that once passed
validation and then killed the prefill thread (repetition_penalty 1e300 / 3.5e38) or overflowed the engine's int64
(top_k >= 2**63) are refused over the WebSocket and HTTP alike, and the server then still synthesizes.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import httpx
import msgspec
import ormsgpack
import pytest
from conftest import greedy
from liveserver import LiveServer, Streamer, assert_usable, expect_error, pack, session, start_msg

from rtts.request import Prosody, Reference, TTSRequest
from rtts.types import FLOAT32_MAX, SamplingParams
from rtts.ws.parse import RANGES, ProtocolError, decode_base64, describe, parse_request, validate_request
from rtts.ws.protocol import decode_client_message, decode_http_body, error_json, finish_event, public_message

# Values no numeric field takes: beyond float32 and int64, NaN and infinities, wrong types.
HOSTILE = [1e300, 3.5e38, -1e300, float("nan"), float("inf"), float("-inf"), 2**63, 2**64 - 1, -(2**63) - 1,
           10**400, True, "1", b"\x01", [1], {"a": 1}]


def refusal(obj: Any, http: bool = False) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        parse_request(obj, http=http, path="start.request")
    return info.value


# -------------------------------------------------------------------------------------------------- numeric fields


@pytest.mark.parametrize("field", [k for k in RANGES if "." not in k and RANGES[k].shown != ""])
def test_every_ranged_field_refuses_what_it_cannot_hold(field: str) -> None:
    bounds = RANGES[field]
    for value in HOSTILE:
        e = refusal({field: value})
        assert f"start.request.{field} must be" in e.message, (value, e.message)
        assert bounds.words() in e.message, (value, e.message)
        assert e.status == 400 and len(e.message) < 300
    for value in (bounds.lo, bounds.hi):  # the ends: accepted unless open
        open_end = (value == bounds.lo and bounds.lo_open) or (value == bounds.hi and bounds.hi_open)
        if open_end:
            refusal({field: value})
        else:
            assert getattr(parse_request({field: value}), field) == value


@pytest.mark.parametrize("field", ["speed", "volume"])
def test_prosody_fields(field: str) -> None:
    for value in HOSTILE:
        e = refusal({"prosody": {field: value}})
        assert f"start.request.prosody.{field} must be" in e.message, e.message
        assert RANGES[f"prosody.{field}"].words() in e.message


def test_the_reported_values() -> None:
    """repetition_penalty 1e300 and 3.5e38 once passed ("finite and > 0") and then raised in Engine.set_params on
    the prefill thread; top_k 2**63 overflowed the engine's int64 ("Overflow when unpacking long long")."""
    for value in (1e300, 3.5e38, FLOAT32_MAX, 2.5, 0.0, -1.0):
        e = refusal({"repetition_penalty": value})
        assert "repetition_penalty must be a number in [0.5, 2]" in e.message, e.message
    for value in (2**63, 2**64 - 1, 65_537, -1):
        e = refusal({"top_k": value})
        assert "top_k must be an integer in [0, 65536]" in e.message, e.message
    assert parse_request({"repetition_penalty": 2, "top_k": 65_536}).top_k == 65_536
    # The engine's own check refuses what its float32/int64 tensors cannot hold, before any slot setting changes.
    for params in (SamplingParams(repetition_penalty=3.5e38), SamplingParams(repetition_penalty=float("nan")),
                   SamplingParams(top_k=2**63), SamplingParams(max_frames=2**40)):
        with pytest.raises(ValueError):
            params.validate()


def test_integers_written_as_floats_and_clamped_lengths() -> None:
    req = parse_request({"max_new_tokens": 200.0, "chunk_length": 10**30, "min_chunk_length": -(10**30)})
    assert (req.max_new_tokens, req.chunk_length, req.min_chunk_length) == (200, 300, 0)
    assert parse_request({"chunk_length": 10**30}, http=True).chunk_length == 1000
    for value in (200.5, float("nan"), float("inf"), "200", True):
        assert "chunk_length must be an integer" in refusal({"chunk_length": value}).message


def test_audio_settings() -> None:
    assert parse_request({"format": "pcm", "sample_rate": 16000}).sample_rate == 16000
    for rate in (22050, 0, -8000, 2**64, 1e300):
        e = refusal({"format": "pcm", "sample_rate": rate})
        assert "sample_rate" in e.message and "8000, 16000" in e.message, e.message
    assert "use one of 48000" in refusal({"format": "opus", "sample_rate": 44100}).message
    assert parse_request({"mp3_bitrate": 192_000}).mp3_bitrate == 192
    for kbps in (0, -64, 10**30, 321):
        assert "mp3_bitrate must be a bitrate" in refusal({"mp3_bitrate": kbps}).message
    for bps in (0, 5, 10**30, -(2**70)):
        assert "opus_bitrate must be -1000 (auto)" in refusal({"opus_bitrate": bps}).message


# --------------------------------------------------------------------------------------------- strings and lists


def test_enums_name_the_choices_without_echoing_everything() -> None:
    e = refusal({"format": "x" * 100_000})
    assert "must be one of mp3, mulaw, opus, pcm, wav" in e.message and len(e.message) < 200
    assert "normal, balanced, low" in refusal({"latency": "instant"}).message


def test_text_bounds_and_unicode() -> None:
    assert refusal({"text": "x" * 10_001}).status == 413
    assert parse_request({"text": "x" * 100_000}, http=True).text
    assert refusal({"text": "x" * 100_001}, http=True).status == 413
    # A lone surrogate, which no tokenizer or encoder takes: the JSON decoder already refuses an escaped one, but a
    # route may build its strings otherwise.
    with pytest.raises(ProtocolError):
        decode_http_body(b'{"text": "caf\\ud800e"}', "application/json")
    e = refusal({"text": "caf\ud800e"})
    assert "start.request.text is not valid Unicode: an unpaired surrogate (U+D800) at character 3" in e.message
    e = refusal({"references": [{"audio": b"RIFF", "text": "\udfff"}]})
    assert "references[0].text is not valid Unicode" in e.message
    assert parse_request({"text": "emoji \U0001f600 and \u0000 NUL"}).text  # valid Unicode of any kind passes


def test_voice_ids_and_references() -> None:
    assert parse_request({"reference_id": "933563129e564b19a115bedd57b7406a"}).reference_id
    for bad in ("../etc/passwd", "a" * 129, "-x", "a b"):
        e = refusal({"reference_id": bad})
        assert "reference_id must be a voice id (1-128 letters" in e.message and len(e.message) < 250, e.message
    assert refusal({"reference_id": ["a"] * 9}).status == 413
    ref = {"audio": b"RIFF", "text": "t"}
    assert refusal({"references": [ref] * 9}).status == 413
    assert refusal({"references": [[ref] * 5, [ref] * 4]}).status == 413
    assert refusal({"references": [[]] * 100_000}).status == 413  # empty speaker lists cannot hide in a long list
    assert refusal({"references": [{"audio": b"RIFF", "text": "t" * 10_001}]}).status == 413
    e = refusal({"references": [{"audio": "not base64!", "text": "t"}]}, http=True)
    assert "references[0].audio is not valid base64: character 3 is ' '" in e.message, e.message


def test_base64_errors_are_precise() -> None:
    wav = b"RIFF\x00\x01binary"
    for good in (base64.b64encode(wav).decode(), base64.urlsafe_b64encode(wav).decode().rstrip("="),
                 "data:audio/wav;base64," + base64.b64encode(wav).decode()):
        assert decode_base64(good, "audio") == wav
    for bad, words in (("hello world", "character 5"), ("/tmp/me.wav", "character 7 is '.'"), ("abcde", "length"),
                       ("data:audio/wav,RIFF", ";base64,"), ("ab=c", "padding")):
        with pytest.raises(ProtocolError) as info:
            decode_base64(bad, "audio")
        assert info.value.message.startswith("audio ") and words in info.value.message, info.value.message


# ----------------------------------------------------------------------------------------- routes that build requests


def test_validate_request_for_other_routes() -> None:
    """The function a route that builds its own TTSRequest (e.g. an OpenAI-style body) calls: the same checks,
    naming rtts's field; a valid request comes back as parse_request would have made it."""
    ok = TTSRequest(text="Hello.", format="pcm", sample_rate=24000, prosody=Prosody(speed=1.5), top_k=5, seed=1,
                    references=(Reference(b"RIFF", "a", 0), Reference(b"RIFF2", "b", 1)), opus_bitrate=32_000)
    assert validate_request(ok) == ok
    assert validate_request(TTSRequest(chunk_length=5000)).chunk_length == 1000
    for bad, words in ((TTSRequest(repetition_penalty=1e300), "repetition_penalty must be"),
                       (TTSRequest(top_k=2**63), "top_k must be"),
                       (TTSRequest(prosody=Prosody(speed=4.0)), "prosody.speed must be a number in [0.5, 2]"),
                       (TTSRequest(temperature=float("nan")), "temperature must be"),
                       (TTSRequest(text="x" * 100_001), "text is 100001 characters"),
                       (TTSRequest(format="flac"), "format must be one of"),
                       (TTSRequest(references=(Reference(b"RIFF", "a", 99),)), "speakers are numbered 0 to 7")):
        with pytest.raises(ProtocolError) as info:
            validate_request(bad)
        assert words in info.value.message, info.value.message


# ------------------------------------------------------------------------------------------------------ error texts


def test_describe_is_short_and_safe() -> None:
    assert describe(10**5000).startswith("an integer of about 5001 digits")  # str() of it would raise
    assert describe(msgspec.msgpack.Ext(5, b"x" * 1000)) == "a value of type Ext"
    assert len(describe("y" * 10**6)) < 80 and len(describe(b"z" * 10**6)) < 40
    assert describe(None) == "nil" and describe(True) == "true"


def test_no_object_repr_reaches_a_client() -> None:
    raw = "reference audio: cannot decode audio (Error opening <_io.BytesIO object at 0x7f3a2c1b9e50>: Format not " \
          "recognised.)"
    for text in (public_message(raw), error_json(400, raw)["message"],
                 ormsgpack.unpackb(finish_event("error", raw))["message"]):
        assert "0x" not in text and "object at" not in text and "Error opening the data: Format" in text
    assert len(public_message("m" * 10**6)) == 1000
    # A message-level refusal of an extension type names its type, not its repr.
    with pytest.raises(ProtocolError) as info:
        decode_client_message(msgspec.msgpack.encode({"event": "start", "request": {"top_k": msgspec.msgpack.Ext(
            1, b"\x00")}}))
    assert "got a value of type Ext" in info.value.message and "0x" not in info.value.message


# ----------------------------------------------------------------------------------------------- through the server


REPORTED = [({"repetition_penalty": 1e300}, "repetition_penalty"), ({"repetition_penalty": 3.5e38},
            "repetition_penalty"), ({"top_k": 2**63}, "top_k"), ({"top_k": 2**64 - 1}, "top_k")]


def test_reported_values_over_the_websocket(srv: LiveServer) -> None:
    """Each is refused at its start, naming the field; a neighbour keeps streaming; the socket and the server still
    synthesize afterwards (the prefill thread is alive), and every slot comes back."""
    neighbour = Streamer(srv)
    neighbour.start()
    assert neighbour.first_audio.wait(30), "the neighbour session never streamed"
    with srv.connect() as ws:
        for request, field in REPORTED:
            # The client's usual sequence: start (refused), text, stop; the refusal is that session's only finish.
            ws.send(start_msg(**greedy(**request)))
            ws.send(pack({"event": "text", "text": "Hello."}))
            ws.send(pack({"event": "stop"}))
            message = expect_error(ws, field, "must be")
            assert "Overflow" not in message and "[0" in message
            assert_usable(ws)
    assert neighbour.halt() == {"event": "finish", "reason": "stop"}
    with srv.connect() as ws:  # a fresh session on a fresh socket
        audio, fin = session(ws, ["Still speaking."], **greedy(max_new_tokens=6, format="pcm"))
        assert fin["reason"] == "stop" and audio
    srv.wait_idle()


def test_reported_values_over_http(srv: LiveServer) -> None:
    with httpx.Client(base_url=srv.http, timeout=60) as h:
        for request, field in REPORTED:
            body = {"text": "Hello.", "format": "pcm", **greedy(max_new_tokens=6), **request}
            for content, ctype in ((ormsgpack.packb(body), "application/msgpack"),
                                   (json.dumps(body).encode(), "application/json")):
                r = h.post("/v1/tts", content=content, headers={"content-type": ctype})
                assert r.status_code == 400, (field, ctype, r.status_code, r.text)
                assert r.json()["status"] == 400 and field in r.json()["message"], r.text
        r = h.post("/v1/tts", json={"text": "Still speaking.", "format": "pcm", **greedy(max_new_tokens=6)})
        assert r.status_code == 200 and r.content
    srv.wait_idle()


def test_references_add_with_json_audio_that_is_not_base64(srv: LiveServer) -> None:
    with httpx.Client(base_url=srv.http, timeout=60) as h:
        r = h.post("/v1/references/add", json={"id": "v1", "audio": "this is not base64", "text": "t"})
        assert r.status_code == 400 and "audio is not valid base64: character 4 is ' '" in r.json()["message"], r.text
        r = h.post("/v1/references/add", json={"id": "v1", "audio": 5, "text": "t"})
        assert r.status_code == 400 and "audio must be" in r.json()["message"], r.text
        # Bytes that are base64 but no audio: libsndfile's complaint, without its object repr.
        r = h.post("/v1/references/add", json={"id": "v1", "audio": base64.b64encode(b"x" * 64).decode(), "text": "t"})
        assert r.status_code == 400 and "0x" not in r.text and "object at" not in r.text, r.text
        r = h.post("/v1/tts", json={"text": "Hi.", "references": [{"audio": base64.b64encode(b"x" * 64).decode(),
                                                                   "text": "t"}]})
        assert r.status_code == 400 and "0x" not in r.text and "object at" not in r.text, r.text
