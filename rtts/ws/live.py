"""`/v1/tts/live` and `/v1/tts/live/with-timestamp`: the Fish live protocol over one WebSocket.

A connection runs sessions one after another (`start … stop → finish`, then a new `start`). The receive loop reads
and validates every frame; each session's sender task streams audio. Frames are msgpack maps in binary messages only,
both ways; every failure becomes `finish` with `reason: "error"` and a `message`, and the socket stays usable.
The connection keeps its scheduler stream (and so its prefilled voice prompt) while consecutive sessions use the same
voice; a voice named in the URL (`?reference_id=…`) is prefilled as the socket opens, before `start` arrives.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import sys
from collections.abc import Awaitable
from dataclasses import dataclass, replace

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketDisconnected

from rtts.pingpong import NoSlotError, StreamHandle, WorkerFailed
from rtts.runtime import DRAINING_MESSAGE, Runtime
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
from rtts.ws.parse import ProtocolError
from rtts.ws.protocol import (
    CancelEvent,
    FlushEvent,
    StartEvent,
    StopEvent,
    TextEvent,
    alignment_fields,
    audio_event,
    decode_client_message,
    finish_event,
)

log = logging.getLogger("rtts.live")


class State(enum.Enum):
    """Where the socket's session stands, as its receive loop sees it."""

    IDLE = "idle"  # no session: the next message should be a start
    ACTIVE = "active"  # a session takes text and flush
    DRAINING = "draining"  # after stop or cancel: the session sends the rest of its audio, then its finish
    # A start that came while DRAINING waits for that session's finish (the receive loop waits with it: no event
    # arrives in this state); meanwhile the kept stream is not idle (_idle).
    STARTING = "starting"
    # The server ended the session (an error) or refused its start for want of a slot: the client's text is kept
    # and its flush resumes the session with the same start (_resume); its stop or cancel gets nothing more.
    ENDED = "ended"
    # A start refused for what it asked (a bad request, an unknown voice): its finish/error was that session's one
    # finish, so the text, flush and stop the client still sends for it are dropped until the next start (answering
    # each would give the session several finishes; a client reusing the socket would read them as its next
    # session's). Unlike a refusal for want of a slot, retrying the same request cannot succeed.
    REFUSED = "refused"


@dataclass
class _Resume:
    """A session the server ended (State.ENDED): its start, and the text received for it since."""

    start: StartEvent
    text: str = ""


