"""Reading a request body under the server's size, time and shape limits."""

from __future__ import annotations

import logging
from typing import Any

import anyio
from starlette.requests import ClientDisconnect, Request

from wavecore.engine.serve.errors import APIError
from wavecore.engine.serve.limits import check_depth, check_text
from wavecore.engine.serve.parsing import parse_json

logger = logging.getLogger("wavecore.engine.serve")

_DRAIN_FACTOR = 64
DEFAULT_BODY_TIMEOUT_S = 30.0


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body exceeds {limit} bytes", code="request_too_large")


async def read_json(
    request: Request, limit: int, *, body_timeout: float = DEFAULT_BODY_TIMEOUT_S
) -> dict[str, Any]:
    """The body as a JSON object; past `limit` bytes a 413, without keeping the rest; not
    all there within `body_timeout` seconds a 408 (the server then closes the connection, as
    it does for any request whose body it did not read to the end); nested too deep or
    holding text that is not valid Unicode a 400 (`limits`).

    A body past the limit is read on and dropped (up to `_DRAIN_FACTOR` times the
    limit), so that the client, still sending, can read the 413 instead of seeing the
    connection cut mid-request; a body declared larger still is refused unread.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit * _DRAIN_FACTOR:
        raise _too_large(limit)
    body = bytearray()
    seen = 0
    try:
        with anyio.fail_after(body_timeout):
            async for piece in request.stream():
                seen += len(piece)
                if seen <= limit:
                    body += piece
                elif seen > limit * _DRAIN_FACTOR:
                    break
    except TimeoutError:
        raise APIError(
            408,
            f"the request body did not arrive within {body_timeout:g} s",
            code="request_timeout",
        ) from None
    except ClientDisconnect:
        client = request.client
        logger.info(
            "%s disconnected before its request body arrived",
            f"{client.host}:{client.port}" if client else "a client",
        )
        raise APIError(400, "the client disconnected", code="client_disconnected") from None
    if seen > limit:
        raise _too_large(limit)
    check_depth(bytes(body))
    parsed = parse_json(bytes(body))
    check_text(parsed)
    return parsed
