"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

from __future__ import annotations

from typing import Any

# An answer the OpenAI SDKs must not send again (they retry 408, 409, 429 and >= 500 unless told): a request that ran
# past --request-timeout was run and aborted; another try would run it again, on a server already slow.
NO_RETRY = {"x-should-retry": "false"}
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          409: "conflict_error", 413: "invalid_request_error", 415: "invalid_request_error", 500: "internal_error",
          502: "bad_gateway", 503: "service_unavailable"}


class APIError(Exception):
    """An error to send to the client. `status`: 400, 401, 404, 409, 413, 415, 500, 502 (the router: a replica
    failed) or 503; `param`: the offending field (or None); `code`: a short machine-readable reason (or None);
    `headers`: extra response headers (`Retry-After`, `NO_RETRY`)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}

