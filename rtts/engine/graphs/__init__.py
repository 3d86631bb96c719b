"""CUDA-graph runners: the hot paths replayed from graphs captured once at startup, instead of launched op by op.

One runner per graph-safe body: `decode.DecodeRunner` (Engine.decode_step), `prefill.FrameZeroRunner`
(Engine.frame_zero), `prefill.PrefillRunner` (Engine.prefill_forward), `codec.CodecGraphRunner` (Codec.decode_stream).
Every runner is used the same way:
- it is created and captured by the object that owns the state its body writes, in that object's `capture_graphs()`
  (the Engine for its three, the codec thread's worker for the codec's), and kept there as an attribute that stays
  None until then;
- `capture()` warms the body up and captures every bucket of its static inputs (helpers below);
- only the owner replays it, from the method that otherwise runs the body eagerly (Engine.decode_batch,
  Engine.prefill_batch, CodecWorker's decode); callers such as the scheduler's threads call that method and never
  see a runner.
Inputs pad up to a captured bucket with rows on the owner's scratch slot, a row no stream owns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import torch

K = TypeVar("K")
T = TypeVar("T")


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_batch, always including max_batch: fine steps where padding would double a
    small batch's work, one graph per 8 rows above."""
    out = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return sorted(set(out + [max_batch]))


def bucket_for(buckets: Sequence[int], n: int) -> int:
    """The smallest of the ascending `buckets` holding n; ValueError if none does."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def capture_graphs(device: torch.device, keys: Iterable[K],
                   body: Callable[[K], T]) -> dict[K, tuple[torch.cuda.CUDAGraph, T]]:
    """For each key in order: run body(key) twice (lazy inits and autotuning happen outside the capture), then
    capture it. All graphs share one new memory pool (give the largest first, so it is sized once) and are captured
    on a side CUDA stream; returns each key's graph and the outputs its replays rewrite."""
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
