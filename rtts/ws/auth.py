"""API keys (`rtts serve --api-key KEY`, repeatable): which routes need one, how it is sent, how it is checked, and
keeping it out of the logs (docs/security.md).

Secure by default: `AuthMiddleware` guards every HTTP route and WebSocket of the app except the few listed in
`OPEN_PATHS` / `OPEN_PREFIXES` (readiness, metrics, the demo page and its files), so a route added later needs the key
without doing anything. A key is sent as `Authorization: Bearer KEY`; the WebSocket upgrade alone also takes
`?api_key=KEY`, because browsers cannot set headers on a WebSocket. Keys are compared in constant time, and the
query-string form is redacted from uvicorn's access and WebSocket log lines.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
from collections.abc import Iterable, Mapping
from urllib.parse import parse_qsl

from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

from rtts.ws.protocol import error_json

__all__ = ["OPEN_PATHS", "OPEN_PREFIXES", "AuthMiddleware", "RedactKeys", "authorized", "install_log_redaction",
           "is_open", "key_matches", "refusal"]

# Routes that answer without a key: probes and scrapers (readiness, which model, metrics) and the demo page, which
# must load before its user can type a key into it. Everything else, reads included, needs the key.
OPEN_PATHS = frozenset({"/", "/favicon.ico", "/v1/health", "/v1/info", "/metrics"})
OPEN_PREFIXES = ("/web/",)
QUERY_KEY = "api_key"  # the WebSocket upgrade's alternative to the Authorization header


def is_open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


def _digest(key: str) -> bytes:
    # Comparing fixed-length digests hides the keys' lengths as well as their contents.
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def key_matches(given: str, keys: Iterable[str]) -> bool:
    """Whether `given` is one of `keys`, in time that depends on neither (every key is compared, no early exit)."""
    digest = _digest(given)
    found = False
    for key in keys:
        found |= hmac.compare_digest(digest, _digest(key))
    return found and bool(given)


def bearer_key(headers: Mapping[str, str]) -> str:
    """The key of an `Authorization: Bearer KEY` header ("" if none; the scheme is case-insensitive, RFC 7235)."""
    scheme, _, key = headers.get("authorization", "").strip().partition(" ")
    return key.strip() if scheme.lower() == "bearer" else ""


def authorized(keys: tuple[str, ...], headers: Mapping[str, str], query_string: bytes | None = None) -> bool:
    """Whether a request may pass: no keys configured, or a right key in its Authorization header, or, where
    `query_string` is given (the WebSocket upgrade only), in its `api_key` parameter."""
    if not keys:
        return True
    if key_matches(bearer_key(headers), keys):
        return True
    if query_string is not None:
        query = dict(parse_qsl(query_string.decode("latin-1"), keep_blank_values=True))
        return key_matches(query.get(QUERY_KEY, ""), keys)
    return False


REFUSAL = "invalid or missing API key (Authorization: Bearer <key>)"
# Routes whose clients expect the OpenAI API's error body (the OpenAI SDK reads `error.code`).
OPENAI_PREFIXES = ("/v1/audio/", "/v1/models")


def refusal(path: str) -> Response:
    """The 401 of an HTTP route: the API's `{status, message}`, or OpenAI's `{error: {...}}` on its routes."""
    if path.startswith(OPENAI_PREFIXES):
        return JSONResponse({"error": {"message": REFUSAL, "type": "invalid_request_error", "param": None,
                                       "code": "invalid_api_key"}}, 401)
    return JSONResponse(error_json(401, REFUSAL), 401)


class AuthMiddleware:
    """Refuses every request to a guarded path without a right key: HTTP with a JSON 401 (`refusal`), a WebSocket
    upgrade with a 401 instead of the upgrade (the SDK raises WebSocketUpgradeError)."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...]) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket") or not self.keys or is_open(scope["path"]):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if kind == "websocket":
            if authorized(self.keys, headers, scope.get("query_string", b"")):
                await self.app(scope, receive, send)
                return
            denial = JSONResponse(error_json(401, f"{REFUSAL[:-1]}, or ?{QUERY_KEY}=<key> on a WebSocket)"), 401)
            ws = WebSocket(scope, receive, send)
            if "websocket.http.response" in scope.get("extensions", {}):
                await ws.send_denial_response(denial)
            else:  # a server without the denial extension: the upgrade is refused with its 403
                await ws.close(1008)
            return
        if authorized(self.keys, headers):
            await self.app(scope, receive, send)
            return
        await refusal(scope["path"])(scope, receive, send)


# ------------------------------------------------------------------------------------------------------------ logging

# `api_key=...` in a logged URL (uvicorn's access log and its WebSocket accepted/refused lines print the query string).
_QUERY_SECRET = re.compile(r"(?i)([?&](?:api[_-]?key|access_token|token)=)[^&\s\"']*")
REDACTED = "[redacted]"


def redact(text: str) -> str:
    return _QUERY_SECRET.sub(lambda m: m.group(1) + REDACTED, text)


class RedactKeys(logging.Filter):
    """Rewrites a record's message and string arguments with the key in a URL redacted (records are kept)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and "=" in record.msg:
            record.msg = redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.args, Mapping):
            record.args = {k: redact(v) if isinstance(v, str) else v for k, v in record.args.items()}
        return True


# uvicorn's HTTP access log, and the logger its WebSocket protocols write their accepted/refused lines to.
REDACTED_LOGGERS = ("uvicorn.access", "uvicorn.error")


def install_log_redaction(names: Iterable[str] = REDACTED_LOGGERS) -> None:
    """Put a RedactKeys filter on each logger (once: calling it again adds none)."""
    for name in names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactKeys) for f in logger.filters):
            logger.addFilter(RedactKeys())
