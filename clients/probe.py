#!/usr/bin/env python3
"""Latency and throughput probe for any Fish-protocol live TTS server.

Two modes, each running N concurrent sessions per level, each on its own WebSocket, and keeping every audio
message's arrival time raw:
- `--mode ttfa` (default): start (the voice prompt prefills server-side) -> settle -> one short text + flush (t0) ->
  first audio (TTFA) -> stop -> finish.
- `--mode throughput`: the sessions open spread over `--stagger` seconds; each sends `--turns` texts of about forty
  tokens with a flush after each (`--max-new-tokens` frames each at most), then stop, so every session keeps generating
  while the others do. The summary gives aggregate delivered frames/s and audio-seconds/s beside TTFA.
Playback health: with playback starting at the first chunk, a chunk that arrives after the audio before it has
finished playing is an underrun (its lateness is recorded).

    python clients/probe.py --url ws://127.0.0.1:8080 --concurrency 1,16,64 [--reference-id ID] [--api-key KEY]
    python clients/probe.py --mode throughput --concurrency 1,16,32,64 --reference-id VOICE
    python clients/probe.py --compare bench/baselines/h200-fp8.json NEW.json    # exit 1 on a regression

Writes latency_reports/<date>_<commit>_<name>.json (raw timestamps, config, commit and a `summary` per concurrency),
a .md table and, with matplotlib, a .png plot beside it. Where the server answers `GET /metrics` with rtts's
garbage-collector histogram (`rtts_gc_pause_seconds`), the report also records the collections the server ran
during each level (they stop every serving thread).
Needs only `websockets` and `ormsgpack` (or `msgpack`); it imports nothing from the server.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import datetime
import io
import json
import math
import re
import shlex
import subprocess
import sys
import time
import urllib.request
import wave
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import probe_report as report  # noqa: E402  (beside this script)

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
# About forty tokens a turn, as a voice agent's reply sentence.
TURN_TEXT = ("Thanks for calling. I can help you change your booking, check the status of an order, or answer a "
             "question about your account today.")


async def one_session(url: str, request: dict[str, Any], texts: list[str], settle: float, headers: dict[str, str],
                      timeout: float, delay: float, level_t0: float, stop_at_first_audio: bool) -> dict[str, Any]:
    """One live session: start (the voice prompt prefills), settle, then every text with a flush (one turn each),
    stop, and the finish. Every audio message's arrival is kept, in seconds since the first text was sent.

    stop_at_first_audio (the ttfa mode) sends the stop right after the first audio; otherwise (the throughput mode)
    it follows the texts at once, so the server generates the turns back to back while the other sessions do the
    same."""
    import websockets  # (here: --compare and --replot need no network stack)

    await asyncio.sleep(delay)
    rec: dict[str, Any] = {"ok": False}
    rate = request.get("sample_rate") or 44100
    t_connect = time.perf_counter()
    async with websockets.connect(url + "/v1/tts/live", additional_headers=headers, max_size=None) as ws:
        rec["connect_s"] = time.perf_counter() - t_connect
        await ws.send(pack({"event": "start", "request": request}))
        await asyncio.sleep(settle)  # the server prefills the voice prompt meanwhile
        t0 = time.perf_counter()
        rec["t_start_s"] = t0 - level_t0
        for text in texts:
            await ws.send(pack({"event": "text", "text": text}))
            await ws.send(pack({"event": "flush"}))
        chunks: list[tuple[float, int]] = []
        stopped = not stop_at_first_audio
        if stopped:
            await ws.send(pack({"event": "stop"}))
        while True:
            msg = unpack(await asyncio.wait_for(ws.recv(), timeout))
            ev = msg.get("event")
            now = time.perf_counter() - t0
            if ev == "audio":
                if msg.get("audio"):
                    chunks.append((now, len(msg["audio"])))
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
        rec.update(report.playback(chunks, rate))
    return rec


def voice_clip(seconds: float, rate: int = 44100, base_hz: float = 140.0,
               harmonics: tuple[int, ...] = (1, 2, 3, 5)) -> bytes:
    """A WAV clip of `seconds` of voiced-sounding audio (a pitch wandering around `base_hz` with `harmonics` and
    syllable-rate loudness): enough for the server to encode a voice prompt of that length; it needs no real speech."""
    n = int(seconds * rate)
    samples = array.array("h")
    phase = 0.0
    for i in range(n):
        t = i / rate
        f0 = base_hz + 30 * math.sin(2 * math.pi * 0.7 * t)
        phase += 2 * math.pi * f0 / rate
        env = 0.5 + 0.5 * math.sin(2 * math.pi * 4.0 * t)
        x = env * sum(math.sin(k * phase) / k for k in harmonics)
        samples.append(int(6000 * x))
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.tobytes())
    return buf.getvalue()


def add_voice(http_url: str, voice_id: str, seconds: float, api_key: str | None) -> None:
    """Store a voice on the server (`POST /v1/references/add`) for the sessions to prefill as `reference_id`."""
    body = pack({"id": voice_id, "audio": voice_clip(seconds),
                 "text": " ".join(["This is the stored voice the probe speaks with."] * max(1, round(seconds / 3)))})
    headers = {"content-type": "application/msgpack"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(http_url + "/v1/references/add", data=body, headers=headers, method="POST")
    with urllib.request.urlopen(req, timeout=300) as resp:
        resp.read()


async def run_level(args: argparse.Namespace, c: int, request: dict[str, Any], headers: dict[str, str],
                    round_no: int) -> list[dict]:
    throughput = args.mode == "throughput"
    texts = [args.text or TURN_TEXT] * args.turns if throughput else [args.text or TEXT]
    # Throughput: sessions open spread over --stagger seconds, so later ones meet a server that is already busy.
    delays = [args.stagger * i / c for i in range(c)] if throughput else [0.0] * c
    level_t0 = time.perf_counter()
    results = await asyncio.gather(*(one_session(args.url, request, texts, args.settle, headers, args.timeout, d,
                                                 level_t0, not throughput) for d in delays),
                                   return_exceptions=True)
    out = []
    for r in results:
        rec = {"ok": False, "error": repr(r)} if isinstance(r, BaseException) else r
        rec["round"] = round_no
        out.append(rec)
    return out


_HIST_LINE = re.compile(r'^rtts_(gc_pause|ttfa_stage)_seconds_(sum|count)\{(?:generation|stage)="(\w+)"\} (\S+)$')


def server_snapshot(metrics_url: str) -> dict[str, dict[str, float]] | None:
    """The server's labelled latency histograms from /metrics: {'gc_pause' | 'ttfa_stage': {'<label> count' /
    '<label> sum': value}}, or None if it has none (another server)."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=5) as resp:
            text = resp.read().decode()
    except (OSError, ValueError):
        return None
    out: dict[str, dict[str, float]] = {}
    for m in map(_HIST_LINE.match, text.splitlines()):
        if m:
            out.setdefault(m[1], {})[f"{m[3]} {m[2]}"] = float(m[4])
    return out or None


