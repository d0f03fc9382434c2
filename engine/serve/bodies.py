"""Reading a request body under the server's size limit."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from wavecore.engine.serve.errors import APIError
from wavecore.engine.serve.parsing import parse_json

_DRAIN_FACTOR = 64


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body exceeds {limit} bytes", code="request_too_large")


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object; past `limit` bytes a 413, without keeping the rest.

    A body past the limit is read on and dropped (up to `_DRAIN_FACTOR` times the
    limit), so that the client, still sending, can read the 413 instead of seeing the
    connection cut mid-request; a body declared larger still is refused unread.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit * _DRAIN_FACTOR:
        raise _too_large(limit)
    body = bytearray()
    seen = 0
    async for piece in request.stream():
        seen += len(piece)
        if seen <= limit:
            body += piece
        elif seen > limit * _DRAIN_FACTOR:
            break
    if seen > limit:
        raise _too_large(limit)
    return parse_json(bytes(body))
