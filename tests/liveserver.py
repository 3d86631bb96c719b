"""A real rtts server (uvicorn on loopback, in a daemon thread) and raw-protocol client helpers for the server tests.

The tiny golden checkpoint is loaded once per test process and shared by every server the tests start (each server
has its own engine, scheduler and voices; the weights and the codec are read-only).
"""

from __future__ import annotations

import functools
import io
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import fish_audio_sdk.websocket
import httpx
import numpy as np
import ormsgpack
import pytest
import soundfile as sf
import torch
from fish_audio_sdk.schemas import StartEvent as LegacyStart
from fish_audio_sdk.schemas import TTSRequest as LegacyRequest
from pydantic import SerializeAsAny
from websockets.sync.client import ClientConnection, connect

from rtts.model.codec import Codec, load_codec
from rtts.model.loading import LoadedModel, load_model
from rtts.runtime import Runtime, ServerConfig
from rtts.ws.server import build_server

RECV_TIMEOUT = 30.0  # a missing `finish` must fail a test, never hang it


@functools.cache
def load_tiny(checkpoint: str) -> tuple[LoadedModel, Codec]:
    return (load_model(checkpoint, device=torch.device("cpu"), dtype=torch.float32),
            load_codec(checkpoint, device=torch.device("cpu"), dtype=torch.float32))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LiveServer:
    """`build_server(...)` + `server.run()` in a daemon thread; ready once `/v1/health` answers 200. The runtime is
    `rt` when given, else one on the config's checkpoint, loaded once per process (load_tiny)."""

    def __init__(self, config: ServerConfig, rt: Runtime | None = None) -> None:
        if rt is None:
            assert config.checkpoint is not None
            loaded, codec = load_tiny(config.checkpoint)
            rt = Runtime(config, loaded=loaded, codec=codec)
        self.config = config
        self.port = config.port
        self.server, self.rt = build_server(config, rt)
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{self.port}", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.http + "/v1/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.05)

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def connect(self, path: str = "/v1/tts/live", key: str | None = None, **kw: Any) -> ClientConnection:
        headers = {"Authorization": f"Bearer {key}"} if key else None
        kw.setdefault("max_size", None)
        return connect(self.ws + path, additional_headers=headers, open_timeout=10, proxy=None, compression=None, **kw)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until every slot is free again (closed sockets release their slots asynchronously)."""
        deadline = time.monotonic() + timeout
        while self.rt.scheduler.slots.free < self.config.max_running:
            if time.monotonic() > deadline:
                raise AssertionError(f"slots still held: {self.rt.scheduler.slots.free} free")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "the server did not shut down"


class ShortLegacyRequest(LegacyRequest):
    """The legacy SDK's schema has no max_new_tokens, so a random-weight model may talk for 1024 frames; this
    subclass adds it (short runs). Over HTTP the request is dumped as is; on the WebSocket it is nested in the SDK's
    StartEvent, which pydantic serializes by the declared type, so tests swap in `ShortLegacyStart` (below)."""

    max_new_tokens: int = 12


class ShortLegacyStart(LegacyStart):
    request: SerializeAsAny[LegacyRequest]  # type: ignore[assignment]


def short_legacy_websocket(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the legacy WebSocket clients send ShortLegacyRequest's extra key (everything else is the SDK's code)."""
    monkeypatch.setattr(fish_audio_sdk.websocket, "StartEvent", ShortLegacyStart)


# ---------------------------------------------------------------------------------------------- raw protocol client


def pack(obj: Any) -> bytes:
    return ormsgpack.packb(obj)


def start_msg(**request: Any) -> bytes:
    return pack({"event": "start", "request": {"text": "", "format": "pcm", "latency": "balanced", **request}})


def text_msg(text: str) -> bytes:
    return pack({"event": "text", "text": text})


FLUSH = pack({"event": "flush"})
STOP = pack({"event": "stop"})
CANCEL = pack({"event": "cancel"})


def recv_event(ws: ClientConnection, timeout: float = RECV_TIMEOUT) -> dict[str, Any]:
    msg = ws.recv(timeout=timeout)
    assert isinstance(msg, bytes), f"the server sent a text frame: {msg!r}"
    ev = ormsgpack.unpackb(msg)
    assert isinstance(ev, dict) and isinstance(ev.get("event"), str), ev
    return ev


def until_finish(ws: ClientConnection, timeout: float = RECV_TIMEOUT) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """-> (audio events, the finish event)."""
    audio: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while True:
        ev = recv_event(ws, max(0.01, deadline - time.monotonic()))
        if ev["event"] == "finish":
            return audio, ev
        if ev["event"] == "audio":
            assert isinstance(ev["audio"], bytes), "audio must be msgpack bin"
            audio.append(ev)


