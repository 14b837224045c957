"""One error type for the whole system, with one HTTP table and one gRPC table.

Messages name the model, version, input, what was expected and what was received, and
the hop that failed where that helps.
"""
from __future__ import annotations

import enum

import grpc


class Code(enum.Enum):
    INVALID_ARG = "INVALID_ARG"
    NOT_FOUND = "NOT_FOUND"
    UNAVAILABLE = "UNAVAILABLE"
    UNSUPPORTED = "UNSUPPORTED"
    INTERNAL = "INTERNAL"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    CANCELLED = "CANCELLED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    UNKNOWN = "UNKNOWN"
    # HTTP-only refinements of a client mistake about the request body itself: HTTP tells them
    # apart (413, 415), gRPC folds them into RESOURCE_EXHAUSTED / INVALID_ARGUMENT.
    TOO_LARGE = "TOO_LARGE"
    UNSUPPORTED_MEDIA_TYPE = "UNSUPPORTED_MEDIA_TYPE"


HTTP_STATUS: dict[Code, int] = {
    Code.INVALID_ARG: 400,
    Code.NOT_FOUND: 404,
    Code.UNAVAILABLE: 503,
    Code.UNSUPPORTED: 501,
    Code.INTERNAL: 500,
    Code.ALREADY_EXISTS: 400,  # Triton's HTTP answers 400 (e.g. a shared-memory region registered twice)
    Code.CANCELLED: 499,
    Code.DEADLINE_EXCEEDED: 504,
    Code.RESOURCE_EXHAUSTED: 429,
    Code.UNAUTHENTICATED: 401,
    Code.PERMISSION_DENIED: 403,
    Code.UNKNOWN: 500,
    Code.TOO_LARGE: 413,
    Code.UNSUPPORTED_MEDIA_TYPE: 415,
}

GRPC_STATUS: dict[Code, grpc.StatusCode] = {
    Code.INVALID_ARG: grpc.StatusCode.INVALID_ARGUMENT,
    Code.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Code.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Code.UNSUPPORTED: grpc.StatusCode.UNIMPLEMENTED,
    Code.INTERNAL: grpc.StatusCode.INTERNAL,
    Code.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    Code.CANCELLED: grpc.StatusCode.CANCELLED,
    Code.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    Code.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Code.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    Code.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    Code.UNKNOWN: grpc.StatusCode.UNKNOWN,
    Code.TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Code.UNSUPPORTED_MEDIA_TYPE: grpc.StatusCode.INVALID_ARGUMENT,
}
_HTTP_ONLY = (Code.TOO_LARGE, Code.UNSUPPORTED_MEDIA_TYPE)
_FROM_GRPC: dict[grpc.StatusCode, Code] = {v: k for k, v in GRPC_STATUS.items() if k not in _HTTP_ONLY}


class InferError(Exception):
    """An error that travels to the client with a status code and a clear message."""

    def __init__(self, code: Code, message: str, *, retry_after_s: float | None = None):
        message = message or f"{code.value} (no details given)"  # a client sees only this text
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s

    def __repr__(self) -> str:
        return f"InferError({self.code.value}, {self.message!r})"

    @property
    def retry_after_ms(self) -> int | None:
        """The retry hint in whole milliseconds (at least 1), None without one."""
        return None if self.retry_after_s is None else max(1, int(self.retry_after_s * 1000 + 0.999))

    @property
    def retry_after_header(self) -> str | None:
        """The retry hint as HTTP's Retry-After value (whole seconds, at least 1), None without one."""
        return None if self.retry_after_s is None else str(max(1, int(self.retry_after_s + 0.999)))

    @property
    def http_status(self) -> int:
        return HTTP_STATUS[self.code]

    @property
    def grpc_status(self) -> grpc.StatusCode:
        return GRPC_STATUS[self.code]

    # Constructors for the common cases keep call sites short and consistent.
    @classmethod
    def invalid(cls, message: str) -> InferError:
        return cls(Code.INVALID_ARG, message)

    @classmethod
    def not_found(cls, message: str) -> InferError:
        return cls(Code.NOT_FOUND, message)

    @classmethod
    def unavailable(cls, message: str) -> InferError:
        return cls(Code.UNAVAILABLE, message)

    @classmethod
    def internal(cls, message: str) -> InferError:
        return cls(Code.INTERNAL, message)

    @classmethod
    def unsupported(cls, message: str) -> InferError:
        return cls(Code.UNSUPPORTED, message)

    @classmethod
    def exhausted(cls, message: str, retry_after_s: float | None = None) -> InferError:
        return cls(Code.RESOURCE_EXHAUSTED, message, retry_after_s=retry_after_s)

    @classmethod
    def too_large(cls, message: str) -> InferError:
        """A request (body or message) over a size limit: HTTP 413, gRPC RESOURCE_EXHAUSTED."""
        return cls(Code.TOO_LARGE, message)

    @classmethod
    def unsupported_media(cls, message: str) -> InferError:
        """A body in an encoding the server does not accept: HTTP 415, gRPC INVALID_ARGUMENT."""
        return cls(Code.UNSUPPORTED_MEDIA_TYPE, message)

    @classmethod
    def from_grpc(cls, code: grpc.StatusCode, details: str | None, hop: str = "") -> InferError:
        """Map a status received from an upstream hop back into our vocabulary."""
        msg = details or code.name
        if hop and code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL,
                            grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED):
            msg = f"{hop}: {msg}"
        return cls(_FROM_GRPC.get(code, Code.UNKNOWN), msg)


def internal_error(exc: BaseException) -> InferError:
    """The 500 / INTERNAL for an unexpected exception. Its text may carry a file path or another
    request's data: it stays in the server's log (every caller logs the exception), and the
    answer names only its type."""
    return InferError.internal(f"internal error: {type(exc).__name__} (the server's log has the details)")


def model_not_found(model: str, version: str = "") -> InferError:
    if version:
        return InferError.not_found(f"Request for unknown model: '{model}' version {version} is not found")
    return InferError.not_found(f"Request for unknown model: '{model}' is not found")
