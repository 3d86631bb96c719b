"""deploy/ on loopback: deploy/launch.sh starts two `rtts serve` workers (tiny model, CPU) behind HAProxy with the
configuration from deploy/haproxy.cfg. Sessions spread over both; one worker is drained (SIGTERM) in the middle of a
run: its sessions finish with all their audio while new ones go to the other, no session fails, the drained worker
exits 0 and the launcher starts it again; SIGTERM to the launcher drains everything and exits 0. Then the same
configuration in front of a worker that refuses everything with 503 (as a draining worker does before HAProxy's
health checks notice) and a real one: every request is retried on the real one.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from conftest import greedy, s16, system_tool
from liveserver import FLUSH, STOP, free_port, recv_event, start_msg, text_msg, until_finish
from websockets.sync.client import ClientConnection, connect

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
TURNS = ("A first turn, spoken while both workers run.", "A second turn, after one of them began to drain.")
REQUEST = greedy(max_new_tokens=24, sample_rate=8000, timestamps=True)
START_TIMEOUT = 240.0  # two workers loading at once on a slow, shared 2-core machine


def wait_for(what: str, check: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def free_pair() -> int:
    """A free port whose next one is free too (worker i listens on base + i)."""
    while True:
        base = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", base + 1))
                return base
            except OSError:
                continue


def get(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=5)
    except httpx.TransportError:
        return None


def gauge(port: int, name: str) -> float:
    """An unlabelled metric of the worker on `port`, read directly (not through HAProxy)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return float(next(line for line in text.splitlines() if line.startswith(name + " ")).split()[-1])


def servers_up(stats: str) -> dict[str, bool]:
    """HAProxy's view of each worker (its status page as CSV)."""
    r = get(f"http://{stats}/stats;csv")
    if r is None or r.status_code != 200:
        return {}
    rows = [line.split(",") for line in r.text.splitlines() if line.startswith("rtts_workers,")]
    return {row[1]: row[17] == "UP" for row in rows if row[1] != "BACKEND"}


class Launch:
    """deploy/launch.sh with `n` CPU workers on the tiny checkpoint, HAProxy on free loopback ports."""

    def __init__(self, golden: Path, run_dir: Path, n: int = 2) -> None:
        self.port, self.stats, self.base = free_port(), f"127.0.0.1:{free_port()}", free_pair()
        self.run_dir, self.n = run_dir, n
        cmd = ["bash", str(DEPLOY / "launch.sh"), "--workers", str(n), "--device", "cpu",
               "--bind", f"127.0.0.1:{self.port}", "--stats", self.stats, "--base-port", str(self.base),
               "--drain-grace", "60", "--run-dir", str(run_dir), "--",
               "--checkpoint", str(golden / "tiny-s2"), "--max-running", "4", "--max-ctx", "2048",
               "--voices-dir", str(run_dir / "voices")]
        env = {**os.environ, "RTTS": f"{sys.executable} -m rtts", "RTTS_HOME": str(run_dir),
               "HAPROXY": system_tool("haproxy")}
        self.out = (run_dir / "launch.out").open("wb")
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=subprocess.STDOUT, env=env)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(self.run_dir.glob("*.log")) + [self.run_dir / "launch.out"] if p.exists())

    def wait_ready(self) -> None:
        def ready() -> bool:
            assert self.proc.poll() is None, self.logs()
            up = servers_up(self.stats)
            return len(up) == self.n and all(up.values())

        try:
            wait_for("both workers up behind HAProxy", ready, START_TIMEOUT)
        except AssertionError:
            raise AssertionError(self.logs()) from None

    def worker_pid(self, i: int) -> int:
        return int((self.run_dir / f"worker-{i}.pid").read_text())

    def connect(self) -> ClientConnection:
        return connect(f"ws://127.0.0.1:{self.port}/v1/tts/live", max_size=None, max_queue=None, open_timeout=30,
                       proxy=None)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.out.close()


def speech_by_turn(events: list[dict[str, Any]]) -> list[np.ndarray]:
    """A session's samples per turn, without the silence that may end a turn (a short last message's pad)."""
    by_turn: dict[int, bytes] = {}
    for e in events:
        by_turn[e["chunk_seq"]] = by_turn.get(e["chunk_seq"], b"") + e["audio"]
    assert sorted(by_turn) == list(range(len(TURNS))), sorted(by_turn)
    turns = []
    for i in range(len(TURNS)):
        x = s16(by_turn[i]).astype(np.int32)
        loud = np.flatnonzero(np.abs(x) > 1)
        turns.append(x[: loud[-1] + 1] if loud.size else x[:0])
    return turns


def begin(ws: ClientConnection) -> dict[str, Any]:
    """Start a session and its first turn; -> its first audio event (the session stays open)."""
    ws.send(start_msg(**REQUEST))
    ws.send(text_msg(TURNS[0]))
    ws.send(FLUSH)
    ev = recv_event(ws)
    assert ev["event"] == "audio", ev
    return ev


def end(ws: ClientConnection, first: dict[str, Any]) -> list[dict[str, Any]]:
    """The second turn and stop; -> every audio event of the session, its finish checked."""
    ws.send(text_msg(TURNS[1]))
    ws.send(FLUSH)
    ws.send(STOP)
    events, fin = until_finish(ws, timeout=90)
    assert fin == {"event": "finish", "reason": "stop"}, fin
    return [first, *events]