class Connection:
    """One socket: its sessions one after another, and the stream it keeps between them.

    Each client message is one event, handled by its `_on_*` method for the current state (→: the state after;
    "error": finish/error, see error()):

    state     | start                  | text, flush               | stop, cancel              | bad message*
    IDLE      | begin                  | error                     | error                     | error
    ACTIVE    | error → ENDED          | to the session            | → DRAINING                | error → ENDED
    DRAINING  | → STARTING, then begin | ignored                   | cancel: drops the audio   | error once drained
    ENDED     | begin                  | text kept, flush: resume  | → IDLE                    | error → IDLE
    REFUSED   | begin                  | dropped                   | → IDLE (ENDED if kept**)  | dropped

    begin (_start): → ACTIVE, or ENDED (no free slot) or REFUSED (a bad request). The session's own finish ends
    ACTIVE (→ ENDED after an error, _on_finish); the end of its stop or cancel ends DRAINING (→ IDLE, _drain).
    * A message that does not decode or validate (ProtocolError). A bad start, or out of a session one naming no
      event (the client's start as far as anyone can tell), is refused: error → REFUSED, whatever the state.
    ** A bad start that ended an active session keeps that session to resume once the client ends the refused one.
    """

    def __init__(self, ws: WebSocket, rt: Runtime, timestamps: bool) -> None:
        self.ws, self.rt, self.timestamps = ws, rt, timestamps
        self.state = State.IDLE
        self.session: Session | None = None  # ACTIVE, DRAINING (and STARTING: the session it waits for)
        self.started: StartEvent | None = None  # that session's start
        self.drain: asyncio.Task[None] | None = None  # DRAINING: the session's stop or cancel (_drain)
        self.resume: _Resume | None = None  # ENDED (and REFUSED**, see above)
        # The stream kept between sessions (the next one with the same voice reuses its prefilled prompt).
        self.handle: StreamHandle | None = None
        self.handle_voice = ""
        self._send_lock = asyncio.Lock()
        # The client is gone: whichever task's send finds it first, whatever the state (the receive loop then ends).
        self.closed = False
        # The client stopped reading (_stalled): it counts as gone; its finish waits behind the message it left.
        self.stalled = False
        self._stall_tail: asyncio.Task[None] | None = None
        self._opening = False  # a start is resolving its voice or waiting for a slot (_start)

    @property
    def busy(self) -> bool:
        """A session runs on this socket or is about to (being opened, or a start waiting for the last one's end):
        a drain waits for it; a socket that is not busy has nothing to finish."""
        running = self.session is not None and not self.session.done.is_set()
        return running or self._opening or self.state is State.STARTING

    # ------------------------------------------------------------------ sending

    async def send(self, data: bytes) -> None:
        """Raises ClientGone once the client has left, whichever way the socket's closing showed, or once it has
        stopped reading: a message the socket does not take within Limits.send_timeout_seconds (_stalled)."""
        async with self._send_lock:
            if self.closed:
                # The receive loop has seen the disconnect: uvicorn would refuse the send with a bare RuntimeError,
                # indistinguishable from a bug.
                raise ClientGone("connection closed")
            try:
                await self._send_within(data, self.rt.config.limits.send_timeout_seconds)
            except asyncio.TimeoutError:
                self._stalled(data)
                raise ClientGone("client is not reading") from None
            except (WebSocketDisconnect, WebSocketDisconnected) as e:
                # Starlette's two forms of a closed socket: WebSocketDisconnect(1006) wraps uvicorn's
                # ClientDisconnected (the socket closed under this send); WebSocketDisconnected is a send after that
                # or after our own close (shutdown).
                self.closed = True
                raise ClientGone("connection closed") from e

    async def _send_within(self, data: bytes, seconds: float) -> None:
        """uvicorn's send waits while the socket's buffers are full (the client does not read) and writes the message
        only once that wait is over: a send the timeout cancels has written none of it."""
        if sys.version_info >= (3, 11):
            async with asyncio.timeout(seconds):
                await self.ws.send_bytes(data)
        else:  # (wait_for runs the send as a task of its own: dearer per message, the same outcome)
            await asyncio.wait_for(self.ws.send_bytes(data), seconds)

    def _stalled(self, untaken: bytes) -> None:
        """The client stopped reading. It counts as gone: its session ends (ClientGone), the stream's slot goes back
        at its finish (_on_finish), later messages are ignored. What the server still holds for it is the message
        its socket did not take and, queued behind it for a client that reads again, finish/error and the close."""
        timeout = self.rt.config.limits.send_timeout_seconds
        message = f"client is not reading audio: the socket accepted nothing for {timeout:g} s"
        log.warning("%s: session ended", message)
        self.closed = self.stalled = True
        self.rt.metrics.errors.inc()
        self._stall_tail = asyncio.create_task(self._after_stall(untaken, message))
        if self.session is None or self.session.done.is_set():  # (else at the session's finish)
            self._release_stream()

    def _release_stream(self) -> None:
        self.rt.idle_stream(self, None)
        if self.handle is not None:
            self.handle.close()
            self.handle = None

    async def _after_stall(self, untaken: bytes, message: str) -> None:
        try:
            await self.ws.send_bytes(untaken)
            await self.ws.send_bytes(finish_event("error", message))
            await self.ws.close(1008)  # policy violation: the receive loop then ends
        except Exception:  # the client left without reading
            pass

    async def _on_audio(self, audio: bytes, extra: dict[str, object]) -> None:
        await self.send(audio_event(audio, **extra))

    async def _on_finish(self, reason: str, message: str | None) -> None:
        """The session's finish (it sends exactly one). A session is over at its finish, not when the socket's next
        message notices."""
        self.rt.metrics.sessions.dec()
        self._idle()
        if self.state is State.ACTIVE:
            # Ended by itself (a failed turn, a full context) or aborted (error(), shutdown, the client gone): after
            # an error the client's flush resumes it (a DRAINING session ends with its stop instead: _drain).
            assert self.started is not None
            self.session = None
            if reason == "error":
                self.state, self.resume = State.ENDED, _Resume(self.started)
            else:
                self.state = State.IDLE
        if self.closed:  # a client that leaves mid-session is not a failed session, and has no one to tell
            if self.stalled:  # (its receive loop may wait on a silent client for long: the slot goes back now)
                self._release_stream()
            return
        if reason == "error":
            self.rt.metrics.errors.inc()
        await self.send(finish_event(reason, message))

    async def error(self, message: str) -> None:
        """End the current session (if any) with finish/error; without one, still answer with finish/error. A session
        draining after `stop` finishes first: the error is the next message's, not that session's. A session this
        ends is kept as one the server ended (ENDED, by _on_finish): the text, flush and stop the client still sends
        for it get no finish of their own, and a flush resumes it (Pipecat keeps one session per call)."""
        self.resume = None
        await self._drained()
        if self.state is State.ACTIVE:
            assert self.session is not None
            await self.session.abort(message)  # its finish moves the socket to ENDED
        else:
            self.state = State.IDLE
            self.rt.metrics.errors.inc()
            await self.send(finish_event("error", message))

    async def _drained(self) -> None:
        """Wait until a DRAINING session has sent its audio and finish (or was aborted): then the socket is IDLE."""
        if self.drain is not None:
            await asyncio.wait({self.drain})  # returns however it ended; cancelling us still cancels us

    def _idle(self) -> None:
        """The kept stream is idle until the next session: another socket's new session may take it back."""
        if self.handle is not None and not self.closed and self.state is not State.STARTING:
            self.rt.idle_stream(self, self._reclaim)

    def _reclaim(self) -> None:
        if self.handle is not None and (self.session is None or self.session.done.is_set()):
            self.handle.close()
            self.handle, self.handle_voice = None, ""

    # ------------------------------------------------------------------ the loop

    async def run(self) -> None:
        self.rt.metrics.connections.inc()
        try:
            await self._preopen()
            while True:
                msg = await self.ws.receive()
                if msg["type"] == "websocket.disconnect":
                    break
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
        except (VoiceError, NoSlotError, ValueError, WorkerFailed) as e:
            # Not fatal: the client has not started a session; `start` will try again and report the error.
            log.info("could not prefill %r at connect: %s", voice_id, e)

    async def _handle(self, data: bytes | str) -> None:
        if self.stalled:  # a client that does not read gets nothing done for it
            return
        try:
            ev = decode_client_message(data, self.rt.config.limits)
        except ProtocolError as e:
            await self._on_bad_message(e)
            return
        match ev:
            case StartEvent():
                await self._on_start(ev)
            case TextEvent():
                await self._on_text(ev)
            case FlushEvent():
                await self._on_flush(ev)
            case StopEvent() | CancelEvent():
                await self._on_end(ev)
            case None:
                pass  # an event from a newer protocol: ignored

    # ------------------------------------------------------------------ one method per event

    async def _on_start(self, ev: StartEvent) -> None:
        self.resume = None  # the ended or refused session is over: what the client sends now is this one's
        self.rt.idle_stream(self, None)  # registered when the session before it finished: in use again
        if self.state is State.DRAINING:
            # Pipelined: the next utterance's start came before the last one's finish. It begins once that session
            # has drained (its audio and finish go out first).
            self.state = State.STARTING
            try:
                await self._drained()
            finally:
                self.state = State.IDLE
        elif self.state is not State.ACTIVE:
            self.state = State.IDLE
        if self.closed:
            return  # the client left (while the session before drained): nothing to start for it
        if self.state is State.ACTIVE:
            await self.error("'start' received while a session is active; send 'stop' first")
            return
        await self._start(ev)

    async def _on_text(self, ev: TextEvent) -> None:
        match self.state:
            case State.ACTIVE:
                assert self.session is not None
                # Text waiting to be spoken is bounded, not the session's total: a call that lasts hours (Pipecat
                # keeps one session) may say any amount.
                if not await self._over_text_limit(self.session.unspoken_chars() + len(ev.text)):
                    self.session.text(ev.text)
            case State.ENDED:
                assert self.resume is not None
                if not await self._over_text_limit(len(self.resume.text) + len(ev.text)):
                    self.resume.text += ev.text
            case State.DRAINING:
                self._after_stop(ev)
            case State.REFUSED:
                log.info("TextEvent for a refused start dropped")
            case State.IDLE:
                await self._before_start(ev)

    async def _on_flush(self, ev: FlushEvent) -> None:
        match self.state:
            case State.ACTIVE:
                assert self.session is not None
                self.session.flush()
            case State.ENDED:
                await self._resume()
            case State.DRAINING:
                self._after_stop(ev)
            case State.REFUSED:
                log.info("FlushEvent for a refused start dropped")
            case State.IDLE:
                await self._before_start(ev)

    async def _on_end(self, ev: StopEvent | CancelEvent) -> None:
        match self.state:
            case State.ACTIVE:
                assert self.session is not None
                ending = self.session.cancel() if isinstance(ev, CancelEvent) else self.session.stop()
                self.state = State.DRAINING
                self.drain = asyncio.create_task(self._drain(ending))
            case State.ENDED:
                # The client ends the session the server ended (the SDK's way after an error): it already has its
                # finish and gets nothing more.
                self.state, self.resume = State.IDLE, None
            case State.DRAINING:
                self._after_stop(ev)
            case State.REFUSED:
                # The client ended the refused session: later events are out of a session (or, after a bad start
                # that ended an active session, that session's, which a flush resumes).
                self.state = State.IDLE if self.resume is None else State.ENDED
                log.info("%s for a refused start dropped", type(ev).__name__)
            case State.IDLE:
                await self._before_start(ev)

    async def _on_bad_message(self, e: ProtocolError) -> None:
        if self.state is State.REFUSED and e.event != "start":
            log.info("bad message for a refused start dropped: %s", e)  # that session has its finish
            return
        # Out of a session the only valid message is a start, so one that names no event (not MessagePack, over
        # the size limit) was the client's start: refused like a bad one, its error is that session's only
        # finish, and the text, flush and stop the client sends for it next get none of their own.
        unknown_start = e.event is None and self.state in (State.IDLE, State.ENDED)
        await self.error(str(e))
        if e.event == "start" or unknown_start:
            self.state = State.REFUSED

    # ------------------------------------------------------------------ what the events do

    async def _before_start(self, ev: TextEvent | FlushEvent | StopEvent | CancelEvent) -> None:
        await self.error(f"'{type(ev).__name__.removesuffix('Event').lower()}' before 'start': send start first")

    def _after_stop(self, ev: TextEvent | FlushEvent | StopEvent | CancelEvent) -> None:
        """The session is draining after `stop`: finishing what it has is the contract, so a late event does not
        abort it (nor gets a finish of its own, which the client would take for its next session's). A cancel still
        drops the rest of the audio (and the finish says so)."""
        assert self.session is not None
        if isinstance(ev, CancelEvent):
            self.session.interrupt()
        else:
            log.warning("%s after 'stop' ignored (the session is finishing)", type(ev).__name__)

    async def _drain(self, ending: Awaitable[None]) -> None:
        """DRAINING: the session's stop or cancel. However it returns, the socket then takes a new start."""
        try:
            await ending
        finally:
            self.session, self.drain = None, None
            if self.state is State.DRAINING:  # (STARTING: the waiting start goes on from there)
                self.state = State.IDLE

    async def _resume(self) -> None:
        """A flush in ENDED: after a session the server ended (a failed turn) or a start it refused for want of a
        free slot. Pipecat sends `start` once per connection, then text + flush for the whole call, and reconnects
        only when the socket closes: its text is kept and, at its flush, spoken by a session resumed with the same
        start request, instead of every sentence failing "before start" for the rest of the call."""
        assert self.resume is not None
        resume, self.resume, self.state = self.resume, None, State.IDLE
        log.info("flush after a session the server ended: resuming it with the same start request")
        await self._start(StartEvent(replace(resume.start.request, text="")))
        if self.state is State.ACTIVE:
            assert self.session is not None
            self.session.text(resume.text)
            self.session.flush()
        elif self.resume is not None:  # refused again (no slot), and said so: the text waits for the next flush
            self.resume.text = resume.text

    async def _over_text_limit(self, unspoken: int) -> bool:
        """Whether `unspoken` characters waiting to be spoken pass the limit (then said with finish/error)."""
        limit = self.rt.config.limits.max_session_text_chars
        if unspoken <= limit:
            return False
        await self.error(f"unspoken text over the limit of {limit} characters")
        return True

    async def _start(self, ev: StartEvent) -> None:
        """_open_session, unless the server drains: a start then gets finish/error (REFUSED), and the drain closes
        the socket, so that the client's next connection reaches a worker that serves it."""
        if self.rt.draining:
            self.rt.metrics.refused.labels("draining").inc()
            await self.error(DRAINING_MESSAGE)
            self.state = State.REFUSED
            return
        self._opening = True
        try:
            await self._open_session(ev)
        finally:
            self._opening = False

    async def _open_session(self, ev: StartEvent) -> None:
        """IDLE → ACTIVE; or ENDED when no slot is free (a client that goes on sending text, like Pipecat, gets the
        session at a flush once one is), REFUSED when the request cannot be served."""
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
                max_unsent_seconds=self.rt.config.limits.max_unsent_audio_seconds,
            )
        except NoSlotError:
            self._idle()  # a stream kept for the same voice is idle again
            self.rt.metrics.refused.labels("capacity").inc()
            await self.error(f"too many concurrent sessions (limit {self.rt.config.max_running}); retry later")
            self.state, self.resume = State.ENDED, _Resume(ev)
            return
        except (SessionError, VoiceError, ValueError) as e:
            self._idle()
            await self.error(str(e))
            self.state = State.REFUSED
            return
        except WorkerFailed as e:  # (the process is about to exit: a supervisor restarts it)
            await self.error(f"server failed ({e}); retry on a restarted server")
            self.state = State.REFUSED
            return
        self.session, self.started, self.state = session, ev, State.ACTIVE
        self.rt.metrics.sessions.inc()
        session.start()

    async def _teardown(self) -> None:
        self.closed = True
        self.rt.idle_stream(self, None)
        session = self.session
        if session is not None and not session.done.is_set():
            session.segmenter.clear()
            session.handle.cancel()
            await session.abort("connection closed")
        self.session, self.drain = None, None
        if self.handle is not None:
            self.handle.close()
            self.handle = None

    async def shutdown(self) -> None:
        """Server stopping: end the session with finish/error and close the socket."""
        if self.stalled:  # nothing can reach it: uvicorn closes the connection
            return
        if self.session is not None and not self.session.done.is_set():
            await self.session.abort("server shutting down")
        try:
            await self.ws.close(1001)
        except Exception:  # already closed
            pass
