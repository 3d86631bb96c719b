"""`rtts serve`: build the runtime, then run the app on uvicorn with a shutdown that finishes every session."""

from __future__ import annotations

import logging
import socket

import uvicorn

from rtts.runtime import Runtime, ServerConfig
from rtts.ws.app import create_app


class _Server(uvicorn.Server):
    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # Tell open sessions first (finish/error + close); uvicorn would otherwise drop them with a bare close frame.
        app = self.config.app
        if hasattr(app, "state") and hasattr(app.state, "shutdown_sessions"):
            await app.state.shutdown_sessions()
        await super().shutdown(sockets)


def build_server(config: ServerConfig, rt: Runtime | None = None) -> tuple[_Server, Runtime]:
    rt = rt or Runtime(config)
    app = create_app(rt)
    ucfg = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        ws="websockets-sansio",  # (uvicorn's legacy "websockets" protocol is deprecated)
        # Above the app's limit on purpose: a message somewhat over max_message_bytes reaches the session, which
        # answers finish/error naming the limit and keeps the socket; at the transport limit websockets can only
        # close with 1009, which the SDK reports as an unexplained disconnect. The cap still bounds memory.
        ws_max_size=2 * config.limits.max_message_bytes,
        ws_ping_interval=20.0,
        ws_ping_timeout=20.0,
        ws_per_message_deflate=False,  # audio does not compress; deflate only adds latency
        log_level="info",
        timeout_graceful_shutdown=10,
        lifespan="on",
    )
    return _Server(ucfg), rt


def serve(config: ServerConfig, rt: Runtime | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server, _ = build_server(config, rt)
    server.run()
