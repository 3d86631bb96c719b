"""The codec thread: kept frames → PCM, decoded incrementally per stream and batched across streams.

Each stream's codec state (conv tails, attention window) lives in its slot's row of one `CodecStreamState`, and
continues across the turns of a session, so a session's audio is exactly the whole-utterance decode of all its kept
codes. A turn's first chunk holds half the latency mode's chunk (low 1 frame, balanced 2, normal 4; at least
`first_chunk_frames`): the mode trades time to first audio against the audio the client holds before the next chunk.
Later chunks grow with the audio already delivered (the client's buffer doubles each time, so a small first chunk is
not followed by a gap longer than the audio it holds) up to the mode's chunk size (low 2, balanced 4, normal 8), which
makes each decode call (and each network message) larger.
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from rtts.engine.graphs.codec import CodecGraphRunner
from rtts.model.codec import Codec
from rtts.pingpong.device import Device
from rtts.pingpong.faults import FaultCounter, WorkerDied
from rtts.pingpong.outbox import AudioChunk
from rtts.pingpong.state import STOP, CodecFrames, CodecReset, StepFrames, Stream, Turn, drain
from rtts.types import FinishReason

log = logging.getLogger("rtts.codec")

CHUNK_FRAMES = {"low": 2, "balanced": 4, "normal": 8}


@dataclass
class _Audio:
    stream: Stream
    turn: Turn
    buffered: list[np.ndarray] = field(default_factory=list)  # [n, num_codebooks] rows not yet decoded
    kept: list[np.ndarray] = field(default_factory=list)  # every kept frame of the turn (for TurnEnd.codes)
    delivered: int = 0
    t_frames: float = 0.0  # when the frames of the first chunk had all been sent here
    t_codec: float = 0.0  # when the first chunk's decode started
    t_waiting: float = 0.0  # since when it has been ready to decode (0: not ready); the oldest group goes first
    final: bool = False
    reason: FinishReason = FinishReason.RUNNING
    message: str = ""

    @property
    def n_buffered(self) -> int:
        return sum(t.shape[0] for t in self.buffered)


class CodecWorker:
    def __init__(self, codec: Codec, dev: Device, capacity: int, first_chunk_frames: int = 1,
                 max_buffer_seconds: float = 120.0, tf32: bool = True) -> None:
        self.codec = codec
        self.dev = dev
        if dev.cuda:
            # TF32 tensor cores for the codec's float32 convolutions: a chunk at many streams decodes in well under
            # half the time, with no audible difference from true float32 (figures: bench/results/graphs/README.md).
            # Off, true float32 keeps streamed and whole decodes within 2e-5 of each other; TF32 puts them ~5e-3
            # apart (the stream's convolutions run on other lengths). The switch is process-wide, so only cuDNN's:
            # the LLM has no convolutions, while TF32 matmuls would change a float32 LLM's tokens (seen on the golden
            # tiny model). It covers the float32 encoder too (voice references), also when the decode runs a half
            # precision copy, where a near tie between two code vectors may then resolve the other way: a
            # reference's codes are a prompt, not a bit-exact artifact.
            torch.backends.cudnn.allow_tf32 = tf32
        self.cuda_stream = dev.new_cuda_stream(urgent=True)
        self.inbox: queue.Queue[object] = queue.Queue()
        self.first_chunk_frames = first_chunk_frames
        self.sample_rate = codec.config.sample_rate
        self.max_buffer_samples = int(max_buffer_seconds * self.sample_rate)
        self.state = codec.new_stream_state(capacity)  # owned by this thread
        self.runner: CodecGraphRunner | None = None  # set by capture_graphs(); until then the decode runs eager
        self.pending: dict[int, _Audio] = {}  # turn id -> audio, oldest first; owned by this thread
        # slot -> turns that must finish before the slot's codec state is reset (a CodecReset behind them)
        self.deferred_resets: dict[int, set[int]] = {}
        self.frames_decoded = 0
        self.faults = FaultCounter("codec", log)

    def capture_graphs(self) -> None:
        """Capture (CUDA only) and from now on replay the streaming decode from CUDA graphs; call it before run()."""
        # The last row is the scratch slot no stream owns (slots are 0 .. capacity - 2): graph padding lands there.
        scratch = self.state.capacity - 1
        runner = CodecGraphRunner(self.codec, self.state, scratch, scratch)
        runner.capture()
        self.runner = runner

    def run(self) -> None:
        with self.dev.on(self.cuda_stream):
            while True:
                ready: list[_Audio] = []
                try:
                    if not self._drain(block=not self._ready()):
                        return
                    ready = self._ready()
                    if ready:
                        self._decode(ready)
                except WorkerDied:
                    raise
                except Exception as e:  # outside any one turn's guard: the turns of this pass fail
                    message = self.faults.batch_fault(e, "a codec pass")
                    for a in ready or list(self.pending.values()):
                        self._fail(a, message)

    def _drain(self, block: bool) -> bool:
        for msg in drain(self.inbox, block):
            if msg is STOP:
                for a in self.pending.values():
                    a.turn.finish(FinishReason.ERROR, "server shutting down", a.delivered)
                return False
            if isinstance(msg, CodecReset):
                # Turns of the slot still in flight here decode from the state they started; the reset waits.
                older = {a.turn.id for a in self.pending.values() if a.stream.slot == msg.slot}
                if older:
                    self.deferred_resets.setdefault(msg.slot, set()).update(older)
                else:
                    self._reset(msg.slot)
                continue
            if isinstance(msg, StepFrames):
                for (stream, turn), row in zip(msg.rows, msg.codes):
                    self._add(stream, turn, row[None].copy(), msg.t_sent)  # (a copy: a view would pin the step)
                continue
            assert isinstance(msg, CodecFrames)
            audio = self._add(msg.stream, msg.turn, msg.codes, msg.t_sent)
            if audio is not None and msg.final:
                audio.final, audio.reason, audio.message = True, msg.reason, msg.message
                if msg.reason == FinishReason.CANCELLED:  # drop audio not yet decoded
                    audio.buffered.clear()
        return True

    def _add(self, stream: Stream, turn: Turn, codes: np.ndarray, t_sent: float) -> _Audio | None:
        """Frames ([n, num_codebooks], maybe none) of a turn arrived: -> its audio record, None if it is over here."""
        if turn.outbox.closed:
            return None
        a = self.pending.get(turn.id) or self.pending.setdefault(turn.id, _Audio(stream, turn))
        if a.final and a.reason == FinishReason.ERROR:
            return None  # failed here already: later frames (the decode thread had not seen it) are dropped
        if codes.size:
            a.buffered.append(codes)
            a.kept.append(codes)
            if not a.t_frames and a.n_buffered >= self._target(a):
                a.t_frames = t_sent
        return a

    def _target(self, a: _Audio) -> int:
        mode = CHUNK_FRAMES.get(a.turn.latency, CHUNK_FRAMES["balanced"])
        first = max(1, self.first_chunk_frames, mode // 2)
        return min(mode, max(first, a.delivered))

    def _reset(self, slot: int) -> None:
        mask = torch.zeros(self.state.capacity, dtype=torch.bool, device=self.codec.device)
        mask[slot] = True
        self.state.reset(mask)

    def _ready(self) -> list[_Audio]:
        """The turns to decode now: per slot only the oldest pending turn (a slot's turns continue one codec state in
        order, and one decode call must not list a slot twice), when it holds enough frames or has ended."""
        out, seen = [], set()
        for a in self.pending.values():
            if a.turn.cancelled and a.reason != FinishReason.ERROR:
                # Stopped before its final message came: a fault's ERROR (the message may still be queued behind
                # this pass) or the client's cancel, as the turn says.
                a.buffered.clear()
                if a.reason != FinishReason.CANCELLED:
                    a.reason, a.message = a.turn.stop_reason
                a.final = True
            if a.stream.slot in seen:
                continue
            seen.add(a.stream.slot)
            if a.final or a.n_buffered >= self._target(a):
                a.t_waiting = a.t_waiting or time.perf_counter()
                out.append(a)
        return out

    def _decode_chunk(self, codes: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """codes [B, num_codebooks, n] -> audio [B, n * frame_length], advancing the slots' codec state."""
        if self.runner is not None:
            return self.runner.decode(codes, slots)
        return self.codec.decode_stream(codes, self.state, slots)

    def _mark_failed(self, a: _Audio, message: str) -> None:
        """A fault hit this turn: it ends with an error once out of this pass (its audio not yet decoded dropped),
        the decode thread stops generating it, and its stream is marked failed (its codec state is suspect)."""
        a.stream.fail(message)
        a.turn.fail(message)
        a.buffered.clear()
        a.final, a.reason, a.message = True, FinishReason.ERROR, message

    def _fail(self, a: _Audio, message: str) -> None:
        """_mark_failed, and the turn ends now (a fault outside the normal end of a pass)."""
        if self.pending.get(a.turn.id) is not a:
            return  # ended already
        self._mark_failed(a, message)
        try:
            self._end(a)
        except Exception:  # the end's own steps failed: still drop the turn and tell its reader
            log.exception("codec worker: ending a failed turn")
            self.pending.pop(a.turn.id, None)
            a.turn.finish(FinishReason.ERROR, message, a.delivered)

    def _chunk(self, a: _Audio) -> int:
        """Frames to decode now: all that are buffered, or, replaying CUDA graphs, the largest captured count that
        fits (the rest waits): turns that buffered different counts then share one call, not one call each."""
        n = a.n_buffered
        return n if self.runner is None else max(c for c in self.runner.chunks if c <= n)

    def _take(self, a: _Audio, t: int) -> np.ndarray | None:
        """The turn's first t buffered frames as [num_codebooks, t], off its buffer (None: a fault, and the turn is
        marked failed)."""
        try:
            frames = np.concatenate(a.buffered)
            a.buffered = [frames[t:]] if t < frames.shape[0] else []
            return frames[:t].T
        except WorkerDied:
            raise
        except Exception as e:
            self._mark_failed(a, self.faults.stream_fault(e, f"stream {a.stream.id}'s frames"))
            return None

    def _decode(self, ready: list[_Audio]) -> None:
        """One decode call per pass: the group of ready turns (same chunk length) holding a turn's first chunk, else
        the one whose turn has waited longest; then the loop drains its inbox again, so a first chunk that came
        meanwhile waits for at most one call."""
        groups: dict[int, list[_Audio]] = {}
        for a in ready:
            if a.n_buffered:
                groups.setdefault(self._chunk(a), []).append(a)
        if groups:
            n, group = min(groups.items(), key=lambda kv: (all(a.delivered for a in kv[1]),
                                                           min(a.t_waiting for a in kv[1])))
            self._decode_group(group, n)
        for a in ready:
            if a.final and not a.buffered:
                try:
                    self._end(a)
                except WorkerDied:
                    raise
                except Exception as e:  # (_end takes the turn out of pending first): end it here
                    message = self.faults.stream_fault(e, f"the end of stream {a.stream.id}'s turn")
                    self._mark_failed(a, message)
                    self.pending.pop(a.turn.id, None)
                    a.turn.finish(FinishReason.ERROR, message, a.delivered)

    def _decode_group(self, turns: list[_Audio], n: int) -> None:
        """One batched call: the next n frames of each of `turns` (distinct slots) into their outboxes."""
        members = [(a, rows) for a in turns if (rows := self._take(a, n)) is not None]
        if not members:
            return
        group = [a for a, _ in members]
        codes = torch.from_numpy(np.stack([rows for _, rows in members]))  # [B, num_codebooks, n]
        slots = torch.tensor([a.stream.slot for a in group], device=self.codec.device)
        t0 = time.perf_counter()
        for a in group:
            a.t_waiting = 0.0
            if not a.delivered:
                a.t_codec, a.t_frames = t0, a.t_frames or t0
        try:
            pcm = self._decode_chunk(codes.to(self.codec.device), slots).float().cpu().numpy()
        except WorkerDied:
            raise
        except Exception as e:
            message = self.faults.batch_fault(e, f"a codec decode of {len(group)} streams")
            for a in group:
                self._mark_failed(a, message)
            return
        self.faults.succeeded()
        self.frames_decoded += n * len(group)
        for a, samples in zip(group, pcm):
            try:
                self._deliver(a, samples, n)
            except WorkerDied:
                raise
            except Exception as e:  # this turn's alone
                self._mark_failed(a, self.faults.stream_fault(e, f"stream {a.stream.id}'s audio chunk"))

    def _deliver(self, a: _Audio, samples: np.ndarray, n: int) -> None:
        """One decoded chunk of a turn into its outbox."""
        if a.turn.cancelled:  # cancelled (or failed) while this chunk was decoding: drop it and what is left
            a.buffered.clear()
            if a.reason not in (FinishReason.ERROR, FinishReason.CANCELLED):
                a.reason, a.message = a.turn.stop_reason
            a.final = True
            return
        a.turn.outbox.put(AudioChunk(np.ascontiguousarray(samples, dtype=np.float32), self.sample_rate, n,
                                     a.delivered, a.turn.t_submit, stages=None if a.delivered else _stages(a)))
        a.delivered += n
        a.turn.frames_delivered = a.delivered
        if a.turn.outbox.buffered_samples > self.max_buffer_samples and not a.final:
            # The consumer stopped reading: end the turn rather than buffer without bound.
            a.turn.fail("client is not reading audio")
            a.buffered.clear()
            a.final, a.reason, a.message = True, FinishReason.ERROR, "client is not reading audio"

    def _end(self, a: _Audio) -> None:
        """The turn is over here: its slot's deferred codec reset (once its last turn in flight ended), its TurnEnd."""
        del self.pending[a.turn.id]
        waiting = self.deferred_resets.get(a.stream.slot)
        if waiting is not None:
            waiting.discard(a.turn.id)
            if not waiting:
                del self.deferred_resets[a.stream.slot]
                self._reset(a.stream.slot)
        kept = (np.concatenate(a.kept).T if a.kept
                else np.zeros((self.codec.config.num_codebooks, 0), dtype=np.int64))
        a.turn.finish(a.reason, a.message, a.delivered, kept)


def _stages(a: _Audio) -> dict[str, float]:
    """Where a turn's time to first audio went, in seconds (rtts_ttfa_stage_seconds), from the moment it became its
    stream's active turn (a queued turn first waits for the ones before it to end, which is not a scheduler stage):
    waiting for the prefill thread, its prompt's prefill and frame 0, the decode steps of the rest of the first chunk,
    waiting for the codec thread, the chunk's decode. Stages a turn skipped (an eager test path) read 0."""
    t = a.turn
    t_active = t.t_active or t.t_submit
    t_prefill = t.t_prefill or t_active
    t_frame0 = t.t_frame0 or t_prefill
    return {"queue": t_prefill - t_active, "prefill": t_frame0 - t_prefill, "frames": max(0.0, a.t_frames - t_frame0),
            "codec_wait": a.t_codec - a.t_frames, "codec": time.perf_counter() - a.t_codec}
