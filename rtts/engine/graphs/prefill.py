"""The prefill thread's CUDA graphs: a turn's frame 0 (FrameZeroRunner) and turn-sized prompt chunks
(PrefillRunner), both created and replayed by the Engine (capture_graphs, prefill_batch).

They replay one at a time on the prefill thread's CUDA stream, concurrently with the decode thread's graphs: so
their own memory pools and their own FP8 split-tile scratch (kernels.graph_scratch(PREFILL_FAMILY)).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from rtts import kernels
from rtts.engine.graphs import batch_buckets, bucket_for, capture_graphs
from rtts.model.quant import FP8FeedForward, FP8Linear

if TYPE_CHECKING:
    from rtts.engine.engine import Engine

PREFILL_FAMILY = "prefill"  # graph family of the prefill thread's graphs (kernels.graph_scratch)
PREFILL_LENGTHS = (16, 32, 64, 128, 256, 512)  # prompt-chunk lengths PrefillRunner captures (512: the default chunk)


class FrameZeroRunner:
    """A turn's frame 0 (sampled by the prefill thread from the prompt's last hidden state: slow head, ten fast
    transformer passes, eleven draws, the commit) replayed from CUDA graphs, one per bucket of sampled rows up to
    the engine's prefill_rows. Eager it is hundreds of small launches, whose host time lands on every turn's time to
    first audio. Padded rows point at the scratch slot and are inactive: they sample, and commit nothing. Its own
    memory pool: the prefill thread replays these while the decode thread replays its graphs."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
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
        """Warm up and capture every bucket (all rows inactive)."""
        t0 = time.perf_counter()
        eng = self.engine
        # Its own split-tile scratch: these replay on the prefill thread while the decode graphs replay.
        with kernels.graph_scratch(PREFILL_FAMILY):
            kernels.reserve_graph_scratch(eng.device)
            self.graphs = capture_graphs(eng.device, reversed(self.buckets),
                                         lambda b: eng.frame_zero(self.hidden[:b], self.slots[:b], self.active[:b]))
        self.capture_seconds = time.perf_counter() - t0

    def __call__(self, hidden: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Frame 0 of len(slots) turns on the current CUDA stream -> columns [n, rows] (a copy: the graph's output
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
    thread's token budget). Eager, a short chunk's forward costs several times more host time launching ops than
    its kernels take, on a turn's time to first audio (and a voice prompt's, when the text follows the start at
    once). Padding follows Engine.prefill_batch: padded positions sit at the spare position max_ctx of their row's
    slot, padded items on the scratch slot; keys past a query's position are masked, so a span longer than the rows'
    histories changes nothing but the work (each layer gathers span positions per item: two spans, 1024 and the
    whole cache, keep that bounded). Shapes without a graph run eager, and so do FP8 models' chunks whose padding
    would cross into the dense path (kernels.fp8_rows_dense: other numbers, more weight traffic)."""

    def __init__(self, engine: Engine, lengths: tuple[int, ...] = PREFILL_LENGTHS, max_positions: int = 2048) -> None:
        self.engine = engine
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
        positions replays (Engine.pack_prefill pads it to that shape), or None: run it eager."""
        if batch > self.buckets[-1] or length > self.lengths[-1] or kv_len > self.spans[-1]:
            return None
        b = bucket_for(self.buckets, batch)
        s = bucket_for(self.lengths, length)
        kv = bucket_for(self.spans, max(kv_len, s))
        if self.fp8 and not kernels.fp8_rows_dense(batch * length) and kernels.fp8_rows_dense(b * s):
            return None
        key = (b, s, kv)
        return key if key in self.keys else None

    def capture(self) -> None:
        """Warm up and capture every key on the scratch slot (nothing when no chunk length fits the context)."""
        if not self.keys:
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
        self.capture_seconds = time.perf_counter() - t0

    def __call__(self, cols: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 key: tuple[int, int, int]) -> torch.Tensor:
        """Replay `key` (from bucket()) over host cols [b, rows, s], positions [b, s] and slots [b] padded to its
        shape, on the current CUDA stream -> hidden [b, s, dim], a view of the graph's output, valid until its next
        replay (prefill_batch gathers the rows it samples at once)."""
        b, s, _ = key
        self.cols[s][:b].copy_(cols, non_blocking=True)
        self.positions[s][:b].copy_(positions, non_blocking=True)
        self.slots[:b].copy_(slots, non_blocking=True)
        g, hidden = self.graphs[key]
        g.replay()
        self.replays += 1
        return hidden
