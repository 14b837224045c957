"""TLS and mutual TLS on the HTTP and gRPC ports (docs/security.md, "TLS and mutual TLS").

Opt-in per port, with Triton's gRPC flag names (`--grpc-use-ssl`, `--grpc-use-ssl-mutual`,
`--grpc-server-cert`, `--grpc-server-key`, `--grpc-root-cert`) and the same for HTTP
(`--http-use-ssl`, ...: Triton has no TLS on HTTP). Without them nothing here runs: the servers
take their plaintext protocol factory as before.

With TLS a port's listening socket accepts plain TCP connections through `Acceptor`, which runs
each handshake itself (`loop.start_tls`) before the server's own protocol (HTTP/1.1 or HTTP/2)
sees the connection, so that the handshakes in progress are counted and bounded:

- a handshake must end within `--tls-handshake-timeout-s` (a client that sends its ClientHello a
  byte at a time, or never, is closed);
- at most `--max-tls-handshakes` are in progress per port; one more closes the OLDEST of those
  that have not sent a byte yet, and only when every one has, the oldest of all (as the
  connection table closes the longest idle connection). A TLS client speaks first (its
  ClientHello): the handshake starts when its first bytes come, so a flood of connections that
  stay silent is closed in turn among itself and never takes a good client's handshake, which
  has begun, out of the way (it did, on a loaded machine, when the oldest of all went first);
- bytes that are not TLS (plaintext HTTP or gRPC sent to a TLS port) fail the handshake at once:
  the connection is closed;
- a failed handshake (wrong CA, an expired certificate, no client certificate under mutual TLS)
  closes the connection: the server's protocol never sees it, no HTTP or gRPC status is sent.

A finished connection counts against --max-connections like a plaintext one. The certificate,
key and root CA files are checked for changes (size, mtime, inode) at most once every
RELOAD_CHECK_S, when a connection arrives: a changed set is loaded into a new context that the
next connections get; connections already made keep theirs. A set that does not load (a file
half written, a key that does not match) is logged and the previous context stays in use.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import grpc

    from meshserve.server.limits import ServerLimits

log = logging.getLogger("meshserve.tls")

RELOAD_CHECK_S = 1.0  # the certificate files are looked at (stat) at most this often
EARLY_MAX_BYTES = 64 << 10  # bytes a connection may send before its handshake starts (a ClientHello: < 16 KiB)
ALPN = {"grpc": ["h2"], "http": ["http/1.1"]}
HOP_KEY_ENV = "MESHSERVE_HOP_KEY_FILE"  # --hop-key-file's default (compose: deploy/compose.hop-key.yaml)


@dataclass(frozen=True, slots=True)
class PortTls:
    """One port's TLS files (the --<proto>-server-cert / -key / -root-cert flags)."""

    cert: str
    key: str
    root: str | None = None
    mutual: bool = False  # client certificates required, checked against `root`


@dataclass(frozen=True, slots=True)
class TlsSettings:
    """The TLS of a process's ports; None: plaintext (the default)."""

    grpc: PortTls | None = None
    http: PortTls | None = None
    hop_key_file: str | None = None  # the hop's shared key (--hop-key-file; configure_hop), never its bytes


def bool_argument(text: str) -> bool:
    """A flag's true or false (Triton's words for them, any case; yes and no too)."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The TLS flags of both ports: `--grpc-use-ssl` (Triton's form `--grpc-use-ssl=true` too) ..."""
    group = ap.add_argument_group("TLS (docs/security.md, \"TLS and mutual TLS\")")
    for proto, name in (("grpc", "gRPC"), ("http", "HTTP")):
        group.add_argument(f"--{proto}-use-ssl", dest=f"tls_{proto}_use_ssl", type=bool_argument, nargs="?", const=True,
                           default=False, metavar="BOOL", help=f"serve {name} over TLS (default false)")
        group.add_argument(f"--{proto}-use-ssl-mutual", dest=f"tls_{proto}_mutual", type=bool_argument, nargs="?",
                           const=True, default=False, metavar="BOOL",
                           help=f"{name}: require a client certificate signed by --{proto}-root-cert "
                                f"(implies --{proto}-use-ssl; default false)")
        group.add_argument(f"--{proto}-server-cert", dest=f"tls_{proto}_cert", default=None, metavar="PEM",
                           help=f"{name}: the server's certificate (chain), PEM")
        group.add_argument(f"--{proto}-server-key", dest=f"tls_{proto}_key", default=None, metavar="PEM",
                           help=f"{name}: the server certificate's private key, PEM")
        group.add_argument(f"--{proto}-root-cert", dest=f"tls_{proto}_root", default=None, metavar="PEM",
                           help=f"{name}: the CA(s) client certificates must be signed by (mutual TLS), PEM")
    group.add_argument("--hop-key-file", dest="hop_key_file", default=os.environ.get(HOP_KEY_ENV) or None,
                       metavar="FILE",
                       help="the gateway -> service hop's shared key (at least 32 bytes; read at start): a gateway "
                            "signs each stream to its services with it, a service believes the hop's marker and "
                            "private parameters only on a stream signed with it (or on a mutual-TLS gRPC port); "
                            f"default ${HOP_KEY_ENV}, else none (docs/security.md, \"The authenticated hop\")")


