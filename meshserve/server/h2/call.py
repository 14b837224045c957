"""What a gRPC handler of meshserve sees of its call, and how a method is registered.

A handler is `fn(request, call)`: `request` is the parsed message (or the raw bytes when the
method has no deserializer; an async iterator of them for a request-streaming method), `call` a
`Call`. A unary-response handler is an async function that returns its response (None, with a
non-OK status set, answers with that status); a streaming-response one is an async generator.
`meshserve.server.h2.server.ServerCall` implements `Call` on meshserve's own HTTP/2 server.

Status codes are gRPC's numbers (`Status`, an IntEnum). An exception out of a handler is UNKNOWN
with a generic text (the exception goes to the log only); `Call.abort` ends the call with a status.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, NoReturn, Protocol

from meshserve.server.h2.frames import Status

Metadata = tuple[tuple[str, Any], ...]  # (key, str value), or (key ending "-bin", bytes value)


class Abort(Exception):
    """Raised by `Call.abort`: the call ends with the status set there (the server catches it)."""


class Call(Protocol):
    """One gRPC call, as its handler sees it."""

    def invocation_metadata(self) -> Metadata:
        """The request's custom metadata (gRPC's reserved headers are not in it)."""

    @property
    def deadline(self) -> float | None:
        """When the client's `grpc-timeout` runs out (`time.monotonic()` time), None without one.
        At the deadline the server answers DEADLINE_EXCEEDED and cancels the handler's task."""

    def time_remaining(self) -> float | None:
        """Seconds left until the deadline (never negative), None without one."""

    def set_status(self, code: Status | int, details: str = "") -> None:
        """The call's status (OK unless set). A unary handler that sets a non-OK status may
        return None: its response, if any, is not sent."""

    def status(self) -> tuple[int, str]:
        """The status set so far: (code, details)."""

    def set_trailing_metadata(self, metadata: Iterable[tuple[str, Any]]) -> None:
        """Metadata sent in the trailers, with the status."""

    async def send_initial_metadata(self, metadata: Iterable[tuple[str, Any]]) -> None:
        """Send the response headers now, with `metadata` (at most once, before any message)."""

    async def write(self, message: Any) -> None:
        """Send one response message (a streaming-response handler may write instead of yield)."""

    async def abort(self, code: Status | int, details: str = "",
                    trailing_metadata: Iterable[tuple[str, Any]] = ()) -> NoReturn:
        """End the call now with a non-OK status (raises `Abort`, which the server catches)."""

    def peer(self) -> str:
        """The client's address as gRPC writes it: `ipv4:1.2.3.4:5678` or `ipv6:[::1]:5678`."""

    def peer_certificate(self) -> dict[str, Any] | None:
        """The client's certificate as `ssl.SSLSocket.getpeercert()` decodes it, only when the
        client presented one and it was verified against the port's CA (`--grpc-use-ssl-mutual`);
        None on plaintext, on TLS without client certificates, or when none was presented."""

    def peer_certificate_der(self) -> bytes | None:
        """The same certificate in DER form (e.g. to hash it), None where peer_certificate is."""

    def secure(self) -> bool:
        """Whether the call came over TLS."""

    def keep_inflated(self) -> Callable[[], None] | None:
        """Request streaming: when the message the handler just took arrived compressed, its
        inflated bytes stay charged to the process's budget (meshserve/server/inflate.py) until
        the function returned here is called (by the handler, once that message's request has
        ended); None for a message that was not compressed, or called twice. Without it the
        charge ends when the handler asks for the next message."""

    def cancelled(self) -> bool:
        """Whether the call was ended from outside: the client reset it or went away, or its
        deadline passed. The handler's task is then cancelled (it sees CancelledError)."""

    def done(self) -> bool:
        """Whether the call has ended (its status is sent, or it was cancelled)."""

    def add_done_callback(self, callback: Callable[[Call], None]) -> None:
        """`callback(call)` once the handler has finished, however it ended."""


class Method(NamedTuple):
    """One registered method: its handler `fn(request, call)` and call shape. A deserializer
    turns the request message's bytes into the handler's request (None: the bytes themselves);
    a serializer the handler's responses into bytes (None: the handler answers bytes)."""

    fn: Callable[[Any, Call], Any]
    request_streaming: bool = False
    response_streaming: bool = False
    request_deserializer: Callable[[bytes], Any] | None = None
    response_serializer: Callable[[Any], bytes] | None = None


def _shape(request_streaming: bool, response_streaming: bool) -> Callable[..., Method]:
    def method(fn: Callable[[Any, Call], Any], request_deserializer: Callable[[bytes], Any] | None = None,
               response_serializer: Callable[[Any], bytes] | None = None) -> Method:
        return Method(fn, request_streaming, response_streaming, request_deserializer, response_serializer)
    return method


# a Method of each call shape: unary_unary(fn, request_deserializer=None, response_serializer=None)
unary_unary = _shape(False, False)
unary_stream = _shape(False, True)
stream_unary = _shape(True, False)
stream_stream = _shape(True, True)

__all__ = ["Abort", "Call", "Metadata", "Method", "Status", "stream_stream", "stream_unary", "unary_stream",
           "unary_unary"]
