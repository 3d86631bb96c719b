"""A session's MP3 / Opus turn ends (Session._next_turn / _release_tail), against a stream stand-in whose turns are
sine tones of chosen lengths: when the held end is released with silence, when it is not, and that an abort while
waiting sends nothing after `finish`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from rtts.audio.encode import TAIL_PAD_SECONDS
from rtts.pingpong.outbox import AudioChunk, TurnEnd
from rtts.session import TAIL_IDLE_SECONDS, Session
from rtts.types import FinishReason
from rtts.ws.parse import parse_request

SR = 44100


class ToneStream:
    """speak() -> an outbox of one tone of `seconds[i]` for the i-th turn (0: a turn without audio)."""

    def __init__(self, seconds: list[float]) -> None:
        self.seconds = list(seconds)
        self.cancelled = False

    def speak(self, text: str, params: Any, **kw: Any) -> AsyncIterator[object]:
        seconds = self.seconds.pop(0)

        async def outbox() -> AsyncIterator[object]:
            if seconds:
                n = int(seconds * SR)
                pcm = (0.3 * np.sin(2 * np.pi * 440 * np.arange(n) / SR)).astype(np.float32)
                yield AudioChunk(pcm, SR, frames=1, first_frame=0, t_submit=time.perf_counter())
            yield TurnEnd(FinishReason.STOP, frames=1 if seconds else 0)

        return outbox()

    def cancel(self) -> None:
        self.cancelled = True


async def run(seconds: list[float], script: Any, fmt: str = "mp3", sizes: list[int] | None = None,
              **options: Any) -> tuple[Session, list[tuple[str, float]]]:
    """A session over ToneStream(seconds); `script(session)` sends its text; -> (session, [(event, time)]). `sizes`
    collects the audio messages' lengths; `options`: request fields and Session keywords (pad_last_message)."""
    events: list[tuple[str, float]] = []

    async def on_audio(audio: bytes, extra: dict[str, object]) -> None:
        events.append(("audio", time.perf_counter()))
        if sizes is not None:
            sizes.append(len(audio))

    async def on_finish(reason: str, message: str | None) -> None:
        events.append((f"finish {reason}", time.perf_counter()))

    pad = options.pop("pad_last_message", True)
    req = parse_request({"format": fmt, "prosody": {"normalize_loudness": False}, **options})
    session = Session(req, ToneStream(seconds), on_audio, on_finish, "s2", SR,  # type: ignore[arg-type]
                      pad_last_message=pad)
    session.start()
    await script(session)
    return session, events


def test_no_silence_while_the_client_still_has_audio_to_play() -> None:
    """The next sentence comes while the first one's audio is still playing: its audio pushes the held end out,
    and no silence goes between the two."""

    async def script(s: Session) -> None:
        s.text("One.")
        s.flush()
        await asyncio.sleep(0.4)  # the client plays 1.5 s of the first turn
        s.text("Two.")
        await s.stop()

    session, _ = asyncio.run(run([1.5, 1.0], script))
    assert session.audio_seconds == pytest.approx(2.5, abs=1e-6)


@pytest.mark.parametrize("fmt", ["mp3", "opus"])
def test_held_end_released_once_the_client_runs_out(fmt: str) -> None:
    """Nothing follows a short turn: its end comes out with TAIL_PAD_SECONDS of silence once the client is about to
    have played everything, before any `stop`."""

    async def script(s: Session) -> None:
        s.text("One.")
        s.flush()
        await asyncio.sleep(0.3 + TAIL_IDLE_SECONDS + 0.3)
        assert s.audio_seconds == pytest.approx(0.3 + TAIL_PAD_SECONDS, abs=1e-3)
        await s.stop()

    session, events = asyncio.run(run([0.3], script, fmt))
    assert [e for e, _ in events][-1] == "finish stop"
    assert session.audio_seconds == pytest.approx(0.3 + TAIL_PAD_SECONDS, abs=1e-3)  # released once


def test_no_silence_between_sentences_after_a_quiet_stretch() -> None:
    """Playback is estimated from each audio's arrival: after the user talked for a while (no audio), a reply's
    sentences that come while its earlier audio still plays get no silence between them."""

    async def script(s: Session) -> None:
        s.text("One.")
        s.flush()
        await asyncio.sleep(3.0)  # the first reply's end is released; then a quiet stretch (3 s > its audio)
        s.text("Two.")
        s.flush()
        await asyncio.sleep(0.4)  # the client plays 2 s of "Two."
        s.text("Three.")
        await s.stop()

    session, _ = asyncio.run(run([0.3, 2.0, 1.0], script))
    assert session.audio_seconds == pytest.approx(0.3 + TAIL_PAD_SECONDS + 2.0 + 1.0, abs=1e-3)


def test_a_turn_without_audio_keeps_the_last_end_held_until_released() -> None:
    async def script(s: Session) -> None:
        s.text("One.")
        s.flush()
        await asyncio.sleep(0.05)
        s.text("Nothing.")
        s.flush()
        await asyncio.sleep(0.3 + TAIL_IDLE_SECONDS + 0.5)
        assert s.audio_seconds == pytest.approx(0.3 + TAIL_PAD_SECONDS, abs=1e-3)  # released all the same
        await s.stop()

    asyncio.run(run([0.3, 0.0], script))


def test_no_silence_after_a_turn_without_audio() -> None:
    async def script(s: Session) -> None:
        s.text("Nothing.")
        s.flush()
        await asyncio.sleep(TAIL_IDLE_SECONDS + 0.3)
        await s.stop()

    session, events = asyncio.run(run([0.0], script))
    assert session.audio_seconds == 0.0 and [e for e, _ in events] == ["finish stop"]


