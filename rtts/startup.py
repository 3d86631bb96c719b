"""Process-wide settings a long-running server applies once it has started (the server and the scheduler bench)."""

from __future__ import annotations

import gc
import logging
import sys
import time

from rtts import env

log = logging.getLogger("rtts.server")


def freeze_startup_objects() -> float:
    """Collect, then move every object alive now (modules, the model, tokenizers, captured graphs) into the collector's
    permanent generation, and return the milliseconds the collection took. Python's full collections walk every tracked
    object while holding the GIL, stopping the decode, prefill and codec threads and the event loop at once. A server
    process holds hundreds of thousands of tracked objects after startup, so one full pass is a pause every stream
    hears (bench/probes/gc_pause.py measures it; latency_reports/README.md records the pauses seen). Frozen, they are
    never walked again; what serving allocates is collected as before, and refcounting frees frozen objects as usual."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    ms = 1e3 * (time.perf_counter() - t0)
    log.info("garbage collector: startup objects frozen (the collection before took %.0f ms)", ms)
    return ms


def set_switch_interval(seconds: float | None = None) -> float:
    """Set the GIL switch interval (RTTS_SWITCH_INTERVAL when `seconds` is None; unset: left as it is) and return the
    one in force. The serving threads hand the GIL to each other around every CUDA call; a thread that wants it back
    waits until the holder's interval runs out."""
    seconds = env.switch_interval() if seconds is None else seconds
    if seconds is not None:
        sys.setswitchinterval(seconds)
        log.info("GIL switch interval %.2f ms", 1e3 * seconds)
    return sys.getswitchinterval()
