"""Decode-step runner: pads a batch to a bucket and replays that bucket's CUDA graph (eager on CPU).

Graphs are captured once at startup, after warm-up, for every (batch bucket, KV-length bucket) pair, all in one
memory pool (they never run at the same time: one decode thread replays them in order). Everything that changes per
step lives in device buffers the graph reads: the slot ids (copied in through a pinned host buffer, non-blocking) and
the per-slot state inside the engine. Padded rows point at the engine's scratch slot, which is permanently frozen, so
they are harmless.

KV-length buckets exist because the torch reference attention reads a fixed number of cache positions per graph;
a kernel that reads each slot's length from device memory needs one bucket (the full context).

The prefill thread has graphs of its own (FrameZeroRunner: a turn's frame 0; PrefillRunner: turn-sized prompt
chunks), replayed one at a time on its stream, concurrently with the decode thread's: their own memory pools and
their own FP8 split-tile scratch (kernels.graph_scratch(PREFILL_FAMILY)).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from rtts import kernels
from rtts.engine.engine import Engine
from rtts.model.quant import FP8FeedForward, FP8Linear


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_batch (mini-sglang's choice), always including max_batch."""
    out = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return sorted(set(out + [max_batch]))


def bucket_for(buckets: Sequence[int], n: int) -> int:
    """The smallest of the ascending `buckets` holding n; ValueError if none does."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def kv_buckets(max_len: int, smallest: int = 256) -> list[int]:
    out, b = [], smallest
    while b < max_len:
        out.append(b)
        b *= 2
    return out + [max_len]


PREFILL_FAMILY = "prefill"  # graph family of the prefill thread's graphs (kernels.graph_scratch)
PREFILL_LENGTHS = (16, 32, 64, 128, 256, 512)  # prompt-chunk lengths PrefillRunner captures (512: the default chunk)

K = TypeVar("K")
T = TypeVar("T")


def capture_graphs(device: torch.device, keys: Iterable[K],
                   body: Callable[[K], T]) -> dict[K, tuple[torch.cuda.CUDAGraph, T]]:
    """For each key in order: run body(key) twice (lazy inits and autotuning happen outside the capture), then
    capture it. All graphs share one new memory pool (give the largest first, so it is sized once) and are captured
    on a side stream; returns each key's graph and the outputs its replays rewrite."""
    out: dict[K, tuple[torch.cuda.CUDAGraph, T]] = {}
    pool = torch.cuda.graph_pool_handle()
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for key in keys:
            for _ in range(2):
                body(key)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, stream=side, capture_error_mode="thread_local"):
                out[key] = (g, body(key))
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # the warm-ups' blocks, cached for the side stream, would sit unused otherwise
    return out


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    cols: torch.Tensor  # [bucket, rows] output buffer written by each replay
    finish: torch.Tensor  # [bucket] int8


