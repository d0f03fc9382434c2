"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with a status.

Every refusal of the server is an `APIError` raised where the problem is found; the app
turns it into a response, so no route builds error bodies by hand.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.responses import JSONResponse

# The `type` OpenAI's API gives for each status class.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """A request the server refuses, with what the client needs to act on it."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "api_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_field(param: str, message: str) -> APIError:
    """A 400 naming the request field that is wrong."""
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")
