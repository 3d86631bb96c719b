"""Faults are contained to their stream: an exception injected (monkeypatched) into each worker (prefill, decode,
codec, the session's audio encoder) fails the session it hit with a clear error, while a neighbour session on another
socket completes, a fresh session works, and every slot comes back. A worker that dies anyway (a device error, a run
of failing batches) fails the server: open turns end with an error, /v1/health answers 503 with the reason, new
sessions are refused, and `rtts serve` exits with status 3."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from conftest import greedy, tiny_config
from fakes import FakeCodec, FakeEngine
from liveserver import (
    STOP,
    LiveServer,
    Streamer,
    assert_usable,
    expect_error,
    free_port,
    start_msg,
    text_msg,
    until_finish,
    wait_serving,
)

from rtts.audio.encode import StreamEncoder
from rtts.engine.engine import Engine
from rtts.model.loading import LoadedModel, load_model
from rtts.pingpong import Scheduler, SchedulerConfig, TurnEnd, WorkerFailed
from rtts.pingpong.codec_stage import CodecWorker
from rtts.pingpong.device import Device
from rtts.pingpong.faults import MAX_BATCH_FAULTS
from rtts.pingpong.outbox import Outbox
from rtts.pingpong.state import CodecFrames, Stream, Turn
from rtts.types import FinishReason, SamplingParams

VICTIM = "Faulty words end this session."
VICTIM_SEED = 4242
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def fsrv(golden: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    s = LiveServer(tiny_config(golden, tmp_path_factory.mktemp("voices")))
    yield s
    s.stop()


def wait_for(cond: Callable[[], bool], timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.01)


def victim_over_ws(srv: LiveServer, words: tuple[str, ...], **request: Any) -> None:
    """The victim's session ends with finish/error naming the fault; the same socket then serves a good session."""
    with srv.connect() as ws:
        ws.send(start_msg(**greedy(**{"seed": VICTIM_SEED, "sample_rate": 8000, "max_new_tokens": 30, **request})))
        ws.send(text_msg(VICTIM + " "))
        ws.send(STOP)
        expect_error(ws, *words)
        assert_usable(ws)


def victim_over_http(srv: LiveServer, words: tuple[str, ...], **request: Any) -> None:
    """POST /v1/tts for the victim: a 5xx JSON error naming the fault, or, once audio went out, a body that breaks
    off (the client sees an incomplete chunked transfer, never a complete-looking short file)."""
    body = greedy(**{"text": VICTIM, "seed": VICTIM_SEED, "format": "pcm", "sample_rate": 8000, "max_new_tokens": 30,
                     **request})
    with httpx.Client(timeout=TIMEOUT) as client, client.stream("POST", srv.http + "/v1/tts", json=body) as r:
        if r.status_code != 200:
            assert r.status_code >= 500, r.status_code
            message = r.read().decode()
            for w in words:
                assert w.lower() in message.lower(), (w, message)
            return
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            r.read()


def contained(srv: LiveServer, words: tuple[str, ...], **victim: Any) -> None:
    """The fault scenario: a neighbour streams throughout, the victim fails (WebSocket, then HTTP), the neighbour
    finishes normally, a fresh session works, and every slot is free again."""
    neighbour = Streamer(srv)
    neighbour.start()
    assert neighbour.first_audio.wait(TIMEOUT), "the neighbour session never streamed"
    victim_over_ws(srv, words, **victim)
    victim_over_http(srv, words, **victim)
    t = time.monotonic()
    wait_for(lambda: any(x > t for x in neighbour.times))  # it still streams after the faults
    assert neighbour.halt() == {"event": "finish", "reason": "stop"}
    with srv.connect() as ws:
        assert_usable(ws)
    srv.wait_idle(30)
    assert srv.rt.failure is None
    assert httpx.get(srv.http + "/v1/health").json()["free_slots"] == srv.config.max_running


