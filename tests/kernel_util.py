"""Helpers the kernel tests share (test_kernels.py, test_attention_kernels.py, ...): the gpu mark, seeded bf16
inputs, and a CUDA-graph capture on a side stream."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

GPU = pytest.mark.gpu


def bf16_input(*shape: int, scale: float = 1.0, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    """A seeded normal [*shape] tensor times `scale`, as bf16 on `device`."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16).to(device)


def capture(fn: Callable[[], torch.Tensor], warm: bool = False) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """`fn` captured in a CUDA graph on a side stream (after one eager call there when `warm`): the graph and the
    tensor its replays write."""
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        if warm:
            fn()
        with torch.cuda.graph(g, stream=s):
            out = fn()
    torch.cuda.current_stream().wait_stream(s)
    return g, out
