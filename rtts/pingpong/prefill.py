"""The prefill thread: voice prompts and text turns, chunked and batched under a token budget.

Loop: take new jobs → pick a batch (at most one job per stream, the oldest of each, text turns first with a share
kept for voice prompts) → run one padded forward of one chunk per job → hand finished turns to the decode thread.
A long prompt is cut into `prefill_chunk`-position chunks, so a decode step never waits behind more than one chunk.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable

import torch

from rtts.engine.engine import ContextFullError, Engine
from rtts.model.errors import PromptError
from rtts.model.prompt import PromptBuilder
from rtts.pingpong.device import Device
from rtts.pingpong.faults import FaultCounter, WorkerDied
from rtts.pingpong.state import NO_FRAMES, STOP, Admit, CodecFrames, CodecReset, PrefillJob, Release, Stream, drain
from rtts.types import FinishReason

log = logging.getLogger("rtts.prefill")

VOICE_SHARE = 4  # every 4th pick offers voice prompts first, so a stream of turns cannot starve them
MIN_WIDTH = 64  # positions: below this a batch's padded width costs about the same whatever it is


class PrefillWorker:
    def __init__(
        self,
        engine: Engine,
        dev: Device,
        to_decode: queue.Queue[object],
        to_codec: queue.Queue[object],
        on_turn_end: Callable[[Stream], None],
        chunk: int,
        token_budget: int,
    ) -> None:
        self.engine = engine
        self.dev = dev
        self.cuda_stream = dev.new_cuda_stream(urgent=True)
        self.inbox: queue.Queue[object] = queue.Queue()
        self.to_decode, self.to_codec = to_decode, to_codec
        self.on_turn_end = on_turn_end
        self.chunk, self.budget = chunk, token_budget
        cfg = engine.config
        self.builder = PromptBuilder(engine.tokenizer, cfg.num_codebooks, cfg.format, cfg.codebook_size)
        self.pending: list[PrefillJob] = []  # owned by this thread
        self._picks = 0
        self.batches = 0  # counters for metrics and tests
        self.positions = 0
        self.faults = FaultCounter("prefill", log)

    # ------------------------------------------------------------------ loop

    def run(self) -> None:
        with self.dev.on(self.cuda_stream):
            while True:
                batch: list[PrefillJob] = []
                try:
                    if not self._drain(block=not self.pending):
                        return
                    batch = self._pick()
                    if batch:
                        self._run(batch)
                except WorkerDied:
                    raise
                except Exception as e:  # a fault outside any one job's guard: the jobs of this pass fail
                    message = self.faults.batch_fault(e, "a prefill pass")
                    for job in batch or list(self.pending):
                        self._fail(job, message)

    def _drain(self, block: bool) -> bool:
        for msg in drain(self.inbox, block):
            if msg is STOP:
                for job in self.pending:
                    if job.turn is not None:
                        job.turn.finish(FinishReason.ERROR, "server shutting down")
                self.pending.clear()
                return False
            if isinstance(msg, Release):
                # Close: no more prompt work for this stream; then the decode thread frees the slot (passed on
                # whatever happens here: a lost release would shrink the server's capacity for good).
                try:
                    self._release(msg.stream)
                finally:
                    self.to_decode.put(msg)
                continue
            assert isinstance(msg, PrefillJob)
            self.pending.append(msg)
        return True

    def _release(self, stream: Stream) -> None:
        for job in [j for j in self.pending if j.stream is stream]:
            if job.turn is None:
                self.pending.remove(job)
                continue
            try:
                self._end(job, FinishReason.CANCELLED)
            except WorkerDied:
                raise
            except Exception as e:
                self.faults.stream_fault(e, f"releasing stream {stream.id}")
                if job in self.pending:
                    self.pending.remove(job)
                job.turn.cancelled = True
                job.turn.finish(FinishReason.CANCELLED)

    def _pick(self) -> list[PrefillJob]:
        firsts: dict[int, PrefillJob] = {}
        for job in self.pending:
            firsts.setdefault(job.stream.id, job)
        turns = [j for j in firsts.values() if j.turn is not None]
        voices = [j for j in firsts.values() if j.turn is None]
        self._picks += 1
        order = voices + turns if self._picks % VOICE_SHARE == 0 else turns + voices
        batch: list[PrefillJob] = []
        width = 0
        for job in order:
            if len(batch) == self.engine.prefill_rows:
                break
            if job.done == 0 and not self._start(job):
                continue
            assert job.columns is not None
            n = min(self.chunk, job.columns.shape[1] - job.done)
            w = max(width, n)
            if batch and (len(batch) + 1) * w > self.budget:
                continue
            if batch and w > max(2 * width, MIN_WIDTH):
                # Every row is padded to the widest: a voice chunk would make the short turns before it (the time to
                # their first audio) pay for its hundreds of positions. It waits for a pick of its own kind.
                continue
            batch.append(job)
            width = w
        return batch

    # ------------------------------------------------------------------ one job

    def _start(self, job: PrefillJob) -> bool:
        """First chunk of a job: order after the slot's last decode step, build and check the prompt.
        False if the job ended here (cancelled, refused, or failed: a fault here is this stream's alone)."""
        try:
            return self._start_job(job)
        except WorkerDied:
            raise
        except Exception as e:
            self._fail(job, self.faults.stream_fault(e, f"stream {job.stream.id}'s prompt set-up"))
            return False

    def _start_job(self, job: PrefillJob) -> bool:
        eng, stream, turn = self.engine, job.stream, job.turn
        self.dev.wait(stream.decode_done)
        if turn is None:  # voice prompt of a new stream: the slot is fresh
            eng.reset_slot(stream.slot)
            self.to_codec.put(CodecReset(stream.slot))
            return True
        if turn.cancelled or stream.error:
            self._end(job, *(turn.stop_reason if turn.cancelled else (FinishReason.ERROR, stream.error)))
            return False
        turn.t_prefill = time.perf_counter()
        eng.end_turn(stream.slot)  # true KV length after the previous turn (one read per turn)
        if turn.fresh:
            self._from_voice_prompt(stream)
        if turn.reset_audio:  # ordered before this turn's frames in the codec inbox
            self.to_codec.put(CodecReset(stream.slot))
        try:
            job.columns = self.builder.turn(turn.text, after_turn=stream.turn_open)
            if not turn.fresh and eng.room(stream.slot) < job.columns.shape[1] + turn.params.max_frames + 1:
                # The conversation so far leaves no room for this turn and all the audio it may generate: forget it
                # (keep the voice prompt), as a fresh turn does, rather than refuse the turn or cut it mid-sentence.
                # A long call never ends its session (Pipecat sends stop only when it hangs up).
                log.info("stream %d: context full after %d positions, turn starts from the voice prompt",
                         stream.id, eng.host_pos[stream.slot])
                self._from_voice_prompt(stream)
                job.columns = self.builder.turn(turn.text, after_turn=False)
            eng.check_room(stream.slot, job.columns.shape[1], sample=True)
            eng.set_params(stream.slot, turn.params)
        except (PromptError, ContextFullError, ValueError) as e:
            self._end(job, FinishReason.ERROR, str(e))
            return False
        return True

    def _from_voice_prompt(self, stream: Stream) -> None:
        """Forget the stream's conversation: its next turn follows the voice prompt alone."""
        self.engine.rewind(stream.slot, stream.voice_len)
        stream.turn_open = False

    def _end(self, job: PrefillJob, reason: FinishReason, message: str = "") -> None:
        if job in self.pending:
            self.pending.remove(job)
        if job.turn is not None:
            job.turn.cancelled = job.turn.cancelled or reason == FinishReason.CANCELLED
            self.to_codec.put(CodecFrames(job.stream, job.turn, NO_FRAMES, final=True,
                                          reason=reason, message=message))
            job.stream.decode_done = self.dev.record()
            self.on_turn_end(job.stream)

    def _fail(self, job: PrefillJob, message: str) -> None:
        """A fault hit this job: its turn ends with an error, its stream is marked failed (a voice prompt's failure
        fails every later turn of the stream)."""
        if job not in self.pending:  # handed on already (or ended): no longer this thread's
            return
        job.stream.fail(message if job.turn is not None else f"voice prompt failed: {message}")
        try:
            self._end(job, FinishReason.ERROR, message)
        except Exception:  # the end's own hand-offs failed: still drop the job and end its turn
            log.exception("prefill worker: ending a failed job")
            if job in self.pending:
                self.pending.remove(job)
            if job.turn is not None:
                job.turn.fail(message)
                job.turn.finish(FinishReason.ERROR, message)

    def _run(self, batch: list[PrefillJob]) -> None:
        items = [job.next_item(self.chunk) for job in batch]
        try:
            frames = self.engine.prefill_batch(items)
        except WorkerDied:
            raise
        except Exception as e:  # a worker thread never dies on one bad batch
            message = self.faults.batch_fault(e, f"a prefill batch of {len(batch)}")
            for job in batch:
                self._fail(job, message)
            return
        self.faults.succeeded()
        self.batches += 1
        sampled = 0
        for job, item in zip(batch, items):
            job.done += item.columns.shape[1]
            self.positions += item.columns.shape[1]
            assert job.columns is not None
            if job.done < job.columns.shape[1]:
                continue
            if job.turn is None:
                job.stream.voice_len = self.engine.host_pos[job.stream.slot]
                self.pending.remove(job)
                continue
            assert frames is not None
            try:
                self._finish_turn_prefill(job, frames[sampled])
            except WorkerDied:
                raise
            except Exception as e:
                self._fail(job, self.faults.stream_fault(e, f"stream {job.stream.id}'s frame 0"))
            sampled += 1

    def _finish_turn_prefill(self, job: PrefillJob, frame0: torch.Tensor) -> None:
        """Frame 0 is sampled: send it to the codec at once (time to first audio) and the stream to decode."""
        stream, turn = job.stream, job.turn
        assert turn is not None
        stream.turn_open = True  # the KV now holds an open assistant turn, whatever happens next
        col = frame0.cpu()  # one host sync per turn, on this thread's CUDA stream only
        turn.t_frame0 = time.perf_counter()
        finish = FinishReason(int(self.engine.state.finish[stream.slot]))
        turn.frames_sampled = 1
        if turn.cancelled or finish != FinishReason.RUNNING:
            # Frame 0 ended the turn (cap of 1 frame, full context) or the turn was cancelled: it is not kept.
            self._end(job, *(turn.stop_reason if turn.cancelled else (finish, "")))
            return
        admit = Admit(stream, turn, col, self.engine.host_pos[stream.slot], self.dev.record())
        self.pending.remove(job)  # (last: a fault before it leaves the job to _fail)
        self.to_codec.put(CodecFrames(stream, turn, col[None, 1:].numpy()))
        self.to_decode.put(admit)
