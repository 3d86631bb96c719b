"""HTTP routes: `POST /v1/tts` (chunked audio), `/v1/references/*`, `/v1/health`, `/metrics` (`/model`: models_api).

Errors are JSON `{status, message}` with a 4xx/5xx status; once audio has started streaming, a failure can only end
the response early (the status line is already sent), which the log records.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from rtts.audio.encode import AudioFormatError
from rtts.pingpong import NoSlotError, StreamHandle, WorkerFailed
from rtts.request import TTSRequest
from rtts.runtime import DRAINING_MESSAGE, Runtime
from rtts.session import OnAudio, OnFinish, Session, SessionError, output_spec, resolve_references
from rtts.voices import VoiceError
from rtts.ws import auth
from rtts.ws.parse import ProtocolError, as_str, decode_base64, describe
from rtts.ws.protocol import decode_body, decode_http_body, error_json

log = logging.getLogger("rtts.http")


BODY_BACKLOG = 16  # audio chunks an HTTP response holds waiting for its client (messages of at most 64 KiB)


class BodyQueue:
    """Audio on its way to a streamed HTTP body (`POST /v1/tts`, and any route that streams a session's audio).

    Bounded: at most BODY_BACKLOG chunks wait for the client, so one that reads slowly holds its session back (whose
    own unsent audio is bounded: Session) instead of growing the server's memory, and `put` fails the session
    (SessionError) once the client has taken nothing for `timeout` seconds (Limits.send_timeout_seconds): it
    stopped reading, its slot goes back. `end()` never waits: the body ends after the chunks already queued."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._items: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._room = asyncio.Semaphore(BODY_BACKLOG)

    async def put(self, chunk: bytes) -> None:
        try:
            await asyncio.wait_for(self._room.acquire(), self.timeout)
        except asyncio.TimeoutError:
            raise SessionError(f"client is not reading audio: it took nothing for {self.timeout:g} s") from None
        self._items.put_nowait(chunk)

    def end(self) -> None:
        self._items.put_nowait(None)

    async def get(self) -> bytes | None:
        """The next chunk (None: the end). Call `taken()` once it has gone out."""
        return await self._items.get()

    def taken(self) -> None:
        self._room.release()


class SynthesisFailed(RuntimeError):
    """A /v1/tts synthesis failed after its response started (aborts the chunked body)."""


class BodyTooLarge(Exception):
    pass


def _check_declared_length(request: Request, limit: int) -> None:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused (BodyTooLarge) as soon as it passes `limit` bytes: by its Content-Length before
    reading anything, else while it streams in. Never the whole of an oversized body in memory."""
    _check_declared_length(request, limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
    return b"".join(chunks)


async def read_form(request: Request, limit: int, max_files: int = 8, max_fields: int = 64) -> FormData:
    """A multipart or urlencoded form, its body bounded like read_body's first (Starlette's parser alone would take
    a chunked body of any size, spooling file parts to disk), then parsed from memory with at most `max_files` files
    and `max_fields` other fields."""
    body = await read_body(request, limit)
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return await Request(request.scope, replay).form(max_files=max_files, max_fields=max_fields)


def decode_map(body: bytes, ctype: str) -> Any:
    """The body of a voice route: MessagePack when the content type says so, else JSON (an empty one: no fields)."""
    msgpack = "msgpack" in ctype
    return decode_body(body, msgpack) if body or msgpack else {}


def _text_field(obj: dict[str, Any], key: str) -> str:
    value = obj.get(key, "")
    if not isinstance(value, str):
        raise ProtocolError(f"{key} must be a string, got {type(value).__name__}")
    return value


def json_error(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_json(status, message), status_code=status)


def authorized(rt: Runtime, headers: Any) -> bool:
    """The Authorization header's key (auth.AuthMiddleware has already checked it for every guarded route)."""
    return auth.authorized(rt.config.api_keys, headers)