class DecodeRunner:
    def __init__(self, engine: Engine, use_graphs: bool | None = None, kv_bucketed: bool | None = None) -> None:
        self.engine = engine
        self.device = engine.device
        self.use_graphs = (engine.device.type == "cuda") if use_graphs is None else use_graphs
        self.buckets = batch_buckets(engine.max_slots)
        full = engine.max_ctx + 1
        if kv_bucketed is None:
            kv_bucketed = not engine.attention_kernel
        self.kv_buckets = kv_buckets(full) if kv_bucketed else [full]
        cap = self.buckets[-1]
        self.slots_dev = torch.full((cap,), engine.scratch_slot, dtype=torch.int64, device=self.device)
        pin = self.device.type == "cuda"
        # Two pinned staging buffers: the one written for step t is not reused before step t-1 completed.
        self._staging = [torch.empty(cap, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._turn = 0
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.capture_seconds = 0.0

    def bucket_for(self, n: int) -> int:
        if n > self.buckets[-1]:
            raise ValueError(f"batch of {n} exceeds max_running {self.buckets[-1]}")
        return bucket_for(self.buckets, n)

    def kv_bucket_for(self, kv_len: int) -> int:
        return bucket_for(self.kv_buckets, min(kv_len, self.kv_buckets[-1]))

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every bucket pair (largest first, so the shared pool is sized once)."""
        if not self.use_graphs:
            return
        t0 = time.perf_counter()
        keys = [(b, kv) for kv in reversed(self.kv_buckets) for b in reversed(self.buckets)]
        graphs = capture_graphs(self.device, keys, lambda k: self.engine.decode_step(self.slots_dev[:k[0]], k[1]))
        self.graphs = {k: _Graph(g, cols, finish) for k, (g, (cols, finish)) in graphs.items()}
        self.capture_seconds = time.perf_counter() - t0

    def step(self, slots: list[int], kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Launch one decode step for `slots` on the current stream -> (cols [>= n, rows], finish [>= n]) on the
        device; rows past len(slots) are padding. Nothing here waits for the GPU."""
        n = len(slots)
        eng = self.engine
        if not self.use_graphs:
            idx = torch.tensor(slots, dtype=torch.int64, device=self.device)
            return eng.decode_step(idx, min(kv_len, eng.max_ctx + 1))
        b, kv = self.bucket_for(n), self.kv_bucket_for(kv_len)
        stage = self._staging[self._turn]
        self._turn ^= 1
        stage[:n] = torch.tensor(slots, dtype=torch.int64)
        stage[n:b] = eng.scratch_slot
        self.slots_dev[:b].copy_(stage[:b], non_blocking=True)
        g = self.graphs[(b, kv)]
        g.graph.replay()
        return g.cols, g.finish


class FrameZeroRunner:
    """A turn's frame 0 (sampled by the prefill thread from the prompt's last hidden state: slow head, ten fast
    transformer passes, eleven draws, the commit) replayed from CUDA graphs, one per bucket of sampled rows up to
    the engine's prefill_rows. Eager it is hundreds of small launches, tens of milliseconds of host time on every
    turn's time to first audio (bench/probes/turn_latency.py). Padded rows point at the scratch slot and are
    inactive: they sample, and commit nothing. Its own memory pool: the prefill thread replays these while the
    decode thread replays its graphs."""

    def __init__(self, engine: Engine, use_graphs: bool | None = None) -> None:
        self.engine = engine
        self.use_graphs = (engine.device.type == "cuda") if use_graphs is None else use_graphs
        cap = min(engine.prefill_rows, engine.max_slots)  # sampled rows: one turn per stream, at most one per slot
        self.buckets = batch_buckets(cap)
        dev = engine.device
        self.hidden = torch.zeros(cap, engine.config.dim, dtype=engine.dtype, device=dev)
        self.slots = torch.full((cap,), engine.scratch_slot, dtype=torch.int64, device=dev)
        self.active = torch.zeros(cap, dtype=torch.bool, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every bucket (all rows inactive), then hand the replays to the engine."""
        if not self.use_graphs:
            return
        t0 = time.perf_counter()
        eng = self.engine
        # Its own split-tile scratch: these replay on the prefill thread while the decode graphs replay.
        with kernels.graph_scratch(PREFILL_FAMILY):
            kernels.reserve_graph_scratch(eng.device)
            self.graphs = capture_graphs(eng.device, reversed(self.buckets),
                                         lambda b: eng.frame_zero(self.hidden[:b], self.slots[:b], self.active[:b]))
        eng.frame_zero_graphs = self
        self.capture_seconds = time.perf_counter() - t0

    def __call__(self, hidden: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Frame 0 of len(slots) turns on the current stream -> columns [n, rows] (a copy: the graph's output
        buffer is reused by the next replay)."""
        n = hidden.shape[0]
        b = bucket_for(self.buckets, n)
        self.hidden[:n].copy_(hidden)
        self.slots[:n].copy_(slots)
        self.slots[n:b].fill_(self.engine.scratch_slot)
        self.active[:n].fill_(True)
        self.active[n:b].fill_(False)
        g, col = self.graphs[b]
        g.replay()
        return col[:n].clone()


class PrefillRunner:
    """A prompt chunk's forward (embedding, slow stack, K/V written) replayed from CUDA graphs: one per (items
    bucket, chunk length of PREFILL_LENGTHS, attention span) whose padded positions fit `max_positions` (the prefill
    thread's token budget). Eager, a 40-position forward is ~25-40 ms of host time on the H200 against ~5-8 ms of
    kernels (bench/results/traces/README.md), on a turn's time to first audio (and a voice prompt's, when the text
    follows the start at once). Padding follows Engine.prefill_batch: padded positions sit at the spare position
    max_ctx of their row's slot, padded items on the scratch slot; keys past a query's position are masked, so a span
    longer than the rows' histories changes nothing but the work (each layer gathers span positions per item: two
    spans, 1024 and the whole cache, keep that bounded). Shapes without a graph run eager, and so do FP8 models'
    chunks whose padding would cross kernels.FP8_DENSE_ROWS (the dense path: other numbers, more weight traffic).
    On a GPU unless SchedulerConfig.prefill_graphs is off."""

    def __init__(self, engine: Engine, use_graphs: bool | None = None,
                 lengths: tuple[int, ...] = PREFILL_LENGTHS, max_positions: int = 2048) -> None:
        self.engine = engine
        self.use_graphs = (engine.device.type == "cuda") if use_graphs is None else use_graphs
        # Items: one chunk per stream, so never more than the slots (as FrameZeroRunner).
        self.buckets = batch_buckets(min(engine.prefill_rows, engine.max_slots))
        self.lengths = tuple(sorted(x for x in lengths if x <= engine.max_ctx))
        full = engine.max_ctx + 1
        self.spans = [1024, full] if full > 1024 else [full]
        self.keys = [(b, s, kv) for s in self.lengths for b in self.buckets if b * s <= max(max_positions, s)
                     for kv in self.spans if kv >= s]
        self.fp8 = any(isinstance(m, (FP8Linear, FP8FeedForward)) for m in engine.model.modules())
        self.graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0
        self.replays = 0

    def bucket(self, batch: int, length: int, kv_len: int) -> tuple[int, int, int] | None:
        """The captured (items, length, span) a chunk of `batch` items x `length` positions attending over kv_len
        positions replays (Engine.pack_prefill pads it to that shape), or None: run it eager. The engine asks only
        once capture() has handed it the runner."""
        if batch > self.buckets[-1] or length > self.lengths[-1] or kv_len > self.spans[-1]:
            return None
        b = bucket_for(self.buckets, batch)
        s = bucket_for(self.lengths, length)
        kv = bucket_for(self.spans, max(kv_len, s))
        if self.fp8 and batch * length <= kernels.FP8_DENSE_ROWS < b * s:
            return None
        key = (b, s, kv)
        return key if key in self.keys else None

    def capture(self) -> None:
        """Warm up and capture every key on the scratch slot, then hand the replays to the engine."""
        if not self.use_graphs or not self.keys:
            return
        t0 = time.perf_counter()
        eng, dev, top = self.engine, self.engine.device, self.buckets[-1]
        # Static inputs (normal tensors: callers may copy into them outside inference mode), one set per length so
        # every graph reads a contiguous prefix of its own.
        self.cols = {s: torch.zeros(top, eng.rows, s, dtype=torch.int64, device=dev) for s in self.lengths}
        self.positions = {s: torch.full((top, s), eng.max_ctx, dtype=torch.int64, device=dev) for s in self.lengths}
        self.slots = torch.full((top,), eng.scratch_slot, dtype=torch.int64, device=dev)

        def body(key: tuple[int, int, int]) -> torch.Tensor:
            b, s, kv = key
            return eng.prefill_forward(self.cols[s][:b], self.positions[s][:b], self.slots[:b], kv)

        keys = sorted(self.keys, key=lambda k: (-k[0] * k[1], -k[2]))  # largest first: the shared pool is sized once
        with torch.inference_mode(), kernels.graph_scratch(PREFILL_FAMILY):
            kernels.reserve_graph_scratch(dev)
            self.graphs = capture_graphs(dev, keys, body)
        eng.prefill_graphs = self
        self.capture_seconds = time.perf_counter() - t0

    def __call__(self, cols: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 key: tuple[int, int, int]) -> torch.Tensor:
        """Replay `key` (from bucket()) over host cols [b, rows, s], positions [b, s] and slots [b] padded to its
        shape, on the current stream -> hidden [b, s, dim], a view of the graph's output, valid until its next
        replay (prefill_batch gathers the rows it samples at once)."""
        b, s, _ = key
        self.cols[s][:b].copy_(cols, non_blocking=True)
        self.positions[s][:b].copy_(positions, non_blocking=True)
        self.slots[:b].copy_(slots, non_blocking=True)
        g, hidden = self.graphs[key]
        g.replay()
        self.replays += 1
        return hidden
