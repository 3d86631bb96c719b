"""The scheduler: three worker threads (prefill, decode, codec) around one engine, and the handles sessions use."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rtts import env
from rtts.engine.engine import Engine
from rtts.model.codec import Codec
from rtts.model.errors import PromptError
from rtts.model.prompt import PromptBuilder, Reference
from rtts.pingpong.codec_stage import CHUNK_FRAMES, CodecWorker
from rtts.pingpong.decode import DecodeWorker
from rtts.pingpong.device import Device
from rtts.pingpong.faults import WorkerFailed, describe
from rtts.pingpong.outbox import Outbox
from rtts.pingpong.prefill import PrefillWorker
from rtts.pingpong.slots import SlotAllocator
from rtts.pingpong.state import NO_FRAMES, STOP, CancelTurn, CodecFrames, PrefillJob, Release, Stream, Turn
from rtts.types import FinishReason, SamplingParams

log = logging.getLogger("rtts.scheduler")


@dataclass(frozen=True)
class SchedulerConfig:
    prefill_chunk: int = 512  # positions per prefill chunk (a decode step waits behind at most one chunk)
    prefill_token_budget: int = 2048  # padded positions per prefill batch
    max_queued_turns: int = 16  # per stream, beyond the active one
    first_chunk_frames: int = 1
    max_buffer_seconds: float = 120.0  # audio a turn may hold unread before it is ended
    # The decode step and turns' frame 0 from CUDA graphs (Engine.capture_graphs), on a CUDA device.
    cuda_graphs: bool = True
    # The codec thread's decode from CUDA graphs too (CodecWorker.capture_graphs): with cuda_graphs, on CUDA.
    codec_graphs: bool = True
    # Turn-sized prompt chunks' forward from CUDA graphs (Engine.capture_graphs(prefill=...)): with cuda_graphs.
    prefill_graphs: bool = True
    # A float32 codec on CUDA convolves with TF32 tensor cores (codec_stage.CodecWorker); False: true float32.
    codec_tf32: bool = True
    # The prefill and codec threads' CUDA streams at high priority (Device.new_cuda_stream); RTTS_PRIORITY_STREAMS=1.
    priority_streams: bool = field(default_factory=env.priority_streams)


class Scheduler:
    """Owns the worker threads. `open()` is the only entry point; everything else goes through handles."""

    def __init__(self, engine: Engine, codec: Codec, config: SchedulerConfig = SchedulerConfig()) -> None:
        self.engine, self.codec, self.config = engine, codec, config
        self.dev = Device(engine.device, config.priority_streams)
        cfg = engine.config
        self.builder = PromptBuilder(engine.tokenizer, cfg.num_codebooks, cfg.format, cfg.codebook_size)
        self.slots = SlotAllocator(engine.max_slots)
        self.codec_worker = CodecWorker(codec, self.dev, engine.max_slots + 1, config.first_chunk_frames,
                                        config.max_buffer_seconds, config.codec_tf32)
        self.decode = DecodeWorker(engine, self.dev, self.slots, self.codec_worker.inbox, self._turn_ended)
        self.prefill = PrefillWorker(engine, self.dev, self.decode.inbox, self.codec_worker.inbox,
                                     self._turn_ended, config.prefill_chunk, config.prefill_token_budget)
        self._threads: list[threading.Thread] = []
        self.streams: dict[int, Stream] = {}  # id -> open stream (for metrics and shutdown)
        self._lock = threading.Lock()
        # Why the scheduler can no longer synthesize (a worker thread died), and who is told (the runtime).
        self.failure: str | None = None
        self.on_failure: Callable[[str], None] | None = None
        self._stopping = False

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Scheduler:
        """Capture CUDA graphs (after warm-up), then start the threads."""
        cfg = self.config
        if cfg.cuda_graphs and self.dev.cuda:
            self.engine.capture_graphs(prefill=cfg.prefill_graphs, prefill_token_budget=cfg.prefill_token_budget)
            if cfg.codec_graphs:
                self.codec_worker.capture_graphs()
        else:
            self.engine.release_graphs()
        self._stopping = False
        for name, target in (("rtts-prefill", self.prefill.run), ("rtts-decode", self.decode.run),
                             ("rtts-codec", self.codec_worker.run)):
            t = threading.Thread(target=self._guarded, args=(name, target), name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def _guarded(self, name: str, target: Callable[[], None]) -> None:
        """A worker thread's body: a worker contains faults to their streams (faults.py); if one ends anyway, the
        scheduler has failed."""
        try:
            target()
        except BaseException as e:
            if self._stopping:  # the scheduler is going down anyway: nothing is left to fail
                log.exception("worker thread %s failed while stopping", name)
                return
            log.critical("worker thread %s died", name, exc_info=e)
            self._fail(f"the {name} thread died: {describe(e)}")
            return
        if not self._stopping:
            self._fail(f"the {name} thread ended")

    def _fail(self, reason: str) -> None:
        """No more synthesis: on_failure is told (once, before any client hears of it), new streams are refused,
        and every open turn ends with an error now (nobody waits for audio that cannot come)."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
            streams = list(self.streams.values())
        if self.on_failure is not None:
            try:
                self.on_failure(reason)
            except Exception:
                log.exception("scheduler failure callback failed")
        message = f"server failed ({reason}); retry on a restarted server"
        for stream in streams:
            for turn in stream.unfinished():
                turn.fail(message)  # a worker that sees the turn stopped ends it with this error too
                turn.finish(FinishReason.ERROR, message)

    def stop(self, timeout: float = 10.0) -> None:
        """Finish every open turn with an error, stop and join the threads."""
        self._stopping = True
        for s in list(self.streams.values()):
            for turn in s.drop_queued():
                turn.finish(FinishReason.ERROR, "server shutting down")
        # Prefill and decode first: their last messages (turn ends) must still reach the codec thread.
        self.prefill.inbox.put(STOP)
        self.decode.inbox.put(STOP)
        for t in self._threads[:2]:
            t.join(timeout)
        self.codec_worker.inbox.put(STOP)
        for t in self._threads[2:]:
            t.join(timeout)
        self._threads.clear()

    def __enter__(self) -> Scheduler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ sessions

    def open(self, references: Sequence[Reference] = ()) -> StreamHandle:
        """Take a slot and start prefilling the voice prompt at once. Raises NoSlotError / PromptError, and
        WorkerFailed once the scheduler failed."""
        if self.failure is not None:
            raise WorkerFailed(self.failure)
        columns = self.builder.system(references)
        if columns.shape[1] + 2 > self.engine.max_ctx:
            raise PromptError(f"voice prompt of {columns.shape[1]} positions does not fit the "
                              f"{self.engine.max_ctx}-position context")
        slot, released = self.slots.acquire()
        stream = Stream(slot)
        stream.decode_done = released
        with self._lock:
            self.streams[stream.id] = stream
        self.prefill.inbox.put(PrefillJob(stream, None, columns, voice_first=True))
        return StreamHandle(self, stream)

    def _turn_ended(self, stream: Stream) -> None:
        """Called by a worker when a stream's active turn is over: start its next queued turn, if any."""
        nxt = stream.advance()
        if nxt is not None:
            nxt.t_active = time.perf_counter()
            self.prefill.inbox.put(PrefillJob(stream, nxt))

    def _close(self, stream: Stream) -> None:
        with stream.lock:
            if stream.closed:
                return
            stream.closed = True
        with self._lock:
            self.streams.pop(stream.id, None)
        self.slots.closing()
        # Through the prefill thread first: it drops the stream's prompt work, then the decode thread frees the slot.
        self.prefill.inbox.put(Release(stream))

    @property
    def generating(self) -> bool:
        """Whether any turn is being prefilled, decoded or decoded to audio (read across threads: a hint)."""
        return bool(self.prefill.pending or self.decode.running or self.codec_worker.pending)

    @property
    def active_streams(self) -> int:
        with self._lock:
            return len(self.streams)

    @property
    def releasing(self) -> int:
        """Slots of closed streams not yet free again (the decode thread frees one once no step in flight uses it)."""
        return self.slots.pending


