"""The HTTP/2 connection layer shared by our server and client: the frame loop, SETTINGS,
PING, flow control both ways, CONTINUATION, HPACK decoding with a cache, write batching."""
from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable
from typing import Any

import hpack

from meshserve.server.h2.frames import (
    ACK,
    CONTINUATION,
    DATA,
    DEFAULT_WINDOW,
    END_DATA,
    END_HEADERS,
    END_STREAM,
    FRAME_HEADER,
    GOAWAY,
    HEADERS,
    LOCAL_CONN_WINDOW,
    LOCAL_HEADER_TABLE,
    LOCAL_MAX_FRAME,
    LOCAL_STREAM_WINDOW,
    MAX_HEADER_BLOCK,
    PADDED,
    PING,
    PREFACE,
    PRIORITY_FLAG,
    PUSH_PROMISE,
    RST_STREAM,
    SETTINGS,
    SETTINGS_ENABLE_PUSH,
    SETTINGS_HEADER_TABLE_SIZE,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_FRAME_SIZE,
    TRACE_FIELD,
    U32,
    WINDOW_UPDATE,
    ErrorCode,
    H2ConnectionError,
    frame,
    frame_header,
    plain_decode,
)

MAX_SETTINGS = 32  # entries in one SETTINGS frame (nghttp2's max_settings)
LINGER_S = 1.0  # after a connection error: input read and dropped this long before the close
HCACHE_BLOCK_MAX = 4096  # header blocks larger than this are parsed each time, never kept (hcache) ...
HCACHE_FIELDS_MAX = 64  # ... and so are blocks of more fields than this (a gRPC call has ~8-12)
# Frames one read is taken at within one pass of the loop (with read_burst set: the server's and
# the client's), the rest left for the next pass with reading paused. read_burst bounds a pass's
# bytes, but a peer sending frames that carry nothing (empty DATA, PRIORITY, WINDOW_UPDATE, unknown
# types: 9 bytes and ~1 µs each here) fitted ~58,000 in one burst, tens of milliseconds of the
# loop, and a good client's p99 rose from ~3-15 ms to 165-365 ms under one such connection
# (tests/adversarial/test_h2_attacks.py::test_frames_that_carry_nothing). A request takes 2-3
# frames and a large message's are 16 KiB or more: no client that sends work meets the bound.
# Header fields decoded count too, each as one frame (~3 us each: a pass of 1024 frames of
# header blocks at the server's MAX_HEADER_LIST could otherwise decode two million of them). A
# block seen before on the connection is not decoded again (hcache): tritonclient's repeated
# calls count their frames alone.
FRAMES_PER_PASS = 1024

log = logging.getLogger("meshserve.grpc.h2")
logging.getLogger("hpack").setLevel(logging.WARNING)  # it logs every header it decodes at DEBUG