def from_args(args: argparse.Namespace) -> TlsSettings:
    """The flags as settings; a port with TLS on must name its files (SystemExit otherwise),
    and they must load."""
    ports: dict[str, PortTls | None] = {}
    for proto in ("grpc", "http"):
        mutual = bool(getattr(args, f"tls_{proto}_mutual", False))
        if not (getattr(args, f"tls_{proto}_use_ssl", False) or mutual):
            ports[proto] = None
            continue
        cert, key, root = (getattr(args, f"tls_{proto}_{k}", None) for k in ("cert", "key", "root"))
        if not cert or not key:
            raise SystemExit(f"--{proto}-use-ssl needs --{proto}-server-cert and --{proto}-server-key")
        if mutual and not root:
            raise SystemExit(f"--{proto}-use-ssl-mutual needs --{proto}-root-cert")
        port = PortTls(cert, key, root, mutual)
        try:
            context(port, proto)
        except (OSError, ssl.SSLError, ValueError) as exc:
            raise SystemExit(f"--{proto}-use-ssl: cannot load the certificate files: {exc}") from None
        ports[proto] = port
    key_file = getattr(args, "hop_key_file", None)
    if key_file is not None:
        load_hop_key(key_file)  # (its bytes are read again by configure_hop: never kept in the settings)
    return TlsSettings(grpc=ports["grpc"], http=ports["http"], hop_key_file=key_file)


def load_hop_key(path: str) -> bytes:
    """The hop key in ``path`` (surrounding white space stripped); SystemExit when it cannot be
    read or is shorter than hop.MIN_KEY_BYTES."""
    from meshserve.protocol import hop

    try:
        with open(path, "rb") as f:
            key = f.read(1 << 16).strip()
    except OSError as exc:
        raise SystemExit(f"--hop-key-file: cannot read {path}: {exc.strerror}") from None
    if len(key) < hop.MIN_KEY_BYTES:
        raise SystemExit(f"--hop-key-file: the key in {path} has {len(key)} bytes, at least {hop.MIN_KEY_BYTES} "
                         f"are needed (e.g. `openssl rand -hex 32`)")
    return key


def configure_hop(settings: TlsSettings, host: str, service: bool) -> None:
    """At start, before any hop stream opens: the hop key (a gateway signs its streams with it, a
    service checks them) and whether mutual TLS authenticates the hop (a service's gRPC port, a
    gateway's --upstream-client-cert; meshserve/protocol/hop.py:vet). Neither: a service believes
    no hop parameter, a gateway's services believe none of its (a line at start says so)."""
    from meshserve.protocol import hop
    from meshserve.server.repository_control import is_loopback

    key = load_hop_key(settings.hop_key_file) if settings.hop_key_file else None
    hop.authenticate(key, settings.grpc is not None and settings.grpc.mutual if service else bool(UPSTREAM.cert))
    if hop.open_hop():
        local = host == "localhost" or is_loopback(host)
        log.log(logging.INFO if service and local else logging.WARNING, hop.OPEN_SERVICE if service else hop.OPEN_GATEWAY)


def flags(settings: TlsSettings) -> list[str]:
    """The command-line flags that give another process these settings (`meshserve up`)."""
    out: list[str] = []
    for proto, port in (("grpc", settings.grpc), ("http", settings.http)):
        if port is None:
            continue
        out += [f"--{proto}-use-ssl=true", f"--{proto}-server-cert", port.cert, f"--{proto}-server-key", port.key]
        if port.root:
            out += [f"--{proto}-root-cert", port.root]
        if port.mutual:
            out.append(f"--{proto}-use-ssl-mutual=true")
    return out


