"""The OpenAI-compatible speech API: `POST /v1/audio/speech` and `GET /v1/models` (docs/clients.md).

A speech request becomes an ordinary session (text segmented into turns, loudness normalized) whose 16-bit PCM at the
model's rate goes through a SpeechEncoder (rtts/audio/transcode.py) into the requested format and tempo, streamed as
a chunked body or, with `stream_format: "sse"`, as server-sent events. Errors use the OpenAI API's JSON shape,
`{"error": {"message", "type", "param", "code"}}`, so the `openai` client raises its usual exceptions.

What differs from the hosted API: `model` may be any string (the server serves the one model it loaded, which
`GET /v1/models` names); `voice` is `default` (the model's own voice) or a stored voice id, and OpenAI's built-in voice
names are unknown here unless a voice is stored under that id; `instructions` is accepted and ignored. Extensions:
`sample_rate`, and the Fish request's generation fields (FISH_FIELDS), validated as on every other route.
"""

from __future__ import annotations

import base64
import json
import logging
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from rtts.audio import ffmpeg
from rtts.audio.transcode import DEFAULT_RATE, FORMATS, RATES, SPEED_RANGE, SpeechEncoder
from rtts.model.prompt import Reference
from rtts.pingpong import NoSlotError, WorkerFailed
from rtts.request import Limits, TTSRequest
from rtts.runtime import DRAINING_MESSAGE, Runtime
from rtts.session import SessionError, output_spec, resolve_references
from rtts.voices import VoiceError
from rtts.ws.http import BodyQueue, BodyTooLarge, SynthesisFailed, read_body, start_body_session
from rtts.ws.parse import ProtocolError, describe, parse_request

log = logging.getLogger("rtts.openai")

DEFAULT_VOICE = "default"
# The hosted API's own voices. Some clients allow only these names (Pipecat's OpenAI service): store voices under them.
OPENAI_VOICES = frozenset({"alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage", "shimmer",
                           "verse", "marin", "cedar"})
STREAM_FORMATS = ("audio", "sse")
# Fields of the Fish request a speech request may add (rtts extensions; the `openai` client sends them in extra_body).
FISH_FIELDS = ("latency", "temperature", "top_p", "top_k", "seed", "max_new_tokens", "repetition_penalty",
               "chunk_length", "min_chunk_length", "normalize", "condition_on_previous_chunks", "early_stop_threshold")
# The speech request's field for each field of the Fish request the validator may name (its refusals begin with it).
PARAMS = {"text": "input", "reference_id": "voice", **{key: key for key in FISH_FIELDS}}


