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


class EngineTimeoutError(PlatformError, TimeoutError):
    """An engine call took longer than `gateway.request_timeout_s` (HTTP 504). The engine is
    slow or the request long, not broken: it stays in service."""

    http_status = 504
    error_type = "timeout_error"


class RetryLaterError(PlatformError, RuntimeError):
    """Refused for now: the client should retry after `retry_after_s` seconds (the service edge
    answers with a Retry-After header). Subclasses set the error `code` and the default wait."""

    retry_code: str | None = None
    default_retry_after_s = 1.0

    def __init__(self, message: str, *, retry_after_s: float | None = None):
        super().__init__(message, code=self.retry_code)
        self.retry_after_s = self.default_retry_after_s if retry_after_s is None else retry_after_s


class BackpressureError(RetryLaterError):
    """A stream is over its high-water mark; retry after `retry_after_s` seconds (default 5)."""

    http_status = 429
    error_type = "rate_limit_error"
    retry_code = "backpressure"
    default_retry_after_s = 5.0


class OverloadedError(RetryLaterError):
    """Every engine's request queue is full (or an engine is not ready): answered at once with
    503 and `Retry-After: retry_after_s` (default 1) instead of waiting in a queue past the
    timeouts."""

    http_status = 503
    error_type = "service_unavailable"
    retry_code = "engine_overloaded"
    default_retry_after_s = 1.0


class EngineUnavailableError(RetryLaterError):
    """No engine runs to serve the request (every engine tried refused the connection, or none
    is in service, as while the only one starts again): answered with 503 and `Retry-After:
    retry_after_s` (default 5), since an engine that starts again takes seconds to load."""

    http_status = 503
    error_type = "service_unavailable"
    retry_code = "engine_unavailable"
    default_retry_after_s = 5.0


class ClientClosedError(PlatformError, ConnectionError):
    """The client closed its connection before the answer was ready; the request was stopped
    and nothing of it recorded (HTTP 499, nginx's "client closed request": nobody reads it)."""

    http_status = 499
    error_type = "client_closed_request"