class _SSLObject(ssl.SSLObject):
    """What the contexts here wrap a connection in (`SSLContext.sslobject_class`): an
    ssl.SSLObject whose read, write and pending are the C methods of the ssl module's own object
    instead of SSLObject's Python methods that only pass their arguments on to them. The TLS
    transport (uvloop's SSLProtocol, asyncio's) calls them per record, positionally: an HTTP/1.1
    request over TLS makes six such calls on the server (pending three times, read twice, write
    once): ~240 instructions a call less, ~1,400 a request (docs/perf/tls-cost.md, "The HTTP
    front door at c32: what is left, and whose it is")."""

    @classmethod
    def _create(cls, *args: Any, **kwargs: Any) -> _SSLObject:
        obj: _SSLObject = super()._create(*args, **kwargs)  # type: ignore[misc]
        raw = obj._sslobj  # type: ignore[attr-defined]
        obj.read, obj.write, obj.pending = raw.read, raw.write, raw.pending  # type: ignore[method-assign]
        return obj


def context(port: PortTls, proto: str) -> ssl.SSLContext:
    """A server context for `port`'s files: TLS 1.2 at least, ALPN as the protocol needs."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.sslobject_class = _SSLObject
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(port.cert, port.key)
    if port.mutual:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cafile=port.root)
    ctx.set_alpn_protocols(ALPN[proto])
    return ctx


def acceptor(limits: ServerLimits, proto: str) -> Acceptor | None:
    """The TLS acceptor of the `proto` port ("grpc", "http"), None when it serves plaintext."""
    port = limits.tls.grpc if proto == "grpc" else limits.tls.http
    if port is None:
        return None
    return Acceptor(port, proto, limits.tls_handshake_timeout_s, limits.max_tls_handshakes)




def _stamp(paths: tuple[str, ...]) -> tuple[tuple[int, int, int], ...] | None:
    try:
        return tuple((s.st_mtime_ns, s.st_size, s.st_ino) for s in map(os.stat, paths))
    except OSError:
        return None


class Acceptor:
    """One TLS port: its current context (reloaded when the files change) and the handshakes in
    progress (see the module docstring). `factory(make)` is the listening socket's protocol factory."""

    __slots__ = ("port", "proto", "timeout", "cap", "silent", "pending", "ctx", "stamp", "checked", "bad",
                 "evicted", "failed")

    def __init__(self, port: PortTls, proto: str, handshake_timeout_s: float, max_handshakes: int) -> None:
        self.port = port
        self.proto = proto
        self.timeout = handshake_timeout_s if handshake_timeout_s > 0 else None
        self.cap = max_handshakes
        self.silent: dict[_Handshake, None] = {}  # accepted, no byte received yet: oldest first
        self.pending: dict[_Handshake, None] = {}  # its ClientHello began, handshake in progress: oldest first
        self.stamp = _stamp(self._paths())
        self.ctx = context(port, proto)
        self.checked = time.monotonic()
        self.bad: object = None  # the stamp of a file set that did not load (warned once)
        self.evicted = 0  # handshakes closed to make room (at the cap)
        self.failed = 0  # handshakes that failed or timed out

    def _paths(self) -> tuple[str, ...]:
        p = self.port
        return (p.cert, p.key) + ((p.root,) if p.root else ())

    def current(self) -> ssl.SSLContext:
        """The context for a new connection (the files looked at, at most once a RELOAD_CHECK_S)."""
        now = time.monotonic()
        if now - self.checked >= RELOAD_CHECK_S:
            self.checked = now
            stamp = _stamp(self._paths())
            if stamp is not None and stamp != self.stamp:
                try:
                    ctx = context(self.port, self.proto)
                except (OSError, ssl.SSLError, ValueError) as exc:
                    if stamp != self.bad:
                        self.bad = stamp
                        log.warning("%s TLS: the changed certificate files do not load (%s); the previous "
                                    "ones stay in use", self.proto, exc)
                else:
                    self.ctx, self.stamp = ctx, stamp
                    log.info("%s TLS: certificate files reloaded", self.proto)
        return self.ctx

    def factory(self, make: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        return lambda: _Handshake(self, make)

    def admit(self, hs: _Handshake) -> None:
        """A new connection: at the cap, one in progress is closed to make room, the oldest silent
        one (no byte yet) if there is one, else the oldest of all."""
        if self.cap and len(self.silent) + len(self.pending) >= self.cap:
            room = self.silent or self.pending
            oldest = next(iter(room))
            del room[oldest]
            self.evicted += 1
            oldest.abort()
        self.silent[hs] = None

    def spoke(self, hs: _Handshake) -> None:
        """``hs``'s first bytes came: its handshake starts (and it is no longer the first to go)."""
        if hs in self.silent:
            del self.silent[hs]
            self.pending[hs] = None

    def done(self, hs: _Handshake) -> None:
        self.silent.pop(hs, None)
        self.pending.pop(hs, None)


class _Handshake(asyncio.Protocol):
    """A TCP connection on a TLS port until its handshake ends (then `make()`'s protocol has it).

    Bytes may arrive before `loop.start_tls` takes the transport (uvloop starts reading after
    `connection_made` returns, whatever it paused): they are kept (at most EARLY_MAX_BYTES) and
    handed to the TLS protocol before its own `connection_made` runs (`_hand_over`)."""

    __slots__ = ("acceptor", "make", "transport", "task", "early", "timer")

    def __init__(self, acceptor: Acceptor, make: Callable[[], asyncio.Protocol]) -> None:
        self.acceptor = acceptor
        self.make = make
        self.transport: asyncio.Transport | None = None
        self.task: asyncio.Task[None] | None = None
        self.early = b""
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.acceptor.admit(self)
        timeout = self.acceptor.timeout
        if timeout is not None:  # (from the accept: a client that never speaks is closed too)
            self.timer = asyncio.get_running_loop().call_later(timeout, self._expire)

    def data_received(self, data: bytes) -> None:
        self.early += data
        t = self.transport
        if t is None:
            return
        t.pause_reading()
        if len(self.early) > EARLY_MAX_BYTES:
            t.abort()
        elif self.task is None:  # its first bytes: the handshake starts
            self.acceptor.spoke(self)
            loop = asyncio.get_running_loop()
            self.task = loop.create_task(self._handshake(t))
            loop.call_soon(self._hand_over)  # (after the task's first step: start_tls has taken the transport)

    def _expire(self) -> None:
        """The handshake timeout, counted from the accept: a connection still silent, or still
        in its handshake, is closed (a handshake under way then fails in ``_handshake``, which
        counts it; start_tls's own timeout, from the first bytes, is the later one)."""
        self.timer = None
        if self.transport is not None:
            if self.task is None:
                self.acceptor.failed += 1
            self.transport.abort()

    def eof_received(self) -> bool | None:
        return None  # (closes the transport: a client gone before its handshake began)

    def connection_lost(self, exc: Exception | None) -> None:  # (before start_tls took the transport)
        self._end()

    def _end(self) -> None:
        self.acceptor.done(self)
        self.transport = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _hand_over(self) -> None:
        t, data = self.transport, memoryview(self.early)
        self.early = b""
        if t is None or not data:
            return
        proto = t.get_protocol()
        if proto is self or not hasattr(proto, "buffer_updated"):  # (not expected: both loops' are buffered)
            t.abort()
            return
        while data:  # (asyncio's and uvloop's SSLProtocol only store what comes before their connection_made)
            buf = proto.get_buffer(len(data))  # type: ignore[attr-defined]
            n = min(len(buf), len(data))
            buf[:n] = data[:n]
            proto.buffer_updated(n)  # type: ignore[attr-defined]
            data = data[n:]

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    async def _handshake(self, transport: asyncio.Transport) -> None:
        acceptor = self.acceptor
        app = self.make()
        try:
            tls = await asyncio.get_running_loop().start_tls(
                transport, Reader(app), acceptor.current(), server_side=True,
                ssl_handshake_timeout=acceptor.timeout)
        except Exception as exc:
            acceptor.failed += 1
            log.debug("%s TLS handshake failed: %s", acceptor.proto, exc)
            transport.abort()
            return
        except asyncio.CancelledError:
            transport.abort()
            raise
        finally:
            self._end()
        if tls is None or tls.is_closing():
            return
        if log.isEnabledFor(logging.DEBUG):
            ssl_object = tls.get_extra_info("ssl_object")
            log.debug("%s TLS: %s %s", acceptor.proto, ssl_object.version(), ssl_object.cipher())
        if hasattr(app, "join_writes"):  # (one TLS record per flush: see h2.connection.H2Endpoint)
            app.join_writes = True
        app.connection_made(tls)


READ_BUFFER_BYTES = 256 << 10  # uvloop's SSL_READ_MAX_SIZE: what one SSLObject.read may give
_buffers = threading.local()  # .view: the decrypted-input buffer the TLS connections of a thread share


def _read_buffer() -> memoryview:
    view = memoryview(bytearray(READ_BUFFER_BYTES))
    _buffers.view = view
    return view


class Reader(asyncio.BufferedProtocol):
    """What the TLS transport (loop.start_tls's SSLProtocol) reads for: it decrypts into one
    buffer that all connections of the thread share, and ``app`` (an asyncio.Protocol) gets a
    copy of what arrived.

    Why (docs/perf/tls-cost.md, "Where the front door's time went"): given a plain
    asyncio.Protocol, uvloop's SSLProtocol (its `_do_read__copied`) asks `SSLObject.read` for
    256 KiB per read: a 256 KiB bytes object, which glibc maps for it (mmap), shrinks to what
    arrived (mremap) and unmaps when the app is done with it (munmap), first-touch page faults
    included. Measured on the gateway at c32 (perf_analyzer, HTTP binary add_sub): those three
    system calls and the faults were 20% of its CPU, 28 µs of the 140 µs a request cost with
    TLS. A buffered protocol gets `SSLObject.read(n, buffer)` into its buffer instead: no
    allocation but the copy (`bytes(view[:n])`, the input's size). One buffer serves all: the
    transport calls get_buffer, decrypts into it and calls buffer_updated in one go, without
    yielding to the loop (and without buffer_updated when nothing decrypted), and the bytes are
    copied out before the app runs."""

    __slots__ = ("app",)

    def __init__(self, app: asyncio.Protocol) -> None:
        self.app = app

    def get_buffer(self, sizehint: int) -> memoryview:
        try:
            return _buffers.view  # type: ignore[no-any-return]
        except AttributeError:
            return _read_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self.app.data_received(bytes(_buffers.view[:nbytes]))

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # (start_tls does not call it)
        self.app.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.app.connection_lost(exc)

    def eof_received(self) -> bool | None:
        return self.app.eof_received()

    def pause_writing(self) -> None:
        self.app.pause_writing()

    def resume_writing(self) -> None:
        self.app.resume_writing()


# ---- a client certificate as a tenant's name (gateway/auth.py:Tenants.authenticate) ---------------

CLIENT_CERT_HEADER = "x-meshserve-client-cert"  # a request's verified client certificate's names (CertNames)
# set at start by a gateway with --tenants, per port that serves mutual TLS (gateway/main.py:
# configure_cert_names); off, nothing per request
cert_names_grpc = False
cert_names_http = False
_NAMES_KEPT = 4096  # connections whose certificate names are remembered (their SSL objects held)
_names: dict[object, CertNames | None] = {}


class CertNames(str):
    """The names of a client certificate the handshake verified (its subject's CN, then its SAN
    URIs and DNS names, one per line). Its type is the proof: a header value from a wire is a
    plain str, so a client cannot send one (Tenants.authenticate checks the type)."""

    __slots__ = ()


def configure_cert_names(settings: TlsSettings, tenants: bool) -> None:
    """With tenants, a port on mutual TLS passes its clients' certificate names (gateway/auth.py)."""
    global cert_names_grpc, cert_names_http
    cert_names_grpc = tenants and settings.grpc is not None and settings.grpc.mutual
    cert_names_http = tenants and settings.http is not None and settings.http.mutual


def client_cert(headers: dict[str, str], transport: object) -> dict[str, str]:
    """``headers`` with CLIENT_CERT_HEADER set to the connection's verified client certificate's
    names, when it has one (a mutual-TLS port); a client's own header of that name is dropped.
    Runs per request only on a port whose ``cert_names_*`` is on; one dict lookup per request
    after the first of a connection."""
    headers.pop(CLIENT_CERT_HEADER, None)
    get = getattr(transport, "get_extra_info", None)
    ssl_object = get("ssl_object") if get is not None else None
    if ssl_object is None:
        return headers
    names = _names.get(ssl_object, _names)
    if names is _names:
        names = _cert_names(ssl_object.getpeercert() or {})
        if len(_names) >= _NAMES_KEPT:
            del _names[next(iter(_names))]
        _names[ssl_object] = names
    if names is not None:
        headers[CLIENT_CERT_HEADER] = names  # type: ignore[assignment]
    return headers


def _cert_names(cert: dict[str, object]) -> CertNames | None:
    """A verified peer certificate's names (ssl's getpeercert() form): CN, SAN URIs, SAN DNS names."""
    out = [value for rdn in cert.get("subject", ()) for key, value in rdn if key == "commonName"]  # type: ignore[attr-defined]
    for kind in ("URI", "DNS"):
        out += [value for k, value in cert.get("subjectAltName", ()) if k == kind]  # type: ignore[attr-defined]
    return CertNames("\n".join(out)) if out else None


def grpc_transport(context: object) -> object:
    """The transport of a call on meshserve's HTTP/2 server (meshserve/server/h2/server.py:ServerCall)."""
    return getattr(getattr(context, "_conn", None), "transport", None)


@dataclass(slots=True)
class UpstreamTls:
    """How a gateway connects to its services (one object, UPSTREAM, set from the gateway's
    --upstream-use-ssl flags at start; read where the hop's channels are made: the replica's
    grpc.aio channel and the inference streams' HTTP/2 channel). Off: plaintext, as before."""

    on: bool = False
    root: str | None = None  # the CA the services' certificates must chain to (None: the system's)
    cert: str | None = None  # the gateway's client certificate (the services' mutual TLS)
    key: str | None = None
    _ctx: ssl.SSLContext | None = None

    def context(self) -> ssl.SSLContext | None:
        """The HTTP/2 client's context (ALPN h2; the service's name checked), None when off."""
        if not self.on:
            return None
        if self._ctx is None:
            ctx = ssl.create_default_context(cafile=self.root)
            ctx.sslobject_class = _SSLObject
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            if self.cert:
                ctx.load_cert_chain(self.cert, self.key)
            ctx.set_alpn_protocols(["h2"])
            self._ctx = ctx
        return self._ctx

    def credentials(self) -> grpc.ChannelCredentials | None:
        """grpc's channel credentials for the same, None when off."""
        if not self.on:
            return None
        import grpc

        def read(path: str | None) -> bytes | None:
            if path is None:
                return None
            with open(path, "rb") as f:
                return f.read()

        return grpc.ssl_channel_credentials(read(self.root), read(self.key), read(self.cert))


UPSTREAM = UpstreamTls()


def add_upstream_arguments(ap: argparse.ArgumentParser) -> None:
    """The gateway's flags for TLS on its hop to the services."""
    group = ap.add_argument_group("TLS to the services (docs/security.md, \"TLS and mutual TLS\")")
    group.add_argument("--upstream-use-ssl", dest="tls_upstream_use_ssl", type=bool_argument, nargs="?", const=True,
                       default=False, metavar="BOOL", help="connect to the services over TLS (default false)")
    group.add_argument("--upstream-root-cert", dest="tls_upstream_root", default=None, metavar="PEM",
                       help="the CA the services' certificates must chain to (default: the system's)")
    group.add_argument("--upstream-client-cert", dest="tls_upstream_cert", default=None, metavar="PEM",
                       help="the gateway's client certificate, for services with --grpc-use-ssl-mutual")
    group.add_argument("--upstream-client-key", dest="tls_upstream_key", default=None, metavar="PEM",
                       help="its private key")


def configure_upstream(args: argparse.Namespace) -> None:
    """UPSTREAM from the flags (SystemExit when its files do not load)."""
    cert, key = args.tls_upstream_cert, args.tls_upstream_key
    on = bool(args.tls_upstream_use_ssl or args.tls_upstream_root or cert)
    if bool(cert) != bool(key):
        raise SystemExit("--upstream-client-cert and --upstream-client-key go together")
    UPSTREAM.on, UPSTREAM.root, UPSTREAM.cert, UPSTREAM.key, UPSTREAM._ctx = on, args.tls_upstream_root, cert, key, None
    try:
        UPSTREAM.context()
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise SystemExit(f"--upstream-use-ssl: cannot load the certificate files: {exc}") from None

