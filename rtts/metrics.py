"""Prometheus metrics for `/metrics`: load gauges read live from the scheduler, latency histograms from sessions."""

from __future__ import annotations

import gc
import time
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from rtts.session import SessionMetrics

if TYPE_CHECKING:
    from rtts.runtime import Runtime

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)
# 0 first: the le="0.0" bucket counts the chunks that came in time, the rest how late the others were.
_LATENESS_BUCKETS = (0.0, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_GC_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class _LiveCounter(Collector):
    """A counter whose value another thread owns (read at scrape time, like the gauges' set_function): exported with
    the counter type and `_total` name, so rate() works on it."""

    def __init__(self, name: str, doc: str, read: Any) -> None:
        self.name, self.doc, self.read = name, doc, read

    def collect(self) -> Any:
        yield CounterMetricFamily(self.name, self.doc, value=float(self.read()))


class Metrics:
    def __init__(self, rt: Runtime) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        sch = rt.scheduler
        self.sessions = Gauge("rtts_active_sessions", "Live sessions (started, not finished)", registry=r)
        self.connections = Gauge("rtts_open_connections", "Open WebSocket connections", registry=r)
        g = Gauge("rtts_queued_prefill_jobs", "Prompt work waiting in or held by the prefill thread", registry=r)
        # Reading the length of a worker-owned list/queue from another thread is a benign racy snapshot.
        g.set_function(lambda: sch.prefill.inbox.qsize() + len(sch.prefill.pending))
        g = Gauge("rtts_running_streams", "Streams in the decode batch", registry=r)
        g.set_function(lambda: len(sch.decode.running))
        g = Gauge("rtts_open_streams", "Scheduler streams holding a slot", registry=r)
        g.set_function(lambda: sch.active_streams)
        g = Gauge("rtts_free_slots", "Slots free for new streams", registry=r)
        g.set_function(lambda: sch.slots.free)
        g = Gauge("rtts_slots", "Slots in all: streams this worker runs at once (--max-running)", registry=r)
        g.set_function(lambda: rt.config.max_running)
        g = Gauge("rtts_active_http_requests", "HTTP requests in progress (POST /v1/tts: until its audio is sent), "
                  "health and metrics aside", registry=r)
        g.set_function(lambda: rt.http_requests)
        g = Gauge("rtts_draining", "1 while the worker drains (SIGTERM: no new sessions, open ones finish)",
                  registry=r)
        g.set_function(lambda: float(rt.draining))
        self.refused = Counter("rtts_refused_sessions", "New sessions and requests refused, by reason (capacity: no "
                               "free slot; draining: the worker is shutting down)", ["reason"], registry=r)
        for reason in ("capacity", "draining"):
            self.refused.labels(reason)  # exported at 0 from the start, so rate() sees the first refusal
        self.ttfa = Histogram("rtts_ttfa_seconds", "Text trigger (flush/stop/segment) to first audio message sent",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.ttfa_stage = Histogram(
            "rtts_ttfa_stage_seconds", "A turn's way to first audio by scheduler stage, from when it became its "
            "stream's active turn: queue (waiting for the prefill thread), prefill (its prompt and frame 0), frames "
            "(decode steps of the rest of the first chunk), codec_wait (waiting for the codec thread), codec (the "
            "chunk's decode), outbox (waiting for the session)",
            ["stage"], buckets=_LATENCY_BUCKETS, registry=r)
        self.chunk_gap = Histogram("rtts_chunk_gap_seconds", "Time between consecutive audio messages of a turn",
                                   buckets=_LATENCY_BUCKETS, registry=r)
        self.lateness = Histogram(
            "rtts_chunk_lateness_seconds", "Audio chunks a playing client waits for: how long after its estimated "
            "playback ran out each came (0: in time)", buckets=_LATENESS_BUCKETS, registry=r)
        self.underruns = Counter("rtts_underruns", "Audio chunks that came after a playing client's estimated "
                                 "playback had run out (lateness over 0)", registry=r)
        self.frames = Counter("rtts_frames_generated", "Codec frames of audio generated (46.4 ms each)", registry=r)
        r.register(_LiveCounter("rtts_decode_steps", "Decode steps run since start", lambda: sch.decode.stats.steps))
        self.errors = Counter("rtts_session_errors", "Sessions that ended with finish/error", registry=r)
        # A collection holds the GIL: every serving thread and the event loop wait for it (see rtts.startup).
        self.gc_pause = Histogram("rtts_gc_pause_seconds", "Garbage-collector passes, by generation (2: full)",
                                  ["generation"], buckets=_GC_BUCKETS, registry=r)
        self._gc_t0 = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        # Runs on whichever thread triggered the collection, with the GIL held: start and stop pair up.
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.gc_pause.labels(str(info.get("generation", "?"))).observe(time.perf_counter() - self._gc_t0)

    def close(self) -> None:
        """Stop timing collections (the callback list is process-wide)."""
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def session(self) -> SessionMetrics:
        """The callbacks a session reports its latencies and frames through."""
        return SessionMetrics(self.ttfa.observe, self.chunk_gap.observe, self.frames.inc, self._late,
                              lambda stage, seconds: self.ttfa_stage.labels(stage).observe(seconds))

    def _late(self, seconds: float) -> None:
        self.lateness.observe(seconds)
        if seconds > 0:
            self.underruns.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
