"""The Starlette app: routes, authentication, lifespan (warm-up before serving, graceful shutdown), the demo page."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketState

from rtts.runtime import DRAINING_MESSAGE, Runtime
from rtts.ws import http, models_api, openai_api
from rtts.ws.auth import AuthMiddleware, install_log_redaction
from rtts.ws.live import Connection
from rtts.ws.protocol import error_json

log = logging.getLogger("rtts.server")

Endpoint = Callable[[Request], Awaitable[Response]]


def by_method(**handlers: Endpoint) -> Endpoint:
    """One endpoint for a path whose methods have different handlers (HEAD as GET)."""

    async def endpoint(request: Request) -> Response:
        method = "GET" if request.method == "HEAD" else request.method
        return await handlers[method](request)

    return endpoint


class CountRequests:
    """Runtime.http_requests: HTTP requests in progress until their response is sent (a /v1/tts body streams its
    audio), health checks and scrapes aside. A drain waits for them."""

    PROBES = frozenset({"/v1/health", "/metrics"})

    def __init__(self, app: ASGIApp, rt: Runtime) -> None:
        self.app, self.rt = app, rt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.PROBES:
            await self.app(scope, receive, send)
            return
        self.rt.http_requests += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.rt.http_requests -= 1


def web_dir() -> Path | None:
    """The browser demo: the in-wheel copy if installed, else the repository's clients/web."""
    import rtts

    here = Path(rtts.__file__).parent
    for d in (here / "_web", here.parent / "clients" / "web"):
        if (d / "index.html").is_file():
            return d
    return None


def create_app(rt: Runtime) -> Starlette:
    connections: set[Connection] = set()

    async def live(ws: WebSocket) -> None:
        await _live(ws, timestamps=False)

    async def live_ts(ws: WebSocket) -> None:
        await _live(ws, timestamps=True)

    async def _live(ws: WebSocket, timestamps: bool) -> None:
        # The key (header, or ?api_key= here: browsers cannot set headers on a WebSocket) is AuthMiddleware's check.
        if not rt.ready:
            await ws.send_denial_response(JSONResponse(error_json(503, "server is starting"), 503))
            return
        if rt.draining:  # refused before the upgrade: a balancer may retry the connection on another worker
            rt.metrics.refused.labels("draining").inc()
            await ws.send_denial_response(JSONResponse(error_json(503, DRAINING_MESSAGE), 503))
            return
        await ws.accept()
        conn = Connection(ws, rt, timestamps)
        connections.add(conn)
        try:
            await conn.run()
        finally:
            connections.discard(conn)

    async def index(request: object) -> Response:
        d = web_dir()
        if d is None:
            return HTMLResponse("<h1>rtts</h1><p>The demo page is not installed.</p>")
        return FileResponse(d / "index.html")

    async def favicon(request: object) -> Response:
        d = web_dir()
        if d is None or not (d / "favicon.ico").is_file():
            return http.json_error(404, "GET /favicon.ico: Not Found")
        return FileResponse(d / "favicon.ico", media_type="image/x-icon")

    async def info(request: object) -> Response:
        return JSONResponse({
            "model": rt.loaded.config.model_type, "default_model": rt.default_model,
            "note": f"embedded demo voice: {rt.model_summary}" if rt.default_model else "",
            "sample_rate": rt.sample_rate, "max_running": rt.config.max_running,
        })

    async def shutdown_sessions() -> None:
        """Every open session gets finish/error, then its socket closes (before uvicorn drops connections)."""
        await asyncio.gather(*(c.shutdown() for c in list(connections)), return_exceptions=True)

    def sessions_in_flight() -> int:
        """Sessions a drain waits for: live sockets' (Connection.busy) and HTTP requests in progress."""
        return sum(c.busy for c in connections) + rt.http_requests

    async def close_quiet() -> None:
        """While draining: close (1001) the sockets that run no session, so that a client's next session goes to a
        worker that serves it instead of meeting a refusal here."""
        quiet = [c for c in connections if not c.busy and c.ws.application_state is WebSocketState.CONNECTED]
        await asyncio.gather(*(c.shutdown() for c in quiet), return_exceptions=True)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # Uvicorn binds the socket only after this startup returns: no client sees a cold server.
        await asyncio.to_thread(rt.start)
        try:
            yield
        finally:
            await shutdown_sessions()
            await asyncio.to_thread(rt.stop)

    routes = [
        WebSocketRoute("/v1/tts/live", live),
        WebSocketRoute("/v1/tts/live/with-timestamp", live_ts),
        Route("/v1/tts", http.tts, methods=["POST"]),
        Route("/v1/references/add", http.references_add, methods=["POST"]),
        Route("/v1/references/list", http.references_list, methods=["GET", "POST"]),
        Route("/v1/references/delete", http.references_delete, methods=["DELETE", "POST"]),
        # the SDK's voice management (client.voices), over the same store; one route per path, so that a 405 lists
        # every method the path serves
        Route("/model", by_method(GET=models_api.list_models, POST=models_api.create_model),
              methods=["GET", "POST"]),
        Route("/model/{model_id}", by_method(GET=models_api.get_model, PATCH=models_api.update_model,
                                             DELETE=models_api.delete_model), methods=["GET", "PATCH", "DELETE"]),
        # OpenAI-compatible speech (docs/clients.md)
        Route("/v1/audio/speech", openai_api.speech, methods=["POST"]),
        Route("/v1/models", openai_api.list_models, methods=["GET"]),
        Route("/v1/models/{model_id}", openai_api.get_model, methods=["GET"]),
        Route("/v1/health", http.health, methods=["GET", "POST"]),
        Route("/metrics", http.metrics, methods=["GET"]),
        Route("/v1/info", info, methods=["GET"]),
        Route("/", index, methods=["GET"]),
        Route("/favicon.ico", favicon, methods=["GET"]),
    ]
    d = web_dir()
    if d is not None:
        routes.append(Mount("/web", StaticFiles(directory=d), name="web"))
    async def http_error(request: Request, exc: Exception) -> Response:
        # Unknown paths and methods answer the API's JSON error ({status, message}), not Starlette's plain text:
        # the legacy SDK parses every error body as JSON (a plain-text 404 raised JSONDecodeError there).
        assert isinstance(exc, HTTPException)
        response = http.json_error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
        response.headers.update(exc.headers or {})  # a 405's Allow
        return response

    async def client_gone(request: Request, exc: Exception) -> Response:
        # The client hung up while sending its request body: nobody is left to read an answer (uvicorn drops it),
        # and it is no server error (no traceback in the log).
        log.info("%s %s: the client left while sending its body", request.method, request.url.path)
        return Response(status_code=400)

    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: http_error, ClientDisconnect: client_gone},
                    middleware=[Middleware(AuthMiddleware, keys=rt.config.api_keys),
                                Middleware(CountRequests, rt=rt)])
    install_log_redaction()  # a key sent as ?api_key= never reaches uvicorn's access log
    app.state.rt = rt
    app.state.shutdown_sessions = shutdown_sessions
    app.state.sessions_in_flight = sessions_in_flight
    app.state.close_quiet = close_quiet
    return app