def start_body_session(rt: Runtime, req: TTSRequest, handle: StreamHandle, on_audio: OnAudio, on_finish: OnFinish,
                       release: Callable[[], None]) -> tuple[Session, asyncio.Task[None]]:
    """Start the one-turn session whose audio goes out as one HTTP response body (/v1/tts, /v1/audio/speech: no
    padding of its last message, the unsent-audio bound of a live session): -> it and the task that ends it.
    `release` (the slot, and what the route holds) runs when that task ends, even if the body is never iterated (a
    client gone before the first audio: its `finally` never runs). ValueError: settings the validator let through
    and the engine cannot take (still the client's), after `release`."""
    try:
        session = Session(req, handle, on_audio, on_finish, rt.model_format, rt.sample_rate,
                          metrics=rt.metrics.session(), pad_last_message=False,
                          max_unsent_seconds=rt.config.limits.max_unsent_audio_seconds)
    except ValueError:
        release()
        raise
    session.start()
    session.flush()
    stopper = asyncio.create_task(session.stop())
    stopper.add_done_callback(lambda _: release())
    return session, stopper


async def tts(request: Request) -> Response:
    rt: Runtime = request.app.state.rt
    if not authorized(rt, request.headers):
        return json_error(401, "invalid or missing API key (Authorization: Bearer <key>)")
    if rt.draining:  # before reading the body: a balancer may retry the request on another worker
        rt.metrics.refused.labels("draining").inc()
        return json_error(503, DRAINING_MESSAGE)
    try:
        body = await read_body(request, rt.config.limits.max_message_bytes)
    except BodyTooLarge:
        return json_error(413, f"request body over {rt.config.limits.max_message_bytes} bytes")
    try:
        req = decode_http_body(body, request.headers.get("content-type", ""), rt.config.limits)
        spec = output_spec(req)
        if not req.text.strip():
            raise ProtocolError("text is empty")
        refs = await resolve_references(req, rt.voices)
        handle = await rt.open_stream(refs)
    except ProtocolError as e:
        # Its status says what kind of refusal it is (413 too large, 415 bad content type); not always 400.
        return json_error(e.status, str(e))
    except (AudioFormatError, SessionError, VoiceError, ValueError) as e:
        return json_error(400, str(e))
    except NoSlotError:
        rt.metrics.refused.labels("capacity").inc()
        return json_error(503, f"too many concurrent requests (limit {rt.config.max_running}); retry later")
    except WorkerFailed as e:  # (the process is about to exit: a supervisor restarts it)
        return json_error(503, f"server failed ({e}); retry on a restarted server")

    queue = BodyQueue(rt.config.limits.send_timeout_seconds)
    failure: list[str] = []

    async def on_audio(audio: bytes, extra: dict[str, object]) -> None:
        await queue.put(audio)  # (waits while the client is BODY_BACKLOG chunks behind)

    async def on_finish(reason: str, message: str | None) -> None:
        if reason == "error":
            failure.append(message or "synthesis failed")
            rt.metrics.errors.inc()
        queue.end()

    try:
        _, stopper = start_body_session(rt, req, handle, on_audio, on_finish, handle.close)
    except ValueError as e:
        return json_error(400, str(e))
    # The status line waits for the first audio, so a request that fails before any (a bad voice prompt, a full
    # queue) still gets a JSON error instead of a 200 with an empty body.
    first = await queue.get()
    if first is None and failure:
        handle.close()
        return json_error(500, f"synthesis failed: {failure[0]}")

    async def body_iter() -> AsyncIterator[bytes]:
        try:
            chunk = first
            while chunk is not None:
                yield chunk
                queue.taken()
                chunk = await queue.get()
            if failure:
                # Once the 200 and some audio are out, the only way to say "failed" is to break the chunked body:
                # the client sees an incomplete transfer instead of truncated audio that looks complete.
                log.warning("POST /v1/tts failed mid-stream: %s", failure[0])
                raise SynthesisFailed(failure[0])
        finally:
            handle.cancel()
            handle.close()
            stopper.cancel()

    return StreamingResponse(body_iter(), media_type=spec.content_type)


