"""Property-based fuzzing (hypothesis) of what clients send: the MessagePack decoder of `/v1/tts/live`
(rtts/ws/protocol.py), the request validator (rtts/ws/parse.py) and the HTTP body decoder, on generated messages of
any types, sizes and nesting, NaN and infinities, huge integers, Unicode edge cases and bytes where strings belong.

The property: every input is either refused with a `ProtocolError` (a clear message, a 4xx status) or becomes a
request the engine and the audio encoders can run; nothing else ever escapes. A few dozen examples also go through a
real server, over the WebSocket and HTTP, so the whole path is covered: every answer is protocol-correct (a finish
naming the problem, or audio then finish; an HTTP 4xx JSON error or 200 audio), never a 5xx, and afterwards the
socket still runs a session and every slot is free. The example counts keep the whole file at about a minute in CI.
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any

import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from liveserver import LiveServer, assert_usable, pack, recv_event

from rtts.audio.encode import SAMPLE_RATES
from rtts.request import Limits, Prosody, Reference, TTSRequest
from rtts.session import output_spec, sampling_params
from rtts.types import FLOAT32_MAX
from rtts.voices import VOICE_ID
from rtts.ws.parse import CHUNK_LENGTH_HTTP, FORMATS, LATENCIES, RANGES, ProtocolError, validate_request
from rtts.ws.protocol import (
    MAX_MESSAGE_CHARS,
    StartEvent,
    TextEvent,
    decode_client_message,
    decode_http_body,
)

# No example database: CI starts clean anyway, and a failure prints the example that reproduces it. Generating
# nested messages on a loaded 2-core machine may be slow: that is not a finding.
SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]
FAST = settings(max_examples=200, deadline=None, database=None, suppress_health_check=SLOW_OK)
LIVE = settings(max_examples=20, deadline=None, database=None,
                suppress_health_check=[*SLOW_OK, HealthCheck.function_scoped_fixture])

# ------------------------------------------------------------------------------------------------------ strategies

EDGE_INTS = [0, 1, -1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, -(2**63), 65_536, 65_537, 4096, 4097, -1000]
EDGE_FLOATS = [1e300, -1e300, 3.5e38, FLOAT32_MAX, 5e-324, -0.0, 0.5, 2.0, 1.9999999, math.nan, math.inf, -math.inf]
EDGE_TEXT = ["", " ", "\x00", "\U0001f600", "\u202e", "e\u0301", "\ufb00", "\u0130", "<|speaker:1|>", "mp3", "PCM",
             " wav ", "low", "933563129e564b19a115bedd57b7406a", "../etc/passwd", "a" * 300]

msgpack_ints = st.one_of(st.integers(-(2**63), 2**64 - 1), st.sampled_from(EDGE_INTS))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(EDGE_FLOATS))
texts = st.one_of(st.text(max_size=40), st.sampled_from(EDGE_TEXT))
scalars = st.one_of(st.none(), st.booleans(), msgpack_ints, floats, texts, st.binary(max_size=40))
any_value = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=5),
                            st.dictionaries(st.one_of(texts, msgpack_ints), inner, max_size=5)),
    max_leaves=16,
)


def plausible(key: str) -> st.SearchStrategy[Any]:
    """Values near what the field takes (so that valid requests are generated too), or anything at all."""
    near: dict[str, st.SearchStrategy[Any]] = {
        "text": st.sampled_from(["", "Hello.", "Hi there! How are you?", "x" * 10_001]),
        "format": st.sampled_from(sorted(FORMATS) + ["MP3", " pcm", "flac", ""]),
        "latency": st.sampled_from(list(LATENCIES) + ["LOW", "fast"]),
        "sample_rate": st.sampled_from([8000, 16000, 22050, 24000, 32000, 44100, 48000, 0, -1]),
        "mp3_bitrate": st.sampled_from([64, 128, 192, 100, 128_000, 0, -64]),
        "opus_bitrate": st.sampled_from([-1000, 24, 32, 64, 32_000, 0, 5, 600_000]),
        "prosody": st.fixed_dictionaries({}, optional={"speed": floats, "volume": floats | msgpack_ints,
                                                       "normalize_loudness": st.booleans() | scalars}),
        "reference_id": st.one_of(texts, st.lists(texts, max_size=9)),
        "references": st.lists(st.one_of(st.fixed_dictionaries({"audio": st.binary(max_size=24) | texts,
                                                                 "text": texts | scalars}),
                                         st.lists(st.fixed_dictionaries({"audio": st.binary(min_size=1, max_size=8),
                                                                         "text": texts}), max_size=3)),
                               max_size=9),
        "max_new_tokens": st.integers(0, 5000),
    }
    bounds = RANGES.get(key)
    if bounds is not None and key not in near and math.isfinite(bounds.lo):
        near[key] = st.one_of(st.floats(bounds.lo - 1, bounds.hi + 1),
                              st.integers(int(bounds.lo) - 1, int(min(bounds.hi, 2**40)) + 1))
    return st.one_of(near.get(key, scalars), any_value)


FIELDS = ["text", "chunk_length", "min_chunk_length", "format", "sample_rate", "mp3_bitrate", "opus_bitrate",
          "references", "reference_id", "normalize", "latency", "prosody", "top_p", "temperature", "top_k", "seed",
          "max_new_tokens", "repetition_penalty", "condition_on_previous_chunks", "early_stop_threshold",
          "timestamps", "features"]
requests = st.one_of(
    st.fixed_dictionaries({}, optional={k: plausible(k) for k in FIELDS}),
    any_value,  # not even a map
)
events = st.one_of(
    st.fixed_dictionaries({"event": st.just("start")}, optional={"request": requests}),
    st.fixed_dictionaries({"event": st.just("text")}, optional={"text": st.one_of(texts, scalars)}),
    st.fixed_dictionaries({"event": st.sampled_from(["flush", "stop", "cancel", "clear", "close", "ping", ""])}),
    st.dictionaries(st.one_of(texts, msgpack_ints), any_value, max_size=4),
    any_value,
)


# ----------------------------------------------------------------------------------------------------- the property


def assert_runnable(req: TTSRequest, limits: Limits, http: bool = False) -> None:
    """What an accepted request guarantees: the engine's float32 / int64 settings hold every value, the sampling
    settings validate, the audio encoders take the output settings, strings and lists are within their limits."""
    for value in (req.temperature, req.top_p, req.repetition_penalty, req.early_stop_threshold, req.prosody.speed,
                  req.prosody.volume):
        assert isinstance(value, float) and math.isfinite(value) and abs(value) <= FLOAT32_MAX, value
    for name in ("temperature", "top_p", "repetition_penalty", "early_stop_threshold"):
        assert RANGES[name].contains(getattr(req, name)), name
    assert req.top_k is None or 0 <= req.top_k <= RANGES["top_k"].hi
    assert req.seed is None or 0 <= req.seed < 2**63
    assert 1 <= req.max_new_tokens <= 4096
    lo, hi = CHUNK_LENGTH_HTTP if http else (100, 300)
    assert lo <= req.chunk_length <= hi and 0 <= req.min_chunk_length <= 100
    for fmt in ("s1", "s2"):
        sampling_params(req, fmt).validate()
    spec = output_spec(req)  # never raises for an accepted request
    assert spec.sample_rate in SAMPLE_RATES[req.format] and req.latency in LATENCIES
    assert len(req.text) <= (limits.max_session_text_chars if http else limits.max_text_chars)
    req.text.encode("utf-8")  # valid Unicode: no lone surrogate
    assert len(req.references) <= limits.max_references and len(req.reference_ids) <= limits.max_references
    for ref in req.references:
        assert isinstance(ref.audio, bytes) and 0 < len(ref.audio) <= limits.max_reference_bytes
        assert len(ref.text) <= limits.max_text_chars and 0 <= ref.speaker < limits.max_references
        ref.text.encode("utf-8")
    assert all(VOICE_ID.fullmatch(v) for v in req.reference_ids)


def assert_refusal(e: ProtocolError) -> None:
    assert e.status in (400, 413, 415), e.status
    assert isinstance(e.message, str) and e.message and len(e.message) <= MAX_MESSAGE_CHARS
    assert " at 0x" not in e.message, e.message


@FAST
@given(st.binary(max_size=200))
def test_decoder_on_arbitrary_bytes(data: bytes) -> None:
    try:
        decode_client_message(data)
    except ProtocolError as e:
        assert_refusal(e)


@FAST
@given(events)
def test_decoder_on_generated_messages(obj: Any) -> None:
    limits = Limits()
    data = msgspec.msgpack.encode(obj)
    try:
        ev = decode_client_message(data, limits)
    except ProtocolError as e:
        assert_refusal(e)
        return
    if isinstance(ev, StartEvent):
        assert_runnable(ev.request, limits)
    elif isinstance(ev, TextEvent):
        assert len(ev.text) <= limits.max_text_chars
    # a message with trailing bytes is refused, whatever it held
    with pytest.raises(ProtocolError):
        decode_client_message(data + b"\xc0", limits)


def _json_able(obj: Any) -> Any:
    """JSON has no bytes and only string keys: bytes become base64 text (as JSON clients send audio)."""
    if isinstance(obj, bytes):
        return base64.b64encode(obj).decode()
    if isinstance(obj, dict):
        return {str(k): _json_able(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_able(v) for v in obj]
    return obj


@FAST
@given(requests, st.sampled_from(["application/msgpack", "application/json", "application/x-msgpack",
                                  "text/plain", ""]))
def test_http_body_decoder(obj: Any, ctype: str) -> None:
    limits = Limits()
    # json.dumps writes NaN and Infinity, which are not JSON: the decoder must refuse them cleanly.
    body = json.dumps(_json_able(obj)).encode() if "json" in ctype else msgspec.msgpack.encode(obj)
    try:
        req = decode_http_body(body, ctype, limits)
    except ProtocolError as e:
        assert_refusal(e)
        return
    assert_runnable(req, limits, http=True)


@FAST
@given(st.builds(
    TTSRequest,
    text=texts, chunk_length=msgpack_ints, min_chunk_length=msgpack_ints, format=texts,
    sample_rate=st.none() | msgpack_ints, mp3_bitrate=msgpack_ints, opus_bitrate=msgpack_ints,
    references=st.lists(st.builds(Reference, audio=st.binary(max_size=8), text=texts,
                                  speaker=st.integers(-2, 10)), max_size=3).map(tuple),
    reference_ids=st.lists(texts, max_size=3).map(tuple), latency=texts,
    prosody=st.builds(Prosody, speed=floats, volume=floats, normalize_loudness=st.booleans()),
    top_p=floats, temperature=floats, top_k=st.none() | msgpack_ints, seed=st.none() | msgpack_ints,
    max_new_tokens=msgpack_ints, repetition_penalty=floats, early_stop_threshold=floats,
))
def test_validate_request_on_built_requests(req: TTSRequest) -> None:
    """The entry point of routes that build a TTSRequest themselves: the same property."""
    limits = Limits()
    try:
        out = validate_request(req, limits)
    except ProtocolError as e:
        assert_refusal(e)
        return
    assert_runnable(out, limits, http=True)


# ------------------------------------------------------------------------------------------- through a real server


def _live_request(obj: Any) -> Any:
    """A generated request, made cheap to run if it is valid: a short text and few frames (the property is about
    the answer, not about long synthesis on a CPU)."""
    if isinstance(obj, dict):
        obj = {**obj, "max_new_tokens": 4}
        if isinstance(obj.get("text"), str):
            obj["text"] = obj["text"][:40]
    return obj


def _finishes(message: bytes) -> int:
    """How many finishes the server owes for `message` then `stop` on an idle socket (docs/protocol.md, sessions):
    one for a start, refused or run (a refused start's stop is dropped with it), and for anything that is no event
    (taken for the client's start); a text, flush, stop or cancel before any start gets an error of its own, and so
    does the stop after it (as after an unknown event, which is ignored)."""
    try:
        ev = decode_client_message(message, srv_limits())
    except ProtocolError as e:
        return 2 if e.event == "text" else 1
    return 1 if ev is None or isinstance(ev, StartEvent) else 2


def srv_limits() -> Limits:
    from conftest import MAX_MESSAGE, MAX_REFERENCE, MAX_SESSION_TEXT, MAX_TEXT

    return Limits(max_text_chars=MAX_TEXT, max_session_text_chars=MAX_SESSION_TEXT, max_message_bytes=MAX_MESSAGE,
                  max_reference_bytes=MAX_REFERENCE)


def _exchange(ws: Any, message: bytes) -> None:
    """Send a generated message and the client's usual end (stop); read every finish owed: audio only before the
    finish of a start that was accepted, every error a message a person can read."""
    ws.send(message)
    ws.send(pack({"event": "stop"}))
    for _ in range(_finishes(message)):
        while True:
            ev = recv_event(ws)
            assert ev["event"] in ("audio", "finish"), ev
            if ev["event"] == "audio":
                assert isinstance(ev["audio"], bytes)
                continue
            assert ev["reason"] in ("stop", "error"), ev
            if ev["reason"] == "error":
                text = ev.get("message")
                assert isinstance(text, str) and text and " at 0x" not in text, ev
                assert "internal error" not in text, ev
            break


@LIVE
@given(events.map(lambda ev: {**ev, "request": _live_request(ev["request"])}
                  if isinstance(ev, dict) and "request" in ev else ev))
def test_live_websocket(srv: LiveServer, obj: Any) -> None:
    with srv.connect() as ws:
        _exchange(ws, msgspec.msgpack.encode(obj))
        assert_usable(ws)


@LIVE
@given(st.binary(min_size=1, max_size=64))
def test_live_websocket_garbage_frames(srv: LiveServer, data: bytes) -> None:
    with srv.connect() as ws:
        _exchange(ws, data)
        assert_usable(ws)


@LIVE
@given(requests.map(_live_request), st.sampled_from(["application/msgpack", "application/json"]))
def test_live_http(srv: LiveServer, obj: Any, ctype: str) -> None:
    body = json.dumps(_json_able(obj)).encode() if "json" in ctype else msgspec.msgpack.encode(obj)
    r = httpx.post(srv.http + "/v1/tts", content=body, headers={"content-type": ctype}, timeout=60)
    assert r.status_code in (200, 400, 413), (r.status_code, r.text[:300])
    if r.status_code == 200:
        assert r.headers["content-type"].startswith("audio/")
    else:
        err = r.json()
        assert err["status"] == r.status_code and err["message"] and " at 0x" not in err["message"], err


def test_server_idle_after_fuzzing(srv: LiveServer) -> None:
    """Every slot the fuzzed sessions and requests took is back (the tests above share `srv`)."""
    srv.wait_idle(timeout=30)
