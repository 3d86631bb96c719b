"""`rtts serve`: build the runtime, then run the app on uvicorn, with a graceful drain on SIGTERM.

Drain (SIGTERM, or Server.request_drain): the server keeps listening but takes no new session (a new socket or
`/v1/tts` gets 503, a `start` on an open socket finish/error), `/v1/health` answers 503 `draining` so that a balancer
routes elsewhere, and sockets without a session close (1001). Open sessions go on, their new text included, until
they finish or `drain_grace` seconds have passed; then whatever is left gets finish/error and the process exits 0.
A second SIGTERM ends the drain at once; Ctrl-C (SIGINT) shuts down without one.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from types import FrameType

import uvicorn
from starlette.applications import Starlette

from rtts.runtime import Runtime, ServerConfig
from rtts.ws.app import create_app

log = logging.getLogger("rtts.server")

DRAIN_POLL = 0.1  # seconds between a drain's looks at its open sessions


class Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: Starlette, rt: Runtime) -> None:
        super().__init__(config)
        self.app, self.rt = app, rt  # (config.app: the same app)
        # Set by a signal handler or another thread; the event loop starts the drain at its next tick (on_tick).
        self.drain_requested = False
        self.drain_cut = False  # a second SIGTERM: the drain ends at its next look
        self.drain_task: asyncio.Task[None] | None = None

    def request_drain(self) -> None:
        """Begin a drain (safe from any thread and from a signal handler)."""
        self.drain_requested = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM:
            # Not recorded in uvicorn's captured signals, which it raises again once stopped: that would end the
            # process by SIGTERM (status 143) instead of exiting 0 after the drain.
            if self.drain_requested:
                self.drain_cut = True
            elif not self.should_exit:  # (once stopping, a SIGTERM changes nothing)
                self.request_drain()
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.drain_requested and self.drain_task is None:
            self.drain_task = asyncio.create_task(self.drain(self.rt.config.drain_grace))
        return await super().on_tick(counter)

    async def drain(self, grace: float) -> None:
        """Refuse new sessions, let open ones finish for up to `grace` seconds, then stop the server (shutdown ends
        what is left with finish/error)."""
        state = self.app.state
        self.rt.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        log.info("draining: no new sessions; open ones have %.0f s to finish", grace)
        while True:
            await state.close_quiet()
            left = state.sessions_in_flight()
            if left == 0 or loop.time() >= deadline or self.drain_cut or self.should_exit:
                break
            await asyncio.sleep(DRAIN_POLL)
        if left:
            log.warning("drain ended with %d session(s) still open: they end with finish/error", left)
        else:
            log.info("drained: every session finished")
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # Tell open sessions first (finish/error + close); uvicorn would otherwise drop them with a bare close frame.
        await self.app.state.shutdown_sessions()
        await super().shutdown(sockets)


def build_server(config: ServerConfig, rt: Runtime | None = None) -> tuple[Server, Runtime]:
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
        # After a drain (or at once without one): what HTTP responses still have to send.
        timeout_graceful_shutdown=10,
        lifespan="on",
    )
    return Server(ucfg, app, rt), rt


def serve(config: ServerConfig, rt: Runtime | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server, _ = build_server(config, rt)
    server.run()
