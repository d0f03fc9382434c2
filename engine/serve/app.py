"""The ASGI app: the routes, Bearer auth, and every refusal as an OpenAI-style error."""

from __future__ import annotations

import hmac

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from wavecore.engine.errors import EngineError
from wavecore.engine.serve.admin_routes import admin_routes
from wavecore.engine.serve.errors import APIError
from wavecore.engine.serve.openai_routes import openai_routes
from wavecore.engine.serve.state import ServerState

_STATUS_TEXT = {404: "no such route", 405: "method not allowed on this route"}


class BearerAuth:
    """Requires `Authorization: Bearer <key>` on the protected paths, compared in
    constant time so the response time says nothing about the key."""

    def __init__(self, app: ASGIApp, *, key: str, protected: frozenset[str]) -> None:
        self._app = app
        self._key = f"Bearer {key}".encode()
        self._protected = protected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._guards(scope["path"]):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._key):
                refusal = APIError(
                    401,
                    "a valid API key is required: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                )
                await refusal.response()(scope, receive, send)
                return
        await self._app(scope, receive, send)

    def _guards(self, path: str) -> bool:
        return path.startswith("/v1/") or path in self._protected


def build_app(state: ServerState) -> Starlette:
    async def metrics(request: Request) -> Response:
        # While the model loads, or after the engine died, the request figures alone.
        ready = state.serving()
        stats = None
        if ready is not None:
            try:
                stats = await ready.engine.stats()
            except EngineError as error:
                raise state.error_of(error) from None
        exposition = state.metrics.exposition(stats, fair_queued=state.fair.queued)
        return Response(exposition, media_type=CONTENT_TYPE_LATEST)

    async def api_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, APIError)  # registered for APIError only
        return error.response()

    async def http_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, HTTPException)  # registered for HTTPException only
        message = _STATUS_TEXT.get(error.status_code, error.detail)
        return APIError(
            error.status_code, f"{message}: {request.method} {request.url.path}"
        ).response()

    async def server_error(request: Request, error: Exception) -> Response:
        return APIError(500, f"internal error: {type(error).__name__}: {error}").response()

    admin = admin_routes(state) if state.options.enable_admin_api else []
    middleware = []
    if state.options.api_key is not None:
        protected = frozenset(route.path for route in admin)
        middleware.append(Middleware(BearerAuth, key=state.options.api_key, protected=protected))
    return Starlette(
        routes=[*openai_routes(state), Route("/metrics", metrics, methods=["GET"]), *admin],
        middleware=middleware,
        exception_handlers={
            APIError: api_error,
            HTTPException: http_error,
            Exception: server_error,
        },
    )