class SpeechRequestError(ValueError):
    """A refused speech request: the message names the field (`param`)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def openai_error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status)


# ----------------------------------------------------------------------------------------------------------- request


@dataclass(frozen=True)
class SpeechRequest:
    input: str
    voice: str | None  # a stored voice id; None: the model's own voice
    response_format: str = "mp3"
    speed: float = 1.0
    stream_format: str = "audio"
    sample_rate: int = DEFAULT_RATE["mp3"]  # extension: the format's default unless asked (RATES)
    # The session's request: the text and voice, 16-bit PCM at the model's rate, the FISH_FIELDS it was given.
    tts: TTSRequest = TTSRequest()


def _string(obj: dict[str, Any], key: str, default: str | None) -> str | None:
    value = obj.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise SpeechRequestError(f"{key} must be a string, got {describe(value)}", key)
    return value


def _choice(obj: dict[str, Any], key: str, choices: tuple[str, ...]) -> str:
    value = (_string(obj, key, choices[0]) or "").strip().lower()
    if value not in choices:
        raise SpeechRequestError(f"{key} must be one of {', '.join(choices)}, got {obj.get(key)!r}", key)
    return value


def _voice(value: Any) -> str | None:
    """`"id"` or `{"id": "..."}` (the API's custom voice object); `default` or nothing: the model's own voice."""
    if isinstance(value, dict):
        value = value.get("id")
    if value is None:
        return None
    if not isinstance(value, str):
        raise SpeechRequestError(f"voice must be a voice id string or {{\"id\": ...}}, got {describe(value)}", "voice")
    value = value.strip()
    return None if value in ("", DEFAULT_VOICE) else value


def _number(obj: dict[str, Any], key: str, default: float) -> float:
    value = obj.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SpeechRequestError(f"{key} must be a number, got {describe(value)}", key)
    return float(value)


def parse_speech(obj: Any, limits: Limits) -> SpeechRequest:
    """Validate a decoded speech request body (the voice's existence is checked later, against the store)."""
    if not isinstance(obj, dict):
        raise SpeechRequestError(f"the body must be a JSON object, got {describe(obj)}")
    _string(obj, "model", "")  # any model name: one model is served
    _string(obj, "instructions", "")  # accepted, ignored (docs/clients.md)
    text = _string(obj, "input", None)
    if text is None or not text.strip():
        raise SpeechRequestError("input is required and must not be empty", "input")
    if len(text) > limits.max_session_text_chars:
        raise SpeechRequestError(f"input is {len(text)} characters, the limit is {limits.max_session_text_chars}",
                                 "input", status=413)
    fmt = _choice(obj, "response_format", FORMATS)
    if fmt == "aac" and ffmpeg.ffmpeg_binary() is None:
        raise SpeechRequestError(f"response_format aac is not available on this server: {ffmpeg.MISSING}",
                                 "response_format")
    speed = _number(obj, "speed", 1.0)
    if not SPEED_RANGE[0] <= speed <= SPEED_RANGE[1]:
        raise SpeechRequestError(f"speed must be in [{SPEED_RANGE[0]:g}, {SPEED_RANGE[1]:g}], got {speed:g}", "speed")
    rate = _number(obj, "sample_rate", DEFAULT_RATE[fmt])
    if rate not in RATES[fmt]:
        allowed = ", ".join(str(r) for r in RATES[fmt])
        raise SpeechRequestError(f"sample_rate for {fmt} must be one of {allowed}, got {rate:g}", "sample_rate")
    voice = _voice(obj.get("voice"))
    fish = {key: obj[key] for key in FISH_FIELDS if key in obj}
    # The one validator, called as for /v1/tts's body (every range in parse.RANGES), on the values as sent: the
    # session runs the request it returns.
    try:
        tts = parse_request({**fish, "text": text, "format": "pcm", "reference_id": voice}, limits, http=True, path="")
    except ProtocolError as e:
        raise _refused(e) from None
    return SpeechRequest(input=text, voice=voice, response_format=fmt, speed=speed,
                         stream_format=_choice(obj, "stream_format", STREAM_FORMATS), sample_rate=int(rate), tts=tts)


def _refused(e: ProtocolError) -> SpeechRequestError:
    """A refusal of the Fish request's validator in the speech request's terms: the field it begins with named as the
    client sent it (`text` is `input`, `reference_id` is `voice`), and `param` that field (None: no one field)."""
    field = e.message.split(" ", 1)[0].split("[", 1)[0]
    param = PARAMS.get(field)
    message = e.message if param is None else param + e.message[len(field):]
    return SpeechRequestError(message, param, e.status)


def _unknown_voice(voice: str) -> str:
    what = "one of OpenAI's built-in voices, which" if voice.lower() in OPENAI_VOICES else "a voice id"
    return (f"voice {voice!r} is {what} this server does not have: use {DEFAULT_VOICE!r} for the model's own voice or "
            f"a stored voice's id (GET /v1/references/list), or store one under this id (rtts voices add {voice} "
            "clip.wav --text ...)")


# ------------------------------------------------------------------------------------------------------------ routes


def served_model(rt: Runtime) -> dict[str, Any]:
    """The one model this server serves, as the API's model object (named after its checkpoint directory)."""
    ckpt = rt.loaded.checkpoint_dir
    try:
        created = int(ckpt.stat().st_mtime)
    except OSError:
        created = 0
    return {"id": ckpt.name or rt.loaded.config.format, "object": "model", "created": created, "owned_by": "rtts"}


async def list_models(request: Request) -> Response:
    rt: Runtime = request.app.state.rt
    return JSONResponse({"object": "list", "data": [served_model(rt)]})


async def get_model(request: Request) -> Response:
    rt: Runtime = request.app.state.rt
    model = served_model(rt)
    if request.path_params["model_id"] != model["id"]:
        return openai_error(404, f"the model {request.path_params['model_id']!r} does not exist; this server serves "
                                 f"{model['id']!r}", param="model", code="model_not_found")
    return JSONResponse(model)


async def speech(request: Request) -> Response:
    rt: Runtime = request.app.state.rt
    if rt.draining:  # before reading the body: a balancer may retry the request on another worker
        rt.metrics.refused.labels("draining").inc()
        return openai_error(503, DRAINING_MESSAGE)
    limit = rt.config.limits.max_message_bytes
    try:
        body = await read_body(request, limit)
        try:
            obj = json.loads(body) if body.strip() else None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SpeechRequestError(f"the body must be JSON ({e})") from None
        sreq = parse_speech(obj, rt.config.limits)
        if sreq.voice is not None:
            try:
                rt.voices.get(sreq.voice)
            except VoiceError:
                raise SpeechRequestError(_unknown_voice(sreq.voice), "voice") from None
        # The session speaks 16-bit PCM at the model's rate; the SpeechEncoder makes the requested format from it.
        req = sreq.tts
        spec = output_spec(req)
        refs = await resolve_references(req, rt.voices)
    except BodyTooLarge:
        return openai_error(413, f"request body over {limit} bytes")
    except SpeechRequestError as e:
        return openai_error(e.status, e.message, param=e.param)
    except (SessionError, VoiceError, ValueError) as e:
        return openai_error(400, str(e))
    return await _synthesize(rt, sreq, req, spec.rate, refs)


async def _synthesize(rt: Runtime, sreq: SpeechRequest, req: TTSRequest, pcm_rate: int,
                      refs: list[Reference]) -> Response:
    # Bounded as /v1/tts's body (docs/security.md, slow clients): a client that stops reading holds its session back,
    # and one that takes nothing for send_timeout_seconds ends it with an error, its slot back at once.
    queue = BodyQueue(rt.config.limits.send_timeout_seconds)
    failure: list[str] = []
    stalled: list[str] = []  # the client stopped reading: why (BodyQueue's refusal)

    async def emit(chunk: bytes) -> None:
        # Called inside on_audio, or by the AAC encoder's reader task, where a raise would end only that task: the
        # refusal is kept for on_audio / on_finish to end the session with, and what the encoder still makes is
        # dropped (the reader keeps reading it, so ffmpeg and on_audio never block on a full pipe).
        if stalled:
            return
        try:
            await queue.put(chunk)
        except SessionError as e:
            stalled.append(str(e))

    encoder = SpeechEncoder(sreq.response_format, sreq.sample_rate, sreq.speed, pcm_rate, emit)
    try:
        await encoder.start()
    except ffmpeg.FfmpegError as e:
        return openai_error(500, f"the {sreq.response_format} encoder did not start: {e}")
    try:
        handle = await rt.open_stream(refs)
    except NoSlotError:
        encoder.abort()
        rt.metrics.refused.labels("capacity").inc()
        return openai_error(503, f"too many concurrent requests (limit {rt.config.max_running}); retry later")
    except WorkerFailed as e:  # (the process is about to exit: a supervisor restarts it)
        encoder.abort()
        return openai_error(503, f"server failed ({e}); retry on a restarted server")

    async def on_audio(audio: bytes, extra: dict[str, object]) -> None:
        pcm = np.frombuffer(audio, dtype="<i2").astype(np.float32) / np.float32(32767.0)  # float_to_s16's scale
        try:
            if not stalled:
                await encoder.push(pcm)
        except ffmpeg.FfmpegError as e:
            raise SessionError(stalled[0] if stalled else str(e)) from None
        if stalled:
            raise SessionError(stalled[0])

    async def on_finish(reason: str, message: str | None) -> None:
        # The session ignores what this raises, so every way out must end the body.
        try:
            if reason != "error" and not stalled:
                await encoder.finish()  # (its last audio may find the client not reading: `stalled`)
        except ffmpeg.FfmpegError as e:
            failure.append(str(e))
        finally:
            if reason == "error" or stalled:  # (the session's message is the stall's when on_audio found it)
                failure.insert(0, message or (stalled[0] if stalled else "synthesis failed"))
                rt.metrics.errors.inc()
            queue.end()

    def release() -> None:  # the slot and the encoder
        handle.close()
        encoder.abort()

    try:
        session, stopper = start_body_session(rt, req, handle, on_audio, on_finish, release)
    except ValueError as e:
        return openai_error(400, str(e))
    # The status line waits for the first audio, so a request that fails before any still gets a JSON error.
    first = await queue.get()
    if first is None and failure:
        release()
        return openai_error(500, f"synthesis failed: {failure[0]}")

    async def pieces() -> AsyncIterator[bytes]:
        try:
            chunk = first
            while chunk is not None:
                yield chunk
                queue.taken()  # (it went out: room for the next)
                chunk = await queue.get()
        finally:
            handle.cancel()
            release()
            stopper.cancel()

    if sreq.stream_format == "sse":
        input_tokens = len(rt.loaded.tokenizer.encode(sreq.input))
        return StreamingResponse(_sse(pieces(), failure, lambda: (input_tokens, session.frames)),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return StreamingResponse(_raw(pieces(), failure), media_type=encoder.content_type)


async def _raw(pieces: AsyncIterator[bytes], failure: list[str]) -> AsyncIterator[bytes]:
    async for chunk in pieces:
        yield chunk
    if failure:
        # Once the 200 and some audio are out, the only way to say "failed" is to break the chunked body.
        log.warning("POST /v1/audio/speech failed mid-stream: %s", failure[0])
        raise SynthesisFailed(failure[0])


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _sse(pieces: AsyncIterator[bytes], failure: list[str], usage: Any) -> AsyncIterator[bytes]:
    """`speech.audio.delta` events (base64 audio in the response format), then `speech.audio.done` with usage: input
    tokens are the text's tokens, output tokens the audio frames generated (one per codec frame)."""
    async for chunk in pieces:
        yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(chunk).decode("ascii")})
    if failure:
        log.warning("POST /v1/audio/speech (sse) failed mid-stream: %s", failure[0])
        yield _event({"type": "error", "error": {"message": f"synthesis failed: {failure[0]}", "type": "server_error",
                                                 "param": None, "code": None}})
        return
    n_in, n_out = usage()
    yield _event({"type": "speech.audio.done",
                  "usage": {"input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out}})
