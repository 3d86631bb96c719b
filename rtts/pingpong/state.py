"""Scheduler state shared by the threads, and who writes what.

Data flow for one stream (a session's conversation, owning one engine slot for its whole life):

    open(references) ──▶ prefill queue: voice-prompt job ──▶ prefill thread writes the slot's KV
    speak(text) ──▶ stream.turns ──▶ (when the stream is idle) prefill queue: turn job
        ──▶ prefill thread: turn prompt + frame 0 ──▶ decode inbox: Admit
        ──▶ decode thread: one batched step per frame for every running stream; results read one step late
        ──▶ codec inbox: kept frames ──▶ codec thread: batched streaming decode ──▶ turn.outbox: AudioChunk…, TurnEnd
    cancel() / close() ──▶ both threads' inboxes; the slot returns to the free list once no step in flight uses it.

Each mutable structure has one owner thread; others reach it only through queues, except the few fields of `Stream`
guarded by `Stream.lock` (the turn queue and the busy flag), which the caller's thread and the decode thread share.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rtts.engine.engine import PrefillItem
from rtts.pingpong.outbox import Outbox, TurnEnd
from rtts.types import FinishReason, SamplingParams

_ids = itertools.count(1)


@dataclass
class Turn:
    """One text turn of a stream. Created by `speak`; its outbox is the caller's result stream."""

    text: str
    params: SamplingParams
    outbox: Outbox
    latency: str = "balanced"  # chunking after the first chunk: low / balanced / normal
    fresh: bool = False  # condition only on the voice prompt: the stream's earlier turns are forgotten first
    reset_audio: bool = False  # a new session on a reused stream: its codec state starts from silence
    id: int = field(default_factory=lambda: next(_ids))
    t_submit: float = field(default_factory=time.perf_counter)
    # Stop generating this turn: set by any thread, workers check it between steps. Alone it is the client's cancel
    # (the turn ends CANCELLED); a fault or a server failure sets `error` first (see fail): the turn ends with ERROR.
    cancelled: bool = False
    error: str = ""
    # perf_counter stamps of the way to first audio (rtts_ttfa_stage_seconds), each written by one thread
    t_active: float = 0.0  # the turn became its stream's active one (the turns before it had ended)
    t_prefill: float = 0.0  # the prefill thread took the turn up
    t_frame0: float = 0.0  # frame 0 was on the host
    # written by the decode thread
    frames_sampled: int = 0
    # written by the codec thread
    frames_delivered: int = 0

    def finish(self, reason: FinishReason, message: str = "", frames: int | None = None, codes: Any = None) -> None:
        self.outbox.put(TurnEnd(reason, self.frames_delivered if frames is None else frames, message, codes,
                                self.t_submit))

    def fail(self, message: str) -> None:
        """Stop the turn for a fault: wherever it is, it ends with ERROR and `message`. The message goes first, so a
        thread that sees `cancelled` also sees why; a turn the client cancelled already stays cancelled."""
        if not self.cancelled:
            self.error = message
        self.cancelled = True

    @property
    def stop_reason(self) -> tuple[FinishReason, str]:
        """How a stopped (`cancelled`) turn ends: ERROR with its fault's message, or CANCELLED (the client's)."""
        return (FinishReason.ERROR, self.error) if self.error else (FinishReason.CANCELLED, "")


