"""Test doubles for the scheduler: an engine whose frames are a known function of (seed, frame) and a tiny codec.

`FakeEngine` is the real `Engine` (slot state, prefill/decode plumbing, finish rules) with the sampling replaced:
frame f of a turn seeded s is `expected_column(s, f)`, and it emits `<|im_end|>` at frame `stop_frame(s)`. Optional
sleeps make prefill and decode steps slow, to put streams in a chosen state.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from rtts.engine.engine import Engine
from rtts.model.kv_cache import KVCache
from rtts.model.loading import LoadedModel


def stop_frame(seed: int) -> int:
    return 3 + seed % 9


def expected_column(seed: int, frame: int, sem_begin: int, n_sem: int, im_end: int, rows: int) -> list[int]:
    c0 = (seed * 7 + frame * 3) % n_sem
    tok = im_end if frame == stop_frame(seed) and frame > 0 else sem_begin + c0
    c0 = 0 if tok == im_end else c0
    return [tok, c0] + [(seed + frame * 5 + k) % 31 for k in range(rows - 2)]


def expected_codes(seed: int, max_frames: int, sem_begin: int, n_sem: int, im_end: int, rows: int) -> list[list[int]]:
    """Kept frames of one turn: every sampled frame but the last (the im_end frame or the one at the cap)."""
    n = min(stop_frame(seed) + 1, max_frames)
    return [expected_column(seed, f, sem_begin, n_sem, im_end, rows)[1:] for f in range(n - 1)]


class FakeEngine(Engine):
    def __init__(self, loaded: LoadedModel, max_slots: int, step_seconds: float = 0.0, prefill_seconds: float = 0.0,
                 **kw: object) -> None:
        super().__init__(loaded, max_slots=max_slots, **kw)  # type: ignore[arg-type]
        self.step_seconds = step_seconds
        self.prefill_seconds = prefill_seconds

    def _sample_frame(
        self, hidden: torch.Tensor, slots: torch.Tensor, fast_kv: KVCache, decode: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        st = self.state
        seeds, frames = st.seed[slots].tolist(), st.frame[slots].tolist()
        n_sem = self.sem_end - self.sem_begin + 1
        cols = [expected_column(s, f, self.sem_begin, n_sem, self.im_end, self.rows) for s, f in zip(seeds, frames)]
        if decode:
            time.sleep(self.step_seconds)
        else:
            time.sleep(self.prefill_seconds)
        col = torch.tensor(cols, dtype=torch.int64, device=self.device)
        return col, col[:, 0]


@dataclass(frozen=True)
class _CodecConfig:
    sample_rate: int = 100
    frame_length: int = 4
    num_codebooks: int = 10


class _FakeCodecState:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.frames = torch.zeros(capacity, dtype=torch.int64)  # frames decoded per slot since reset

    def reset(self, mask: torch.Tensor) -> None:
        self.frames[mask] = 0


class FakeCodec:
    """PCM of frame i of a slot = 4 samples of (c0 + c1) / 100 + its running frame count / 1e4."""

    def __init__(self, decode_seconds: float = 0.0) -> None:
        self.config = _CodecConfig()
        self.device = torch.device("cpu")
        self.decode_seconds = decode_seconds
        self.gate: threading.Event | None = None  # when set by a test, each decode waits for it (then clears it)
        self.entered = threading.Event()  # set when a decode call starts

    def new_stream_state(self, capacity: int) -> _FakeCodecState:
        return _FakeCodecState(capacity)

    def decode_stream(self, codes: torch.Tensor, state: _FakeCodecState, slots: torch.Tensor) -> torch.Tensor:
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(30)
        time.sleep(self.decode_seconds)
        B, _, t = codes.shape
        base = state.frames[slots][:, None] + torch.arange(t)[None]  # [B, t]
        state.frames[slots] += t
        val = (codes[:, 0] + codes[:, 1]).float() / 100 + base.float() / 1e4
        return val.repeat_interleave(self.config.frame_length, dim=1)
