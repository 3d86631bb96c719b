"""Outbox: worker threads put results, one consumer (asyncio or a plain thread) takes them.

Workers never touch the event loop directly: `put` appends under a lock and wakes an asyncio waiter through
`loop.call_soon_threadsafe`, or a blocking reader through a condition variable.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import numpy as np

from rtts.types import FinishReason


@dataclass
class AudioChunk:
    """PCM of one or more codec frames of a turn."""

    pcm: np.ndarray  # [samples] float32 in [-1, 1] at `sample_rate`
    sample_rate: int
    frames: int  # codec frames in this chunk
    first_frame: int  # index of its first frame within the turn
    t_submit: float  # perf_counter when the turn was submitted (speak)
    t_ready: float = field(default_factory=time.perf_counter)  # when the PCM was ready
    # A turn's first chunk: seconds its way to first audio spent in each scheduler stage (codec_stage._stages)
    stages: dict[str, float] | None = None


@dataclass
class TurnEnd:
    """The last item of a turn's outbox."""

    reason: FinishReason
    frames: int  # frames of audio delivered for the turn
    message: str = ""
    codes: np.ndarray | None = None  # [num_codebooks, frames] the kept codes of the turn, int64
    t_submit: float = 0.0
    t_end: float = field(default_factory=time.perf_counter)

    @property
    def ok(self) -> bool:
        return self.reason in (FinishReason.STOP, FinishReason.LENGTH)


Item = AudioChunk | TurnEnd


class Outbox:
    """Items of one turn, in order; closed by a TurnEnd. Thread-safe producer side, single consumer."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._items: deque[Item] = deque()
        self._lock = threading.Condition()
        self._loop = loop
        self._event: asyncio.Event | None = None
        self.closed = False  # a TurnEnd was put
        self.buffered_samples = 0  # audio put but not yet taken (for back-pressure)

    def put(self, item: Item) -> None:
        with self._lock:
            if self.closed:
                return  # a cancelled turn may still see late items from a worker: drop them
            self._items.append(item)
            if isinstance(item, AudioChunk):
                self.buffered_samples += item.pcm.size
            else:
                self.closed = True
            self._lock.notify_all()
            loop, event = self._loop, self._event
        if loop is not None and event is not None:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    def _pop(self) -> Item | None:
        with self._lock:
            if not self._items:
                return None
            item = self._items.popleft()
            if isinstance(item, AudioChunk):
                self.buffered_samples -= item.pcm.size
            return item

    # ---------------------------------------------------------------- consumers

    def poll(self) -> Item | None:
        """The next item if one is there, else None (never blocks)."""
        return self._pop()

    def get(self, timeout: float | None = None) -> Item:
        """Blocking get (for threads and tests)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while not self._items:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError("no item from the scheduler in time")
                self._lock.wait(remaining)
        item = self._pop()
        assert item is not None
        return item

    def __iter__(self) -> Iterator[Item]:
        while True:
            item = self.get()
            yield item
            if isinstance(item, TurnEnd):
                return

    async def aget(self) -> Item:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                if self._event is None:
                    self._event = asyncio.Event()
                self._event.clear()
            item = self._pop()
            if item is not None:
                return item
            await self._event.wait()

    async def __aiter__(self) -> AsyncIterator[Item]:
        while True:
            item = await self.aget()
            yield item
            if isinstance(item, TurnEnd):
                return