def delta(before: dict[str, dict[str, float]] | None, after: dict[str, dict[str, float]] | None,
          name: str) -> dict[str, float] | None:
    """What one histogram family gained between two snapshots."""
    if before is None or after is None or name not in after:
        return None
    old = before.get(name, {})
    return {k: v - old.get(k, 0.0) for k, v in after[name].items()}


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
    max_new = args.max_new_tokens or (200 if args.mode == "throughput" else 256)
    request: dict[str, Any] = {"text": "", "format": "pcm", "sample_rate": args.sample_rate, "latency": args.latency,
                               "max_new_tokens": max_new}
    http_url = args.url.replace("ws://", "http://", 1).replace("wss://", "https://", 1).rstrip("/")
    if args.voice_seconds:
        args.reference_id = args.reference_id or "probe-voice"
        add_voice(http_url, args.reference_id, args.voice_seconds, args.api_key)
    if args.reference_id:
        request["reference_id"] = args.reference_id
    if args.top_k is not None:
        request["top_k"] = args.top_k
    metrics_url = http_url + "/metrics"
    levels, server_gc, stages, summary = {}, {}, {}, {}
    for c in [int(x) for x in args.concurrency.split(",")]:
        runs = []
        before = server_snapshot(metrics_url)
        for k in range(args.rounds):
            runs += await run_level(args, c, request, headers, k)
        after = server_snapshot(metrics_url)
        levels[str(c)] = runs
        summary[str(c)] = asdict(report.summarize(c, runs))
        if (gcs := delta(before, after, "gc_pause")) is not None:  # collections during this level: count and seconds
            server_gc[str(c)] = gcs
        if (ttfa := delta(before, after, "ttfa_stage")) is not None:  # where the server's first-audio time went
            stages[str(c)] = report.stage_means(ttfa)
        s = summary[str(c)]
        print(f"c={c}: {s['sessions_ok']}/{s['sessions']} ok, TTFA p50 {s['ttfa_p50_ms']:.1f} ms, "
              f"{s['frames_per_s']:.0f} frames/s, {s['underruns']} underruns", flush=True)
    return {"levels": levels, "request": request, "server_gc": server_gc, "ttfa_stages_ms": stages,
            "summary": summary, "mode": args.mode,
            "turns": args.turns if args.mode == "throughput" else 1, "stagger": args.stagger}


