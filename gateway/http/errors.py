"""The gateway's one error type: `ApiError`, answered to the client in OpenAI's error format.

Every layer raises it (the JSON parsing, the schema, the engine client's callers), and the app's
exception handler (`gateway.http.routes`) is the one place that turns it into a response.
"""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An error answered to the client in OpenAI's format."""

    def __init__(
        self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 for a request the client must change (``param``: the field at fault)."""
    return ApiError(400, message, "invalid_request_error", param, code)