@dataclass
class Stream:
    """A live conversation bound to one engine slot."""

    slot: int
    id: int = field(default_factory=lambda: next(_ids))
    lock: threading.Lock = field(default_factory=threading.Lock)
    # guarded by lock: turns waiting behind the active one, and whether a turn is active (prefilling or decoding)
    turns: deque[Turn] = field(default_factory=deque)
    busy: bool = False
    issued: list[Turn] = field(default_factory=list)  # turns whose outbox is not closed yet (a failure ends them)
    closed: bool = False
    # written by the prefill thread only
    turn_open: bool = False  # an assistant turn is open in the KV context (the next turn closes it first)
    voice_len: int = 0  # KV length at the end of the voice prompt
    # written by the decode thread, read by the prefill thread after the turn ended: the last decode step that
    # included this slot; the next prefill on the slot waits for it (GPU ordering, no host sync)
    decode_done: torch.cuda.Event | None = None
    # Set when the voice prompt failed or a worker fault hit the stream (its state may be inconsistent): every later
    # turn fails with this message, and a socket opens a new stream for its next session.
    error: str = ""

    def fail(self, message: str) -> None:
        if not self.error:
            self.error = message

    def submit(self, turn: Turn) -> bool:
        """Queue a turn; True if it should start now (the stream was idle)."""
        with self.lock:
            self.issued = [t for t in self.issued if not t.outbox.closed] + [turn]
            if self.busy:
                self.turns.append(turn)
                return False
            self.busy = True
            return True

    def advance(self) -> Turn | None:
        """The active turn ended: the next queued turn to start, or None (the stream goes idle)."""
        with self.lock:
            if self.turns and not self.closed:
                return self.turns.popleft()
            self.busy = False
            return None

    def unfinished(self) -> list[Turn]:
        with self.lock:
            return [t for t in self.issued if not t.outbox.closed]

    def drop_queued(self) -> list[Turn]:
        with self.lock:
            dropped = list(self.turns)
            self.turns.clear()
            return dropped


@dataclass
class PrefillJob:
    """Prompt work for one stream: the voice prompt (turn is None) or a text turn (samples frame 0 at the end)."""

    stream: Stream
    turn: Turn | None
    columns: torch.Tensor | None = None  # [rows, T]; built by the prefill thread for turns
    done: int = 0  # positions already prefilled
    voice_first: bool = False  # open job: reset the slot before the first chunk

    def next_item(self, chunk: int) -> PrefillItem:
        assert self.columns is not None
        end = min(self.done + chunk, self.columns.shape[1])
        last = end == self.columns.shape[1]
        return PrefillItem(self.stream.slot, self.columns[:, self.done:end], sample=last and self.turn is not None)


@dataclass
class Admit:
    """Prefill → decode: a turn whose frame 0 is sampled; the stream joins the running batch."""

    stream: Stream
    turn: Turn
    frame0: torch.Tensor  # [rows] int64 on the CPU
    pos: int  # KV length after the prefill (frame 0 not yet fed)
    ready: torch.cuda.Event | None  # the prefill's writes; the decode CUDA stream waits for it before the next step


@dataclass
class CancelTurn:
    stream: Stream
    turn: Turn


@dataclass
class Release:
    """Close: free the stream's slot once no step in flight uses it."""

    stream: Stream


NO_FRAMES = np.zeros((0, 0), dtype=np.int64)


@dataclass
class CodecFrames:
    """→ codec: frames of one turn (frame 0 from the prefill thread), or its end (final=True, usually no frames)."""

    stream: Stream
    turn: Turn
    codes: np.ndarray  # [n, num_codebooks] int64 (may be empty when final)
    final: bool = False
    reason: FinishReason = FinishReason.RUNNING
    message: str = ""
    t_sent: float = field(default_factory=time.perf_counter)


@dataclass
class StepFrames:
    """Decode → codec: the kept frames of one decode step, one row per turn that kept a frame (one message per step:
    the codec thread wakes once, not once per running stream)."""

    rows: list[tuple[Stream, Turn]]
    codes: np.ndarray  # [len(rows), num_codebooks] int64
    t_sent: float = field(default_factory=time.perf_counter)


@dataclass
class CodecReset:
    """A new stream took this slot: zero its codec streaming state."""

    slot: int


STOP = object()  # sentinel for every worker inbox


def drain(inbox: queue.Queue[object], block: bool) -> Iterator[object]:
    """The messages waiting in `inbox` now (waiting for a first one if `block`), oldest first."""
    while True:
        try:
            msg = inbox.get(block=block)
        except queue.Empty:
            return
        block = False
        yield msg
