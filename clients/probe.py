#!/usr/bin/env python3
"""Latency probe for any Fish-protocol live TTS server: time to first audio (TTFA) and streaming health.

For each concurrency level, N sessions run at once, each on its own WebSocket:
    start (voice prompt prefilled server-side) -> settle -> text + flush (t0) -> first audio (TTFA) -> stop -> finish
and every audio message's arrival time is kept raw. Playback health: with playback starting at the first chunk, a
chunk that arrives after the audio before it has finished playing is an underrun (its lateness is recorded).

    python clients/probe.py --url ws://127.0.0.1:8080 --concurrency 1,16,64 [--reference-id ID] [--api-key KEY]

Writes latency_reports/<date>_<commit>_<name>.json (raw timestamps, config, commit) and a .md table beside it. Where
the server answers `GET /metrics` with rtts's garbage-collector histogram (`rtts_gc_pause_seconds`), the report also
records the collections the server ran during each level (they stop every serving thread).
Needs only `websockets` and `ormsgpack` (or `msgpack`); it imports nothing from the server.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import re
import shlex
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import websockets

try:
    import ormsgpack as _mp

    def pack(o: Any) -> bytes:
        return _mp.packb(o)

    def unpack(b: bytes) -> Any:
        return _mp.unpackb(b)
except ImportError:  # pragma: no cover
    import msgpack as _mp  # type: ignore[no-redef]

    def pack(o: Any) -> bytes:
        return _mp.packb(o, use_bin_type=True)

    def unpack(b: bytes) -> Any:
        return _mp.unpackb(b, raw=False)

TEXT = "Hello! This is a latency probe speaking one short sentence."
BYTES_PER_SAMPLE = 2  # pcm s16le mono


async def one_session(url: str, request: dict[str, Any], text: str, settle: float, headers: dict[str, str],
                      timeout: float) -> dict[str, Any]:
    rec: dict[str, Any] = {"ok": False}
    rate = request.get("sample_rate") or 44100
    t_connect = time.perf_counter()
    async with websockets.connect(url + "/v1/tts/live", additional_headers=headers, max_size=None) as ws:
        rec["connect_s"] = time.perf_counter() - t_connect
        await ws.send(pack({"event": "start", "request": request}))
        await asyncio.sleep(settle)  # the server prefills the voice prompt meanwhile
        t0 = time.perf_counter()
        await ws.send(pack({"event": "text", "text": text}))
        await ws.send(pack({"event": "flush"}))
        chunks: list[tuple[float, int]] = []
        stopped = False
        while True:
            msg = unpack(await asyncio.wait_for(ws.recv(), timeout))
            ev = msg.get("event")
            now = time.perf_counter() - t0
            if ev == "audio":
                chunks.append((now, len(msg.get("audio") or b"")))
                if not stopped:
                    await ws.send(pack({"event": "stop"}))
                    stopped = True
            elif ev == "finish":
                rec["finish"] = msg.get("reason")
                rec["message"] = msg.get("message")
                break
    rec["chunks"] = chunks
    if chunks and rec.get("finish") == "stop":
        rec["ok"] = True
        rec["ttfa_s"] = chunks[0][0]
        # Playback from the first chunk: chunk i must arrive before the audio before it has played out.
        played, worst = 0.0, 0.0
        for t, nbytes in chunks:
            due = chunks[0][0] + played
            worst = max(worst, t - due)
            played += nbytes / BYTES_PER_SAMPLE / rate
        rec["audio_s"] = played
        rec["max_lateness_s"] = worst
        rec["underrun"] = worst > 0.0 and len(chunks) > 1
        rec["rtf"] = (chunks[-1][0] - chunks[0][0]) / played if played else None
    return rec


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
    return xs[k]


async def run_level(args: argparse.Namespace, c: int, request: dict[str, Any], headers: dict[str, str]) -> list[dict]:
    results = await asyncio.gather(*(one_session(args.url, request, args.text, args.settle, headers, args.timeout)
                                     for _ in range(c)), return_exceptions=True)
    out = []
    for r in results:
        out.append({"ok": False, "error": repr(r)} if isinstance(r, BaseException) else r)
    return out


def max_gap(r: dict[str, Any]) -> float:
    """The longest wait between two audio messages of a session, in seconds (0 with fewer than two)."""
    ts = [t for t, _ in r.get("chunks", [])]
    return max((b - a for a, b in zip(ts, ts[1:])), default=0.0)


_GC_LINE = re.compile(r'^rtts_gc_pause_seconds_(sum|count)\{generation="(\d+)"\} (\S+)$')


def gc_snapshot(metrics_url: str) -> dict[str, float] | None:
    """{'<generation> count' / '<generation> sum': value} from the server's /metrics, or None if it has none."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=5) as resp:
            text = resp.read().decode()
    except (OSError, ValueError):
        return None
    out = {f"{m[2]} {m[1]}": float(m[3]) for m in map(_GC_LINE.match, text.splitlines()) if m}
    return out or None


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=False).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    headers = {"model": args.model}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    request: dict[str, Any] = {"text": "", "format": "pcm", "sample_rate": args.sample_rate, "latency": args.latency,
                               "max_new_tokens": args.max_new_tokens}
    if args.reference_id:
        request["reference_id"] = args.reference_id
    if args.top_k is not None:
        request["top_k"] = args.top_k
    metrics_url = args.url.replace("ws://", "http://", 1).replace("wss://", "https://", 1).rstrip("/") + "/metrics"
    levels, server_gc = {}, {}
    for c in [int(x) for x in args.concurrency.split(",")]:
        runs = []
        before = gc_snapshot(metrics_url)
        for _ in range(args.rounds):
            runs += await run_level(args, c, request, headers)
        after = gc_snapshot(metrics_url)
        levels[str(c)] = runs
        if before is not None and after is not None:  # collections during this level: count and seconds
            server_gc[str(c)] = {k: after[k] - before.get(k, 0.0) for k in after}
    return {"levels": levels, "request": request, "server_gc": server_gc}


