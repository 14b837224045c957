"""Decompressing a compressed gRPC request message (``grpc-encoding`` gzip / deflate) before its
handler, and so before admission, sees it: in slices, within a process-wide budget.

A unary message arrives whole (at most --max-request-bytes on the wire, within its connection's
receive window), and only then can its model and tenant be admitted: its model name is inside it.
Inflated in one call on the event loop, a 64 KiB gzip bomb cost ~0.4 s of loop time up to the
64 MiB message limit (every other call on the process waited), and the inflated bytes of all
connections together were bounded by nothing but the streams they could open (1024 a
connection). Here (``Inflation.run``):

- at most ``STEP`` (64 KiB) of output per slice, the event loop runs other calls between slices;
- one message (``TURNS``) is inflated at a time in the process (the HTTP front door's bodies take
  the same turns, a chunk's output at a time), the others wait their turn in order (holding only
  their compressed bytes, within their connections' receive windows): what a flood adds to each
  turn of the event loop is one slice, however many streams carry it (all inflating runs on the
  loop's thread: more at once would add no throughput, only longer turns; with 24 bombs inflating
  side by side the good client's p99 went from 5 to 400 ms);
- every slice is charged to ``INFLATING`` (the process's decompressed bytes held, both of its gRPC
  ports together; its limit is --max-receive-bytes, the same bound the HTTP front door holds its
  bodies, wire and decoded, to) before it is inflated; a message whose next slice does not fit is
  refused RESOURCE_EXHAUSTED at once (the client may retry) and what it held is given back;
- the message limit holds as before: more than --max-request-bytes inflated is
  RESOURCE_EXHAUSTED "Received message larger than max", never inflated further;
- the bytes stay charged until the call ends (``Inflation.release``): the handler holds the
  message, then its parsed request, until it answers. A request stream's message is a request of
  its own: charged until that request ends (ModelStreamInfer keeps the charge, `Call.keep_inflated`,
  and gives it back as the request's task ends), not until the whole call ends (one long stream
  would hold the budget for ever) nor only until its handler takes it (the parsed requests of a
  stream would be bounded by nothing but their count).

The HTTP front door decodes bodies in slices of 1 MiB (`meshserve/protocol/http_codec.py:BodyDecoder`)
and charges the decoded bytes to its own process-wide budget (--max-receive-bytes,
`meshserve/server/http1/request.py:Request.read_body`).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import zlib

STEP = 1 << 16  # output bytes inflated per slice (~0.1 ms quiet, ~0.4 ms on a busy 2-core box)
TURNS = 1  # messages inflated at once, process-wide


class Refused(Exception):
    """The message is not inflated: ``code`` (a grpc status name) and ``message`` for the client."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class Budget:
    """Decompressed bytes of request messages held by calls not yet ended, process-wide."""

    __slots__ = ("limit", "used")

    def __init__(self) -> None:
        self.limit = 0  # 0: unbounded (set from --max-receive-bytes by the gRPC server)
        self.used = 0


INFLATING = Budget()


class Turns:
    """At most TURNS holders at once; the others wait in order (a holder that is cancelled while
    it waits leaves the line; one cancelled after its turn came passes it on)."""

    __slots__ = ("running", "waiting")

    def __init__(self) -> None:
        self.running = 0
        self.waiting: collections.deque[asyncio.Future[None]] = collections.deque()

    async def take(self) -> None:
        if self.running < TURNS and not self.waiting:
            self.running += 1
            return
        turn = asyncio.get_running_loop().create_future()
        self.waiting.append(turn)
        try:
            await turn  # (give() counted this holder in when it set the result)
        except BaseException:
            if turn.done() and not turn.cancelled():
                self.give()
            else:
                with contextlib.suppress(ValueError):
                    self.waiting.remove(turn)
            raise

    def give(self) -> None:
        while self.waiting:
            turn = self.waiting.popleft()
            if not turn.done():
                turn.set_result(None)  # handed over: ``running`` stays
                return
        self.running -= 1


INFLATING_NOW = Turns()


class Inflation:
    """One message's inflation and what it holds of ``INFLATING``."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held = 0

    def release(self) -> None:
        """Give back what the message held (the call ended); idempotent."""
        INFLATING.used -= self.held
        self.held = 0

    async def run(self, encoding: bytes | None, data: bytes, limit: int) -> bytes:
        """``data`` inflated (gzip or deflate by ``encoding``), at most ``limit`` bytes of it,
        in slices of ``STEP`` charged to ``INFLATING`` as they are made. Raises Refused."""
        if encoding == b"gzip":
            d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif encoding == b"deflate":
            d = zlib.decompressobj()
        else:
            raise Refused("INVALID_ARGUMENT",
                          "cannot decompress the request: compressed flag set without a grpc-encoding")
        parts: list[bytes] = []
        size = 0
        tail = data
        budget = INFLATING
        await INFLATING_NOW.take()
        try:
            while True:
                room = min(STEP, limit + 1 - size)
                if budget.limit and budget.used + room > budget.limit:
                    raise Refused("RESOURCE_EXHAUSTED",
                                  f"server busy: {budget.used} bytes of decompressed request messages held "
                                  f"(limit --max-receive-bytes {budget.limit}); retry later")
                budget.used += room
                self.held += room
                piece = d.decompress(tail, room)
                unused = room - len(piece)
                budget.used -= unused
                self.held -= unused
                size += len(piece)
                if size > limit:
                    raise Refused("RESOURCE_EXHAUSTED",
                                  f"Received message larger than max (decompressed over {limit} vs. {limit})")
                parts.append(piece)
                if d.eof:
                    break
                tail = d.unconsumed_tail
                if len(piece) < room and not tail:
                    raise zlib.error("incomplete or truncated stream")
                await asyncio.sleep(0)  # (other calls run between slices)
        except zlib.error as exc:
            self.release()
            raise Refused("INVALID_ARGUMENT", f"cannot decompress the request: {exc}") from None
        except BaseException:
            self.release()
            raise
        finally:
            INFLATING_NOW.give()
        return parts[0] if len(parts) == 1 else b"".join(parts)
