"""A streaming call's loops that stay interpreted: the requests a request-streaming handler takes
(``ServerConnection._requests``, meshserve/server/h2/server.py: an async generator, which mypyc
does not compile) and the answers of a response-streaming one (``answered``: its ``finally``
awaits, and mypyc 2.4's coroutines then leave the exception they unwound, a CancelledError, as
the thread's handled exception, raised again by a later call). server.py is one of the modules
``python -m meshserve.native build`` compiles (docs/perf/native.md)."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from meshserve.server import inflate
from meshserve.server.h2.frames import Status

# Messages the request-streaming handlers of one connection take in one pass of the loop without
# waiting (the ones already queued), before they let the loop serve the rest of the process. One
# 16 KiB DATA frame holds ~3,000 empty messages, and each stream queues up to STREAM_MAX_QUEUED
# (4096): a ModelStreamInfer handler started a request for each in one pass, and their thousands
# of steps ran in the next one (a good client's p99 6 -> 345 ms on a service under one stream;
# under 200 streams of one connection, 1.5-3.2 s and 2-3 requests in 20 s). Counted per connection,
# not per stream: a connection's many streams share one allowance (docs/security.md, "Session 20:
# messages in a row").
MESSAGES_PER_PASS = 64


async def taken(self: Any, st: Any, eof: object, compressed: Any) -> AsyncIterator[Any]:
    """``ServerConnection._requests``: each message of the stream ``st`` as the handler takes it.
    A message already waiting is taken at once while the connection's handlers have taken fewer
    than MESSAGES_PER_PASS so in this pass of the loop (``pass_taken``, reset by ``_next_pass``
    at the next one); past that, after the loop has passed."""
    assert st.queue is not None and st.handler is not None
    deser = st.handler.request_deserializer
    while True:
        if st.queue.qsize():
            if self.pass_taken >= MESSAGES_PER_PASS:
                await asyncio.sleep(0)  # (the connection's share of this pass is spent)
                continue
            if not self.pass_taken:
                self.loop.call_soon(self._next_pass)
            self.pass_taken += 1
        item = await st.queue.get()
        if item is eof:
            return
        msg, size = item
        del item
        st.queued -= size if len(msg) + 5 <= size else len(msg) + 5  # (an inflated message: as charged)
        st.taken += size  # released to the connection window by _settle
        if st.parked and not st.closed:  # room in the queue: take messages still waiting in buf
            unparked = self._messages(st) and not st.parked
            if unparked and st.remote_ended:
                self._remote_end(st)  # the last parked messages are queued: now the end of the stream
        self._settle(st)
        if msg.__class__ is compressed:  # as a unary message is (_inflated), in the handler's task
            inflation = inflate.Inflation(st.metadata, self.transport)  # (the metadata name the tenant)
            try:
                msg = await inflation.run(st.encoding, msg.data, self.server.max_receive)
            except inflate.Refused as exc:
                self._fail(st, Status[exc.code], exc.message)
                return  # (the call has its status and its Task is cancelled: its requests in progress end)
            # charged until the handler asks for the next one, or, when it keeps the charge
            # (ServerCall.keep_inflated), until the request ends: each message of a stream is a
            # request of its own (ModelStreamInfer)
            st.inflated = inflation
            try:
                yield deser(msg) if deser else msg
            finally:
                msg = None  # (not held while the next one is awaited)
                if st.inflated is inflation:
                    st.inflated = None
                    inflation.release()
            continue
        yield deser(msg) if deser else msg
        msg = None  # (not held while the next one is awaited: the handler's request may have ended)


async def answered(self: Any, st: Any, result: Any, ser: Any, queue_max: int) -> bool:
    """``ServerConnection._run``: each answer of the response-streaming handler's ``result`` sent
    on ``st`` as it comes, waiting for the peer's window when it does not read; the handler's
    generator closed whatever happens. True when the stream closed meanwhile (nothing more to send)."""
    try:
        async for item in result:
            if st.closed:
                return True
            self._send_message(st, ser(item) if ser else item)
            if (len(st.out) > queue_max or self.paused
                    or (st in self.blocked and len(st.out) > 2)):  # the peer is not reading: wait for its window
                await self._writable(st)
    finally:
        if hasattr(result, "aclose"):
            await result.aclose()
    return False