class StreamHandle:
    """A session's grip on its stream. Thread-safe; `speak` may be awaited from asyncio or iterated from a thread.

    Usage::

        handle = scheduler.open(references)             # the voice prompt starts prefilling now
        async for item in handle.speak("Hello.", SamplingParams(top_k=1)):
            ...                                         # AudioChunk items, then one TurnEnd
        handle.cancel()                                 # ends the active turn (and drops queued ones) within a step
        handle.close()                                  # frees the slot once no GPU step uses it
    """

    def __init__(self, scheduler: Scheduler, stream: Stream) -> None:
        self._s = scheduler
        self.stream = stream
        self._active: Turn | None = None
        self._turns: list[Turn] = []

    @property
    def slot(self) -> int:
        return self.stream.slot

    def speak(self, text: str, params: SamplingParams | None = None, latency: str = "balanced",
              loop: asyncio.AbstractEventLoop | None = None, fresh: bool = False,
              reset_audio: bool = False) -> Outbox:
        """Queue one text turn; returns its outbox (AudioChunk…, then TurnEnd). Turns of a stream run in order, each
        conditioned on the ones before, unless fresh=True (then only on the voice prompt). reset_audio=True starts
        the stream's audio afresh (a new session reusing the stream), as if it had just been opened."""
        params = params or SamplingParams()
        params.validate()
        if latency not in CHUNK_FRAMES:
            raise ValueError(f"latency must be one of {sorted(CHUNK_FRAMES)}, got {latency!r}")
        if not text.strip():
            raise PromptError("text is empty")
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
        turn = Turn(text, params, Outbox(loop), latency=latency, fresh=fresh, reset_audio=reset_audio)
        if self.stream.closed:
            turn.finish(FinishReason.ERROR, "stream is closed")
            return turn.outbox
        if self._s.failure is not None:
            turn.finish(FinishReason.ERROR, f"server failed ({self._s.failure})")
            return turn.outbox
        if len(self.stream.turns) >= self._s.config.max_queued_turns:
            turn.finish(FinishReason.ERROR, f"too many queued turns (limit {self._s.config.max_queued_turns})")
            return turn.outbox
        self._turns = [t for t in self._turns if not t.outbox.closed] + [turn]
        if self.stream.submit(turn):
            turn.t_active = time.perf_counter()
            self._s.prefill.inbox.put(PrefillJob(self.stream, turn))
        return turn.outbox

    def cancel(self) -> None:
        """End every unfinished turn of this stream: queued ones at once, the active one within one step."""
        for turn in self.stream.drop_queued():
            turn.cancelled = True
            turn.finish(FinishReason.CANCELLED)
        for turn in self._turns:
            if not turn.outbox.closed:
                turn.cancelled = True
                self._s.decode.inbox.put(CancelTurn(self.stream, turn))
                # The codec ends the turn's outbox now, dropping audio not yet decoded.
                self._s.codec_worker.inbox.put(CodecFrames(self.stream, turn, NO_FRAMES,
                                                           final=True, reason=FinishReason.CANCELLED))

    def close(self) -> None:
        """Cancel everything and give the slot back (once no in-flight step uses it)."""
        for turn in self._turns:
            turn.cancelled = True
        for turn in self.stream.drop_queued():
            turn.finish(FinishReason.CANCELLED)
        self._s._close(self.stream)

    def __enter__(self) -> StreamHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


