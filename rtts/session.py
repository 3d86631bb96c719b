"""A live TTS session: `start → (text | flush)* → stop → finish`, independent of the transport.

The session turns text events into synthesis turns (through the segmenter), submits them to its scheduler stream in
order, and streams each turn's audio — encoded in the requested format and sample rate — back through `send`. One
sender task drains the turns' outboxes in order; the event loop only awaits, the model runs in the scheduler threads.

A session ends with exactly one `finish`: `stop` after `stop` and all audio, `error` (+ message) on any failure. A
client that closes its socket mid-session ends it quietly (ClientGone).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from rtts.audio.encode import OutputSpec, Rechunker, StreamEncoder, message_bytes_target
from rtts.model.prompt import Reference
from rtts.pingpong import AudioChunk, StreamHandle, TurnEnd
from rtts.pingpong.outbox import Outbox
from rtts.request import Limits, TTSRequest
from rtts.segmenter import Segmenter
from rtts.types import FinishReason, SamplingParams
from rtts.voices import Voice, VoiceError, VoiceStore

log = logging.getLogger("rtts.session")

OnAudio = Callable[[bytes, dict[str, object]], Awaitable[None]]  # encoded audio bytes, extra event fields
OnFinish = Callable[[str, str | None], Awaitable[None]]  # reason ("stop" | "cancelled" | "error"), message
Alignment = Callable[..., dict[str, object]]  # formats the with-timestamp fields (the transport's wire names)

# Turns a session keeps submitted to its stream beyond the one being streamed out. The rest of its text waits in the
# session: a stream queues a bounded number of turns (SchedulerConfig.max_queued_turns), and a client may send text
# without limit (Pipecat: one session, text + flush for every sentence). A few ahead keep the stream busy: its turns
# run one after another anyway, each conditioned on the one before.
SUBMIT_AHEAD = 4
# MP3 and Ogg Opus encoders keep the last tens of ms of a turn until more audio comes (StreamEncoder.release_tail),
# which after a `flush` may be the next reply, seconds later. The session releases it with silence once no turn has
# followed for TAIL_IDLE_SECONDS and the client has at most TAIL_MARGIN_SECONDS of audio left to play (as if it plays
# in real time from each audio's arrival: Session._played): while the client still plays earlier audio the next turn
# usually comes first and pushes the end out itself, with no silence added between sentences.
TAIL_IDLE_SECONDS = 0.1
TAIL_MARGIN_SECONDS = 0.1


class SessionError(Exception):
    """Ends the session with finish/error and this message."""


class ClientGone(Exception):
    """Raised by the transport's `on_audio` / `on_finish` once its client has gone away (a closed socket). Closing
    the socket is how clients interrupt (docs/protocol.md): the session ends quietly, as a normal end and not a failure,
    and no finish is sent (nobody is left to read it)."""


@dataclass
class SessionMetrics:
    """Callbacks the server's metrics registry provides (all optional)."""

    ttfa: Callable[[float], None] = lambda s: None
    chunk_gap: Callable[[float], None] = lambda s: None
    frames: Callable[[int], None] = lambda n: None
    # How late an audio chunk came for a client playing the session's audio (seconds after its estimated playback
    # ran out; 0 in time). A turn whose text came after that ran out is measured by ttfa instead.
    lateness: Callable[[float], None] = lambda s: None
    # A turn's first audio: seconds spent in one stage of the scheduler (AudioChunk.stages, and "outbox": the chunk
    # waiting for this session's event loop to take it)
    ttfa_stage: Callable[[str, float], None] = lambda stage, s: None


# Voice ids that client plugins send by default, naming a voice of the hosted Fish service (LiveKit's
# fish plugin defaults to the first; the second is the hosted preset that older plugin releases and Fish's own
# examples default to). Unless stored here under that id, they get the server's default voice, so a plugin with
# default settings speaks; any other unknown id is an error.
HOSTED_DEFAULT_VOICES = frozenset({"933563129e564b19a115bedd57b7406a", "8ef4a238714b45718ce04243307c57a7"})


def _voice_ids(req: TTSRequest) -> tuple[str, ...]:
    return req.reference_ids or ((req.reference_id,) if req.reference_id else ())