@pytest.fixture(scope="module")
def launch(golden: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launch]:
    """One launch for the module: the retry test borrows a worker, then the drain test (last) ends the launch."""
    system_tool("haproxy")
    lx = Launch(golden, tmp_path_factory.mktemp("launch"))
    try:
        lx.wait_ready()
        yield lx
    finally:
        lx.close()


class _Refuser(http.server.BaseHTTPRequestHandler):
    """A worker that has begun to drain but still passes HAProxy's health check: 503 to everything else."""

    refused: list[str] = []

    def do_GET(self) -> None:
        if self.path == "/v1/health":
            self._answer(200, {"status": "ok"})
        else:
            self.refused.append(f"GET {self.path}")
            self._answer(503, {"status": 503, "message": "server is draining"})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.refused.append(f"POST {self.path}")
        self._answer(503, {"status": 503, "message": "server is draining"})

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except ConnectionError:  # HAProxy's health check hangs up once it has read the status
            pass

    def log_message(self, *args: Any) -> None:
        pass


def test_haproxy_retries_a_refusal_on_another_worker(launch: Launch, tmp_path: Path) -> None:
    refuser = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refuser)
    threading.Thread(target=refuser.serve_forever, daemon=True).start()
    port, stats = free_port(), f"127.0.0.1:{free_port()}"
    cfg = tmp_path / "retry.cfg"
    render = [str(DEPLOY / "render-haproxy.sh"), f"127.0.0.1:{refuser.server_address[1]}", f"127.0.0.1:{launch.base}"]
    cfg.write_text(subprocess.run(render, check=True, capture_output=True, text=True).stdout)
    env = {**os.environ, "RTTS_LB_BIND": f"127.0.0.1:{port}", "RTTS_LB_STATS": stats}
    log = (tmp_path / "retry.log").open("wb")
    proxy = subprocess.Popen([system_tool("haproxy"), "-db", "-f", str(cfg)], stdout=log, stderr=subprocess.STDOUT,
                             env=env)
    try:
        wait_for("both servers up", lambda: servers_up(stats) == {"w0": True, "w1": True})
        # Equal load: least connections takes turns, so the refuser gets every other attempt.
        for _ in range(3):
            with connect(f"ws://127.0.0.1:{port}/v1/tts/live", max_size=None, open_timeout=30, proxy=None) as ws:
                ws.send(start_msg(**greedy(max_new_tokens=4, sample_rate=8000)))
                ws.send(text_msg("Retried."))
                ws.send(STOP)
                events, fin = until_finish(ws)
                assert fin == {"event": "finish", "reason": "stop"} and events
            r = httpx.post(f"http://127.0.0.1:{port}/v1/tts", timeout=60,
                           json={"text": "Retried too.", "format": "pcm", **greedy(max_new_tokens=4)})
            assert r.status_code == 200 and r.content
        assert any(x.startswith("GET /v1/tts/live") for x in _Refuser.refused), _Refuser.refused
        assert any(x.startswith("POST /v1/tts") for x in _Refuser.refused), _Refuser.refused
    finally:
        proxy.terminate()
        proxy.wait(30)
        log.close()
        refuser.shutdown()


def test_a_worker_drains_behind_haproxy_without_losing_a_session(launch: Launch) -> None:
    with contextlib.ExitStack() as sockets:
        drain_one_worker(launch, sockets)
    # The drained worker exits 0 and the launcher starts it again; SIGTERM drains the rest and stops everything.
    wait_for("worker 0 to exit", lambda: "worker 0 exited (status 0)" in (launch.run_dir / "launch.out").read_text())
    launch.proc.send_signal(signal.SIGTERM)
    assert launch.proc.wait(90) == 0, launch.logs()
    out = (launch.run_dir / "launch.out").read_text()
    assert "worker 1 stopped (status 0)" in out and out.rstrip().endswith("launch.sh: stopped"), out


def drain_one_worker(launch: Launch, sockets: contextlib.ExitStack) -> None:
    ports = (launch.base, launch.base + 1)
    # Four sessions through HAProxy, each on its own socket and left open after its first turn: two per worker.
    old = [sockets.enter_context(launch.connect()) for _ in range(4)]
    firsts = [begin(ws) for ws in old]
    assert [gauge(p, "rtts_active_sessions") for p in ports] == [2, 2]

    # Worker 0 drains: it answers 503 from then on, and HAProxy takes it out of rotation.
    os.kill(launch.worker_pid(0), signal.SIGTERM)
    wait_for("worker 0 to drain", lambda: (r := get(f"http://127.0.0.1:{ports[0]}/v1/health")) is not None
             and r.json().get("status") == "draining")
    # New sessions meanwhile all land on worker 1 (one that reached worker 0 first is retried there).
    new = [sockets.enter_context(launch.connect()) for _ in range(2)]
    firsts += [begin(ws) for ws in new]
    assert [gauge(p, "rtts_active_sessions") for p in ports] == [2, 4]
    wait_for("HAProxy to mark worker 0 down", lambda: servers_up(launch.stats).get("w0") is False)

    # Every session finishes, with all its audio: the same greedy speech, turn by turn, whichever worker spoke it.
    sessions = [end(ws, first) for ws, first in zip(old + new, firsts)]
    reference = speech_by_turn(sessions[0])
    assert all(t.size > 4000 for t in reference), [t.size for t in reference]  # half a second at 8 kHz at least
    for events in sessions[1:]:
        for got, ref in zip(speech_by_turn(events), reference):
            assert abs(got.size - ref.size) <= 2, (got.size, ref.size)
            n = min(got.size, ref.size)
            assert np.abs(got[:n] - ref[:n]).max() <= 1
