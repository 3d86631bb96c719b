"""The decode step from CUDA graphs: a batch padded to a bucket replays that bucket's graph.

Graphs are captured once at startup, after warm-up, for every (batch bucket, KV-length bucket) pair, all in one
memory pool (they never run at the same time: one decode thread replays them in order). Everything that changes per
step lives in device buffers the graph reads: the slot ids (copied in through a pinned host buffer, non-blocking) and
the per-slot state inside the engine. Padded rows point at the engine's scratch slot, which is permanently frozen, so
they are harmless.

KV-length buckets exist because the torch reference attention reads a fixed number of cache positions per graph;
a kernel that reads each slot's length from device memory needs one bucket (the full context).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rtts.engine.graphs import batch_buckets, bucket_for, capture_graphs

if TYPE_CHECKING:
    from rtts.engine.engine import Engine


def kv_buckets(max_len: int, smallest: int = 256) -> list[int]:
    out, b = [], smallest
    while b < max_len:
        out.append(b)
        b *= 2
    return out + [max_len]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    cols: torch.Tensor  # [bucket, rows] output buffer written by each replay
    finish: torch.Tensor  # [bucket] int8


class DecodeRunner:
    """Engine.decode_step replayed per (batch bucket, KV-length bucket); created and replayed by the Engine
    (capture_graphs, decode_batch)."""

    def __init__(self, engine: Engine, kv_bucketed: bool | None = None) -> None:
        self.engine = engine
        self.device = engine.device
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
        t0 = time.perf_counter()
        keys = [(b, kv) for kv in reversed(self.kv_buckets) for b in reversed(self.buckets)]
        graphs = capture_graphs(self.device, keys, lambda k: self.engine.decode_step(self.slots_dev[:k[0]], k[1]))
        self.graphs = {k: _Graph(g, cols, finish) for k, (g, (cols, finish)) in graphs.items()}
        self.capture_seconds = time.perf_counter() - t0

    def step(self, slots: list[int], kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay one decode step for `slots` on the current CUDA stream -> (cols [>= n, rows], finish [>= n]) on the
        device, the graph's output buffers; rows past len(slots) are padding. Nothing here waits for the GPU."""
        n = len(slots)
        b, kv = self.bucket_for(n), self.kv_bucket_for(kv_len)
        stage = self._staging[self._turn]
        self._turn ^= 1
        stage[:n] = torch.tensor(slots, dtype=torch.int64)
        stage[n:b] = self.engine.scratch_slot
        self.slots_dev[:b].copy_(stage[:b], non_blocking=True)
        g = self.graphs[(b, kv)]
        g.graph.replay()
        return g.cols, g.finish