def stored_voices_key(ids: tuple[str, ...], voices: VoiceStore) -> str:
    """Stored voices by id and version: a voice overwritten or deleted since a stream prefilled it no longer
    matches that stream."""
    parts = []
    for voice_id in ids:
        try:
            parts.append(f"{voice_id}@{voices.get(voice_id).created!r}")
        except VoiceError:
            parts.append(voice_id + "@-")
    return "id:" + "|".join(parts)


def voice_key(req: TTSRequest, voices: VoiceStore) -> str:
    """Identifies the voice prompt a request asks for (to reuse an already prefilled stream)."""
    if req.references:
        h = hashlib.sha256()
        for r in req.references:
            h.update(hashlib.sha256(r.audio).digest())
            h.update(r.text.encode())
            h.update(b"%d;" % r.speaker)
        return "inline:" + h.hexdigest()
    if ids := _voice_ids(req):
        return stored_voices_key(ids, voices)
    return "none"


async def resolve_references(req: TTSRequest, voices: VoiceStore) -> list[Reference]:
    """Stored voices or inline references -> prompt references, each with its speaker number (inline audio is
    encoded off the event loop, once). Voice id i of a list voices speaker i; every id must exist."""
    if req.references:
        refs = []
        for r in req.references:
            try:
                codes = await asyncio.to_thread(voices.encode, r.audio)
            except (VoiceError, ValueError) as e:
                raise SessionError(f"reference audio: {e}") from None
            refs.append(Reference(r.text, torch.from_numpy(codes), speaker=r.speaker))
        return refs
    refs = []
    for i, voice_id in enumerate(_voice_ids(req)):
        try:
            v = voices.get(voice_id)
        except VoiceError as e:
            if voice_id in HOSTED_DEFAULT_VOICES:
                log.warning("reference_id %s is a hosted service's default voice, not stored here: serving the "
                            "default voice (store one under this id to change it)", voice_id)
                continue
            raise SessionError(str(e)) from None
        refs += voice_references(v, speaker=i)
    return refs


def voice_references(voice: Voice, speaker: int = 0) -> list[Reference]:
    return [Reference(voice.text, torch.from_numpy(voice.codes), speaker=speaker)]


def output_spec(req: TTSRequest) -> OutputSpec:
    """The audio the request asks for, validated (AudioFormatError names an unsupported value)."""
    return OutputSpec(format=req.format, sample_rate=req.sample_rate, mp3_bitrate=req.mp3_bitrate,
                      opus_bitrate=req.opus_bitrate, speed=req.prosody.speed, volume_db=req.prosody.volume,
                      normalize_loudness=req.prosody.normalize_loudness).validated()


def sampling_params(req: TTSRequest, model_format: str) -> SamplingParams:
    top_k = req.top_k if req.top_k is not None else (30 if model_format == "s2" else 0)
    temperature, top_p = req.temperature, req.top_p
    if temperature == 0.0 or top_p == 0.0:  # the limit of either: always the most likely token
        temperature, top_p, top_k = 1.0, 1.0, 1
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                          repetition_penalty=req.repetition_penalty, seed=req.seed, max_frames=req.max_new_tokens)


class _Chunk(NamedTuple):
    """The turn whose audio is going out, as the timestamps extension reports it (docs/protocol.md): a chunk is one
    turn."""

    seq: int  # chunk_seq: the turn's number in the session
    offset: float  # chunk_audio_offset_sec: where the turn starts on the session's audio timeline
    text: str  # the turn's text
    speech: float  # seconds of its speech so far
    audio: float  # seconds of its audio so far: the speech plus any silence that released a codec's tail


@dataclass
class _Timing:
    t_trigger: float = 0.0  # when the text that triggered the turn arrived (flush/stop/segment end)
    first_sent: bool = False
    last_send: float = 0.0


