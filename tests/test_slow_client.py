"""Slow and stuck clients (docs/security.md, slow clients): a client that stops reading cannot grow the server's
memory without bound or stall other sessions. Its socket taking nothing for `send_timeout_seconds` ends its session
with an error and gives its slot back at once; a client that reads, but slower than the audio is generated, has its
session ended once `max_unsent_audio_seconds` of audio wait unsent. A client that reads again afterwards finds its
audio, then finish/error saying why.

The clients here are raw sockets with a small receive buffer (a WebSocket library would read into memory on its own
thread), over the WebSocket (the websockets sans-I/O protocol frames and parses) and over HTTP, each while a
neighbour session completes on the same server. Waits are for events (slots back, a finish), with generous timeouts.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from conftest import LONG_TEXT, metric, tiny_config
from liveserver import FLUSH, LiveServer, Streamer, pack, post_json_head, start_msg, text_msg
from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode
from websockets.http11 import Response
from websockets.uri import parse_uri

from rtts.request import Limits

SEND_TIMEOUT = 2.0
# Lots of raw audio quickly: 48 kHz 16-bit PCM, slowed to half speed (twice the samples per generated frame).
HEAVY = {"format": "pcm", "sample_rate": 48000, "prosody": {"speed": 0.5}, "top_k": 1, "max_new_tokens": 1024}
WAIT = 240.0  # generous: a loaded 2-core CI machine generates this tiny model's audio slowly


@pytest.fixture(scope="module")
def slow_srv(golden: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    s = LiveServer(tiny_config(golden, tmp_path_factory.mktemp("voices"),
                               limits=Limits(send_timeout_seconds=SEND_TIMEOUT)))
    quiet_keepalive(s)
    yield s
    s.stop()


def quiet_keepalive(srv: LiveServer) -> None:
    """No WebSocket pings on the connections `srv` accepts from now on. A client that does not read cannot answer
    them (a slow one answers late, behind the audio queued before them), and the keepalive's timeout (40 s) is
    another way to end such a connection, not the one tested here."""
    srv.server.config.ws_ping_interval = None


def _small_socket(srv: LiveServer) -> socket.socket:
    """A TCP socket to `srv` with small buffers at both ends: its receive buffer (the window the server may fill)
    and the server's send buffer for it (_shrink_server_buffer)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window scale is agreed then
    s.settimeout(30)
    s.connect(("127.0.0.1", srv.port))
    _shrink_server_buffer(srv, s)
    return s


def _shrink_server_buffer(srv: LiveServer, client: socket.socket) -> None:
    """A fixed, small kernel send buffer on the server's end of `client` (setting SO_SNDBUF also stops Linux from
    growing it to megabytes): the server's socket then stops taking data after tens of KB, so a client that does
    not read shows within a second or two of audio instead of after minutes of generation on a slow machine. What is
    tested (the server's own bounds) does not depend on it."""
    port = client.getsockname()[1]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for conn in list(srv.server.server_state.connections):
            if getattr(conn, "client", None) == ("127.0.0.1", port):
                conn.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
                return
        time.sleep(0.01)
    raise AssertionError("the server did not accept the connection")


class RawWebSocket:
    """A WebSocket client that reads only when told to (websockets' sans-I/O protocol over a plain socket)."""

    def __init__(self, srv: LiveServer, path: str = "/v1/tts/live") -> None:
        self.sock = _small_socket(srv)
        self.proto = ClientProtocol(parse_uri(srv.ws + path), max_size=None)
        self.proto.send_request(self.proto.connect())
        self._flush()
        while not any(isinstance(e, Response) for e in self._read()):
            pass

    def _flush(self) -> None:
        for data in self.proto.data_to_send():
            if data:
                self.sock.sendall(data)

    def _read(self) -> list[Any]:
        data = self.sock.recv(65536)
        if data:
            self.proto.receive_data(data)
        else:
            self.proto.receive_eof()
        events = self.proto.events_received()
        self._flush()  # pongs to the server's pings, a close reply
        if not data and not events:
            raise EOFError("the server closed the connection")
        return events

    def send(self, message: bytes) -> None:
        self.proto.send_binary(message)
        self._flush()

    def events(self, deadline: float, pause: float = 0.0) -> Iterator[dict[str, Any] | None]:
        """Every server event from here on (None for a close frame), reading as fast as the socket gives, or with
        `pause` seconds after each read (a slow reader: a receive buffer's worth per pause)."""
        while time.monotonic() < deadline:
            time.sleep(pause)
            for ev in self._read():
                if isinstance(ev, Frame) and ev.opcode is Opcode.BINARY:
                    yield msgspec.msgpack.decode(ev.data)
                elif isinstance(ev, Frame) and ev.opcode is Opcode.CLOSE:
                    yield None
        raise TimeoutError("no end of the server's events in time")

    def close(self) -> None:
        self.sock.close()