class H2Endpoint(asyncio.Protocol):
    """HTTP/2 framing shared by our server and client connections: the frame loop, SETTINGS,
    PING, flow control both ways, CONTINUATION, write batching. Subclasses handle HEADERS,
    DATA, RST_STREAM and GOAWAY for their side of the streams."""

    # Over TLS, asyncio's and uvloop's transports make one TLS record (an encryption and its
    # framing) of every buffer given to writelines: a flush joins them first (set by
    # meshserve/server/tls.py and h2.client.connect on TLS connections).
    join_writes = False

    expect_preface = False
    # The server's at-once hooks (H2GrpcServer.at_once; the server's ``_at_once`` reads them)
    at_once: Any = ()
    # The server's unary calls taken from their two frames: a HEADERS frame with only END_HEADERS
    # is first offered to ``_at_once`` with the frame after it (the client: never)
    two_frames = False
    # Our receive window for the whole connection. The server sets it to its receive budget
    # (ServerLimits.conn_receive_buffer_bytes) and gives bytes back only as handlers take them.
    conn_window = LOCAL_CONN_WINDOW
    # Bytes a connection's reads take before the loop serves the others (0: no bound; the
    # server's and the client's: meshserve/server/limits.py:READ_BURST, the same rule as the
    # HTTP/1.1 connections): past them, reading pauses until the loop's next pass (``_yield_reads``).
    read_burst = 0
    # the header list a peer's block may decode to (the server's: MAX_HEADER_LIST, advertised)
    header_list_max = MAX_HEADER_BLOCK

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.peername: Any = None
        self.decoder = hpack.Decoder(max_header_list_size=self.header_list_max)
        self.decoder.max_allowed_table_size = LOCAL_HEADER_TABLE
        self.streams: dict[int, Any] = {}
        self.preface = not self.expect_preface
        self.chunks: list[bytes] = []
        self.chunks_len = 0
        self.need = 0
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_max_frame = 16384
        self.peer_max_streams = 1 << 31  # the peer's SETTINGS_MAX_CONCURRENT_STREAMS (unlimited until said)
        self.dead = False  # a connection error was sent: input is discarded until the close
        self.send_window = DEFAULT_WINDOW
        self.recv_unacked = 0  # released bytes not yet given back with a WINDOW_UPDATE
        self.recv_window = self.conn_window  # what the peer may still send us (enforced)
        self.window_update_at = self.conn_window // 8
        self.last_sid = 0
        self.rx_burst = 0  # bytes read since the connection last yielded the loop (read_burst)
        self.read_yielded = False
        self.frames_waiting = False  # frames read past FRAMES_PER_PASS wait in ``chunks`` for the next pass
        self.pass_fields = 0  # header fields decoded in this read (_decode): each counts as a frame
        self.wbuf: list[bytes] = []
        self.flush_scheduled = False
        self.blocked: set[Any] = set()
        self.going_away = False
        self.continuation: Any = None
        self.continuation_since = 0.0
        self.closed = False
        self.hcache: dict[bytes, tuple[Any, ...]] = {}
        self.paused = False  # the transport's write buffer is over its high-water mark
        self.queued_out = 0  # bytes of DATA waiting in streams' send queues (the peer's windows)
        self.heard = False  # bytes arrived since the last timer tick (keepalive)
        self.reading = False  # in data_received: writes wait for its end (one write for all)
        # A message was sent since the connection last read (the client's ClientStream.send): the
        # first message after a read is written at once (at concurrency 1 nothing else writes in
        # that pass, and the deferred flush would cost a loop pass per request), the ones after
        # it at the end of the pass, together.
        self.sent_since_read = False

    def _settings(self) -> tuple[tuple[int, int], ...]:
        return ((SETTINGS_HEADER_TABLE_SIZE, LOCAL_HEADER_TABLE), (SETTINGS_ENABLE_PUSH, 0),
                (SETTINGS_INITIAL_WINDOW_SIZE, LOCAL_STREAM_WINDOW), (SETTINGS_MAX_FRAME_SIZE, LOCAL_MAX_FRAME))

    def _preamble(self) -> bytes:
        """Our SETTINGS and a connection window big enough for large tensors."""
        settings = b"".join(struct.pack(">HI", k, v) for k, v in self._settings())
        return (frame(SETTINGS, 0, 0, settings)
                + frame(WINDOW_UPDATE, 0, 0, U32.pack(self.conn_window - DEFAULT_WINDOW)))

    # hooks for the two sides
    def _on_headers(self, flags: int, sid: int, payload: bytes) -> None:
        raise NotImplementedError

    def _headers_complete(self, st: Any, flags: int, block: bytes) -> None:
        raise NotImplementedError

    def _on_data(self, flags: int, sid: int, data: bytes, start: int, end: int) -> None:
        raise NotImplementedError

    def _at_once(self, sid: int, data: bytes, start: int, end: int) -> int:
        """A HEADERS frame (its block ``data[start:end]``) and what follows it in ``data`` taken
        together: the offset after the frames taken, or 0 (the HEADERS frame goes the usual way)."""
        return 0

    def _on_reset(self, sid: int, code: int) -> None:
        raise NotImplementedError

    def _on_goaway(self, last_sid: int, code: int) -> None:
        self.going_away = True

    def _on_deadlines(self, now: float) -> float | None:
        """The connection's one deadline timer (meshserve/server/deadlines.py) fired: the streams
        whose deadline (``due``, loop time) is up end (``_expire``); the earliest deadline left."""
        if self.closed:
            return None
        later = None
        for st in list(self.streams.values()):
            due = st.due
            if due is None or st.closed:
                continue
            if due <= now:
                self._expire(st)
            elif later is None or due < later:
                later = due
        self._flush()
        return later

    def _expire(self, st: Any) -> None:
        """A stream past its deadline."""
        raise NotImplementedError

    def _closed(self, st: Any) -> None:
        """The stream's final frame (END_STREAM HEADERS) was written."""
        raise NotImplementedError

    def _replenish(self, st: Any, length: int, ended: bool) -> None:
        """Receive-side flow control: give back what a DATA frame used (the connection's part
        in big increments, or at once when the peer's window runs low)."""
        self._release(length)
        if st is not None:
            self._credit_stream(st, length, ended)

    def _release(self, length: int) -> None:
        """``length`` received bytes are no longer held: give them back to the connection window."""
        self.recv_unacked += length
        if self.recv_unacked >= self.window_update_at or self.recv_window < self.window_update_at:
            if self.recv_unacked:
                self.wbuf.append(frame(WINDOW_UPDATE, 0, 0, U32.pack(self.recv_unacked)))
                self.recv_window += self.recv_unacked
                self.recv_unacked = 0
                self._schedule_flush()

    def _credit_stream(self, st: Any, length: int, ended: bool) -> None:
        """Give ``length`` bytes back to a stream's window, in big increments (none once ended)."""
        st.recv_unacked += length
        if not ended and st.recv_unacked >= LOCAL_STREAM_WINDOW // 2:
            self._write(frame(WINDOW_UPDATE, 0, st.sid, U32.pack(st.recv_unacked)))
            st.recv_unacked = 0

    def _fragment(self, flags: int, payload: bytes) -> bytes:
        """The header block fragment of a HEADERS frame: without padding and priority fields."""
        start, end = self._unpad(flags, payload, 0, len(payload))
        if flags & PRIORITY_FLAG:
            start += 5
        if start > end:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "HEADERS padding exceeds the frame")
        return payload[start:end]

    @staticmethod
    def _unpad(flags: int, data: bytes, start: int, end: int) -> tuple[int, int]:
        if flags & PADDED:
            if end == start or data[start] >= end - start:
                raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "padding exceeds the frame")
            return start + 1, end - data[start]
        return start, end

    # ---- reading ---------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self.read_burst:
            burst = self.rx_burst + len(data)
            if burst > self.read_burst:
                burst = 0
                self._yield_reads()
            self.rx_burst = burst
        if self.dead:
            return  # after our GOAWAY: the peer's frames are read and dropped until the close
        self.heard = True
        self.sent_since_read = False
        self.reading = True
        try:
            self._read(data)
        finally:
            self.reading = False
        self._flush()

    def _yield_reads(self) -> None:
        """Reading pauses until the loop's next pass (the data in hand is still read): a peer
        sending at loopback speed takes ``read_burst`` bytes per pass, not libuv's 32 reads of
        one readable socket, and the other connections' callbacks come between."""
        transport = self.transport
        if not self.read_yielded and transport is not None and not transport.is_closing():
            self.read_yielded = True
            transport.pause_reading()
            self.loop.call_soon(self._reads_resume)

    def _reads_resume(self) -> None:
        self.read_yielded = False
        transport = self.transport
        if self.frames_waiting:  # (a read's frames past FRAMES_PER_PASS: taken now, as many again at most)
            self.frames_waiting = False
            if self.closed or transport is None or transport.is_closing():
                return
            self.data_received(b"")
            if self.frames_waiting or self.read_yielded:  # (it yields again: resumed at the next pass)
                return
        if transport is not None and not transport.is_closing():
            transport.resume_reading()

    def _frames_later(self, rest: bytes) -> None:
        """More than FRAMES_PER_PASS frames in one read: the rest waits for the loop's next pass,
        reading paused meanwhile as ``_yield_reads`` pauses it (so what waits is at most one
        read), and ``_reads_resume`` takes it before reading on."""
        self._keep(rest, 9)
        self.frames_waiting = True
        self._yield_reads()

    def _read(self, data: bytes) -> None:
        if self.chunks:
            self.chunks.append(data)
            self.chunks_len += len(data)
            if self.chunks_len < self.need:
                return
            data = b"".join(self.chunks)
            self.chunks.clear()
            self.chunks_len = 0
        try:
            pos = 0
            if not self.preface:
                if len(data) < 24:
                    if not PREFACE.startswith(data):
                        raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "not an HTTP/2 prior-knowledge connection")
                    self._keep(data, 24)
                    return
                if data[:24] != PREFACE:
                    raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "not an HTTP/2 prior-knowledge connection")
                self.preface = True
                pos = 24
            n = len(data)
            frames = self.pass_fields = 0
            while n - pos >= 9:
                frames += 1
                if frames + self.pass_fields > FRAMES_PER_PASS and self.read_burst:
                    self._frames_later(data[pos:])
                    return
                hi, lo, typ, flags, sid = FRAME_HEADER.unpack_from(data, pos)
                length = hi << 16 | lo
                end = pos + 9 + length
                if length > LOCAL_MAX_FRAME:
                    raise H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, f"frame of {length} bytes exceeds {LOCAL_MAX_FRAME}")
                if end > n:
                    break
                sid &= 0x7FFFFFFF
                if self.continuation is not None and typ != CONTINUATION:
                    raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "expected CONTINUATION")
                if typ == DATA:
                    self.recv_window -= length
                    if self.recv_window < 0:
                        raise H2ConnectionError(ErrorCode.FLOW_CONTROL_ERROR,
                                                f"DATA beyond the connection window ({-self.recv_window} bytes over)")
                    self._on_data(flags, sid, data, pos + 9, end)
                elif typ == HEADERS:
                    # (the server's unary call answered at once from its two frames: _at_once)
                    if flags == END_HEADERS and self.two_frames and (after := self._at_once(sid, data, pos + 9, end)):
                        pos = after
                        continue
                    self._on_headers(flags, sid, data[pos + 9:end])
                elif typ == CONTINUATION:
                    self._on_continuation(flags, sid, data[pos + 9:end])
                elif typ == SETTINGS:
                    self._on_settings(flags, sid, data[pos + 9:end])
                elif typ == WINDOW_UPDATE:
                    if length != 4:
                        raise H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "WINDOW_UPDATE payload must be 4 bytes")
                    # (read in place: a gRPC client sends about two per call, one of them for the stream
                    # just answered, gone from ``streams``: no slice, no call, for that one)
                    if sid == 0:  # (the connection's: inline, about one per call too)
                        inc = U32.unpack_from(data, pos + 9)[0] & 0x7FFFFFFF
                        if inc == 0 or self.send_window + inc > 0x7FFFFFFF:
                            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR if inc == 0 else ErrorCode.FLOW_CONTROL_ERROR,
                                                    "invalid connection WINDOW_UPDATE")
                        self.send_window += inc
                        if self.blocked:
                            self._unblock_all()
                    elif sid in self.streams:
                        self._stream_window(sid, U32.unpack_from(data, pos + 9)[0] & 0x7FFFFFFF)
                elif typ == PING:
                    if length != 8:
                        raise H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "PING payload must be 8 bytes")
                    if not flags & ACK:
                        self._control_reply()
                        self.wbuf.append(frame(PING, ACK, 0, data[pos + 9:end]))
                    else:
                        self._on_ping_ack(data[pos + 9:end])
                elif typ == RST_STREAM:
                    if length != 4:
                        raise H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "RST_STREAM payload must be 4 bytes")
                    if sid == 0:  # RFC 9113 6.4: a connection error
                        raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "RST_STREAM on stream 0")
                    self._on_reset(sid, U32.unpack_from(data, pos + 9)[0])
                elif typ == GOAWAY:
                    if length < 8:
                        raise H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "GOAWAY payload too short")
                    self._on_goaway(U32.unpack_from(data, pos + 9)[0] & 0x7FFFFFFF,
                                    U32.unpack_from(data, pos + 13)[0])
                elif typ == PUSH_PROMISE:
                    raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "clients must not push")
                # PRIORITY and unknown frame types are ignored (RFC 9113 5.5)
                pos = end
            if pos < n:
                rest = data[pos:]
                need = 9
                if len(rest) >= 9:
                    hi, lo = rest[0], int.from_bytes(rest[1:3], "big")
                    need = 9 + (hi << 16 | lo)
                self._keep(rest, need)
        except H2ConnectionError as exc:
            self._fatal(exc.code, str(exc))
            return
        except Exception as err:  # never let one connection's bug take the loop down
            log.exception("HTTP/2 connection error")
            self._fatal(ErrorCode.INTERNAL_ERROR, f"internal error: {err}")

    def _keep(self, data: bytes, need: int) -> None:
        self.chunks = [data]
        self.chunks_len = len(data)
        self.need = need

    def _fatal(self, code: int, message: str) -> None:
        log.debug("closing HTTP/2 connection from %s: %s", self.peername, message)
        transport = self.transport
        if transport is not None and not transport.is_closing():
            self.wbuf.clear()
            self.dead = True
            transport.write(frame(GOAWAY, 0, 0, U32.pack(self.last_sid) + U32.pack(code)
                                  + message.encode()[:256]))
            if self.paused:  # the peer does not read: drop what it has not taken, free it now
                transport.abort()
            elif transport.can_write_eof():
                # Half-close after the GOAWAY and keep reading (and dropping) for a moment: closing
                # a socket with unread input sends a TCP RST, and a peer that is still writing (a
                # flood) would lose the GOAWAY that says why (nghttp2 and Go linger the same way).
                transport.write_eof()
                asyncio.get_running_loop().call_later(LINGER_S, transport.abort)
            else:
                transport.close()

    # ---- write-side backpressure -------------------------------------------------------------
    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False

    def _control_reply(self) -> None:
        """A PING or SETTINGS ACK is about to be queued (the server caps them; see there)."""

    def _on_ping_ack(self, payload: bytes) -> None:
        """The peer acknowledged a PING of ours."""

    def _on_settings(self, flags: int, sid: int, payload: bytes) -> None:
        if sid != 0:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            return
        if len(payload) % 6:
            raise H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS length not a multiple of 6")
        if len(payload) > 6 * MAX_SETTINGS:  # each INITIAL_WINDOW_SIZE entry touches every stream
            raise H2ConnectionError(ErrorCode.ENHANCE_YOUR_CALM,
                                    f"more than {MAX_SETTINGS} entries in one SETTINGS frame")
        grown = False
        for i in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, i)
            if key == 0x4:
                if value > 0x7FFFFFFF:
                    raise H2ConnectionError(ErrorCode.FLOW_CONTROL_ERROR, "INITIAL_WINDOW_SIZE too large")
                delta = value - self.peer_initial_window
                self.peer_initial_window = value
                for st in self.streams.values():
                    st.send_window += delta
                grown = grown or delta > 0
            elif key == 0x5:
                if not 16384 <= value <= 16777215:
                    raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "MAX_FRAME_SIZE out of range")
                self.peer_max_frame = value
            elif key == 0x3:
                self.peer_max_streams = value
        # The ACK goes out before any DATA the new settings allow: grpc core (and h2) count a
        # larger INITIAL_WINDOW_SIZE only once it is acknowledged, and grpc fails the stream
        # ("frame of size N overflows local window") on DATA that arrives before the ACK.
        self._control_reply()
        self.wbuf.append(frame(SETTINGS, ACK, 0))
        if grown:
            self._unblock_all()

    def _stream_window(self, sid: int, inc: int) -> None:
        """A WINDOW_UPDATE frame's increment for a stream (``_read`` checked its length and takes
        the connection's itself; one for a stream we no longer know is dropped there)."""
        st = self.streams.get(sid)
        if st is not None:
            st.send_window += inc
            if st in self.blocked:
                self.blocked.discard(st)
                self._drain(st)

    def _unblock_all(self) -> None:
        if self.blocked:
            waiting = list(self.blocked)
            self.blocked.clear()
            for st in waiting:
                self._drain(st)

    def _on_continuation(self, flags: int, sid: int, payload: bytes) -> None:
        st = self.continuation
        if st is None or st.sid != sid or st.header_block is None:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "unexpected CONTINUATION")
        st.header_block += payload
        if len(st.header_block) > MAX_HEADER_BLOCK:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "header block too large")
        if flags & END_HEADERS:
            self.continuation = None
            block, st.header_block = bytes(st.header_block), None
            self._headers_complete(st, st.header_flags, block)

    def _header_block(self, st: Any, flags: int, block: bytes) -> None:
        """A HEADERS frame's fragment: complete, or the start of a CONTINUATION sequence."""
        if not flags & END_HEADERS:
            st.header_block = bytearray(block)
            st.header_flags = flags
            self.continuation = st
            self.continuation_since = self.loop.time()
            return
        self._headers_complete(st, flags, block)

    def _decode(self, block: bytes, parse: Callable[[Any], tuple[Any, ...]]
                ) -> tuple[Any, ...]:
        """HPACK-decode a header block and `parse` it. A block that leaves the dynamic table as
        it was (a repeat request whose fields are all indexed: every gRPC call after the first
        on a connection) is cached, and the cache is dropped whenever a block changes the
        table, since indexes then shift."""
        plain = plain_decode(block, self.header_list_max)
        if plain is not None:  # the table is untouched: no need for the hpack decoder
            self.pass_fields += len(plain)
            parsed = parse(plain)
            self._cache(block, parsed, len(plain))
            return parsed
        table: Any = self.decoder.header_table.dynamic_entries  # (Any: entries compared by identity, never re-boxed by mypyc)
        before = (len(table), table[0] if table else None)
        try:
            headers: Any = self.decoder.decode(block, raw=True)  # (a list, typed as an Iterable)
        except Exception as exc:
            raise H2ConnectionError(ErrorCode.COMPRESSION_ERROR, f"HPACK: {exc}") from None
        self.pass_fields += len(headers)
        parsed = parse(headers)
        if len(table) != before[0] or (table[0] if table else None) is not before[1]:
            self.hcache.clear()
        else:
            self._cache(block, parsed, len(headers))
        return parsed

    def _cache(self, block: bytes, parsed: tuple[Any, ...], fields: int) -> None:
        if TRACE_FIELD in block or len(block) > HCACHE_BLOCK_MAX or fields > HCACHE_FIELDS_MAX:
            # (a trace id never repeats; a large block: 256 of them were up to 256 MiB a connection,
            # outside flow control; many fields: a 2 KB block of 1-byte references decoded to ~1,900
            # fields, ~250 KB of Python objects, 256 of them ~64 MiB a connection, kept)
            return
        if len(self.hcache) >= 256:  # other one-off blocks: start afresh
            self.hcache.clear()
        self.hcache[block] = parsed

    # ---- writing (flow-controlled) ---------------------------------------------------------
    def _headers(self, sid: int, flags: int, block: bytes) -> bytes:
        """A header block as HEADERS (+ CONTINUATION) frames no larger than the peer's
        MAX_FRAME_SIZE (RFC 9113 4.2, 6.10). `flags` may hold END_STREAM; END_HEADERS goes on
        the last frame. The frames must be written together (nothing may come between them)."""
        limit = self.peer_max_frame
        if len(block) <= limit:
            return frame(HEADERS, flags | END_HEADERS, sid, block)
        last = (len(block) - 1) // limit * limit  # offset of the final piece
        return b"".join([frame(HEADERS, flags & ~END_HEADERS, sid, block[:limit])]
                        + [frame(CONTINUATION, END_HEADERS if i == last else 0, sid, block[i:i + limit])
                           for i in range(limit, len(block), limit)])

    def _drain(self, st: Any) -> None:
        out = st.out
        while out:
            kind, item = out[0]
            if kind == HEADERS:
                out.popleft()
                self._write(self._headers(st.sid, END_STREAM, item))
                self._closed(st)
                return
            if kind == END_DATA:
                out.popleft()
                self._write(frame(DATA, END_STREAM, st.sid))
                continue
            size = len(item)
            while size:
                n = min(size, self.send_window, st.send_window, self.peer_max_frame)
                if n <= 0:
                    self.blocked.add(st)
                    self._schedule_flush()
                    if st.waiter is not None:
                        self._wake(st)
                    return
                self.send_window -= n
                st.send_window -= n
                self.queued_out -= n
                self._write(frame_header(DATA, 0, st.sid, n))
                if n == size:
                    self._write(item)
                    size = 0
                else:
                    mv = memoryview(item)
                    self._write(mv[:n])
                    item = mv[n:]
                    size -= n
                    out[0] = (DATA, item)
            out.popleft()
        if st.waiter is not None:
            self._wake(st)

    def _discard_out(self, st: Any) -> None:
        """Drop what a finished stream still had queued to send (and its count)."""
        if st.out:
            self.queued_out -= sum(len(item) for kind, item in st.out if kind == DATA)
            st.out.clear()

    @staticmethod
    def _wake(st: Any) -> None:
        """Wake the task waiting for room in the stream's send queue (it checks again)."""
        waiter = st.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _write(self, data: bytes | memoryview) -> None:
        self.wbuf.append(data)  # type: ignore[arg-type]
        if not self.reading:  # (inside data_received: its end writes the lot, no loop callback needed)
            self._schedule_flush()

    def _send_now(self, data: bytes) -> None:
        """Write `data` after anything buffered, at once rather than at the next loop pass. For
        the last frames of an answer (or a request) that nothing else of this connection can
        join in this pass (the caller checks): the deferred flush would cost that pass, an
        epoll_pwait and a callback, per request at concurrency 1. Order is kept (the buffer
        goes first); a paused transport still buffers it, and the send budget is checked."""
        transport = self.transport
        if self.reading:  # inside data_received: its end writes everything the input caused at once
            self.wbuf.append(data)
        elif self.wbuf:
            self.wbuf.append(data)
            self._flush()
        elif transport is not None and not self.dead and not transport.is_closing():
            transport.write(data)
            if self.paused:
                self._over_send_budget()

    def _schedule_flush(self) -> None:
        if not self.flush_scheduled:
            self.flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self.flush_scheduled = False
        if self.wbuf:
            buf, self.wbuf = self.wbuf, []
            if self.transport is not None and not self.transport.is_closing() and not self.dead:
                if self.join_writes:  # TLS: one record for the lot, not one per buffer (meshserve/server/tls.py)
                    self.transport.write(b"".join(buf))
                else:
                    self.transport.writelines(buf)
                if self.paused:
                    self._over_send_budget()

    def _over_send_budget(self) -> bool:
        """The server closes a connection that holds too much unsent output (see there)."""
        return False
