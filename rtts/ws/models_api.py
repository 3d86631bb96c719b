"""The SDK's voice management, `GET/POST /model`, `GET/PATCH/DELETE /model/{id}` (fish-audio-sdk 1.3 `client.voices`),
over the same voice store as `/v1/references/*`: a voice created here is a `reference_id` for synthesis, and a voice
added there is listed here (titled by its id).

What a local server cannot do is refused or ignored, and documented rather than faked: there is no speech recognition,
so every voice file needs its transcript (`texts`); cover images, `enhance_audio_quality` and the owner / language
filters of the listing are accepted and ignored; likes, marks and task counts are zero. Several voice files make one
voice, their codes and transcripts joined in order (VoiceStore.add_samples).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import uuid
from typing import Any

from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from rtts.runtime import Runtime
from rtts.voices import Voice, VoiceError, VoiceMeta
from rtts.ws.http import BodyTooLarge, authorized, decode_map, json_error, read_body, read_form
from rtts.ws.parse import ProtocolError, as_str

MAX_PAGE_SIZE = 100
AUTHOR = {"_id": "rtts", "nickname": "rtts", "avatar": ""}  # every voice here is the server owner's


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, tz=datetime.timezone.utc).isoformat()


def model_entity(v: Voice) -> dict[str, Any]:
    """A stored voice as the API's model entity (the SDK's `Voice`, every field it requires)."""
    return {"_id": v.id, "type": "tts", "title": v.meta.title or v.id, "description": v.meta.description,
            "cover_image": "", "train_mode": "fast", "state": "trained", "tags": list(v.meta.tags), "samples": [],
            "created_at": _iso(v.created), "updated_at": _iso(v.updated or v.created), "languages": [],
            "visibility": v.meta.visibility, "lock_visibility": False, "like_count": 0, "mark_count": 0,
            "shared_count": 0, "task_count": 0, "liked": False, "marked": False, "author": AUTHOR}


MAX_FIELD_CHARS = 10_000  # a title, description, tag or transcript
MAX_LIST_ITEMS = 256  # tags, transcripts


def _bounded(value: str, key: str) -> str:
    try:
        return as_str(value, key, MAX_FIELD_CHARS)
    except ProtocolError as e:
        raise ProtocolError(str(e), status=e.status if e.status == 413 else 422) from None


class _Fields:
    """A request body's fields, whatever its encoding: multipart or urlencoded form (repeated keys are lists), JSON
    or msgpack (lists are lists)."""

    def __init__(self, form: FormData | None = None, obj: dict[str, Any] | None = None) -> None:
        self.form, self.obj = form, obj or {}

    def has(self, key: str) -> bool:
        return key in self.form if self.form is not None else key in self.obj

    def all(self, key: str) -> list[Any]:
        if self.form is not None:
            return list(self.form.getlist(key))
        v = self.obj.get(key)
        return [] if v is None else list(v) if isinstance(v, (list, tuple)) else [v]

    def text(self, key: str) -> str | None:
        values = self.all(key)
        if not values:
            return None
        if len(values) > 1 or not isinstance(values[0], str):
            raise ProtocolError(f"{key} must be one string", status=422)
        return _bounded(values[0], key)

    def texts(self, key: str) -> list[str]:
        values = self.all(key)
        if len(values) > MAX_LIST_ITEMS:
            raise ProtocolError(f"{key} has {len(values)} items, the limit is {MAX_LIST_ITEMS}", status=422)
        if not all(isinstance(v, str) for v in values):
            raise ProtocolError(f"{key} must be strings", status=422)
        return [_bounded(v, f"{key}[{i}]") for i, v in enumerate(values)]

    async def files(self, key: str, limit: int) -> list[bytes]:
        out = []
        for v in self.all(key):
            data = await v.read() if isinstance(v, UploadFile) else v
            if not isinstance(data, bytes):
                raise ProtocolError(f"{key}: every item must be a file (audio bytes)", status=422)
            if len(data) > limit:
                raise ProtocolError(f"{key}: a file over {limit} bytes", status=413)
            out.append(data)
        return out


async def _fields(request: Request, limit: int, max_files: int) -> _Fields:
    ctype = request.headers.get("content-type", "")
    if ctype.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        return _Fields(form=await read_form(request, limit, max_files=max_files, max_fields=256))
    obj = decode_map(await read_body(request, limit), ctype)
    if not isinstance(obj, dict):
        raise ProtocolError("the body must be a map of fields", status=422)
    return _Fields(obj=obj)


def _meta_fields(f: _Fields) -> dict[str, Any]:
    """The VoiceMeta fields a create or update sends (an empty tag list is sent: it clears the tags)."""
    title = f.text("title")
    if title is not None and not title.strip():
        raise ProtocolError("title must not be blank", status=422)
    out = {"title": title, "description": f.text("description"), "visibility": f.text("visibility"),
           "tags": tuple(t for t in f.texts("tags") if t) if f.has("tags") else None}
    return {k: v for k, v in out.items() if v is not None}


async def _guarded(request: Request, limit: int, handler: Any, max_files: int = 1) -> Response:
    """Auth, then `handler(fields)` (the body read within `limit` bytes, `max_files` form files; limit 0: no body)
    with every refusal as the JSON error the rest of the API gives."""
    rt: Runtime = request.app.state.rt
    if not authorized(rt, request.headers):
        return json_error(401, "invalid or missing API key (Authorization: Bearer <key>)")
    try:
        fields = await _fields(request, limit, max_files) if limit else _Fields()
        try:
            return await handler(fields)
        finally:
            if fields.form is not None:
                await fields.form.close()  # the parser spooled each file part into a temporary file
    except BodyTooLarge:
        return json_error(413, f"request body over {limit} bytes")
    except HTTPException as e:  # Starlette's refusal of a malformed multipart body
        return json_error(e.status_code, str(e.detail))
    except ProtocolError as e:
        return json_error(e.status, str(e))
    except VoiceError as e:
        status = 404 if str(e).startswith("unknown reference_id") else 422
        return json_error(status, str(e))
    except ValueError as e:  # audio that does not decode
        return json_error(422, str(e))


async def create_model(request: Request) -> Response:
    rt: Runtime = request.app.state.rt
    lim = rt.config.limits
    per_file = lim.max_reference_bytes

    async def handler(f: _Fields) -> Response:
        if (f.text("type") or "tts") != "tts":
            raise ProtocolError("type: only tts models are served here", status=422)
        if (f.text("train_mode") or "fast") not in ("fast", "full"):
            raise ProtocolError("train_mode must be fast or full", status=422)
        if f.text("title") is None:
            raise ProtocolError("title is required", status=422)
        audios = await f.files("voices", per_file)
        texts = f.texts("texts")
        if not audios:
            raise ProtocolError("voices: at least one audio file is required", status=422)
        if len(audios) > lim.max_references:
            raise ProtocolError(f"voices: {len(audios)} files, the limit is {lim.max_references}", status=413)
        if len(texts) != len(audios):
            raise ProtocolError(f"texts: one transcript per voice file ({len(audios)}), got {len(texts)}; this "
                                "server does not transcribe audio", status=422)
        meta = dataclasses.replace(VoiceMeta(visibility="public"), **_meta_fields(f))  # the API's default: public
        voice = await asyncio.to_thread(rt.voices.add_samples, uuid.uuid4().hex, list(zip(audios, texts)), meta)
        return JSONResponse(model_entity(voice), status_code=201)

    # The voice files (up to max_references of max_reference_bytes), a cover image and small fields.
    return await _guarded(request, (lim.max_references + 1) * per_file + (1 << 20), handler,
                          max_files=lim.max_references + 1)


async def list_models(request: Request) -> Response:
    rt: Runtime = request.app.state.rt

    async def handler(_: _Fields) -> Response:
        q = request.query_params
        try:
            size, page = int(q.get("page_size", "10")), int(q.get("page_number", "1"))
        except ValueError:
            raise ProtocolError("page_size and page_number must be integers", status=422) from None
        if size < 1 or page < 1:
            raise ProtocolError("page_size and page_number must be at least 1", status=422)
        size = min(size, MAX_PAGE_SIZE)  # a larger page is served as the largest (total still counts them all)
        title, tags = q.get("title", "").lower(), set(q.getlist("tag"))
        voices = [v for v in rt.voices.list()
                  if title in (v.meta.title or v.id).lower() and tags <= set(v.meta.tags)]
        voices.sort(key=lambda v: (-v.created, v.id))  # newest first (task counts are all zero here)
        items = voices[(page - 1) * size:page * size]
        return JSONResponse({"total": len(voices), "items": [model_entity(v) for v in items]})

    return await _guarded(request, 0, handler)


async def get_model(request: Request) -> Response:
    rt: Runtime = request.app.state.rt

    async def handler(_: _Fields) -> Response:
        return JSONResponse(model_entity(rt.voices.get(request.path_params["model_id"])))

    return await _guarded(request, 0, handler)


async def update_model(request: Request) -> Response:
    rt: Runtime = request.app.state.rt

    async def handler(f: _Fields) -> Response:
        await asyncio.to_thread(rt.voices.update, request.path_params["model_id"], **_meta_fields(f))
        return JSONResponse({"status": 200, "message": "ok"})  # what the API answers (the SDK reads nothing)

    # Small fields and a cover image (accepted, not kept).
    return await _guarded(request, rt.config.limits.max_reference_bytes + (1 << 20), handler)


async def delete_model(request: Request) -> Response:
    rt: Runtime = request.app.state.rt

    async def handler(_: _Fields) -> Response:
        voice_id = request.path_params["model_id"]
        if not rt.voices.delete(voice_id):
            raise VoiceError(f"unknown reference_id {voice_id!r}")
        return JSONResponse({"status": 200, "message": "ok"})

    return await _guarded(request, 0, handler)