def session(ws: ClientConnection, texts: Iterable[str | bytes], **request: Any) -> tuple[bytes, dict[str, Any]]:
    """start, each text (bytes = a raw message, e.g. FLUSH), stop -> (concatenated audio, finish)."""
    ws.send(start_msg(**request))
    for t in texts:
        ws.send(t if isinstance(t, bytes) else text_msg(t))
    ws.send(STOP)
    audio, fin = until_finish(ws)
    return b"".join(ev["audio"] for ev in audio), fin


def expect_error(ws: ClientConnection, *words: str) -> str:
    """The next finish is reason "error" and its message contains every word (case-insensitive)."""
    audio, fin = until_finish(ws)
    assert fin["reason"] == "error", fin
    message = fin.get("message")
    assert isinstance(message, str) and message, fin
    for w in words:
        assert w.lower() in message.lower(), (w, message)
    return message


def assert_usable(ws: ClientConnection) -> None:
    """A good (short) session still works on this socket."""
    _, fin = session(ws, ["Okay."], max_new_tokens=4, sample_rate=8000)
    assert fin == {"event": "finish", "reason": "stop"}, fin


# ------------------------------------------------------------------------------------------------------------- audio


def reference_wav(golden: Path, seconds: float = 1.0) -> bytes:
    """The codec fixture's 1 s test signal (tiled to `seconds`) as a float32 WAV at 44.1 kHz."""
    sig = np.load(golden / "tiny-s2" / "fixtures" / "codec" / "encode1s.signal.npy").astype(np.float32)
    n = int(round(seconds * 44100))
    sig = np.tile(sig, -(-n // sig.size))[:n]
    buf = io.BytesIO()
    sf.write(buf, sig, 44100, format="WAV", subtype="FLOAT")
    return buf.getvalue()


def decode_audio(data: bytes) -> tuple[np.ndarray, int]:
    """wav/mp3/ogg-opus bytes -> (samples, rate); fails the test if libsndfile cannot read them."""
    samples, rate = sf.read(io.BytesIO(data), dtype="float32")
    return samples, int(rate)


class Streamer(threading.Thread):
    """A good live session on its own socket that keeps speaking until `halt()`, then `stop` and the finish.

    It sends one sentence + flush at a time and the next only once the audio of the last one is streaming (the
    `content` of the audio events, from the timestamps extension), so it never builds a backlog. Records the
    arrival time of every audio event."""

    def __init__(self, srv: LiveServer, **request: Any) -> None:
        super().__init__(daemon=True, name="streamer")
        self.srv = srv
        self.request = {"sample_rate": 8000, "max_new_tokens": 24, "timestamps": True, **request}
        self.times: list[float] = []
        self.finish: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self.first_audio = threading.Event()
        self._halt = threading.Event()

    def run(self) -> None:
        try:
            with self.srv.connect() as ws:
                ws.send(start_msg(**self.request))
                sent, last, last_feed, stopped = 0, "", 0.0, False
                feed = True
                while True:
                    now = time.monotonic()
                    if not self._halt.is_set():
                        if feed or now - last_feed > 2.0:  # (a turn that made no audio at all: move on)
                            last = f"This is sentence number {sent}, spoken in the background."
                            ws.send(text_msg(last + " "))
                            ws.send(FLUSH)
                            sent, last_feed, feed = sent + 1, now, False
                    elif not stopped:
                        ws.send(STOP)
                        stopped = True
                    try:
                        ev = recv_event(ws, 0.05)
                    except TimeoutError:
                        continue
                    if ev["event"] == "audio":
                        self.times.append(time.monotonic())
                        self.first_audio.set()
                        feed = feed or ev.get("content") == last
                    elif ev["event"] == "finish":
                        self.finish = ev
                        return
        except BaseException as e:  # re-raised by halt()
            self.error = e

    def halt(self, timeout: float = RECV_TIMEOUT) -> dict[str, Any]:
        """Stop feeding, wait for the finish; -> the finish event."""
        self._halt.set()
        self.join(timeout)
        assert not self.is_alive(), "the background session did not finish"
        if self.error is not None:
            raise self.error
        assert self.finish is not None
        return self.finish

    def audio_between(self, t0: float, t1: float) -> list[float]:
        return [t for t in self.times if t0 <= t <= t1]


def wait_serving(proc: subprocess.Popen[Any], url: str, ended: Callable[[], str], timeout: float = 120.0) -> None:
    """Until the `rtts serve` process `proc` answers /v1/health at `url`; fails with ended() if it exits first."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, ended()
        try:
            if httpx.get(url + "/v1/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "rtts serve did not start"
        time.sleep(0.2)


def post_json_head(sock: socket.socket, path: str, body: bytes) -> bytes:
    """POST a JSON body on a raw socket and read only the response head (a streamed body's status line comes with its
    first audio); the rest stays unread, for tests of clients that stop reading."""
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (path.encode(), len(body), body))
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    return head
