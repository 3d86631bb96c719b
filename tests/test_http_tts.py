"""The HTTP side of a real server (tiny golden checkpoint, CPU): health, info and metrics, `POST /v1/tts` in
MessagePack and JSON and its errors, JSON errors for unknown paths and methods, the browser demo. PROTOCOL.md §5,
§7-§9.
"""

from __future__ import annotations

import base64
import io
import json
import re

import httpx
import numpy as np
import ormsgpack
import pytest
import soundfile as sf
from conftest import MAX_MESSAGE, MAX_SESSION_TEXT, REF_TEXT, greedy
from liveserver import FLUSH, LiveServer, session
from websockets.sync.client import ClientConnection

# ---------------------------------------------------------------------------------------------------- health, metrics


def test_health_and_info(srv: LiveServer) -> None:
    r = httpx.get(srv.http + "/v1/health")
    assert r.status_code == 200
    assert r.json()["status"] == "ok" and r.json()["free_slots"] == 4
    info = httpx.get(srv.http + "/v1/info").json()
    assert info["sample_rate"] == 44100 and info["max_running"] == 4


def test_metrics(srv: LiveServer, ws: ClientConnection) -> None:
    audio, fin = session(ws, ["Metrics please.", FLUSH], **greedy(max_new_tokens=8))
    assert fin["reason"] == "stop" and audio
    text = httpx.get(srv.http + "/metrics").text
    for name in ("rtts_active_sessions", "rtts_open_connections", "rtts_free_slots", "rtts_ttfa_seconds_bucket",
                 "rtts_frames_generated_total", "rtts_session_errors_total"):
        assert name in text, name
    count = next(line for line in text.splitlines() if line.startswith("rtts_ttfa_seconds_count"))
    assert float(count.split()[-1]) >= 1
    # The first audio's way through the scheduler, stage by stage; the stages are disjoint spans of the turn's path
    stages = {m[1]: float(m[2]) for m in re.finditer(r'^rtts_ttfa_stage_seconds_sum\{stage="(\w+)"\} (\S+)$', text,
                                                   re.M)}
    assert set(stages) == {"queue", "prefill", "frames", "codec_wait", "codec", "outbox"}
    assert all(v >= 0 for v in stages.values()) and stages["prefill"] > 0 and stages["codec"] > 0
    frames = next(line for line in text.splitlines() if line.startswith("rtts_frames_generated_total"))
    assert float(frames.split()[-1]) >= 1
    steps = next(line for line in text.splitlines() if line.startswith("rtts_decode_steps_total"))
    assert float(steps.split()[-1]) >= 1 and "# TYPE rtts_decode_steps_total counter" in text
    import gc

    gc.collect()  # a full pass: the server times every collection of its process
    text = httpx.get(srv.http + "/metrics").text
    full = next(line for line in text.splitlines() if line.startswith('rtts_gc_pause_seconds_count{generation="2"}'))
    assert float(full.split()[-1]) >= 1


def test_unknown_paths_and_methods_answer_json_errors(srv: LiveServer) -> None:
    """The API's JSON error body ({status, message}) for any path or method it does not serve: the legacy SDK
    parses error bodies as JSON."""
    r = httpx.get(srv.http + "/wallet/self/api-credit")
    assert r.status_code == 404 and r.json()["status"] == 404 and "/wallet/self/api-credit" in r.json()["message"]
    r = httpx.put(srv.http + "/v1/tts")
    assert r.status_code == 405 and r.json()["status"] == 405 and r.headers["allow"] == "POST"
    for path, methods in (("/model", {"GET", "HEAD", "POST"}), ("/model/some-id", {"GET", "HEAD", "PATCH", "DELETE"})):
        r = httpx.put(srv.http + path)  # a path several handlers serve: the Allow header lists them all
        assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == methods, r.headers


