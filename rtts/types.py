"""Shared vocabulary every layer may import (a leaf module: it imports nothing from rtts)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

FLOAT32_MAX = 3.4028234663852886e38


class FinishReason(enum.IntEnum):
    """Why a stream's turn ended. Stored on the device as int8, so values are small ints."""

    RUNNING = 0
    STOP = 1  # the model emitted <|im_end|>
    LENGTH = 2  # max_frames reached
    CONTEXT = 3  # the slot's KV context is full
    CANCELLED = 4
    ERROR = 5


@dataclass(frozen=True)
class SamplingParams:
    """Per-turn generation settings.

    Defaults are the reference HTTP server's. `top_k <= 0` disables top-k (S1 has none by default).
    `repetition_penalty` only affects S1-format models (the S2 reference accepts and ignores it); S2 uses
    repetition-aware sampling instead (`ras`).
    """

    temperature: float = 0.8
    top_p: float = 0.8
    top_k: int = 30
    repetition_penalty: float = 1.1
    seed: int | None = None
    max_frames: int = 1024
    ras: bool = True

    def validate(self) -> None:
        if not 0.0 < self.temperature < 2.0:
            raise ValueError(f"temperature must be in (0, 2), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        # The engine keeps these per slot in float32 and int64 tensors: a value they cannot hold is refused here,
        # before any of the slot's settings change.
        if not 0.0 < self.repetition_penalty <= FLOAT32_MAX:
            raise ValueError(f"repetition_penalty must be in (0, {FLOAT32_MAX:g}], got {self.repetition_penalty}")
        if not -(2**63) <= self.top_k < 2**63:
            raise ValueError(f"top_k must fit in 64 bits, got {self.top_k}")
        if not 1 <= self.max_frames < 2**31:
            raise ValueError(f"max_frames must be in [1, 2**31), got {self.max_frames}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
