"""What every training stage shares: device and precision, the learning-rate schedule, the wall-clock budget, logs."""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


def pick_device(name: str | None = None) -> torch.device:
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def autocast(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast on CUDA; float32 elsewhere (CPU bf16 is slow and not what the GPU run does). On CUDA attention
    also keeps to the flash / memory-efficient kernels: cuDNN's builds a plan for every new sequence length, and the
    batches' lengths vary step to step (it cost ~180 ms of host time in a 244 ms step)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast("cuda", dtype=torch.bfloat16))
    stack.enter_context(sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]))
    return stack


def cosine_lr(step: int, total: int, warmup: int, base: float, floor: float = 0.05) -> float:
    """Linear warm-up, then cosine decay to floor * base at `total`."""
    if step < warmup:
        return base * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return base * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr


@dataclass
class Deadline:
    """Stop a stage before the GPU machine's per-command limit: `minutes` <= 0 means no limit."""

    minutes: float
    start: float = 0.0

    def __post_init__(self) -> None:
        self.start = time.monotonic()

    @property
    def passed(self) -> bool:
        return self.minutes > 0 and time.monotonic() - self.start > self.minutes * 60

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start


@dataclass
class StepBudget:
    """Fits a run's step count to its time budget from steps timed after a warm-up: the first steps pay for cuDNN
    autotuning, allocator growth and kernel compilation, and counting them once made a stage train a fifth of what
    its budget allowed. The fit is redone each time the timed steps double (batches of new shapes keep paying for
    kernel selection for a while: one fit made the DualAR stage stop at 60% of its budget)."""

    deadline: Deadline
    warmup: int = 10
    timed: int = 30
    margin_s: float = 20.0
    _t_warm: float | None = None
    _next: int = 0
    _per_step: float = 0.0

    def fit(self, planned: int, step: int, steps_run: int) -> int | None:
        """Call before every step (`steps_run` steps done in this run, now at `step`): the fitted total at each fit
        point (never above `planned`), else None. The schedule then decays fully within the call."""
        if self.deadline.minutes <= 0:
            return None
        if steps_run == self.warmup:
            self._t_warm, self._next = self.deadline.elapsed, self.timed
        if self._t_warm is None or steps_run != self.warmup + self._next:
            return None
        per_step = (self.deadline.elapsed - self._t_warm) / self._next
        self._per_step, self._next = per_step, 2 * self._next
        left = self.deadline.minutes * 60 - self.deadline.elapsed - self.margin_s
        return max(step + 1, min(planned, step + int(left / max(per_step, 1e-9))))

    @property
    def per_step(self) -> float:
        """Seconds per step at the last fit."""
        return self._per_step


class Log:
    """Lines to stderr and JSON records to <workdir>/<stage>.log.jsonl (kept small: one record per log step)."""

    def __init__(self, workdir: Path, stage: str) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.path = workdir / f"{stage}.log.jsonl"
        self.stage = stage

    def __call__(self, step: int, **values: Any) -> None:
        text = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())
        print(f"{self.stage} step {step}: {text}", file=sys.stderr, flush=True)
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")


def batches_forever(n: int, batch: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Shuffled index batches over range(n), epoch after epoch."""
    while True:
        order = torch.randperm(n, generator=generator)
        for start in range(0, n - batch + 1 if n >= batch else 1, batch):
            yield order[start:start + batch]
