"""CUDA streams and events when there is a GPU, no-ops on CPU (where each thread's ops are synchronous)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class Device:
    def __init__(self, device: torch.device, priority_streams: bool = False) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.priority_streams = priority_streams

    def new_cuda_stream(self, urgent: bool = False) -> torch.cuda.Stream | None:
        """urgent (with priority_streams): a high-priority stream, whose kernels' blocks the GPU schedules before
        those of normal streams as SMs free up (first audio: prompts and audio chunks before decode steps)."""
        if not self.cuda:
            return None
        return torch.cuda.Stream(device=self.device, priority=-1 if urgent and self.priority_streams else 0)

    @contextlib.contextmanager
    def on(self, cuda_stream: torch.cuda.Stream | None) -> Iterator[None]:
        """Run the block with `cuda_stream` as the current CUDA stream (and with grad off, for worker threads)."""
        with torch.inference_mode():
            if cuda_stream is None:
                yield
            else:
                with torch.cuda.stream(cuda_stream):
                    yield

    def record(self) -> torch.cuda.Event | None:
        """An event after everything enqueued so far on the current CUDA stream."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def wait(self, event: torch.cuda.Event | None) -> None:
        """Make the current CUDA stream wait for `event` (GPU-side; the host does not block)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    @staticmethod
    def synchronize(event: torch.cuda.Event | None) -> None:
        if event is not None:
            event.synchronize()
