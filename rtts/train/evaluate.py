"""Evaluate stage: Whisper tiny.en WER/CER on the held-out sentences (train/heldout.txt, never trained on).

- `source`: the flite voice itself (the floor a voice distilled from it can reach);
- `codec` (with --codec DIR): the source audio encoded and decoded by a trained codec (DEMO_VOICE.md's codec gate:
  within a few points of the source);
- `server`: a checkpoint served by a real rtts server (started in this process on a free loopback port, or one
  already running at --url), each sentence one session on the live WebSocket `/v1/tts/live` with the default
  sampling settings, audio as 16 kHz PCM. A length cap of 3x the source's duration (+1 s) stops a model that never
  stops; such turns finish with reason "length" and are counted.

Both write a JSON report (per-sentence reference, hypothesis, seconds, finish reason, totals) and print a table.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rtts.train import flite, wer
from rtts.train.whisper import Whisper

PCM_RATE = 16000


@dataclass
class Item:
    text: str
    hypothesis: str
    seconds: float
    finish: str
    wer: float
    cer: float


def source_audio(texts: list[str], bundle: Path | None, processes: int) -> list[np.ndarray]:
    voice = flite.find(bundle)
    return [s.audio.astype(np.float32) / 32768.0 for s in flite.synthesize(voice, texts, processes)]


class InProcessServer:
    """`rtts serve --checkpoint DIR` on 127.0.0.1:<free port> in a daemon thread (the live server tests' pattern)."""

    def __init__(self, checkpoint: Path, max_running: int = 2) -> None:
        from rtts.runtime import ServerConfig
        from rtts.ws.server import build_server

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        self.config = ServerConfig(checkpoint=str(checkpoint), port=port, max_running=max_running, max_ctx=2048)
        self.server, self.rt = build_server(self.config)
        self.thread = threading.Thread(target=self.server.run, name="rtts-eval-server", daemon=True)
        self.thread.start()
        self.url = f"ws://127.0.0.1:{port}"
        import httpx

        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the evaluation server did not start")
            time.sleep(0.1)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


def speak_live(url: str, text: str, max_new_tokens: int, timeout: float = 300.0,
               sampling: dict[str, float] | None = None) -> tuple[np.ndarray, str]:
    """One live-WebSocket session: start, the text, flush, stop -> (16 kHz float audio, finish reason). `sampling`:
    request fields such as temperature / top_p (absent: the server's defaults)."""
    import ormsgpack
    from websockets.sync.client import connect

    pack = ormsgpack.packb
    chunks: list[bytes] = []
    with connect(url + "/v1/tts/live", open_timeout=30, max_size=None, proxy=None) as ws:
        ws.send(pack({"event": "start", "request": {"text": "", "format": "pcm", "sample_rate": PCM_RATE,
                                                    "latency": "balanced", "max_new_tokens": max_new_tokens,
                                                    **(sampling or {})}}))
        ws.send(pack({"event": "text", "text": text}))
        ws.send(pack({"event": "flush"}))
        ws.send(pack({"event": "stop"}))
        deadline = time.monotonic() + timeout
        while True:
            msg = ws.recv(timeout=max(0.1, deadline - time.monotonic()))
            if not isinstance(msg, bytes):
                raise RuntimeError(f"the server sent a text frame: {msg[:200]!r}")
            ev: Any = ormsgpack.unpackb(msg)
            if ev.get("event") == "audio":
                chunks.append(ev["audio"])
            elif ev.get("event") == "finish":
                reason = str(ev.get("reason"))
                if reason == "error":
                    raise RuntimeError(f"server error on {text!r}: {ev.get('message')}")
                break
    pcm = np.frombuffer(b"".join(chunks), dtype="<i2").astype(np.float32) / 32768.0
    return pcm, reason


def score_items(asr: Whisper, texts: list[str], audios: list[np.ndarray], finishes: list[str]) -> list[Item]:
    items = []
    for text, audio, finish in zip(texts, audios, finishes):
        hyp = asr.transcribe(audio, PCM_RATE)
        s = wer.score(text, hyp)
        items.append(Item(text, hyp, round(audio.size / PCM_RATE, 3), finish, round(s.wer, 4), round(s.cer, 4)))
    return items


def summary(items: list[Item]) -> dict[str, Any]:
    total = wer.corpus([(i.text, i.hypothesis) for i in items])
    return {"sentences": len(items), "wer": round(total.wer, 4), "cer": round(total.cer, 4),
            "seconds": round(sum(i.seconds for i in items), 2),
            "finish": {r: sum(1 for i in items if i.finish == r) for r in sorted({i.finish for i in items})}}


def resynthesized(codec_dir: Path, audios: list[np.ndarray]) -> list[np.ndarray]:
    """The source audio through the codec (encode, decode), loaded by the server's loader: the codec's own ceiling."""
    import torch

    from rtts.model.codec import encode_audio, load_codec

    codec = load_codec(codec_dir)
    if codec.config.sample_rate != PCM_RATE:
        raise ValueError(f"the codec runs at {codec.config.sample_rate} Hz; this check feeds it {PCM_RATE} Hz")
    out = []
    with torch.inference_mode():
        for audio in audios:
            codes = encode_audio(codec, audio.astype(np.float32))
            out.append(codec.decode(codes[None])[0, : audio.size].float().numpy())
    return out


def evaluate(texts: list[str], out: Path, checkpoint: Path | None = None, url: str | None = None,
             bundle: Path | None = None, processes: int = 1, threads: int = 1,
             codec_dir: Path | None = None, sampling: dict[str, float] | None = None) -> dict[str, Any]:
    """Score the source voice; the codec's resynthesis of it when `codec_dir` is given; the served checkpoint when
    one is given (`checkpoint` or `url`)."""
    asr = Whisper.load(threads=threads)
    t0 = time.perf_counter()
    src = source_audio(texts, bundle, processes)
    source_items = score_items(asr, texts, src, ["stop"] * len(src))
    report: dict[str, Any] = {"source": {"items": [asdict(i) for i in source_items], "summary": summary(source_items)}}
    if codec_dir is not None:
        items = score_items(asr, texts, resynthesized(codec_dir, src), ["stop"] * len(src))
        report["codec"] = {"codec": str(codec_dir), "items": [asdict(i) for i in items], "summary": summary(items)}
    if checkpoint is not None or url is not None:
        server = InProcessServer(checkpoint) if url is None and checkpoint is not None else None
        try:
            target = url or (server.url if server else "")
            audios, finishes = [], []
            for text, ref in zip(texts, src):
                cap = int(np.ceil((3 * ref.size / PCM_RATE + 1.0) * _frame_rate(checkpoint)))
                audio, finish = speak_live(target, text, cap, sampling=sampling)
                audios.append(audio)
                finishes.append(finish)
        finally:
            if server is not None:
                server.stop()
        items = score_items(asr, texts, audios, finishes)
        report["server"] = {"checkpoint": str(checkpoint or url), "sampling": sampling or "server defaults",
                            "items": [asdict(i) for i in items], "summary": summary(items)}
        ratio = [i.seconds / max(s.size / PCM_RATE, 1e-3) for i, s in zip(items, src)]
        report["server"]["summary"]["length_ratio_median"] = round(float(np.median(ratio)), 3)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    return report


def _frame_rate(checkpoint: Path | None) -> float:
    if checkpoint is None:
        return 50.0  # an external server: a generous cap (more frames than any codec here makes per second)
    cfg = json.loads((checkpoint / "codec_config.json").read_text()) if (checkpoint / "codec_config.json").is_file() \
        else {"sample_rate": 44100, "frame_length": 2048}
    return float(cfg["sample_rate"]) / float(cfg["frame_length"])


def table(report: dict[str, Any]) -> str:
    rows = ["| voice | sentences | WER | CER | audio s | finish |", "|---|---|---|---|---|---|"]
    for name in ("source", "codec", "server"):
        if name in report:
            s = report[name]["summary"]
            rows.append(f"| {name} | {s['sentences']} | {100 * s['wer']:.1f} % | {100 * s['cer']:.1f} % | "
                        f"{s['seconds']:.1f} | {s['finish']} |")
    return "\n".join(rows)