def test_browser_demo_is_served(srv: LiveServer) -> None:
    """The demo page at `/` and the scripts it loads from /web (not the "not installed" fallback)."""
    page = httpx.get(srv.http + "/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "not installed" not in page.text
    for script in ("app.js", "msgpack.min.js"):
        assert script in page.text
        r = httpx.get(f"{srv.http}/web/{script}")
        assert r.status_code == 200 and len(r.content) > 100, script


# ------------------------------------------------------------------------------------------------------------ /v1/tts


def test_http_tts_msgpack_and_json(srv: LiveServer, ref_wav: bytes) -> None:
    req = {"text": "Hello over HTTP, in several chunks.", "format": "pcm", **greedy()}
    with httpx.Client(base_url=srv.http, timeout=30) as h:
        with h.stream("POST", "/v1/tts", content=ormsgpack.packb(req),
                      headers={"content-type": "application/msgpack", "model": "s2-pro"}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("audio/pcm")
            assert r.headers.get("transfer-encoding") == "chunked"
            chunks = [c for c in r.iter_raw() if c]
        via_msgpack = b"".join(chunks)
        # Streamed as a chunked body (above); how many reads the client needed depends on its timing (one, under
        # CPU load), so the check is on the audio: whole samples, more than the 2 frames of the first chunk.
        assert len(via_msgpack) % 2 == 0 and len(via_msgpack) > 2 * 2048 * 2

        r = h.post("/v1/tts", json=req)
        assert r.status_code == 200 and len(r.content) == len(via_msgpack)
        # Greedy: the same codes both ways. The audio may differ by rounding where the codec batched this stream's
        # chunks with another session's (a different batch takes other float paths), never by more than a few LSB.
        diff = np.abs(np.frombuffer(r.content, np.int16).astype(np.int32) - np.frombuffer(via_msgpack, np.int16))
        assert diff.max() <= 2, diff.max()

        # JSON carries reference audio as base64.
        ref = {"audio": base64.b64encode(ref_wav).decode(), "text": REF_TEXT}
        r = h.post("/v1/tts", json={**req, "format": "wav", "references": [ref]})
        assert r.status_code == 200 and r.content[:4] == b"RIFF"
        r = h.post("/v1/tts", content=ormsgpack.packb({**req, "format": "mp3",
                                                        "references": [{"audio": ref_wav, "text": REF_TEXT}]}),
                   headers={"content-type": "application/msgpack"})
        assert r.status_code == 200
        assert sf.info(io.BytesIO(r.content)).samplerate == 44100


@pytest.mark.parametrize(
    "content,ctype,status,words",
    [
        (b'{"text": "hi"}', "text/plain", 415, ("Content-Type",)),
        (b'{"text": "hi"', "application/json", 400, ("JSON",)),
        (b"\xc1\xc1", "application/msgpack", 400, ("MessagePack",)),
        (json.dumps({"text": "hi", "format": "flac"}).encode(), "application/json", 400, ("format",)),
        (json.dumps({"text": "hi", "format": "pcm", "sample_rate": 22050}).encode(), "application/json", 400,
         ("sample_rate",)),
        (json.dumps({"text": "  "}).encode(), "application/json", 400, ("text",)),
        (json.dumps({"text": "hi", "reference_id": "nobody"}).encode(), "application/json", 400, ("nobody",)),
        (json.dumps({"text": "hi", "references": [{"audio": "bm90IGF1ZGlv", "text": "x"}]}).encode(),
         "application/json", 400, ("reference audio",)),
        (json.dumps({"text": "x" * (MAX_SESSION_TEXT + 1)}).encode(), "application/json", 413, ("text", "limit")),
        (b"0" * (MAX_MESSAGE + 1), "application/json", 413, ("bytes",)),
        (b"[" * 100_000 + b"]" * 100_000, "application/json", 400, ("nests", "deeply")),
    ],
)
def test_http_errors(srv: LiveServer, content: bytes, ctype: str, status: int, words: tuple[str, ...]) -> None:
    r = httpx.post(srv.http + "/v1/tts", content=content, headers={"content-type": ctype}, timeout=30)
    assert r.status_code == status, r.text
    body = r.json()
    assert body["status"] == status and isinstance(body["message"], str)
    for w in words:
        assert w.lower() in body["message"].lower(), (w, body)