def test_a_prefill_fault_fails_only_its_session(fsrv: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    real = Engine.set_params

    def set_params(self: Engine, slot: int, params: SamplingParams) -> None:
        if params.seed == VICTIM_SEED:  # what a repetition_penalty beyond float32 did before validation caught it
            raise RuntimeError("value cannot be converted to type float without overflow")
        real(self, slot, params)

    monkeypatch.setattr(Engine, "set_params", set_params)
    contained(fsrv, ("prefill failed", "overflow"))


def test_a_decode_fault_in_one_row_fails_only_its_session(fsrv: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step whose row for the victim is garbage (a finish code no reason has): that row's session fails, the
    other rows of the same step go on."""
    real = Engine.decode_batch
    running = fsrv.rt.scheduler.decode.running  # read on the decode thread, which owns it

    def decode_batch(self: Engine, slots: list[int], kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        cols, finish = real(self, slots, kv_len)
        bad = [i for i, s in enumerate(slots) if VICTIM in running[s].turn.text]
        if bad:
            finish = finish.clone()
            finish[bad] = 99
        return cols, finish

    monkeypatch.setattr(Engine, "decode_batch", decode_batch)
    contained(fsrv, ("decode failed", "99"))


def test_a_codec_fault_fails_only_its_session(fsrv: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    real = CodecWorker._deliver

    def deliver(self: CodecWorker, a: Any, samples: Any, n: int) -> None:
        if VICTIM in a.turn.text:
            raise ValueError("injected codec fault")
        real(self, a, samples, n)

    monkeypatch.setattr(CodecWorker, "_deliver", deliver)
    contained(fsrv, ("codec failed", "injected codec fault"))


def test_an_audio_encoder_fault_fails_only_its_session(fsrv: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The session's encoder (loudness, resampling, the format) runs on the event loop: its fault ends that session
    only (the victim asks for 16 kHz, everyone else for 8 kHz)."""
    real = StreamEncoder.push

    def push(self: StreamEncoder, pcm: Any) -> bytes:
        if self.spec.sample_rate == 16000:
            raise ValueError("injected encoder fault")
        return real(self, pcm)

    monkeypatch.setattr(StreamEncoder, "push", push)
    contained(fsrv, ("internal error", "injected encoder fault"), sample_rate=16000)


def test_a_failed_decode_step_fails_its_streams_and_the_server_goes_on(fsrv: LiveServer,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A batched step that raises is one computation: the streams in it fail, nothing else; the next step runs."""
    real = Engine.decode_batch
    running = fsrv.rt.scheduler.decode.running
    fired: list[int] = []

    def decode_batch(self: Engine, slots: list[int], kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not fired and any(VICTIM in running[s].turn.text for s in slots):
            fired.append(len(slots))
            raise RuntimeError("injected step fault")
        return real(self, slots, kv_len)

    monkeypatch.setattr(Engine, "decode_batch", decode_batch)
    victim_over_ws(fsrv, ("decode failed", "injected step fault"))
    assert fired
    with fsrv.connect() as ws:
        assert_usable(ws)
    fsrv.wait_idle(30)
    assert fsrv.rt.failure is None and fsrv.rt.scheduler.decode.faults.batch_faults == 0


# ------------------------------------------------------------------------------------------- scheduler level


@pytest.fixture(scope="module")
def tiny(golden: Path) -> LoadedModel:
    return load_model(golden / "tiny-s2")


def drain(outbox: Any) -> TurnEnd:
    while True:
        item = outbox.get(timeout=TIMEOUT)
        if isinstance(item, TurnEnd):
            return item


def test_a_faulted_stream_fails_its_later_turns_and_a_new_stream_works(tiny: LoadedModel,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault in one stream's prompt set-up (what a repetition_penalty beyond float32 did in Engine.set_params
    before requests were range-checked): its turn fails, the prefill thread lives, another stream's turn runs; the
    faulted stream's later turns fail too (its state is suspect), a new stream works, and the slots come back."""
    engine = FakeEngine(tiny, 2, max_ctx=512)
    real = engine.set_params

    def set_params(slot: int, params: SamplingParams) -> None:
        if params.seed == VICTIM_SEED:
            raise RuntimeError("value cannot be converted to type float without overflow")
        real(slot, params)

    monkeypatch.setattr(engine, "set_params", set_params)
    with Scheduler(engine, FakeCodec(), SchedulerConfig()) as sch:  # type: ignore[arg-type]
        bad, good = sch.open(), sch.open()
        end = drain(bad.speak("hello", SamplingParams(seed=VICTIM_SEED)))
        assert end.reason == FinishReason.ERROR and "prefill failed" in end.message and "overflow" in end.message
        assert drain(good.speak("hello", SamplingParams(seed=2))).ok
        assert drain(bad.speak("again", SamplingParams(seed=3))).reason == FinishReason.ERROR
        bad.close()
        wait_for(lambda: sch.slots.free == 1)  # (a closed stream's slot comes back asynchronously)
        again = sch.open()
        assert drain(again.speak("hello", SamplingParams(seed=4))).ok
        for h in (good, again):
            h.close()
        wait_for(lambda: sch.slots.free == 2)
        assert sch.failure is None and sch.prefill.faults.batch_faults == 0


def test_a_worker_that_keeps_failing_dies_and_fails_the_scheduler(tiny: LoadedModel,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Every decode step raising: each turn fails alone until MAX_BATCH_FAULTS steps in a row have failed with no
    success between them; then the worker gives up, the scheduler fails (once) and refuses new streams."""
    engine = FakeEngine(tiny, 2, max_ctx=512)

    def broken(*a: object, **k: object) -> None:
        raise RuntimeError("injected: every step fails")

    failures: list[str] = []
    with Scheduler(engine, FakeCodec(), SchedulerConfig()) as sch:  # type: ignore[arg-type]
        sch.on_failure = failures.append
        monkeypatch.setattr(engine, "decode_batch", broken)
        h = sch.open()
        for i in range(MAX_BATCH_FAULTS - 1):
            end = drain(h.speak("hello", SamplingParams(seed=i)))
            assert end.reason == FinishReason.ERROR and "injected" in end.message
            h.close()
            wait_for(lambda: sch.slots.free == 2)  # a closed stream's slot comes back asynchronously
            h = sch.open()
        assert sch.failure is None
        wait_for(lambda: sch.slots.free == 1)
        waiting = sch.open()  # a stream with a turn queued when the worker dies: its turn ends too
        outbox = h.speak("the last straw", SamplingParams(seed=99))
        end = drain(outbox)
        assert end.reason == FinishReason.ERROR
        wait_for(lambda: bool(failures))  # (told from the dying thread, which ends after that)
        sch._threads[1].join(TIMEOUT)
        assert failures == [sch.failure] and "rtts-decode" in sch.failure and "in a row" in sch.failure
        assert not sch._threads[1].is_alive()
        end = drain(waiting.speak("anyone there?", SamplingParams(seed=5)))
        assert end.reason == FinishReason.ERROR and "server failed" in end.message
        with pytest.raises(WorkerFailed):
            sch.open()


def test_a_failed_step_ends_its_turn_with_an_error_while_the_codec_holds_frame_0(
        tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """The interleaving that made a failed turn look cancelled: the codec thread has taken the turn's frame 0 from its
    inbox, the decode thread's step fails and stops the turn, and only then does the codec pick its ready turns (the
    turn's final ERROR still queued behind). The turn ends with the step's error, not CANCELLED. Events pin the order:
    the step raises once the codec holds frame 0, and the codec goes on once the decode thread has retired the turn."""
    engine = FakeEngine(tiny, 2, max_ctx=512)
    sch = Scheduler(engine, FakeCodec(), SchedulerConfig())  # type: ignore[arg-type]
    codec, decode = sch.codec_worker, sch.decode
    took_frame0, retired = threading.Event(), threading.Event()
    held: list[bool] = []
    real_drain, real_retire = codec._drain, decode._retire

    def drain_then_hold(block: bool) -> bool:
        going_on = real_drain(block)
        if not held and any(not a.final for a in codec.pending.values()):
            took_frame0.set()
            held.append(retired.wait(TIMEOUT))
        return going_on

    def step(*a: object, **k: object) -> None:
        took_frame0.wait(TIMEOUT)
        raise RuntimeError("injected step fault")

    def retire(*a: Any, **k: Any) -> None:
        real_retire(*a, **k)
        retired.set()

    monkeypatch.setattr(codec, "_drain", drain_then_hold)
    monkeypatch.setattr(decode, "_retire", retire)
    monkeypatch.setattr(engine, "decode_batch", step)
    with sch:
        h = sch.open()
        end = drain(h.speak("hello", SamplingParams(seed=1)))
        assert held == [True], "the interleaving was not reached"
        assert end.reason == FinishReason.ERROR and "decode failed" in end.message and "injected" in end.message, end
        h.close()
        wait_for(lambda: sch.slots.free == 2)
        assert sch.failure is None


@pytest.mark.parametrize("stop", ["fault", "cancel"])
def test_the_codec_ends_a_stopped_turn_as_its_stop_says(tiny: LoadedModel, stop: str) -> None:
    """A turn stopped while the codec holds frames of it and before any final message: a fault's stop (Turn.fail, as
    the workers and a server failure call it) ends it with ERROR and the fault's message, the client's cancel with
    CANCELLED and no message."""
    worker = CodecWorker(FakeCodec(), Device(torch.device("cpu")), 3)  # type: ignore[arg-type]
    stream = Stream(0)
    turn = Turn("hello", SamplingParams(), Outbox())
    worker.inbox.put(CodecFrames(stream, turn, np.zeros((1, 10), dtype=np.int64)))
    assert worker._drain(block=False)
    if stop == "fault":
        turn.fail("server failed (injected); retry on a restarted server")
    else:
        turn.cancelled = True
    worker._decode(worker._ready())
    end = turn.outbox.get(timeout=TIMEOUT)
    assert isinstance(end, TurnEnd) and end.frames == 0 and not worker.pending
    if stop == "fault":
        assert end.reason == FinishReason.ERROR and end.message.startswith("server failed (injected)"), end
    else:
        assert end.reason == FinishReason.CANCELLED and end.message == "", end


# ----------------------------------------------------------------------------------------- the server fails


def test_a_device_error_fails_the_server(golden: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA error is sticky: the worker dies at once. The server reports it (health 503 with the reason, the hook
    the CLI uses to exit), open sessions end with an error, new ones are refused over both transports."""
    srv = LiveServer(tiny_config(golden, tmp_path, max_running=2))
    try:
        seen: list[str] = []
        srv.rt.failure_hooks.append(seen.append)

        def device_error(*a: object, **k: object) -> None:
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered (injected)")

        monkeypatch.setattr(Engine, "decode_batch", device_error)
        with srv.connect() as ws:
            ws.send(start_msg(**greedy(sample_rate=8000)))
            ws.send(text_msg(VICTIM + " "))
            ws.send(STOP)
            _, fin = until_finish(ws)
            assert fin["reason"] == "error" and "server failed" in fin["message"], fin
            wait_for(lambda: bool(seen))
            assert srv.rt.failure == seen[0] and "device error" in seen[0]
            r = httpx.get(srv.http + "/v1/health")
            assert r.status_code == 503 and r.json() == {"status": "failed", "reason": srv.rt.failure}
            ws.send(start_msg(**greedy(sample_rate=8000)))  # the socket's kept stream: its turns fail at once
            ws.send(text_msg("Hello again. "))
            ws.send(STOP)
            expect_error(ws, "server failed")
        with srv.connect() as ws:  # a new socket: refused at its start, and told why
            ws.send(start_msg(**greedy(sample_rate=8000)))
            expect_error(ws, "server failed")
        r = httpx.post(srv.http + "/v1/tts", json={"text": "Hello.", "format": "pcm"}, timeout=TIMEOUT)
        assert r.status_code == 503 and "server failed" in r.json()["message"]
    finally:
        srv.stop()


EXIT_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from rtts.engine.engine import Engine
    from rtts.runtime import Runtime

    armed = []  # the fault waits for the server to be up (the warm-up decodes too)
    real_start, real_step = Runtime.start, Engine.decode_batch

    def start(self):
        real_start(self)
        armed.append(True)

    def decode_batch(self, slots, kv_len):
        if armed:
            raise torch.AcceleratorError("CUDA error: injected by test_faults")
        return real_step(self, slots, kv_len)

    Runtime.start, Engine.decode_batch = start, decode_batch
    from rtts.__main__ import main
    main(sys.argv[1:])
""")


def test_rtts_serve_exits_with_status_3_when_a_worker_dies(golden: Path, tmp_path: Path) -> None:
    """The whole process: `rtts serve` with a decode step that fails with a device error once serving. The session
    gets its error, health says failed, and the process ends by itself with status 3 (a supervisor restarts it)."""
    port = free_port()
    cmd = [sys.executable, "-c", EXIT_SCRIPT, "serve", "--checkpoint", str(golden / "tiny-s2"), "--port", str(port),
           "--max-running", "2", "--max-ctx", "1024", "--voices-dir", str(tmp_path / "voices")]
    env = {**os.environ, "RTTS_HOME": str(tmp_path / "home")}
    log = (tmp_path / "serve.log").open("w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_serving(proc, url, lambda: "rtts serve ended before serving")
        r = httpx.post(url + "/v1/tts", json={"text": "Hello there.", "format": "pcm", "max_new_tokens": 8},
                       timeout=TIMEOUT)
        assert r.status_code == 500 and "server failed" in r.json()["message"], r.text
        health = httpx.get(url + "/v1/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert proc.wait(timeout=60) == 3
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.seek(0)
        output = log.read()
        log.close()
    assert "device error" in output and "exiting with status 3" in output, output[-3000:]
