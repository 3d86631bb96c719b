"""Slot allocation. A slot is one row of every per-stream structure (slow KV, sampling state, codec state)."""

from __future__ import annotations

import threading
from collections import deque

import torch


class NoSlotError(RuntimeError):
    """Every slot is taken (max_running concurrent streams)."""


class SlotAllocator:
    """Thread-safe free list. A released slot carries the event of the last GPU step that used it: whoever takes it
    next makes its own CUDA stream wait for that event before writing the slot (no host sync)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._free: deque[int] = deque(range(n))
        self._events: dict[int, torch.cuda.Event | None] = {}
        self._closing = 0  # slots of closed streams not yet released (see closing())
        self._lock = threading.Lock()

    def acquire(self) -> tuple[int, torch.cuda.Event | None]:
        with self._lock:
            if not self._free:
                raise NoSlotError(f"all {self.n} streams are busy; try again later")
            slot = self._free.popleft()
            return slot, self._events.pop(slot, None)

    def closing(self) -> None:
        """A stream holding a slot was closed: its slot comes back (release) once the threads are done with it."""
        with self._lock:
            self._closing += 1

    def release(self, slot: int, event: torch.cuda.Event | None) -> None:
        with self._lock:
            assert slot not in self._free, f"slot {slot} released twice"
            assert self._closing > 0, f"slot {slot} released without a close"
            self._events[slot] = event
            self._free.append(slot)
            self._closing -= 1

    @property
    def free(self) -> int:
        with self._lock:
            return len(self._free)

    @property
    def pending(self) -> int:
        """Slots of closed streams on their way back: a caller at capacity can wait for one instead of closing
        another stream."""
        with self._lock:
            return self._closing
