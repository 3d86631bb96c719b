"""Faults in the worker threads: contained to the streams they hit, or, when a worker can no longer work, fatal.

Each worker (prefill, decode, codec) catches an exception around every unit of work and fails the streams that unit
was for: a stream's own work (its prompt set-up, its row of a decode step, its audio chunk) fails that stream alone; a
batched computation (a prefill batch, a decode step, a codec decode call) fails the streams in the batch. The turn
ends with `TurnEnd(ERROR, message)` (the session's `finish` with reason error), the stream is marked failed (its state
may be inconsistent, so its later turns fail and a socket opens a new stream), and the worker goes on.

Two kinds of fault end the worker instead (`WorkerDied`, which the scheduler turns into a server failure: every open
turn fails, `/v1/health` answers 503, `rtts serve` exits): a device error (CUDA errors are sticky: every later call on
the device fails too) and a run of `MAX_BATCH_FAULTS` batched computations failing with no success in between (the
worker cannot do anything any more). Faults of one stream's own work never count toward that: no request, however
bad, can stop the server.
"""

from __future__ import annotations

import logging

import torch

MAX_BATCH_FAULTS = 32


class WorkerDied(RuntimeError):
    """A worker cannot go on (see the module docstring): raised out of its loop, it ends the thread."""


class WorkerFailed(RuntimeError):
    """The scheduler failed (a worker thread died): no new stream can be served. The process is about to exit."""


def is_device_error(e: BaseException) -> bool:
    """An error of the device itself (not of one computation's inputs): on CUDA such errors are sticky."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(e, accelerator_error):
        return True
    return isinstance(e, RuntimeError) and "CUDA error" in str(e)


def describe(e: BaseException) -> str:
    """An exception in words for a client's error message: its type and message, never an object's repr."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


class FaultCounter:
    """One worker's fault bookkeeping: logs every fault with its traceback, and decides when the worker dies."""

    def __init__(self, worker: str, log: logging.Logger, limit: int = MAX_BATCH_FAULTS) -> None:
        self.worker, self.log, self.limit = worker, log, limit
        self.batch_faults = 0  # batched computations failed in a row

    def succeeded(self) -> None:
        self.batch_faults = 0

    def stream_fault(self, e: BaseException, what: str) -> str:
        """A fault in one stream's own work: logged, never fatal (unless the device failed). -> the turn's message."""
        self.log.error("%s worker: %s failed", self.worker, what, exc_info=e)
        self._check_device(e)
        return f"{self.worker} failed: {describe(e)}"

    def batch_fault(self, e: BaseException, what: str) -> str:
        """A fault in a batched computation: logged; fatal after `limit` in a row. -> the turns' message."""
        self.log.error("%s worker: %s failed", self.worker, what, exc_info=e)
        self._check_device(e)
        self.batch_faults += 1
        if self.batch_faults >= self.limit:
            raise WorkerDied(f"{self.worker}: {self.batch_faults} batches failed in a row, the last with "
                             f"{describe(e)}") from e
        return f"{self.worker} failed: {describe(e)}"

    def _check_device(self, e: BaseException) -> None:
        if is_device_error(e):
            raise WorkerDied(f"{self.worker}: device error: {describe(e)}") from e
