"""The ping-pong scheduler: continuous batching with a prefill thread and a decode thread, no per-step host barrier.

Threads (each with its own CUDA stream on a GPU; the same threads without graphs or events on CPU):

- **prefill** — voice prompts the moment a stream opens (before any text exists) and each new text turn; chunked
  (`prefill_chunk` positions) and batched across streams under a token budget; the last chunk of a turn samples
  frame 0, which goes straight to the codec (time to first audio) while the stream joins the decode batch.
- **decode** — one batched step over every generating stream, again and again (CUDA graph per batch-size bucket);
  admits and retires streams between steps; sampled columns stay on the device for the next step and reach the
  host through a pinned ring buffer one step later, ordered by an event.
- **codec** — kept frames are decoded incrementally per stream (each slot keeps its codec state), batched across
  streams, into PCM chunks: the first after half the turn's latency-mode chunk (low: one frame), then growing to
  the mode's chunk (codec_stage.py); from CUDA graphs on a GPU (engine/graphs/codec.py,
  SchedulerConfig.codec_graphs).

API (thread-safe; results come back through per-turn outboxes that asyncio code awaits)::

    scheduler = Scheduler(engine, codec, SchedulerConfig()).start()
    handle = scheduler.open(references)        # takes a slot; the voice prompt is prefilled at once
    outbox = handle.speak(text, params)        # one text turn, conditioned on the stream's earlier turns
    async for item in outbox:                  # AudioChunk(pcm float32, sample_rate, frames, first_frame, timing)…
        ...                                    # …then TurnEnd(reason, frames, message, codes)
    handle.cancel()                            # ends queued turns now and the active one within one step
    handle.close()                             # frees the slot once no in-flight GPU step uses it
    scheduler.stop()                           # open turns end with reason ERROR ("server shutting down")

`open` raises `NoSlotError` when all `max_running` slots are taken and `PromptError` for a voice prompt that cannot
fit the context; a turn that cannot run ends with `TurnEnd(reason=ERROR, message=...)` and nothing else is affected.
An exception in a worker fails the streams it was working on and the worker goes on (faults.py); a worker that dies
anyway fails the scheduler (`Scheduler.failure`, `on_failure`): open turns end with an error, `open` raises
`WorkerFailed`.
"""

from rtts.pingpong.faults import WorkerFailed
from rtts.pingpong.outbox import AudioChunk, Outbox, TurnEnd
from rtts.pingpong.scheduler import Scheduler, SchedulerConfig, StreamHandle
from rtts.pingpong.slots import NoSlotError

__all__ = ["AudioChunk", "NoSlotError", "Outbox", "Scheduler", "SchedulerConfig", "StreamHandle", "TurnEnd",
           "WorkerFailed"]