class Session:
    def __init__(
        self,
        request: TTSRequest,
        handle: StreamHandle,
        on_audio: OnAudio,
        on_finish: OnFinish,
        model_format: str,
        input_rate: int,
        alignment: Alignment | None = None,
        fresh_first_turn: bool = False,
        metrics: SessionMetrics | None = None,
        pad_last_message: bool = True,
        max_unsent_seconds: float = Limits.max_unsent_audio_seconds,
    ) -> None:
        """pad_last_message: lift a turn's short last pcm / wav message over Pipecat's floor with silence
        (StreamEncoder.last_message_pad); off for HTTP, whose body has no message boundaries.
        max_unsent_seconds: the audio the session may hold generated and not yet sent (a client reading slower
        than it is generated); past it the session ends with an error (Limits.max_unsent_audio_seconds)."""
        self.req = request
        self.handle = handle
        self.on_audio, self.on_finish = on_audio, on_finish
        self.params = sampling_params(request, model_format)
        self.params.validate()
        spec = output_spec(request)
        self.spec = spec
        self.encoder = StreamEncoder(spec, input_rate)
        self.pad_last_message = pad_last_message
        self.rechunker = Rechunker(message_bytes_target(spec))
        self.segmenter = Segmenter(request.chunk_length, request.min_chunk_length)
        self.alignment = alignment
        self.metrics = metrics or SessionMetrics()
        self._fresh = fresh_first_turn
        self._turns: asyncio.Queue[tuple[Outbox, str, _Timing] | None] = asyncio.Queue()
        self._outboxes: deque[Outbox] = deque()  # the submitted turns' outboxes not streamed out yet, oldest first
        self.max_unsent_seconds = max_unsent_seconds
        self._backlog: deque[tuple[str, _Timing]] = deque()  # segments not submitted yet
        self._submitted = 0  # turns submitted whose audio is not streamed out yet
        self._stopping = False  # `stop` arrived: the end marker follows the backlog's last turn
        self._end_queued = False
        self._sender: asyncio.Task[None] | None = None
        self._closed = False
        self.done = asyncio.Event()  # set once finish was sent
        self.cancelled = False  # the client cancelled it (the cancel / clear extension)
        # Timestamps (docs/protocol.md): a chunk is one turn. Its audio events share its chunk_seq and carry its
        # offset on the session's audio timeline and a cumulative alignment relative to that offset, which each event
        # of the chunk replaces.
        self.audio_seconds = 0.0  # the session's output timeline: where the next turn starts
        self._tail_held = False  # the codec holds the end of the last turn (TAIL_IDLE_SECONDS)
        # When the client will have played all audio sent so far, as if it plays in real time from each arrival:
        # after a quiet stretch (the user talking) playback restarts from the next audio.
        self._play_end = 0.0
        self._chunk = _Chunk(0, 0.0, "", 0.0, 0.0)
        self._turns_streamed = 0
        self.frames = 0
        self.t_start = time.perf_counter()

    # ------------------------------------------------------------------ client events

    def start(self) -> None:
        self._sender = asyncio.create_task(self._send_loop())
        if self.req.text.strip():
            self.text(self.req.text)

    def text(self, text: str) -> None:
        self._speak(self.segmenter.push(text))

    def flush(self) -> None:
        self._speak(self.segmenter.flush())

    async def stop(self) -> None:
        """Synthesize what is buffered, stream everything, then finish/stop."""
        self.flush()
        self._stopping = True
        self._pump()
        if self._sender is not None:
            await self._sender

    def unspoken_chars(self) -> int:
        """Characters received and not yet handed to the stream: the segmenter's buffer and the backlog."""
        return len(self.segmenter.pending) + sum(len(seg) for seg, _ in self._backlog)

    def drop(self) -> None:
        """Forget buffered and pending text and cancel the turns in flight (their outboxes end at once)."""
        self.segmenter.clear()
        self._backlog.clear()
        self.handle.cancel()

    def interrupt(self) -> None:
        """The client's cancel: drop() and end with finish/cancelled rather than stop (the extension's reply in
        docs/protocol.md: a client that cancelled can tell the end of what it asked from a normal end)."""
        self.cancelled = True
        self.drop()

    async def cancel(self) -> None:
        """interrupt(), then stop: the session ends at once with finish/cancelled."""
        self.interrupt()
        await self.stop()

    async def abort(self, message: str) -> None:
        """End the session now with finish/error (bad input, shutdown)."""
        if self._closed:
            return
        self.segmenter.clear()
        self._backlog.clear()
        self.handle.cancel()
        self._closed = True
        if self._sender is not None and not self._sender.done():
            self._sender.cancel()
        await self._finish("error", message)

    def _speak(self, segments: list[str]) -> None:
        if self._closed:
            return
        now = time.perf_counter()
        self._backlog.extend((seg, _Timing(now)) for seg in segments)
        self._pump()

    def _pump(self) -> None:
        """Submit backlog segments while fewer than SUBMIT_AHEAD turns are pending, in order; after `stop`, queue the
        end marker once the backlog is empty."""
        while self._backlog and self._submitted < SUBMIT_AHEAD and not self._closed:
            seg, timing = self._backlog.popleft()
            first_on_reused = self._fresh
            fresh = first_on_reused or not self.req.condition_on_previous_chunks
            self._fresh = False
            # The first turn on a reused stream also restarts the codec from silence: otherwise the previous
            # session's audio history shapes this session's waveform (same codes, different PCM than a new socket).
            outbox = self.handle.speak(seg, self.params, latency=self.req.latency, fresh=fresh,
                                       reset_audio=first_on_reused)
            self._turns.put_nowait((outbox, seg, timing))
            self._outboxes.append(outbox)
            self._submitted += 1
        if self._stopping and not self._backlog and not self._end_queued:
            self._end_queued = True
            self._turns.put_nowait(None)

    # ------------------------------------------------------------------ audio out

    async def _send_loop(self) -> None:
        try:
            while True:
                item = await self._next_turn()
                if self._closed:  # aborted while waiting (Python < 3.12's wait_for may return instead of raising)
                    return
                if item is None:
                    break
                await self._stream_turn(*item)
                self._outboxes.popleft()
                self._submitted -= 1
                self._pump()
            await self._emit(self.rechunker.push(self.encoder.finish()) + self.rechunker.flush(), content="")
            await self._finish("cancelled" if self.cancelled else "stop")
        except SessionError as e:
            self.handle.cancel()
            await self._finish("error", str(e))
        except ClientGone:
            # Usually the transport notices the close first and aborts the session; this is the sender noticing it
            # first (e.g. while a pipelined start waits for this session to drain). Its finish still releases what
            # the session holds (the transport knows the client is gone and sends nothing).
            log.info("client gone mid-session: session ended")
            self.drop()
            await self._finish("error", "connection closed")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug must still end the session properly
            log.exception("session failed")
            with contextlib.suppress(Exception):  # (the bug may be the stream's own) its turns stop generating
                self.handle.cancel()
            await self._finish("error", f"internal error: {e}")

    async def _next_turn(self) -> tuple[Outbox, str, _Timing] | None:
        """The next queued turn (None: the end marker). While the codec holds the last turn's end, wait for one only
        until the client is about to run out of audio (TAIL_IDLE_SECONDS at least), then release that end."""
        if self._tail_held:
            wait = max(TAIL_IDLE_SECONDS, self._play_end - time.perf_counter() - TAIL_MARGIN_SECONDS)
            try:
                return await asyncio.wait_for(self._turns.get(), wait)
            except asyncio.TimeoutError:
                if not self._closed:
                    await self._release_tail()
        return await self._turns.get()

    async def _release_tail(self) -> None:
        """Out with the end of the last turn the codec holds, with silence (_add_silence)."""
        self._tail_held = False
        encoded, seconds = self.encoder.release_tail()
        self._add_silence(seconds)
        await self._emit(self.rechunker.push(encoded) + self.rechunker.flush(), content=self._chunk.text)

    def _add_silence(self, seconds: float) -> None:
        """Silence after the last turn's speech lengthens that turn's audio: the session timeline, the timestamps'
        audio duration and the playback estimate (the text's segment still ends where the speech does)."""
        self._chunk = self._chunk._replace(audio=self._chunk.audio + seconds)
        self.audio_seconds += seconds
        self._played(seconds)

    def _played(self, seconds: float) -> None:
        """`seconds` more audio on its way to the client (its playback estimate: _play_end)."""
        self._play_end = max(self._play_end, time.perf_counter()) + seconds

    async def _stream_turn(self, outbox: Outbox, text: str, timing: _Timing) -> None:
        start_s = self.audio_seconds
        seq, self._turns_streamed = self._turns_streamed, self._turns_streamed + 1
        turn_seconds = 0.0
        async for item in outbox:
            if isinstance(item, AudioChunk):
                if item.stages is not None:
                    for stage, seconds in item.stages.items():
                        self.metrics.ttfa_stage(stage, seconds)
                    self.metrics.ttfa_stage("outbox", time.perf_counter() - item.t_ready)
                self.frames += item.frames
                self.metrics.frames(item.frames)
                self._check_unsent(item.sample_rate)
                encoded = self.encoder.push(item.pcm)
                self._tail_held = False  # this audio pushes the last turn's held end out of the codec
                # Output time: prosody.speed shortens the audio by that factor.
                seconds = item.pcm.size / item.sample_rate / self.spec.speed
                turn_seconds += seconds
                if timing.t_trigger < self._play_end:  # its text came before the audio sent runs out: it plays on
                    self.metrics.lateness(max(0.0, time.perf_counter() - self._play_end))
                self._played(seconds)
                self._chunk = _Chunk(seq, start_s, text, turn_seconds, turn_seconds)
                await self._emit(self.rechunker.push(encoded), content=text, timing=timing)
            elif isinstance(item, TurnEnd):
                if item.reason == FinishReason.ERROR:
                    raise SessionError(item.message or "synthesis failed")
                if item.reason == FinishReason.CONTEXT:
                    # Never end audio silently mid-sentence: a full context is an error the client must see. (A turn
                    # starts from the voice prompt when the conversation leaves too little room, so only one turn's
                    # own text and audio can fill it.)
                    raise SessionError("one turn's text and audio filled the stream's context; send shorter text "
                                       "segments or a lower max_new_tokens")
                # The turn is over and the client waits for the end of its audio: out with what the resampler,
                # stretcher and rechunker still hold (the next turn starts afresh). A short raw last message gets a
                # little silence: Pipecat drops audio events of up to 1024 bytes.
                pieces = self.rechunker.push(self.encoder.drain())
                self.audio_seconds = start_s + turn_seconds
                spoke = turn_seconds > 0 and item.reason != FinishReason.CANCELLED
                pad = self.encoder.last_message_pad(self.rechunker.pending) if spoke and self.pad_last_message else 0
                if pad:  # (spoke: self._chunk is this turn's)
                    pieces += self.rechunker.push(self.encoder.silence(pad))
                    self._add_silence(pad / self.encoder.output_rate)
                await self._emit(pieces + self.rechunker.flush(), content=text, timing=timing)
                if turn_seconds > 0:  # (a turn without audio leaves the last one's held end held)
                    self._tail_held = self.encoder.holds_tail

    def _check_unsent(self, rate: int) -> None:
        """The audio waiting in the turns' outboxes: what the stream generated and the client's socket has not taken
        yet (the sender takes the next chunk only once the last one is sent)."""
        # (an item source that does not count its audio, like a test's generator, counts none)
        unsent = sum(getattr(o, "buffered_samples", 0) for o in self._outboxes) / rate
        if unsent > self.max_unsent_seconds:
            raise SessionError(f"client is not reading audio fast enough: {unsent:.0f} s of audio waiting to be sent, "
                               f"the limit is {self.max_unsent_seconds:g} s")

    async def _emit(self, pieces: list[bytes], content: str, timing: _Timing | None = None) -> None:
        for audio in pieces:
            if not audio:
                continue
            extra: dict[str, object] = {}
            if self.alignment is not None:
                chunk = self._chunk
                extra = self.alignment(segments=[(chunk.text, 0.0, chunk.speech)] if chunk.text else [],
                                       chunk_seq=chunk.seq, chunk_audio_offset_sec=chunk.offset, content=content,
                                       audio_duration=chunk.audio,
                                       elapsed_ms=(time.perf_counter() - self.t_start) * 1000)
            await self.on_audio(audio, extra)
            now = time.perf_counter()
            if timing is not None:
                if not timing.first_sent:
                    timing.first_sent = True
                    self.metrics.ttfa(now - timing.t_trigger)
                else:
                    self.metrics.chunk_gap(now - timing.last_send)
                timing.last_send = now

    async def _finish(self, reason: str, message: str | None = None) -> None:
        if self.done.is_set():
            return
        self._closed = True
        self.done.set()
        try:
            await self.on_finish(reason, message)
        except Exception:  # the client is gone: nothing left to tell it
            pass

