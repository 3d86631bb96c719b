#!/usr/bin/env python3
"""Soak test for a running rtts server: many concurrent clients doing random things for a set time, then checks.

Each of `--concurrency` clients picks operations at random (seeded) until `--duration` seconds have passed:
live sessions over the WebSocket (with and without a stored or inline voice, every format and latency mode, text in
pieces with flushes, several sessions on one socket), cancels, readers that stop reading for a while, sockets dropped
without a close, malformed messages, `POST /v1/tts` read whole, dropped after the first audio or dropped halfway
through sending its body, and voices added (overwriting) while sessions use them. Every operation has an expected
outcome and a timeout: anything else (a wrong finish, no answer) is a failure. Then it checks:

- every slot is free again (`/v1/health` free_slots == `/v1/info` max_running),
- a fresh live session and a fresh `POST /v1/tts` work,
- no traceback in the server's log (`--server-log`),
- the server's RSS, idle after the run, exceeds its RSS idle after a warm-up of the same load (`--warmup` seconds)
  by at most `--rss-growth-mb` (`--server-pid`: the server runs on this machine). Both are read once the server has
  been idle `--settle` seconds: rtts gives freed heap memory back when idle (rtts/allocator.py), so what is left is
  what the server keeps; the peak under load is reported beside it,
- no operation failed.

It writes `<out>/<date>_<commit>_<name>.json` (command, commit, machine, date, every operation's outcome counts and
durations, the RSS samples, the checks) and a markdown summary beside it, and exits 1 if a check failed.

    python clients/soak.py --url http://127.0.0.1:8080 --concurrency 64 --duration 600 \\
        --server-pid $PID --server-log serve.log --name h200-soak-c64

Needs only `websockets` and `ormsgpack` (the server's own dependencies) and Linux's /proc for the RSS; it imports
nothing from the server.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import ormsgpack
import websockets
from websockets.asyncio.client import ClientConnection

sys.path.insert(0, str(Path(__file__).resolve().parent))
import probe  # noqa: E402  (beside this script)
import soak_report as report  # noqa: E402

FORMATS = {"pcm": (8000, 16000, 24000, 44100), "wav": (16000, 44100), "mp3": (44100,), "opus": (48000,),
           "mulaw": (8000,)}
WORDS = ("hello there the quick brown fox jumps over a lazy dog while we wait for the train to arrive at "
         "platform nine, numbers like 42 and 3.14 appear; does it rain today? café naïve — fine!").split()
REFUSED = "too many concurrent"  # the server at capacity: an expected answer when clients outnumber slots
VOICE_IDS = ("soak-voice-0", "soak-voice-1")


class Failure(Exception):
    """An operation did not end the way it must."""


@dataclass
class Response:
    status: int
    body: bytes

    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.body)


def dechunk(data: bytes) -> bytes:
    """A chunked transfer's payload (what arrived of it)."""
    out, i = bytearray(), 0
    while i < len(data):
        end = data.find(b"\r\n", i)
        if end < 0:
            break
        size = int(data[i:end].split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out += data[end + 2:end + 2 + size]
        i = end + 2 + size + 2
    return bytes(out)


async def http(host: str, port: int, method: str, path: str, body: bytes = b"", content_type: str = "",
               headers: dict[str, str] | None = None, timeout: float = 60.0) -> Response:
    """One HTTP/1.1 request on its own connection (closed after the answer), read whole."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", "Connection: close", f"Content-Length: {len(body)}"]
        lines += [f"Content-Type: {content_type}"] if content_type else []
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    if not status_line.startswith("HTTP/"):
        raise Failure(f"{method} {path}: no HTTP answer ({raw[:80]!r})")
    if any(h.lower().replace(" ", "") == "transfer-encoding:chunked" for h in header_lines):
        payload = dechunk(payload)
    return Response(int(status_line.split()[1]), payload)


@dataclass
class Stats:
    counts: Counter[str] = field(default_factory=Counter)  # "kind:outcome" -> n
    durations: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    failures: list[str] = field(default_factory=list)

    def record(self, kind: str, outcome: str, seconds: float) -> None:
        self.counts[f"{kind}:{outcome}"] += 1
        self.durations[kind].append(seconds)


def pack(obj: Any) -> bytes:
    return ormsgpack.packb(obj)


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + ". "


def voice_clip(seconds: float, seed: int, rate: int = 16000) -> bytes:
    """A WAV clip of voiced-sounding audio (the probe's, a different pitch per seed): any audio makes a voice prompt."""
    return probe.voice_clip(seconds, rate, base_hz=120 + 20 * seed, harmonics=(1, 2, 3))


# ------------------------------------------------------------------------------------------------ the operations


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        base = args.url.rstrip("/")
        self.http = base
        self.ws = base.replace("http://", "ws://", 1).replace("https://", "wss://", 1)
        parts = urlsplit(base)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.stats = Stats()
        self.clips = {i: voice_clip(1.0 + i / 2, i) for i in range(2)}
        self.stored: set[str] = set()  # voice ids added so far
        self.audio_bytes = 0

    # ---------------------------------------------------------------- helpers

    def request(self, rng: random.Random, **extra: Any) -> dict[str, Any]:
        fmt = rng.choice(sorted(FORMATS))
        req: dict[str, Any] = {"text": "", "format": fmt, "sample_rate": rng.choice(FORMATS[fmt]),
                               "latency": rng.choice(["low", "balanced", "normal"]),
                               "max_new_tokens": rng.randint(8, self.args.max_new_tokens), **extra}
        voice = rng.random()
        if voice < 0.3 and self.stored:
            req["reference_id"] = rng.choice(sorted(self.stored))
        elif voice < 0.4:
            i = rng.randrange(2)
            req["references"] = [{"audio": self.clips[i], "text": "A clip of a voice that says nothing at all."}]
        return req

    async def connect(self) -> ClientConnection:
        return await websockets.connect(self.ws + "/v1/tts/live", additional_headers=self.headers, max_size=None,
                                        open_timeout=self.args.timeout, compression=None, proxy=None)

    async def finish(self, ws: ClientConnection, pause: Callable[[int], float] | None = None) -> tuple[int, dict]:
        """Read until the finish: (audio bytes, the finish event). `pause(n)`: seconds to stop reading after the
        n-th audio message (a slow reader)."""
        audio, n = 0, 0
        while True:
            ev = await self.event(ws)
            if ev.get("event") == "finish":
                return audio, ev
            if ev.get("event") == "audio":
                audio += len(ev["audio"])
                n += 1
                if pause is not None and (wait := pause(n)) > 0:
                    await asyncio.sleep(wait)

    async def event(self, ws: ClientConnection) -> dict[str, Any]:
        """The next server event (a msgpack map in a binary message)."""
        msg = await asyncio.wait_for(ws.recv(), self.args.timeout)
        if not isinstance(msg, bytes):
            raise Failure(f"a text frame: {msg!r:.80}")
        ev = ormsgpack.unpackb(msg)
        if not isinstance(ev, dict):
            raise Failure(f"not an event: {ev!r:.80}")
        return ev

    @staticmethod
    def outcome(fin: dict[str, Any], *allowed: str) -> str:
        reason, message = fin.get("reason"), str(fin.get("message", ""))
        if reason == "error" and REFUSED in message:
            return "refused"
        if reason in allowed:
            return str(reason)
        raise Failure(f"finish {reason!r} {message!r:.200}")

    async def speak(self, ws: ClientConnection, rng: random.Random, pause: Callable[[int], float] | None = None,
                    **extra: Any) -> str:
        """One session: start, text in pieces with flushes, stop, its finish (stop, or refused at capacity)."""
        await ws.send(pack({"event": "start", "request": self.request(rng, **extra)}))
        for _ in range(rng.randint(1, 3)):
            await ws.send(pack({"event": "text", "text": sentence(rng, rng.randint(2, 12))}))
            if rng.random() < 0.6:
                await ws.send(pack({"event": "flush"}))
        await ws.send(pack({"event": "stop"}))
        audio, fin = await self.finish(ws, pause)
        self.audio_bytes += audio  # (a turn may end at its first frame: a session without audio is no failure)
        return self.outcome(fin, "stop")

    # ---------------------------------------------------------------- WebSocket operations

    async def ws_sessions(self, rng: random.Random) -> str:
        """One to three sessions one after another on one socket (the later ones may reuse its stream)."""
        async with await self.connect() as ws:
            outcomes = [await self.speak(ws, rng) for _ in range(rng.randint(1, 3))]
        return "refused" if "refused" in outcomes else "stop"

    async def ws_cancel(self, rng: random.Random) -> str:
        async with await self.connect() as ws:
            long = self.request(rng, max_new_tokens=self.args.max_new_tokens)
            await ws.send(pack({"event": "start", "request": long}))
            await ws.send(pack({"event": "text", "text": sentence(rng, 30)}))
            await ws.send(pack({"event": "flush"}))
            if rng.random() < 0.7:  # after the first audio, or at once
                msg = await self.event(ws)
                if msg.get("event") == "finish":
                    return self.outcome(msg, "stop", "cancelled")
            await ws.send(pack({"event": rng.choice(["cancel", "clear"])}))
            _, fin = await self.finish(ws)
            result = self.outcome(fin, "cancelled", "stop")
            if result != "refused":  # the socket takes the next session
                result = "cancelled" if (await self.speak(ws, rng)) != "refused" else "refused"
            return result

    async def ws_slow_reader(self, rng: random.Random) -> str:
        """A client that stops reading for up to two seconds, now and then, while its audio keeps coming."""
        async with await self.connect() as ws:
            return await self.speak(ws, rng, pause=lambda n: rng.uniform(0.5, 2.0) if n % 3 == 1 else 0.0,
                                    max_new_tokens=self.args.max_new_tokens)

    async def ws_drop(self, rng: random.Random) -> str:
        """A socket dropped without a close frame: before its start, mid-text, or mid-audio."""
        ws = await self.connect()
        when = rng.choice(["opened", "started", "audio"])
        if when != "opened":
            await ws.send(pack({"event": "start", "request": self.request(rng)}))
            await ws.send(pack({"event": "text", "text": sentence(rng, 20)}))
            await ws.send(pack({"event": "flush"}))
        if when == "audio":
            await self.event(ws)
        ws.transport.abort()
        return when

    async def ws_bad(self, rng: random.Random) -> str:
        """A malformed message gets finish/error, and the socket then serves a good session."""
        bad = rng.choice([b"\xc1\xff not msgpack", pack({"event": "start", "request": {"format": "wav", "latency": 7}}),
                          pack({"event": "text", "text": "before start"}), pack([1, 2, 3])])
        async with await self.connect() as ws:
            await ws.send(bad)
            _, fin = await self.finish(ws)
            if fin.get("reason") != "error" or not fin.get("message"):
                raise Failure(f"a malformed message got {fin}")
            return await self.speak(ws, rng)

    # ---------------------------------------------------------------- HTTP operations

    def tts_body(self, rng: random.Random) -> bytes:
        req = self.request(rng)
        req["text"] = sentence(rng, rng.randint(3, 15))
        req.pop("references", None)  # (bytes do not go in JSON)
        return json.dumps(req).encode()

    async def call(self, method: str, path: str, body: bytes = b"", content_type: str = "") -> Response:
        return await http(self.host, self.port, method, path, body, content_type, self.headers, self.args.timeout)

    async def http_full(self, rng: random.Random) -> str:
        r = await self.call("POST", "/v1/tts", self.tts_body(rng), "application/json")
        if r.status == 503 and REFUSED in r.text():
            return "refused"
        if r.status != 200 or not r.body:
            raise Failure(f"POST /v1/tts: {r.status} {r.text()[:200]!r}")
        return "ok"

    async def raw_post(self, body: bytes, declared: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        auth = "".join(f"{k}: {v}\r\n" for k, v in self.headers.items())
        writer.write(f"POST /v1/tts HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n{auth}"
                     f"Content-Length: {declared}\r\n\r\n".encode() + body)
        await writer.drain()
        return reader, writer

    async def http_abort_response(self, rng: random.Random) -> str:
        """Dropped after the first bytes of the response (a client that hangs up mid-audio)."""
        body = self.tts_body(rng)
        reader, writer = await self.raw_post(body, len(body))
        first = await asyncio.wait_for(reader.read(4096), self.args.timeout)
        writer.transport.abort()
        if not first:
            raise Failure("POST /v1/tts: the connection closed without a response")
        return "aborted"

    async def http_abort_request(self, rng: random.Random) -> str:
        """Dropped while sending its body (a client that hangs up before the request is complete)."""
        body = self.tts_body(rng)
        _, writer = await self.raw_post(body[: len(body) // 2], len(body))
        await asyncio.sleep(rng.uniform(0.0, 0.3))
        writer.transport.abort()
        return "aborted"

    async def voice_add(self, rng: random.Random) -> str:
        """A stored voice added or overwritten while sessions use it, then a session with it."""
        voice_id = rng.choice(VOICE_IDS)
        i = rng.randrange(2)
        r = await self.call("POST", "/v1/references/add", pack(
            {"id": voice_id, "audio": self.clips[i], "text": "A clip of a voice that says nothing at all."}),
            "application/msgpack")
        if r.status != 200:
            raise Failure(f"references/add: {r.status} {r.text()[:200]!r}")
        self.stored.add(voice_id)
        listed = (await self.call("GET", "/v1/references/list")).json()
        if voice_id not in listed.get("reference_ids", []):
            raise Failure(f"{voice_id} missing from references/list")
        async with await self.connect() as ws:
            return await self.speak(ws, rng, reference_id=voice_id)

    # ---------------------------------------------------------------- the run

    def operations(self) -> list[tuple[str, Callable[[random.Random], Awaitable[str]], float]]:
        return [("ws_sessions", self.ws_sessions, 25), ("ws_cancel", self.ws_cancel, 10),
                ("ws_slow_reader", self.ws_slow_reader, 8), ("ws_drop", self.ws_drop, 12),
                ("ws_bad", self.ws_bad, 5), ("http_full", self.http_full, 10),
                ("http_abort_response", self.http_abort_response, 15),
                ("http_abort_request", self.http_abort_request, 7), ("voice_add", self.voice_add, 3)]

    async def client(self, index: int, deadline: float) -> None:
        rng = random.Random(self.args.seed * 100_000 + index)
        ops = self.operations()
        while time.monotonic() < deadline:
            kind, op, _ = rng.choices(ops, weights=[w for _, _, w in ops])[0]
            t0 = time.monotonic()
            try:
                outcome = await asyncio.wait_for(op(rng), 3 * self.args.timeout)
            except (Failure, asyncio.TimeoutError, OSError, ValueError, websockets.exceptions.WebSocketException) as e:
                outcome = "FAILED"
                what = "no answer in time" if isinstance(e, asyncio.TimeoutError) else f"{type(e).__name__}: {e}"
                self.stats.failures.append(f"{kind}: {what}"[:300])
            self.stats.record(kind, outcome, time.monotonic() - t0)


# ------------------------------------------------------------------------------------------------ after the run


class RssSampler:
    """The server's RSS, sampled every second (/proc/<pid>/statm: the server runs on this machine)."""

    def __init__(self, pid: int | None) -> None:
        self.samples: list[tuple[float, float]] = []  # (seconds since start, MB)
        self.statm = Path(f"/proc/{pid}/statm") if pid is not None else None
        if self.statm is not None and not self.statm.exists():
            raise SystemExit(f"--server-pid {pid}: no such process on this machine")
        self.t0 = time.monotonic()

    def sample(self) -> float | None:
        if self.statm is None:
            return None
        mb = int(self.statm.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
        self.samples.append((round(time.monotonic() - self.t0, 1), round(mb, 1)))
        return mb

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.sample()
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except asyncio.TimeoutError:
                pass

    async def idle_level(self, settle: float) -> float | None:
        """The RSS once the server has been idle `settle` seconds (an idle server gives freed memory back): the median
        of three samples half a second apart."""
        if self.statm is None:
            return None
        await asyncio.sleep(settle)
        levels = []
        for _ in range(3):
            levels.append(self.sample() or 0.0)
            await asyncio.sleep(0.5)
        return round(statistics.median(levels), 1)


async def fresh_session_works(soak: Soak) -> str:
    """A plain session and a plain POST /v1/tts after the soak: '' if both work, else what went wrong."""
    try:
        async with await soak.connect() as ws:
            await ws.send(pack({"event": "start", "request": {"text": "", "format": "pcm", "max_new_tokens": 16}}))
            await ws.send(pack({"event": "text", "text": "A fresh session after the soak."}))
            await ws.send(pack({"event": "stop"}))
            audio, fin = await soak.finish(ws)
            if fin.get("reason") != "stop":
                return f"live session: {fin}"
        body = json.dumps({"text": "And a fresh request.", "format": "wav", "max_new_tokens": 16}).encode()
        r = await soak.call("POST", "/v1/tts", body, "application/json")
        if r.status != 200 or not r.body:
            return f"POST /v1/tts: {r.status} {r.text()[:200]}"
    except (Failure, OSError, ValueError, asyncio.TimeoutError, websockets.exceptions.WebSocketException) as e:
        return f"{type(e).__name__}: {e}"
    return ""


async def slots_back(soak: Soak, max_running: int, timeout: float) -> tuple[bool, Any]:
    deadline = time.monotonic() + timeout
    free: Any = None
    while time.monotonic() < deadline:
        r = await soak.call("GET", "/v1/health")
        free = r.json().get("free_slots") if r.status == 200 else r.json()
        if free == max_running:
            return True, free
        await asyncio.sleep(0.5)
    return False, free


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Warm-up load, idle (baseline RSS), the measured load, idle (end RSS), then the checks."""
    soak = Soak(args)
    log = Path(args.server_log) if args.server_log else None
    offset = log.stat().st_size if log is not None and log.exists() else 0
    info = (await soak.call("GET", "/v1/info")).json()
    max_running = int(info["max_running"])
    rss = RssSampler(args.server_pid)
    stop = asyncio.Event()
    sampler = asyncio.create_task(rss.run(stop))

    async def load(seconds: float, first: int) -> None:
        deadline = time.monotonic() + seconds
        await asyncio.gather(*(soak.client(first + i, deadline) for i in range(args.concurrency)))

    await load(args.warmup, 0)  # the allocator reaches its working set for this load
    ok_warm, _ = await slots_back(soak, max_running, args.timeout)
    baseline = await rss.idle_level(args.settle)
    t0 = time.monotonic()
    await load(args.duration, args.concurrency)
    elapsed = time.monotonic() - t0
    ok_slots, free = await slots_back(soak, max_running, args.timeout)
    end = await rss.idle_level(args.settle)
    stop.set()
    await sampler
    fresh = await fresh_session_works(soak)
    traces = report.tracebacks(log, offset)
    ops: dict[str, Any] = {}
    for key, n in sorted(soak.stats.counts.items()):
        kind, outcome = key.split(":", 1)
        o = ops.setdefault(kind, {"count": 0, "outcomes": {}})
        o["count"] += n
        o["outcomes"][outcome] = n
    for kind, o in ops.items():
        o["p50_s"] = report.percentile(soak.stats.durations[kind], 0.5)
        o["p95_s"] = report.percentile(soak.stats.durations[kind], 0.95)
    checks: dict[str, dict[str, Any]] = {
        "no operation failed": {"ok": not soak.stats.failures, "detail": f"{len(soak.stats.failures)} failed"},
        "every slot free again": {"ok": ok_slots and ok_warm, "detail": f"free_slots {free} of {max_running}"},
        "a fresh session works": {"ok": not fresh, "detail": fresh or "live session and POST /v1/tts"},
    }
    if log is not None:
        checks["no traceback in the server log"] = {"ok": not traces, "detail": f"{len(traces)} tracebacks"
                                                    + (f": {traces[0]}" if traces else "")}
    rss_report: dict[str, Any] = {"bound_mb": args.rss_growth_mb, "samples": rss.samples}
    if end is not None and baseline is not None:
        growth = round(end - baseline, 1)
        rss_report.update(start_mb=rss.samples[0][1], baseline_mb=baseline, end_mb=end, growth_mb=growth,
                          peak_mb=max(mb for _, mb in rss.samples), slope_mb_per_min=report.slope(rss.samples))
        checks["RSS growth under the bound"] = {
            "ok": growth <= args.rss_growth_mb,
            "detail": f"idle after the warm-up {baseline:.0f} MB, idle after the run {end:.0f} MB: {growth:+.0f} MB "
                      f"(bound {args.rss_growth_mb:g}; peak under load {rss_report['peak_mb']:.0f})"}
    return {
        "name": args.name, "command": report.recorded_command(args), "commit": args.commit or report.commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": report.machine(args.hardware), "server": soak.http, "server_info": info,
        "params": {k: v for k, v in vars(args).items() if k not in ("api_key",)}, "elapsed_s": round(elapsed, 1),
        "total_operations": sum(o["count"] for o in ops.values()), "operations": ops,
        "audio_mb_received": round(soak.audio_bytes / 2**20, 1),
        "failures": soak.stats.failures, "tracebacks": traces, "rss": rss_report, "checks": checks,
        "passed": all(c["ok"] for c in checks.values()),
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8080", help="the server (http://host:port)")
    p.add_argument("--concurrency", type=int, default=8, help="clients at once")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of random operations (after the warm-up)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=60, help="the most frames a turn may generate")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds an answer may take before it counts as none")
    p.add_argument("--server-pid", type=int, default=None, help="the server's process (same machine): RSS check")
    p.add_argument("--server-log", default=None, help="the server's log file: traceback check")
    p.add_argument("--warmup", type=float, default=20.0,
                   help="seconds of the same load before the measured run (its idle RSS is the baseline)")
    p.add_argument("--rss-growth-mb", type=float, default=256.0,
                   help="the most the idle RSS may grow from after the warm-up to after the run")
    p.add_argument("--settle", type=float, default=5.0, help="seconds idle before each RSS level is read")
    p.add_argument("--api-key", default=None)
    p.add_argument("--name", default="soak")
    p.add_argument("--commit", default=None)
    p.add_argument("--hardware", default="", help="free text recorded in the report")
    p.add_argument("--out", default="bench/results/soak")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    result = asyncio.run(run(args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{result['date'][:10]}_{result['commit']}_{args.name}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    text = report.markdown(result)
    (out / f"{stem}.md").write_text(text)
    print(text)
    print(f"wrote {out / stem}.json")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
