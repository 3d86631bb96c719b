"""Giving freed heap memory back to the OS once the server is idle (glibc's malloc_trim).

Why: under load, the server's native heap (glibc malloc, which torch's CPU tensors, NumPy arrays, the audio encoders
and the sockets' buffers all use, from many threads and so many arenas) grows to the working set of the heaviest
moment and keeps it: memory freed in the middle of an arena stays mapped. Measured on the tiny model on CPU with
aborted HTTP streams (bench/results/soak/README.md): Python's own objects and traced allocations stay flat while RSS
climbs to a plateau that depends on the concurrency (about +0.13 GB at 8 at once, +0.5 GB at 16), and `malloc_trim`
gives nearly all of it back: it is allocator retention, not a leak. Fixing glibc's mmap threshold instead (no heap
growth for large blocks) bounded it too, but cost about 40% of the CPU model's throughput (every large tensor became
an mmap/munmap pair).

So the trimming waits until no turn is generating (nothing streams, so no thread waits on an arena lock the trim
holds) and has been for `IDLE_SECONDS`, then runs once per idle period, at most once per `MIN_INTERVAL`. A long busy
stretch keeps its plateau; the memory comes back when the load drops. Without glibc (musl, macOS) this does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable

log = logging.getLogger("rtts.allocator")

IDLE_SECONDS = 2.0  # no turn generating for this long before the heap is trimmed
MIN_INTERVAL = 30.0  # at most one trim this often (a conversation pauses between its turns)
POLL_SECONDS = 0.5


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim  # type: ignore[no-any-return]


def rss_bytes() -> int:
    """This process's resident set (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class IdleTrimmer:
    """A daemon thread: once `idle()` has held for IDLE_SECONDS after some activity, malloc_trim(0) (once per idle
    period). `trims` and `released` count what it did (tests, logs)."""

    def __init__(self, idle: Callable[[], bool], idle_seconds: float = IDLE_SECONDS,
                 min_interval: float = MIN_INTERVAL, poll_seconds: float = POLL_SECONDS) -> None:
        self.idle, self.idle_seconds, self.poll_seconds = idle, idle_seconds, poll_seconds
        self.min_interval = min_interval
        self.trim = _malloc_trim()
        self.trims = 0
        self.released = 0  # bytes of RSS the trims gave back
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> IdleTrimmer:
        if self.trim is not None:
            self._thread = threading.Thread(target=self._run, name="rtts-trim", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        idle_since: float | None = None
        trimmed = True  # nothing to give back before the first activity
        last = -self.min_interval
        while not self._stop.wait(self.poll_seconds):
            now = time.monotonic()
            if not self.idle():
                idle_since, trimmed = None, False
            elif idle_since is None:
                idle_since = now
            elif not trimmed and now - idle_since >= self.idle_seconds and now - last >= self.min_interval:
                self.trim_now()
                trimmed, last = True, time.monotonic()

    def trim_now(self) -> None:
        assert self.trim is not None
        before, t0 = rss_bytes(), time.perf_counter()
        self.trim(0)
        released = max(0, before - rss_bytes())
        self.trims += 1
        self.released += released
        log.info("idle: returned %.0f MB of freed heap to the OS in %.0f ms", released / 2**20,
                 (time.perf_counter() - t0) * 1000)
