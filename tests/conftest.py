"""Shared test fixtures: where the golden reference outputs live, markers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# CI and the dev checkout have `shared/` beside the repository; RTTS_GOLDEN_DIR overrides.
GOLDEN = Path(os.environ.get("RTTS_GOLDEN_DIR", Path(__file__).resolve().parents[2] / "shared" / "golden"))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def golden() -> Path:
    """The golden fixture root. Missing fixtures fail the test (they are part of CI), never skip it silently."""
    if not GOLDEN.is_dir():
        pytest.fail(f"golden fixtures not found at {GOLDEN} (set RTTS_GOLDEN_DIR)")
    return GOLDEN
