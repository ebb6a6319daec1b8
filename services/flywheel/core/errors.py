"""The platform's error hierarchy. Each class also inherits the matching stdlib type.

Service edges map these to HTTP status codes (OpenAI error JSON) or gRPC status codes in one
handler each; nothing else catches them except for bounded, deliberate fault tolerance.
"""

from __future__ import annotations


class PlatformError(Exception):
    """Base of every Flywheel error. `http_status` is what a service edge answers."""

    http_status = 500
    error_type = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class ConfigurationError(PlatformError, ValueError):
    """Settings or deployment are wrong; the message says which value to change."""


class ContractError(PlatformError, ValueError):
    """Data violates a wire contract (Sample invariants, proto schema version, protocol shape)."""


class InvalidRequestError(PlatformError, ValueError):
    """A client sent a request that cannot be served (OpenAI `invalid_request_error`)."""

    http_status = 400
    error_type = "invalid_request_error"


class NotFoundError(PlatformError, KeyError):
    http_status = 404
    error_type = "not_found_error"

    def __str__(self) -> str:
        return self.message


class AuthenticationError(PlatformError, PermissionError):
    """No API key, or one that is unknown or revoked (HTTP 401)."""

    http_status = 401
    error_type = "authentication_error"


class PermissionDeniedError(PlatformError, PermissionError):
    """A valid API key whose role does not allow the request (HTTP 403)."""

    http_status = 403
    error_type = "permission_error"


class ConflictError(PlatformError, RuntimeError):
    http_status = 409
    error_type = "conflict_error"


class UpstreamError(PlatformError, ConnectionError):
    """An engine, judge or Redis call failed after its bounded retries."""

    http_status = 502
    error_type = "upstream_error"


class BackpressureError(PlatformError, RuntimeError):
    """A stream is over its high-water mark; retry after `retry_after_s` seconds."""

    http_status = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after_s: float = 5.0):
        super().__init__(message, code="backpressure")
        self.retry_after_s = retry_after_s


class OverloadedError(PlatformError, RuntimeError):
    """Every engine's request queue is full (or an engine is not ready): answered at once with
    503 and `Retry-After: retry_after_s` instead of waiting in a queue past the timeouts."""

    http_status = 503
    error_type = "service_unavailable"

    def __init__(self, message: str, *, retry_after_s: float = 1.0):
        super().__init__(message, code="engine_overloaded")
        self.retry_after_s = retry_after_s


class ClientClosedError(PlatformError, ConnectionError):
    """The client closed its connection before the answer was ready; the request was stopped
    and nothing of it recorded (HTTP 499, nginx's "client closed request": nobody reads it)."""

    http_status = 499
    error_type = "client_closed_request"
