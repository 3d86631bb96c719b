"""The decode thread: one batched step over every generating stream, again and again, with no host barrier.

Loop (top to bottom):
    admit / cancel / release what the inbox holds
    launch step t          (slot ids in through a pinned buffer; graph replay; columns out to a pinned ring buffer)
    collect step t-1       (wait for its copy event, which the GPU passed long ago; hand kept frames to the codec,
                            retire finished turns)
The host therefore reads step t-1 while step t is already queued: the GPU never waits for Python between steps.
A stream that finished at step t-1 rides along in step t frozen (the engine leaves its state untouched).
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rtts.engine.engine import Engine
from rtts.pingpong.device import Device
from rtts.pingpong.faults import FaultCounter, WorkerDied
from rtts.pingpong.slots import SlotAllocator
from rtts.pingpong.state import (
    NO_FRAMES,
    STOP,
    Admit,
    CancelTurn,
    CodecFrames,
    Release,
    StepFrames,
    Stream,
    Turn,
    drain,
)
from rtts.types import FinishReason

log = logging.getLogger("rtts.decode")


@dataclass
class _Running:
    stream: Stream
    turn: Turn
    pos: int  # upper bound of the slot's KV length (exact until the turn's finish is seen)


@dataclass
class _InFlight:
    rows: list[tuple[int, int]]  # (slot, turn id) of each batch row
    cols: torch.Tensor  # pinned host view [n, rows]
    finish: torch.Tensor  # pinned host view [n]
    done: torch.cuda.Event | None
    t_launch: float


@dataclass
class DecodeStats:
    steps: int = 0
    frames: int = 0  # kept frames produced
    rows: int = 0  # sum of batch sizes
    step_log: list[tuple[float, int]] = field(default_factory=list)  # (launch time, batch) of recent steps


class DecodeWorker:
    def __init__(
        self,
        engine: Engine,
        dev: Device,
        slots: SlotAllocator,
        to_codec: queue.Queue[object],
        on_turn_end: Callable[[Stream], None],
    ) -> None:
        self.engine, self.dev, self.slots = engine, dev, slots
        self.cuda_stream = dev.new_cuda_stream()
        self.inbox: queue.Queue[object] = queue.Queue()
        self.to_codec = to_codec
        self.on_turn_end = on_turn_end
        self.running: dict[int, _Running] = {}  # slot -> stream; owned by this thread
        cap, rows = engine.max_slots, engine.rows  # the widest batch: every slot
        pin = dev.cuda
        self._ring = [(torch.empty(cap, rows, dtype=torch.int64, pin_memory=pin),
                       torch.empty(cap, dtype=torch.int8, pin_memory=pin)) for _ in range(2)]
        self._turn = 0
        self.stats = DecodeStats()
        self.on_step: Callable[[int], None] | None = None  # test hook: called with the batch size after a launch
        # Benchmarks set this to a list: (start, end) CUDA events around each step's GPU work, for idle-time math.
        self.profile: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None = None
        self.faults = FaultCounter("decode", log)

    # ------------------------------------------------------------------ loop

    def run(self) -> None:
        with self.dev.on(self.cuda_stream):
            inflight: _InFlight | None = None
            while True:
                try:
                    if not self._drain(block=not self.running and inflight is None):
                        break
                    launched = self._launch() if self.running else None
                    step, inflight = inflight, launched
                    if step is not None:
                        self._collect(step, launched)
                except WorkerDied:
                    raise
                except Exception as e:  # outside any one stream's guard: every running stream was in this step
                    message = self.faults.batch_fault(e, "a decode pass")
                    inflight = None
                    for run in list(self.running.values()):
                        self._fail(run, message)
            for run in list(self.running.values()):
                self._retire(run, FinishReason.ERROR, "server shutting down")

    def _drain(self, block: bool) -> bool:
        for msg in drain(self.inbox, block):
            if msg is STOP:
                return False
            if isinstance(msg, Release):
                try:
                    cur = self.running.get(msg.stream.slot)
                    if cur is not None:
                        self.engine.cancel(msg.stream.slot)
                        self._retire(cur, FinishReason.CANCELLED, advance=False)
                except WorkerDied:
                    raise
                except Exception as e:
                    self.faults.stream_fault(e, f"releasing stream {msg.stream.id}")
                finally:  # the slot comes back whatever happened above (see the prefill thread's Release)
                    self.running.pop(msg.stream.slot, None)
                    self._give_back(msg.stream)
                continue
            assert isinstance(msg, (Admit, CancelTurn))
            try:
                self._on_turn_message(msg)
            except WorkerDied:
                raise
            except Exception as e:  # this turn's alone
                self._fail_turn(msg.stream, msg.turn, self.faults.stream_fault(e, f"stream {msg.stream.id}'s "
                                                                                  f"{type(msg).__name__}"),
                                handed_over=isinstance(msg, Admit))
        return True

    def _give_back(self, stream: Stream) -> None:
        try:
            self.slots.release(stream.slot, self.dev.record())
        except WorkerDied:
            raise
        except Exception as e:  # (the allocator refuses a double release: a bug, logged, and no one else's fault)
            self.faults.stream_fault(e, f"returning stream {stream.id}'s slot")

    def _on_turn_message(self, msg: Admit | CancelTurn) -> None:
        if isinstance(msg, Admit):
            self.dev.wait(msg.ready)
            run = _Running(msg.stream, msg.turn, msg.pos)
            self.running[msg.stream.slot] = run
            if msg.turn.cancelled:  # cancelled (or failed) while its prefill finished: never step it
                self.engine.cancel(msg.stream.slot)
                self._retire(run, *msg.turn.stop_reason)
        else:
            cur = self.running.get(msg.stream.slot)
            if cur is not None and cur.turn is msg.turn:
                self.engine.cancel(msg.stream.slot)  # device write, ordered before the next step
                self._retire(cur, FinishReason.CANCELLED)

    # ------------------------------------------------------------------ faults

    def _fail(self, run: _Running, message: str) -> None:
        """A fault hit this running turn: it leaves the batch (frozen on the device), ends with an error, and its
        stream is marked failed."""
        if self.running.get(run.stream.slot) is not run:
            return  # retired already
        try:
            self.engine.cancel(run.stream.slot)
        except Exception:  # (the same fault may hit this write): the turn ends anyway; its slot is reset on reuse
            log.exception("decode worker: freezing a failed slot")
        self._fail_turn(run.stream, run.turn, message)

    def _fail_turn(self, stream: Stream, turn: Turn, message: str, handed_over: bool = False) -> None:
        """handed_over: the prefill thread had passed the turn on to this one (an Admit), which ends it even if it
        never joined the batch; otherwise only a running turn is this thread's to end."""
        stream.fail(message)
        turn.fail(message)
        run = self.running.get(stream.slot)
        if run is not None and run.turn is turn:
            self._retire(run, FinishReason.ERROR, message)
        elif handed_over and not turn.outbox.closed:  # (an Admit that failed before it ran): end it as _retire would
            self.to_codec.put(CodecFrames(stream, turn, NO_FRAMES, final=True,
                                          reason=FinishReason.ERROR, message=message))
            self.on_turn_end(stream)

    # ------------------------------------------------------------------ one step

    def _launch(self) -> _InFlight:
        slots = sorted(self.running)
        runs = [self.running[s] for s in slots]
        kv_len = max(r.pos for r in runs) + 1
        t = time.perf_counter()
        start = self.dev.record() if self.profile is not None else None
        try:
            cols, finish = self.engine.decode_batch(slots, kv_len)
        except WorkerDied:
            raise
        except Exception as e:  # a failed step fails its turns, not the thread
            message = self.faults.batch_fault(e, f"a decode step of {len(runs)}")
            for r in runs:
                self._fail(r, message)
            return _InFlight([], self._ring[0][0][:0], self._ring[0][1][:0], None, t)
        self.faults.succeeded()
        n = len(slots)
        hc, hf = self._ring[self._turn]
        self._turn ^= 1
        hc[:n].copy_(cols[:n], non_blocking=True)
        hf[:n].copy_(finish[:n], non_blocking=True)
        done = self.dev.record()
        if self.profile is not None and start is not None and done is not None:
            self.profile.append((start, done))
        for r in runs:
            r.pos += 1
        self.stats.steps += 1
        self.stats.rows += n
        if self.on_step is not None:
            self.on_step(n)
        return _InFlight([(s, r.turn.id) for s, r in zip(slots, runs)], hc[:n], hf[:n], done, t)

    def _collect(self, step: _InFlight, launched: _InFlight | None) -> None:
        self.dev.synchronize(step.done)
        # numpy copies: per-row torch indexing cost microseconds of GIL each, 64 rows a step
        cols, finish = step.cols.numpy().copy(), step.finish.numpy().copy()
        event = launched.done if launched is not None else step.done
        kept_rows: list[int] = []
        kept: list[tuple[Stream, Turn]] = []
        for row, (slot, turn_id) in enumerate(step.rows):
            run = self.running.get(slot)
            if run is None or run.turn.id != turn_id:
                continue  # retired or cancelled since the launch: this row was frozen or is stale
            try:
                if self._collect_row(run, int(finish[row]), event):
                    kept_rows.append(row)
                    kept.append((run.stream, run.turn))
            except WorkerDied:
                raise
            except Exception as e:  # this row's stream alone
                self._fail(run, self.faults.stream_fault(e, f"stream {run.stream.id}'s frame"))
        if kept:
            # One message per step: one wake-up of the codec thread, not one per running stream.
            self.to_codec.put(StepFrames(kept, cols[kept_rows, 1:]))
            self.stats.frames += len(kept)

    def _collect_row(self, run: _Running, finish: int, event: torch.cuda.Event | None) -> bool:
        """-> whether the row's frame is kept (it goes to the codec with the step's other kept frames)."""
        if run.turn.cancelled:
            self.engine.cancel(run.stream.slot)
            self._retire(run, *run.turn.stop_reason)
            return False
        run.turn.frames_sampled += 1
        reason = FinishReason(finish)
        if reason == FinishReason.RUNNING:
            return True  # a frame is kept iff another frame follows it (the reference drops the last sampled one)
        self._retire(run, reason, event=event)
        return False

    def _retire(self, run: _Running, reason: FinishReason, message: str = "",
                event: torch.cuda.Event | None = None, advance: bool = True) -> None:
        """The turn ended: leave the batch, flush the codec, let the stream's next turn start."""
        self.running.pop(run.stream.slot, None)
        run.stream.decode_done = event if event is not None else self.dev.record()
        self.to_codec.put(CodecFrames(run.stream, run.turn, NO_FRAMES, final=True,
                                      reason=reason, message=message))
        if advance:
            self.on_turn_end(run.stream)
