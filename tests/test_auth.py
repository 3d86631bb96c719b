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


# ------------------------------------------------------------------------------------------- the rules, one by one


def _guarded_requests(srv: LiveServer) -> list[tuple[str, str]]:
    """(method, path) of every HTTP route the app serves that is not open, read from the app itself: a route added
    later is in this list without anyone editing the test."""
    from starlette.routing import Route

    from rtts.ws.auth import is_open

    app = srv.server.config.app
    out = []
    for route in app.routes:
        if isinstance(route, Route) and not is_open(route.path):
            path = route.path.replace("{model_id}", "x")
            out += [(m, path) for m in sorted(route.methods or ()) if m != "HEAD"]
    return out


def test_every_guarded_route_needs_the_key(auth_srv: LiveServer) -> None:
    routes = _guarded_requests(auth_srv)
    writes = {(m, p) for m, p in routes if m in ("POST", "PATCH", "DELETE", "PUT")}
    for must in (("POST", "/v1/references/add"), ("DELETE", "/v1/references/delete"), ("POST", "/v1/references/delete"),
                 ("POST", "/model"), ("PATCH", "/model/x"), ("DELETE", "/model/x"), ("POST", "/v1/tts")):
        assert must in writes, must  # the routes that change state are among those checked
    with httpx.Client(base_url=auth_srv.http, timeout=30) as h:
        for method, path in routes:
            # A key in the query string is for WebSocket upgrades only (browsers cannot set their headers).
            for headers, params in (({}, {}), ({"authorization": "Bearer wrong"}, {}), ({}, {"api_key": "secret"}),
                                    ({"authorization": "Basic secret"}, {})):
                r = h.request(method, path, json={"id": "v", "text": "hi"}, headers=headers, params=params)
                assert r.status_code == 401, (method, path, headers, params, r.status_code)
                body = r.json()
                assert body.get("status") == 401 or body["error"]["code"] == "invalid_api_key", body
        # With the key, no route answers 401 (what else it answers depends on the body sent).
        for method, path in routes:
            r = h.request(method, path, json={}, headers={"authorization": "Bearer secret"})
            assert r.status_code != 401, (method, path)


def test_open_routes_need_no_key(auth_srv: LiveServer) -> None:
    from rtts.ws.auth import OPEN_PATHS

    assert OPEN_PATHS == {"/", "/favicon.ico", "/v1/health", "/v1/info", "/metrics"}  # docs/security.md lists these
    with httpx.Client(base_url=auth_srv.http, timeout=30) as h:
        for path in ("/v1/health", "/v1/info", "/metrics", "/"):
            assert h.get(path).status_code == 200, path
        page = h.get("/").text
        if "app.js" in page:  # the demo's files (installed with the repository's clients/web)
            assert h.get("/web/app.js").status_code == 200


def test_websocket_key_in_header_or_query(auth_srv: LiveServer) -> None:
    from websockets.sync.client import connect

    url = auth_srv.ws + "/v1/tts/live"
    for query in ("?api_key=secret", "?reference_id=&api_key=secret"):
        with connect(url + query, open_timeout=10, proxy=None) as ws:
            assert session(ws, ["Query key."], max_new_tokens=4)[1]["reason"] == "stop"
    for query in ("?api_key=wrong", "?api_key=", "?key=secret", "?API_KEY=secret"):
        with pytest.raises(websockets.exceptions.InvalidStatus) as exc:
            connect(url + query, open_timeout=10, proxy=None)
        assert exc.value.response.status_code == 401, query
    auth_srv.wait_idle()


def test_keys_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every configured key is compared with hmac.compare_digest, on fixed-length digests, whichever matches."""
    import hmac

    from rtts.ws import auth

    calls: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    keys = ("k1", "a-much-longer-second-key", "k3")
    for given, expected in (("k1", True), ("k3", True), ("nope", False), ("", False), ("k", False)):
        calls.clear()
        assert auth.key_matches(given, keys) is expected
        assert calls == [(32, 32)] * len(keys), calls  # all keys, no early exit, lengths hidden
    assert auth.authorized((), {}) is True  # no keys configured: open
    assert auth.authorized(keys, {"authorization": "bearer  k1 "}) is True
    assert auth.authorized(keys, {}, b"api_key=k3") is True  # the query string counts only where it is passed
    assert auth.authorized(keys, {}) is False and auth.authorized(keys, {}, b"api_key=k4") is False


def test_key_never_logged(auth_srv: LiveServer) -> None:
    """A key sent as ?api_key= is redacted from uvicorn's access log and its WebSocket lines (the record is kept)."""
    import logging

    from websockets.sync.client import connect

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Keep()
    loggers = [logging.getLogger(n) for n in ("uvicorn.access", "uvicorn.error")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    try:
        with connect(auth_srv.ws + "/v1/tts/live?api_key=secret", open_timeout=10, proxy=None) as ws:
            assert session(ws, ["Logged?"], max_new_tokens=4)[1]["reason"] == "stop"
        with pytest.raises(websockets.exceptions.InvalidStatus):
            connect(auth_srv.ws + "/v1/tts/live?api_key=secret-but-wrong&x=1", open_timeout=10, proxy=None)
        httpx.get(auth_srv.http + "/v1/health?api_key=secret", timeout=30)
        httpx.get(auth_srv.http + "/v1/references/list?token=secret", headers={"authorization": "Bearer secret"},
                  timeout=30)
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(handler)
            lg.setLevel(level)
    lines = "\n".join(seen)
    assert "/v1/tts/live?api_key=[redacted]" in lines and "/v1/health?api_key=[redacted]" in lines, lines
    assert "?api_key=[redacted]&x=1" in lines and "token=[redacted]" in lines, lines
    assert "secret" not in lines, lines
    auth_srv.wait_idle()