def full_gcs(d: dict[str, float] | None) -> str:
    """'N (T)': full (generation 2) collections the server ran during a level and their total milliseconds."""
    if not d:
        return "-"
    return f"{d.get('2 count', 0):.0f} ({1000 * d.get('2 sum', 0):.0f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="ws://127.0.0.1:8080")
    p.add_argument("--concurrency", default="1")
    p.add_argument("--rounds", type=int, default=3, help="repetitions of each concurrency level")
    p.add_argument("--text", default=TEXT)
    p.add_argument("--sample-rate", type=int, default=44100)
    p.add_argument("--latency", default="balanced")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--reference-id")
    p.add_argument("--api-key")
    p.add_argument("--model", default="s2-pro")
    p.add_argument("--settle", type=float, default=0.5, help="seconds between start and the text (voice prefill)")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--name", default="probe")
    p.add_argument("--commit", default=None)
    p.add_argument("--hardware", default="", help="free text recorded in the report (GPU, host)")
    p.add_argument("--out", default="latency_reports")
    args = p.parse_args()
    data = asyncio.run(main_async(args))
    data.update({"command": recorded_command(args),
                 "commit": args.commit or commit(), "hardware": args.hardware,
                 "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")})
    rows = ["| concurrency | sessions ok | TTFA p50 ms | p90 ms | p99 ms | underruns | max lateness ms "
            "| max chunk gap ms | RTF mean | server full GCs (ms) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for c, runs in data["levels"].items():
        ok = [r for r in runs if r.get("ok")]
        ttfa = [1000 * r["ttfa_s"] for r in ok]
        rtf = [r["rtf"] for r in ok if r.get("rtf") is not None]
        rows.append(f"| {c} | {len(ok)}/{len(runs)} | {pct(ttfa, 50):.1f} | {pct(ttfa, 90):.1f} | {pct(ttfa, 99):.1f} "
                    f"| {sum(1 for r in ok if r.get('underrun'))} | "
                    f"{1000 * max((r['max_lateness_s'] for r in ok), default=0):.1f} "
                    f"| {1000 * max((max_gap(r) for r in ok), default=0):.1f} "
                    f"| {statistics.mean(rtf) if rtf else float('nan'):.3f} | {full_gcs(data['server_gc'].get(c))} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{datetime.date.today().isoformat()}_{data['commit']}_{args.name}"
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1))
    table = "\n".join(rows)
    (out / f"{stem}.md").write_text(f"# {args.name}\n\n- command: `{data['command']}`\n- commit: `{data['commit']}`\n"
                                    f"- hardware: {args.hardware}\n- date: {data['date']}\n\n{table}\n")
    print(table)
    print(f"wrote {out / stem}.json")


def recorded_command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run, shell-quoted, without the API key (reports are committed)."""
    words = ["python", "clients/probe.py"]
    for k, v in vars(args).items():
        if v is None or k == "api_key":
            continue
        words += [f"--{k.replace('_', '-')}", str(v)]
    if args.api_key:
        words += ["--api-key", "$RTTS_API_KEY"]
    return shlex.join(words).replace("'$RTTS_API_KEY'", '"$RTTS_API_KEY"')


if __name__ == "__main__":
    main()