async def _read_reference_form(request: Request, limit: int) -> tuple[str, bytes, str]:
    ctype = request.headers.get("content-type", "")
    if ctype.startswith("multipart/form-data"):
        form = await read_form(request, limit, max_files=1, max_fields=8)
        try:
            field = form.get("audio")
            if isinstance(field, UploadFile):
                data = await field.read()
            else:
                data = (field or "").encode()
            return str(form.get("id", "")), data, str(form.get("text", ""))
        finally:
            await form.close()  # the parser spooled each file part into a temporary file
    obj = decode_map(await read_body(request, limit), ctype)
    if not isinstance(obj, dict):
        raise ProtocolError("body must be a map with id, audio, text")
    audio = obj.get("audio") or b""
    if isinstance(audio, str):  # JSON carries audio as base64
        audio = decode_base64(audio, "audio")
    if not isinstance(audio, bytes):
        raise ProtocolError(f"audio must be the audio file's bytes (base64 in JSON), got {describe(audio)}")
    return _text_field(obj, "id"), audio, _text_field(obj, "text")


async def references_add(request: Request) -> Response:
    rt: Runtime = request.app.state.rt
    if not authorized(rt, request.headers):
        return json_error(401, "invalid or missing API key")
    try:
        # The body holds the audio (base64 in JSON: 4/3 of it) and a transcript.
        voice_id, audio, text = await _read_reference_form(request, 2 * rt.config.limits.max_reference_bytes)
        text = as_str(text, "text", rt.config.limits.max_text_chars)
        if not audio:
            raise ProtocolError("audio is missing")
        if len(audio) > rt.config.limits.max_reference_bytes:
            raise ProtocolError(f"audio over {rt.config.limits.max_reference_bytes} bytes")
        voice = await asyncio.to_thread(rt.voices.add, voice_id, audio, text)
    except BodyTooLarge:
        return json_error(413, f"request body over {2 * rt.config.limits.max_reference_bytes} bytes")
    except HTTPException as e:  # Starlette's refusal of a malformed multipart body
        return json_error(e.status_code, str(e.detail))
    except (ProtocolError, VoiceError, ValueError) as e:
        return json_error(400, str(e))
    return JSONResponse({"status": 200, "message": "ok", "reference": voice.info()})


async def references_list(request: Request) -> Response:
    rt: Runtime = request.app.state.rt
    if not authorized(rt, request.headers):
        return json_error(401, "invalid or missing API key")
    voices = [v.info() for v in rt.voices.list()]
    ids = [v["id"] for v in voices]
    return JSONResponse({"status": 200, "message": "ok", "references": voices, "reference_ids": ids})


async def references_delete(request: Request) -> Response:
    rt: Runtime = request.app.state.rt
    if not authorized(rt, request.headers):
        return json_error(401, "invalid or missing API key")
    voice_id = request.query_params.get("id") or request.query_params.get("reference_id")
    if not voice_id:
        limit = rt.config.limits.max_message_bytes
        try:
            obj = decode_map(await read_body(request, limit), request.headers.get("content-type", ""))
            voice_id = str(obj.get("id") or obj.get("reference_id") or "")
        except BodyTooLarge:
            return json_error(413, f"request body over {limit} bytes")
        except (ProtocolError, AttributeError):
            return json_error(400, "body must be JSON or msgpack with an id")
    if not voice_id:
        return json_error(400, "missing id")
    if not rt.voices.delete(voice_id):
        return json_error(404, f"unknown reference_id {voice_id!r}")
    return JSONResponse({"status": 200, "message": "ok"})


async def health(request: Request) -> Response:
    """Readiness: 200 only while new sessions are served. `?live=1`: liveness, 200 while the process can still
    synthesize, draining included (a liveness probe must not kill a worker finishing its sessions)."""
    rt: Runtime = request.app.state.rt
    code, state = rt.health()
    if request.query_params.get("live", "") not in ("", "0", "false") and rt.failure is None:
        return JSONResponse({"status": state})
    if code != 200:
        body: dict[str, object] = {"status": state}
        if rt.failure is not None:
            body["reason"] = rt.failure
        return JSONResponse(body, status_code=code)
    return JSONResponse({"status": state, "model": rt.loaded.config.model_type,
                         "default_model": rt.default_model, "free_slots": rt.scheduler.slots.free})


async def metrics(request: Request) -> Response:
    rt: Runtime = request.app.state.rt
    return Response(rt.metrics.render(), media_type="text/plain; version=0.0.4")
