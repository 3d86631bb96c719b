"""`/v1/tts/live` and `/v1/tts/live/with-timestamp`: the Fish live protocol over one WebSocket.

A connection runs sessions one after another (`start … stop → finish`, then a new `start`). The receive loop reads
and validates every frame; each session's sender task streams audio. Frames are msgpack maps in binary messages only,
both ways; every failure becomes `finish` with `reason: "error"` and a `message`, and the socket stays usable.
The connection keeps its scheduler stream (and so its prefilled voice prompt) while consecutive sessions use the same
voice; a voice named in the URL (`?reference_id=…`) is prefilled as the socket opens, before `start` arrives.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketDisconnected

from rtts.pingpong import NoSlotError, StreamHandle
from rtts.session import (
    ClientGone,
    Session,
    SessionError,
    resolve_references,
    stored_voices_key,
    voice_key,
    voice_references,
)
from rtts.voices import VoiceError
from rtts.ws.protocol import (
    CancelEvent,
    FlushEvent,
    ProtocolError,
    StartEvent,
    StopEvent,
    TextEvent,
    alignment_fields,
    audio_event,
    decode_client_message,
    finish_event,
)
from rtts.ws.runtime import Runtime

log = logging.getLogger("rtts.live")


class Connection:
    def __init__(self, ws: WebSocket, rt: Runtime, timestamps: bool) -> None:
        self.ws, self.rt, self.timestamps = ws, rt, timestamps
        self.session: Session | None = None
        self.started: StartEvent | None = None  # the start of the current session
        # The start to resume when text + flush arrive with no session: that of a session the server ended with an
        # error, or one refused for want of a slot (see _start and _resume); and the text received for it since.
        self.resume: StartEvent | None = None
        self.resume_text = ""
        # A start refused for what it asked (a bad request, an unknown voice): its finish/error was that session's
        # one finish, so the text, flush and stop the client still sends for it are dropped until the next start
        # (answering each would give the session several finishes; a client reusing the socket would read them as
        # its next session's). Unlike a refusal for want of a slot, retrying the same request cannot succeed.
        self.refused = False
        self.stopping: asyncio.Task[None] | None = None
        self.handle: StreamHandle | None = None
        self.handle_voice = ""
        self._send_lock = asyncio.Lock()
        self.closed = False  # the client is gone
        self.starting = False  # a start waits for the session before it to drain (its stream is not idle)

    # ------------------------------------------------------------------ sending

    async def send(self, data: bytes) -> None:
        """Raises ClientGone once the client has left, whichever way the socket's closing showed."""
        async with self._send_lock:
            if self.closed:
                # The receive loop has seen the disconnect: uvicorn would refuse the send with a bare RuntimeError,
                # indistinguishable from a bug.
                raise ClientGone("connection closed")
            try:
                await self.ws.send_bytes(data)
            except (WebSocketDisconnect, WebSocketDisconnected) as e:
                # Starlette's two forms of a closed socket: WebSocketDisconnect(1006) wraps uvicorn's
                # ClientDisconnected (the socket closed under this send); WebSocketDisconnected is a send after that
                # or after our own close (shutdown).
                self.closed = True
                raise ClientGone("connection closed") from e

    async def _on_audio(self, audio: bytes, extra: dict[str, object]) -> None:
        await self.send(audio_event(audio, **extra))

    async def _on_finish(self, reason: str, message: str | None) -> None:
        # A session is active until its finish (it sends exactly one), not until the socket's next message reaps it.
        self.rt.metrics.sessions.dec()
        self._idle()
        if self.closed:  # a client that leaves mid-session is not a failed session, and has no one to tell
            return
        if reason == "error":
            self.rt.metrics.errors.inc()
        await self.send(finish_event(reason, message))

    async def error(self, message: str) -> None:
        """End the current session (if any) with finish/error; without one, still answer with finish/error. A session
        draining after `stop` finishes first: the error is the next message's, not that session's. A session this
        ends is kept as one the server ended (_resume): the text, flush and stop the client still sends for it get
        no finish of their own, and a flush resumes it (Pipecat keeps one session per call)."""
        self._clear_resume()
        await self._drained()
        ended = None
        if self.session is not None and not self.session.done.is_set():
            ended = self.started
            await self.session.abort(message)
        else:
            self.rt.metrics.errors.inc()
            await self.send(finish_event("error", message))
        self._end_session()
        if ended is not None:
            self.resume = ended

    async def _drained(self) -> None:
        """Wait until a session draining after `stop` has sent its audio and finish (or was aborted), and forget it."""
        if self.stopping is not None:
            await asyncio.wait({self.stopping})  # returns however it ended; cancelling us still cancels us
            self._reap()

    def _idle(self) -> None:
        """The kept stream is idle until the next session: another socket's new session may take it back."""
        if self.handle is not None and not self.closed and not self.starting:
            self.rt.idle_stream(self, self._reclaim)

    def _reclaim(self) -> None:
        if self.handle is not None and (self.session is None or self.session.done.is_set()):
            self.handle.close()
            self.handle, self.handle_voice = None, ""

    def _clear_resume(self) -> None:
        self.resume, self.resume_text = None, ""

    def _reap(self) -> None:
        """Forget a session that has ended: drained after `stop`, or finished with an error by itself (a failed turn,
        a full context), so the socket takes a new `start`."""
        if self.stopping is not None and self.stopping.done():
            self._end_session()
        elif self.session is not None and self.stopping is None and self.session.done.is_set():
            if self.session.failed:
                self.resume = self.started
            self._end_session()

    def _end_session(self) -> None:
        self.session = None
        self.stopping = None

    # ------------------------------------------------------------------ the loop

    async def run(self) -> None:
        self.rt.metrics.connections.inc()
        try:
            await self._preopen()
            while True:
                msg = await self.ws.receive()
                if msg["type"] == "websocket.disconnect":
                    break
                self._reap()
                data = msg.get("bytes")
                # A text frame is refused by the decoder like any bad message (out of a session, like a bad start)
                await self._handle(data if data is not None else msg.get("text") or "")
        except ClientGone:  # (every send goes through self.send)
            pass
        finally:
            await self._teardown()
            self.rt.metrics.connections.dec()

    async def _preopen(self) -> None:
        voice_id = self.ws.query_params.get("reference_id")
        if not voice_id:
            return
        try:
            self.handle = self.rt.scheduler.open(voice_references(self.rt.voices.get(voice_id)))
            self.handle_voice = stored_voices_key((voice_id,), self.rt.voices)
            self._idle()
        except (VoiceError, NoSlotError, ValueError) as e:
            # Not fatal: the client has not started a session; `start` will try again and report the error.
            log.info("could not prefill %r at connect: %s", voice_id, e)

    async def _handle(self, data: bytes | str) -> None:
        try:
            ev = decode_client_message(data, self.rt.config.limits)
        except ProtocolError as e:
            if self.refused and e.event != "start" and self.session is None:
                log.info("bad message for a refused start dropped: %s", e)  # that session has its finish
                return
            # Out of a session the only valid message is a start, so one that names no event (not MessagePack, over
            # the size limit) was the client's start: refused like a bad one, its error is that session's only
            # finish, and the text, flush and stop the client sends for it next get none of their own.
            unknown_start = e.event is None and self.session is None and not self.starting
            await self.error(str(e))
            self.refused = e.event == "start" or unknown_start
            return
        if ev is None:
            return  # an event from a newer protocol: ignored
        if isinstance(ev, StartEvent):
            self._clear_resume()
            self.refused = False
            # Pipelined: the next utterance's start came before the last one's finish. It begins once that session
            # has drained (its audio and finish go out first); meanwhile its stream is not idle (_idle).
            self.starting = True
            self.rt.idle_stream(self, None)  # registered when the session before it finished: in use again
            try:
                await self._drained()
            finally:
                self.starting = False
            if self.closed:
                return  # the client left while the session before drained: nothing to start for it
            if self.session is not None:
                await self.error("'start' received while a session is active; send 'stop' first")
                return
            await self._start(ev)
            return
        if self.session is None and self.refused:
            if isinstance(ev, (StopEvent, CancelEvent)):
                self.refused = False  # the client ended the refused session: later events are out of a session
            log.info("%s for a refused start dropped", type(ev).__name__)
            return
        if self.session is None and self.resume is not None:
            await self._resume(ev)
            return
        if self.session is None:
            await self.error(f"'{type(ev).__name__.removesuffix('Event').lower()}' before 'start': send start first")
            return
        if self.stopping is not None:
            # The session is draining after `stop`: finishing what it has is the contract, so a late event does not
            # abort it (nor gets a finish of its own, which the client would take for its next session's). A cancel
            # still drops the rest of the audio (and the finish says so).
            if isinstance(ev, CancelEvent):
                self.session.interrupt()
            else:
                log.warning("%s after 'stop' ignored (the session is finishing)", type(ev).__name__)
            return
        if isinstance(ev, TextEvent):
            # Text waiting to be spoken is bounded, not the session's total: a call that lasts hours (Pipecat keeps
            # one session) may say any amount.
            if await self._over_text_limit(self.session.unspoken_chars() + len(ev.text)):
                return
            self.session.text(ev.text)
        elif isinstance(ev, FlushEvent):
            self.session.flush()
        elif isinstance(ev, StopEvent):
            self.stopping = asyncio.create_task(self._stop(self.session.stop()))
        elif isinstance(ev, CancelEvent):
            self.stopping = asyncio.create_task(self._stop(self.session.cancel()))

    async def _resume(self, ev: TextEvent | FlushEvent | StopEvent | CancelEvent) -> None:
        """An event with no session, after a session the server ended (a failed turn) or a start it refused for want
        of a free slot. Pipecat sends `start` once per connection, then text + flush for the whole call, and
        reconnects only when the socket closes: its text is kept and, at its flush, spoken by a session resumed with
        the same start request, instead of every sentence failing "before start" for the rest of the call. A client
        that ends instead (stop, cancel: the SDK's way after an error) already has its finish and gets nothing
        more."""
        if isinstance(ev, (StopEvent, CancelEvent)):
            self._clear_resume()
            return
        if isinstance(ev, TextEvent):
            if await self._over_text_limit(len(self.resume_text) + len(ev.text)):
                return
            self.resume_text += ev.text
            return
        assert self.resume is not None
        start, text = self.resume, self.resume_text
        self._clear_resume()
        log.info("flush after a session the server ended: resuming it with the same start request")
        await self._start(StartEvent(dataclasses.replace(start.request, text="")))
        if self.session is not None:  # else refused again (no slot), and said so: the text waits for the next flush
            self.session.text(text)
            self.session.flush()
        else:
            self.resume_text = text

    async def _over_text_limit(self, unspoken: int) -> bool:
        """Whether `unspoken` characters waiting to be spoken pass the limit (then said with finish/error)."""
        limit = self.rt.config.limits.max_session_text_chars
        if unspoken <= limit:
            return False
        await self.error(f"unspoken text over the limit of {limit} characters")
        return True

    async def _stop(self, aw: Any) -> None:
        await aw
        self._end_session()

    async def _start(self, ev: StartEvent) -> None:
        self.rt.idle_stream(self, None)  # in use again (or about to be replaced): not to be taken back
        req = ev.request
        key = voice_key(req, self.rt.voices)
        try:
            fresh = False
            if self.handle is not None and key == self.handle_voice and not self.handle.stream.error:
                fresh = True  # same voice as the prefilled stream: reuse it, forgetting the previous session's turns
            else:
                refs = await resolve_references(req, self.rt.voices)
                if self.handle is not None:  # another voice: the slot goes back (open_stream waits for it)
                    self.handle.close()
                    self.handle = None
                self.handle = await self.rt.open_stream(refs)
                self.handle_voice = key
            session = Session(
                req, self.handle, self._on_audio, self._on_finish, self.rt.model_format, self.rt.sample_rate,
                alignment=alignment_fields if (self.timestamps or req.timestamps) else None,
                fresh_first_turn=fresh,
                metrics=self.rt.metrics.session(),
            )
        except NoSlotError:
            self._idle()  # a stream kept for the same voice is idle again
            await self.error(f"too many concurrent sessions (limit {self.rt.config.max_running}); retry later")
            self.resume = ev  # a client that goes on sending text (Pipecat) gets the session once a slot is free
            return
        except (SessionError, VoiceError, ValueError) as e:
            self._idle()
            await self.error(str(e))
            self.refused = True
            return
        self.session, self.started, self.resume = session, ev, None
        self.rt.metrics.sessions.inc()
        session.start()

    async def _teardown(self) -> None:
        self.closed = True
        self.rt.idle_stream(self, None)
        if self.session is not None and not self.session.done.is_set():
            self.session.segmenter.clear()
            self.session.handle.cancel()
            await self.session.abort("connection closed")
        if self.session is not None:
            self._end_session()
        if self.handle is not None:
            self.handle.close()
            self.handle = None

    async def shutdown(self) -> None:
        """Server stopping: end the session with finish/error and close the socket."""
        if self.session is not None and not self.session.done.is_set():
            await self.session.abort("server shutting down")
        try:
            await self.ws.close(1001)
        except Exception:  # already closed
            pass