def test_abort_while_holding_the_end_sends_nothing_after_finish() -> None:
    """A turn queued in the same loop iteration as an abort (a flush, then a bad message or a disconnect): the
    session ends with finish/error and its sender sends nothing more."""

    async def script(s: Session) -> None:
        s.text("One.")
        s.flush()
        await asyncio.sleep(0.05)  # the first turn is out; the end is held
        s.text("Two.")
        s.flush()
        await s.abort("bad message")
        await asyncio.sleep(0.6)
        assert s._sender is not None and s._sender.done()

    _, events = asyncio.run(run([0.5, 0.5], script))
    names = [e for e, _ in events]
    assert "finish error" in names and names[-1] == "finish error", names


@pytest.mark.parametrize("delay", [0.06, 0.35])
def test_a_new_stream_takes_back_one_idle_stream_at_a_time(delay: float) -> None:
    """At capacity, Runtime.open_stream takes back an idle socket's stream, but a slot comes free only a while after
    its close (once no decode step in flight uses it; under GPU load that can take longer than any fixed pause): one
    new session must not take back several, however late the slot frees."""
    from collections import OrderedDict
    from types import SimpleNamespace

    from rtts.pingpong import NoSlotError
    from rtts.runtime import Runtime

    free_at: list[float] = []  # when slots given back come free
    taken: list[int] = []

    class Scheduler:
        def open(self, references: Any) -> str:
            if any(t <= time.monotonic() for t in free_at):
                return "handle"
            raise NoSlotError("full")

        @property
        def releasing(self) -> int:  # closed streams whose slots are not free yet
            return sum(t > time.monotonic() for t in free_at)

    rt = SimpleNamespace(scheduler=Scheduler(), _idle=OrderedDict())
    for i in range(6):
        rt._idle[i] = lambda i=i: (taken.append(i), free_at.append(time.monotonic() + delay))
    t0 = time.monotonic()
    assert asyncio.run(Runtime.open_stream(rt)) == "handle"  # type: ignore[arg-type]
    assert taken == [0] and list(rt._idle) == [1, 2, 3, 4, 5]
    assert time.monotonic() - t0 < delay + 0.2  # taken back at once, not after a fixed pause


def test_a_voice_change_waits_for_its_own_slot() -> None:
    """A socket that changes voice closes its stream and opens another at once: at capacity it waits for its own
    slot to come free rather than taking back another socket's idle stream."""
    from collections import OrderedDict
    from types import SimpleNamespace

    from rtts.pingpong import NoSlotError
    from rtts.runtime import Runtime

    own_free_at = time.monotonic() + 0.25
    taken: list[int] = []

    class Scheduler:
        # The slot's state is read once per open: a refused open means this socket's own slot is still on its way
        # back, whatever the clock says by the time open_stream asks (a busy CI machine can cross own_free_at there).
        pending = True

        def open(self, references: Any) -> str:
            self.pending = time.monotonic() < own_free_at
            if not self.pending:
                return "handle"
            raise NoSlotError("full")

        @property
        def releasing(self) -> int:
            return int(self.pending)

    rt = SimpleNamespace(scheduler=Scheduler(), _idle=OrderedDict())
    rt._idle["other"] = lambda: taken.append(1)
    assert asyncio.run(Runtime.open_stream(rt)) == "handle"  # type: ignore[arg-type]
    assert taken == [] and list(rt._idle) == ["other"]


def test_a_slot_pending_elsewhere_does_not_block_taking_one_back_for_long() -> None:
    """The pending count is the server's: a slot on its way back may go to another opener. After RECLAIM_ANYWAY
    without a slot, open_stream takes back an idle stream regardless (one, not one per retry)."""
    from collections import OrderedDict
    from types import SimpleNamespace

    from rtts import runtime
    from rtts.pingpong import NoSlotError
    from rtts.runtime import Runtime

    free_at: list[float] = []
    taken: list[int] = []

    class Scheduler:
        releasing = 1  # another socket's slot, never this opener's

        def open(self, references: Any) -> str:
            if any(t <= time.monotonic() for t in free_at):
                return "handle"
            raise NoSlotError("full")

    rt = SimpleNamespace(scheduler=Scheduler(), _idle=OrderedDict())
    for i in range(3):
        rt._idle[i] = lambda i=i: (taken.append(i), free_at.append(time.monotonic() + 0.05))
    t0 = time.monotonic()
    assert asyncio.run(Runtime.open_stream(rt)) == "handle"  # type: ignore[arg-type]
    assert taken == [0] and runtime.RECLAIM_ANYWAY <= time.monotonic() - t0 < runtime.SLOT_WAIT


@pytest.mark.parametrize("pad", [True, False])
def test_a_short_last_pcm_message_is_lifted_over_pipecats_floor(pad: bool) -> None:
    """pcm at 16 kHz: the resampler's tail leaves a short last message at the turn's end. Live sessions lift it over
    1024 bytes with silence, which the timeline counts; HTTP's (pad_last_message=False) stay as they are."""

    async def script(s: Session) -> None:
        s.text("One.")
        await s.stop()

    sizes: list[int] = []
    session, _ = asyncio.run(run([0.5], script, "pcm", sizes, sample_rate=16000, pad_last_message=pad))
    samples = sum(sizes) // 2
    assert session.audio_seconds == pytest.approx(samples / 16000, abs=1e-9)
    if pad:
        assert min(sizes) > 1024 and samples > 0.5 * 16000
    else:
        assert min(sizes) <= 1024 and samples == 0.5 * 16000
