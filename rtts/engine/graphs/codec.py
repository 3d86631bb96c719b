"""The codec thread's streaming decode from CUDA graphs (created and replayed by pingpong.codec_stage.CodecWorker).

Eager, one chunk decode of the S2 codec is ~3800 torch ops (VQ lookups, the windowed post transformer, the causal
upsampler and decoder): host-bound on a GPU, and on the path of every turn's first audio. The streaming decode
(Codec.decode_stream, codec_stream.py) is graph-safe: slot rows are gathered and scattered on the device, with no
host sync. So each (batch bucket, frames) pair is captured once over static inputs and replayed:
- batches pad up to a bucket (batch_buckets) with rows on the scratch slot, the state row no stream owns: their
  garbage stays in that row (every op of the decode is per batch row);
- a call of n frames replays the captured frame counts largest first (8, 4, 2, 1 by default): the streaming decode is
  exact across chunk boundaries (codec_stream.py), so the split changes nothing but float rounding.
Before capture(), and for a batch wider than the largest bucket, `decode` is the codec's decode_stream itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from rtts.engine.graphs import batch_buckets, bucket_for, capture_graphs
from rtts.model.codec import Codec
from rtts.model.codec_stream import CodecStreamState

CHUNK_FRAMES = (8, 4, 2, 1)  # captured frame counts: the codec stage's chunk sizes (first chunk 1; 2 / 4 / 8 after)


def chunk_plan(n: int, chunks: tuple[int, ...] = CHUNK_FRAMES) -> list[int]:
    """Frame counts, largest captured ones first, that add up to n (chunks must contain 1)."""
    out = []
    for t in sorted(chunks, reverse=True):
        while n >= t:
            out.append(t)
            n -= t
    return out


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    audio: torch.Tensor  # [bucket, t * frame_length], rewritten by each replay


class CodecGraphRunner:
    def __init__(self, codec: Codec, state: CodecStreamState, max_batch: int, scratch_slot: int,
                 chunks: tuple[int, ...] = CHUNK_FRAMES) -> None:
        if 1 not in chunks:
            raise ValueError("the captured frame counts must include 1")
        if not 0 <= scratch_slot < state.capacity:
            raise ValueError(f"scratch slot {scratch_slot} is not a row of the {state.capacity}-slot codec state")
        self.codec, self.state, self.scratch = codec, state, scratch_slot
        self.chunks = tuple(sorted(chunks, reverse=True))
        self.buckets = batch_buckets(max_batch)
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.capture_seconds = 0.0
        self.replays = 0

    def capture(self) -> None:
        """Capture every (bucket, frames) pair, largest first. Replays then run on whatever CUDA stream is current
        (the codec thread's)."""
        t0 = time.perf_counter()
        dev, ncb = self.codec.device, self.codec.config.num_codebooks
        top = self.buckets[-1]
        # Static inputs: the slots every graph reads (a prefix of), and one code buffer per frame count. Warm-up and
        # capture run on the scratch slot only.
        self.slots = torch.full((top,), self.scratch, dtype=torch.long, device=dev)
        self.codes = {t: torch.zeros(top, ncb, t, dtype=torch.long, device=dev) for t in self.chunks}

        def body(key: tuple[int, int]) -> torch.Tensor:
            b, t = key
            return self.codec.decode_stream(self.codes[t][:b], self.state, self.slots[:b])

        keys = [(b, t) for b in reversed(self.buckets) for t in self.chunks]
        with torch.inference_mode():
            captured = capture_graphs(dev, keys, body)
        self.graphs = {k: _Graph(g, audio) for k, (g, audio) in captured.items()}
        self.capture_seconds = time.perf_counter() - t0

    def decode(self, codes: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """codes [B, num_codebooks, n] on the codec's device, slots [B] int64 (distinct, never the scratch slot) ->
        audio [B, n * frame_length], exactly what decode_stream gives (up to float rounding)."""
        B, n = codes.shape[0], codes.shape[-1]
        if not self.graphs or B > self.buckets[-1]:
            return self.codec.decode_stream(codes, self.state, slots)
        b = bucket_for(self.buckets, B)
        self.slots[:B].copy_(slots)
        self.slots[B:b].fill_(self.scratch)
        parts, i = [], 0
        for t in chunk_plan(n, self.chunks):
            g = self.graphs[(b, t)]
            self.codes[t][:B].copy_(codes[:, :, i:i + t])
            g.graph.replay()
            parts.append(g.audio[:B].clone())  # the next replay rewrites the graph's output
            i += t
            self.replays += 1
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