def write(data: dict[str, Any], out: Path, stem: str, name: str) -> None:
    """The report's JSON, its markdown table and (with matplotlib) its plot, side by side."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(data, indent=None, separators=(",", ":")))
    table = report.markdown(data, name)
    (out / f"{stem}.md").write_text(table)
    if not report.plot(data, out / f"{stem}.png"):
        print("matplotlib is not installed: no plot (rewrite it later with --replot)")
    print(table)
    print(f"wrote {out / stem}.json")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="ws://127.0.0.1:8080")
    p.add_argument("--mode", choices=["ttfa", "throughput"], default="ttfa",
                   help="ttfa: one short turn per session; throughput: every session generates --turns turns")
    p.add_argument("--concurrency", default="1")
    p.add_argument("--rounds", type=int, default=3, help="repetitions of each concurrency level")
    p.add_argument("--turns", type=int, default=3, help="throughput mode: turns per session")
    p.add_argument("--stagger", type=float, default=1.0, help="throughput mode: seconds over which sessions open")
    p.add_argument("--text", default=None, help="the turn's text (default: a short sentence; ~40 tokens in throughput)")
    p.add_argument("--sample-rate", type=int, default=44100)
    p.add_argument("--latency", default="balanced")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="frames per turn at most (default: 200 in throughput mode, 256 in ttfa mode)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--reference-id")
    p.add_argument("--voice-seconds", type=float, default=None,
                   help="first store a synthetic voice clip of this length (as --reference-id, default probe-voice)")
    p.add_argument("--api-key")
    p.add_argument("--model", default="s2-pro")
    p.add_argument("--settle", type=float, default=0.5, help="seconds between start and the text (voice prefill)")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--name", default="probe")
    p.add_argument("--commit", default=None)
    p.add_argument("--hardware", default="", help="free text recorded in the report (GPU, host)")
    p.add_argument("--out", default="latency_reports")
    p.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"),
                   help="compare two reports; exit 1 on a regression at c = 1, 16 or 64 (frames/s -5%%, TTFA +10%%)")
    p.add_argument("--replot", metavar="REPORT", help="rewrite a report's markdown and plot from its JSON")
    args = p.parse_args()
    if args.compare:
        old, new = (json.loads(Path(f).read_text()) for f in args.compare)
        table, regressed = report.compare(old, new)
        print(table)
        sys.exit(1 if regressed else 0)
    if args.replot:
        path = Path(args.replot)
        data = json.loads(path.read_text())
        data["summary"] = report.summaries(data)
        write(data, path.parent, path.stem, path.stem.split("_", 2)[-1])
        return
    data = asyncio.run(main_async(args))
    data.update({"command": recorded_command(args),
                 "commit": args.commit or commit(), "hardware": args.hardware,
                 "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")})
    stem = f"{datetime.date.today().isoformat()}_{data['commit']}_{args.name}"
    write(data, Path(args.out), stem, args.name)


def recorded_command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run, shell-quoted, without the API key (reports are committed)."""
    words = ["python", "clients/probe.py"]
    for k, v in vars(args).items():
        if v is None or k in ("api_key", "compare", "replot"):
            continue
        words += [f"--{k.replace('_', '-')}", str(v)]
    if args.api_key:
        words += ["--api-key", "$RTTS_API_KEY"]
    return shlex.join(words).replace("'$RTTS_API_KEY'", '"$RTTS_API_KEY"')


if __name__ == "__main__":
    main()
