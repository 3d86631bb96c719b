"""Process settings read from the environment (rtts/env.py)."""

from __future__ import annotations

import os

import pytest

from rtts import env


def test_cpu_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RTTS_CPU_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert env.cpu_threads() == max(1, (os.cpu_count() or 2) // 2)  # decode and codec threads: half the cores each
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert env.cpu_threads() is None  # the user's OpenMP setting stands
    monkeypatch.setenv("RTTS_CPU_THREADS", "5")
    assert env.cpu_threads() == 5
    for bad in ("0", "-1", "many"):
        monkeypatch.setenv("RTTS_CPU_THREADS", bad)
        with pytest.raises(ValueError):
            env.cpu_threads()
