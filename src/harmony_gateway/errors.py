"""Domain errors, raised anywhere and turned into HTTP/SSE errors in one place (api/error_responses.py).

    GatewayError
    ├── InvalidRequest            400  (param names the offending field)
    ├── AuthenticationFailed      401
    ├── PermissionDenied          403  (a valid key that may not use this route: the admin plane)
    ├── NotFound                  404
    │   └── ModelNotFound         404  code model_not_found
    ├── RequestTimeout            408  (the client sent its body too slowly)
    ├── Conflict                  409
    ├── PayloadTooLarge           413
    ├── RateLimited               429  (a key's budget, or admission's queue full / timed out; retry_after)
    ├── Overloaded                503  (the gateway is draining; retry_after)
    ├── NoHealthyWorker           503
    └── UpstreamError             502  (the engine misbehaved)
        ├── UpstreamTimeout       504
        ├── UpstreamUnavailable   503  (recoverable: another worker may serve the request)
        ├── UpstreamRejected      400  (the engine refused the request as invalid)
        └── UpstreamBadOutput     502  (model output that is not Harmony at all)

Each class carries `status_code`, `error_type` and a default `code`, named in its class line; instances
may override `code`, `param` and `retry_after`. Only `api/error_responses.py` and the wires (`wire.py`)
turn them into wire bodies.

Anything else a request or a background response raises is a gateway bug or a dependency's failure: a
clean 500 (or a failed response) with one log line. `is_failure` says which exceptions count, a Rust
extension's panic included (`is_panic`): pyo3 derives it from BaseException, past `except Exception`.
"""

from __future__ import annotations


class GatewayError(Exception):
    """Base of every error the gateway reports to a client.

    A subclass names what it answers with in its class line, and inherits what it leaves out:
    `class NotFound(GatewayError, status_code=404, error_type=INVALID_REQUEST)`."""

    status_code: int = 500
    error_type: str = "server_error"
    code: str | None = None
    #: Seconds after which a retry may succeed (sent as `retry-after`); None when the error does not say.
    retry_after: float | None = None

    def __init_subclass__(
        cls, *, status_code: int | None = None, error_type: str | None = None, code: str | None = None
    ) -> None:
        super().__init_subclass__()
        if status_code is not None:
            cls.status_code = status_code
        if error_type is not None:
            cls.error_type = error_type
        if code is not None:
            cls.code = code

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if retry_after is not None:
            self.retry_after = retry_after

    def to_dict(self) -> dict[str, object]:
        return {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}


#: The `error_type` of the errors a client can fix by changing its request.
INVALID_REQUEST = "invalid_request_error"


class InternalError(GatewayError, code="internal_error"):
    """A failure that is the gateway's own (a bug, a dependency's panic): answered opaquely, by request id."""


class InvalidRequest(GatewayError, status_code=400, error_type=INVALID_REQUEST):
    """Raised when a request is malformed or asks for something the model cannot do."""


class AuthenticationFailed(
    GatewayError, status_code=401, error_type="authentication_error", code="invalid_api_key"
):
    """Raised when an API key is missing or unknown."""


class PermissionDenied(
    GatewayError, status_code=403, error_type="permission_error", code="permission_denied"
):
    """Raised when a known key asks for a route it may not use (a tenant key on the admin plane)."""


class NotFound(GatewayError, status_code=404, error_type=INVALID_REQUEST):
    """Raised when a named object (response, conversation, item, worker) does not exist or is not visible."""


class ModelNotFound(NotFound, code="model_not_found"):
    """Raised when no worker serves the requested model."""


class Conflict(GatewayError, status_code=409, error_type=INVALID_REQUEST):
    """Raised when the request conflicts with an object's state."""


class RequestTimeout(GatewayError, status_code=408, error_type=INVALID_REQUEST, code="request_timeout"):
    """Raised when a client sends its request body too slowly (nginx's client_body_timeout)."""


class PayloadTooLarge(GatewayError, status_code=413, error_type=INVALID_REQUEST, code="request_too_large"):
    """Raised when a request body is larger than `--max-body-bytes`."""


class RateLimited(GatewayError, status_code=429, error_type="rate_limit_error", code="rate_limit_exceeded"):
    """Raised when a key or address is over its request or token budget, or admission refuses a request
    (its queue is full, or the wait timed out); retry after `retry_after`."""

    retry_after: float | None = 1.0


class Overloaded(GatewayError, status_code=503, code="overloaded"):
    """Raised when the gateway itself cannot take requests now (it is shutting down); another replica
    can, or this one after `retry_after`."""

    retry_after: float | None = 1.0


class NoHealthyWorker(GatewayError, status_code=503, code="no_healthy_worker"):
    """Raised when no healthy worker can take the request (recoverable once a worker returns)."""


class UpstreamError(GatewayError, status_code=502, code="upstream_error"):
    """Raised when the engine failed the request."""

    #: True when nothing was generated yet, so the request may be retried on another worker.
    retryable: bool = False
    #: True when the failure says the worker is unwell, so it counts towards its circuit breaker;
    #: False when the client caused it (a request the engine refused as invalid).
    blames_worker: bool = True


class UpstreamTimeout(UpstreamError, status_code=504, code="upstream_timeout"):
    """Raised when the engine did not answer within the configured timeout."""


class UpstreamUnavailable(UpstreamError, status_code=503, code="upstream_unavailable"):
    """Raised when the engine cannot be reached; recoverable on another worker."""

    retryable = True


class UpstreamRejected(UpstreamError, status_code=400, error_type=INVALID_REQUEST, code="invalid_request"):
    """Raised when the engine rejected the request as invalid (gRPC INVALID_ARGUMENT)."""

    blames_worker = False


class UpstreamBadOutput(UpstreamError, code="bad_model_output"):
    """Raised when model output is not Harmony at all; never passed off as content."""


def is_panic(exc: BaseException) -> bool:
    """True for a panic inside a Rust extension (openai-harmony, quicktok, pydantic-core, ...). pyo3
    raises it as `pyo3_runtime.PanicException`, a BaseException; each extension has its own class of
    that name, so it is recognised by name."""
    kind = type(exc)
    return kind.__name__ == "PanicException" and kind.__module__ == "pyo3_runtime"


def is_failure(exc: BaseException) -> bool:
    """True for what a request or a background response reports as its own failure: any Exception and a
    dependency's panic. Cancellation, KeyboardInterrupt and SystemExit are not failures: they propagate."""
    if isinstance(exc, BaseExceptionGroup) and not isinstance(exc, Exception):
        return all(is_failure(inner) for inner in exc.exceptions)  # a task group's panic
    return isinstance(exc, Exception) or is_panic(exc)
