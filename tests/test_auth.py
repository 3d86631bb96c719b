"""API keys: a server started with one refuses every route but health without it (WebSocket upgrades with 401, HTTP
with a JSON 401), for raw clients and both SDKs, and serves everything with it. PROTOCOL.md §4.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import httpx_ws
import pytest
import websockets
from conftest import tiny_config
from liveserver import LiveServer, ShortLegacyRequest, session, short_legacy_websocket


@pytest.fixture(scope="module")
def auth_srv(golden: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    s = LiveServer(tiny_config(golden, tmp_path_factory.mktemp("voices"), api_keys=("secret",)))
    yield s
    s.stop()


def test_auth(auth_srv: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    from fish_audio_sdk import WebSocketSession
    from fishaudio import FishAudio, TTSConfig

    short_legacy_websocket(monkeypatch)
    # Wrong or missing key: the upgrade is refused with HTTP 401 (the SDK raises WebSocketUpgradeError).
    for key in ("wrong", None):
        with pytest.raises(websockets.exceptions.InvalidStatus) as exc:
            auth_srv.connect(key=key)
        assert exc.value.response.status_code == 401
        assert json.loads(exc.value.response.body or b"{}")["status"] == 401
    with FishAudio(api_key="wrong", base_url=auth_srv.http) as c, pytest.raises(httpx_ws.WebSocketUpgradeError) as up:
        list(c.tts.stream_websocket(iter(["Hello."]), format="pcm"))
    assert up.value.response.status_code == 401
    with WebSocketSession("wrong", base_url=auth_srv.http) as legacy, pytest.raises(httpx_ws.WebSocketUpgradeError):
        list(legacy.tts(ShortLegacyRequest(text="", format="pcm"), iter(["Hello."])))
    for path in ("/v1/tts/live", "/v1/tts/live/with-timestamp"):
        with pytest.raises(websockets.exceptions.InvalidStatus):
            auth_srv.connect(path, key="nope")

    # HTTP routes: 401 JSON.
    with httpx.Client(base_url=auth_srv.http, timeout=30) as h:
        for method, path in (("POST", "/v1/tts"), ("GET", "/v1/references/list"), ("POST", "/v1/references/add"),
                             ("DELETE", "/v1/references/delete"), ("GET", "/model"), ("POST", "/model"),
                             ("GET", "/model/x"), ("PATCH", "/model/x"), ("DELETE", "/model/x")):
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "secret"},
                            {"authorization": "secret Bearer"}):
                r = h.request(method, path, json={"text": "hi"}, headers=headers)
                assert r.status_code == 401, (method, path, headers)
                assert r.json()["status"] == 401 and r.json()["message"]
        assert h.get("/v1/health").status_code == 200  # probes need no key

    # The right key works everywhere.
    short = TTSConfig(format="pcm", max_new_tokens=8)
    with FishAudio(api_key="secret", base_url=auth_srv.http) as good:
        pcm = b"".join(good.tts.stream_websocket(iter(["Authorized."]), config=short))
        assert pcm and len(pcm) % 2 == 0
        assert good.tts.convert(text="Authorized HTTP.", config=short)
    with WebSocketSession("secret", base_url=auth_srv.http) as legacy:
        assert b"".join(legacy.tts(ShortLegacyRequest(text="", format="pcm"), iter(["Legacy."])))
    with auth_srv.connect(key="secret") as ws:
        assert session(ws, ["Raw."], max_new_tokens=4)[1]["reason"] == "stop"
    for scheme in ("Bearer", "bearer", "BEARER"):  # the auth scheme is case-insensitive (RFC 7235)
        r = httpx.get(auth_srv.http + "/v1/references/list", headers={"authorization": f"{scheme} secret"})
        assert r.status_code == 200 and r.json()["reference_ids"] == []