def _wait_for(what: str, condition: Any, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _free(srv: LiveServer) -> int:
    return srv.rt.scheduler.slots.free


def test_websocket_client_that_stops_reading(slow_srv: LiveServer) -> None:
    srv = slow_srv
    errors = metric(srv, "rtts_session_errors_total")
    stuck = RawWebSocket(srv)
    try:
        stuck.send(start_msg(**HEAVY))
        stuck.send(text_msg(LONG_TEXT))
        stuck.send(FLUSH)
        # It reads nothing from here on. Its session takes a slot, then fills the socket's buffers.
        _wait_for("the stuck session's slot", lambda: _free(srv) < srv.config.max_running, 60)
        neighbour = Streamer(srv)
        neighbour.start()
        assert neighbour.first_audio.wait(60), "the neighbour session never streamed"
        # The stuck session ends by itself: its error counted, its slot back while its socket is still open.
        _wait_for("the stuck session to end", lambda: metric(srv, "rtts_session_errors_total") > errors)
        assert neighbour.halt() == {"event": "finish", "reason": "stop"}  # the neighbour completed meanwhile
        srv.wait_idle(timeout=30)  # (the stuck socket's kept stream included)
        # Reading again, the client finds the audio that was on its way, then the finish saying why, then the close.
        audio = 0
        finish: dict[str, Any] | None = None
        for ev in stuck.events(time.monotonic() + 60):
            if ev is None:
                break
            if ev["event"] == "audio":
                assert finish is None, "audio after the finish"
                audio += len(ev["audio"])
            elif ev["event"] == "finish":
                finish = ev
        assert audio > 0
        assert finish == {"event": "finish", "reason": "error",
                          "message": f"client is not reading audio: the socket accepted nothing for {SEND_TIMEOUT:g} s"}
    finally:
        stuck.close()
    srv.wait_idle(timeout=30)


def test_http_client_that_stops_reading(slow_srv: LiveServer) -> None:
    srv = slow_srv
    errors = metric(srv, "rtts_session_errors_total")
    sock = _small_socket(srv)
    try:
        body = json.dumps({"text": LONG_TEXT, **HEAVY}).encode()
        head = post_json_head(sock, "/v1/tts", body)
        assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower(), head
        # It reads nothing more. Its session ends by itself, its slot back, while a neighbour completes.
        neighbour = Streamer(srv)
        neighbour.start()
        _wait_for("the stuck request's session to end", lambda: metric(srv, "rtts_session_errors_total") > errors)
        assert neighbour.halt() == {"event": "finish", "reason": "stop"}
        srv.wait_idle(timeout=30)
        # Reading again: the audio that was on its way, then a broken chunked body (no terminating chunk), so the
        # client cannot take it for the whole of its audio.
        rest = b""
        while True:
            data = sock.recv(65536)
            if not data:
                break
            rest += data
        assert len(rest) > 0 and not rest.endswith(b"0\r\n\r\n")
    finally:
        sock.close()
    srv.wait_idle(timeout=30)


def test_slow_reader_past_the_unsent_audio_limit(golden: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A client that reads, slowly: its socket takes something before the send timeout every time, but the audio
    waiting for it grows past max_unsent_audio_seconds; the session then ends, and the client reads why."""
    srv = LiveServer(tiny_config(golden, tmp_path_factory.mktemp("voices"),
                                 limits=Limits(send_timeout_seconds=120.0, max_unsent_audio_seconds=2.0)))
    quiet_keepalive(srv)
    try:
        slow = RawWebSocket(srv)
        try:
            slow.send(start_msg(**HEAVY))
            slow.send(text_msg(LONG_TEXT))
            slow.send(FLUSH)
            finish: dict[str, Any] | None = None
            deadline = time.monotonic() + WAIT
            # A receive buffer's worth (a few KB) per 0.1 s: slower than half-speed 48 kHz PCM is made.
            for ev in slow.events(deadline, pause=0.1):
                if ev is not None and ev["event"] == "finish":
                    finish = ev
                    break
            assert finish is not None and finish["reason"] == "error", finish
            assert finish["message"].startswith("client is not reading audio fast enough: "), finish
            assert finish["message"].endswith("the limit is 2 s"), finish
            slow.send(pack({"event": "stop"}))  # the client ends the session the server ended
        finally:
            slow.close()
        srv.wait_idle(timeout=30)
    finally:
        srv.stop()
