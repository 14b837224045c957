"""TLS and mutual TLS on the HTTP and gRPC ports (meshserve/server/tls.py), with the real
tritonclient, through the gateway and direct to a service.

A throwaway CA signs the servers' and the good client's certificates; a second CA ("other")
signs a client certificate the servers must refuse; the good CA also signs an expired client
certificate. The processes (each port: TLS, or mutual TLS):

- service S: gRPC plaintext (the gateways' hop), HTTP mutual TLS;
- service T: gRPC mutual TLS, HTTP TLS (direct only);
- gateway G1 (in front of S): gRPC mutual TLS, HTTP TLS;
- gateway G2 (in front of S): gRPC TLS, HTTP mutual TLS.

A refused handshake is no HTTP or gRPC answer: the client sees its connection fail (gRPC:
UNAVAILABLE), never a 5xx or INTERNAL.
"""
from __future__ import annotations

import shutil
import socket
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from load.bench.procs import Endpoints
from tests.conftest import Proc, start
from tests.support import certs
from tests.support.http1 import closed_within, connect
from tests.support.up import meshserve_up
from tests.support.waiting import eventually

REFUSED_WITHIN_S = 5.0  # a refused handshake or plaintext on a TLS port: closed well within this


@dataclass
class Pki:
    ca: certs.Authority
    other: certs.Authority
    server: certs.Issued
    client: certs.Issued
    stranger: certs.Issued  # a client certificate from the other CA
    expired: certs.Issued  # a client certificate from the good CA, expired
    directory: Path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca, other = certs.authority(d, "mesh-ca"), certs.authority(d, "other-ca")
    return Pki(ca, other, ca.issue(d, "server", server=True), ca.issue(d, "client", server=False),
               other.issue(d, "stranger", server=False), ca.issue(d, "expired", server=False, days=-1,
                                                                   not_before_days=-3), d)


def tls_flags(proto: str, pki: Pki, mutual: bool) -> list[str]:
    flags = [f"--{proto}-use-ssl", f"--{proto}-server-cert", str(pki.server.cert),
             f"--{proto}-server-key", str(pki.server.key), f"--{proto}-root-cert", str(pki.ca.cert)]
    return flags + ([f"--{proto}-use-ssl-mutual=true"] if mutual else [])


@dataclass
class Target:
    name: str
    proc: Endpoints  # a Proc, or a `meshserve up` (tests/support/up.py:Up)
    http_mutual: bool
    grpc_mutual: bool


@pytest.fixture(scope="module")
def procs(model_repo: Path, pki: Pki) -> Iterator[dict[str, Target]]:
    load = ["--model-control-mode", "explicit", "--load-model", "add_sub"]
    started: list[Proc] = []
    try:
        s = start(["service", "onnx", "--repository", str(model_repo), "--grpc-port", "0", "--http-port", "0",
                   *load, *tls_flags("http", pki, True)])
        started.append(s)
        t = start(["service", "onnx", "--repository", str(model_repo), "--grpc-port", "0", "--http-port", "0",
                   *load, *tls_flags("grpc", pki, True), *tls_flags("http", pki, False)])
        started.append(t)
        g1 = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", s.grpc,
                    *tls_flags("grpc", pki, True), *tls_flags("http", pki, False)])
        started.append(g1)
        g2 = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", s.grpc,
                    *tls_flags("grpc", pki, False), *tls_flags("http", pki, True)])
        started.append(g2)
        targets = {"service-S": Target("service-S", s, True, False), "service-T": Target("service-T", t, False, True),
                   "gateway-1": Target("gateway-1", g1, False, True), "gateway-2": Target("gateway-2", g2, True, False)}
        for target in targets.values():
            eventually(lambda target=target: http_client(target, pki).is_model_ready("add_sub"), timeout=60,
                       what=f"{target.name}: add_sub ready over HTTPS")
        yield targets
    finally:
        for p in reversed(started):
            p.stop()


def http_client(target: Target, pki: Pki, ca: certs.Authority | None = None,
                client: certs.Issued | None = None) -> httpclient.InferenceServerClient:
    """tritonclient.http over TLS trusting `ca` (default the good one), presenting `client`
    (default: the good client certificate where the port wants one)."""
    options = {"ca_certs": str((ca or pki.ca).cert)}
    client = client if client is not None else (pki.client if target.http_mutual else None)
    if client is not None:
        options.update(certfile=str(client.cert), keyfile=str(client.key))
    return httpclient.InferenceServerClient(target.proc.http, ssl=True, ssl_options=options,
                                            connection_timeout=10, network_timeout=10)


def _grpc(target: Target, pki: Pki, ca: certs.Authority | None = None,
          client: certs.Issued | None = None) -> grpcclient.InferenceServerClient:
    """tritonclient.grpc over TLS: root_certificates / private_key / certificate_chain are file paths."""
    client = client if client is not None else (pki.client if target.grpc_mutual else None)
    return grpcclient.InferenceServerClient(
        target.proc.grpc, ssl=True, root_certificates=str((ca or pki.ca).cert),
        private_key=str(client.key) if client is not None else None,
        certificate_chain=str(client.cert) if client is not None else None)


def _inputs(mod: object) -> list[object]:
    a = np.arange(16, dtype=np.float32).reshape(1, 16)
    b = np.full((1, 16), 2.0, dtype=np.float32)
    ins = [mod.InferInput("INPUT0", [1, 16], "FP32"), mod.InferInput("INPUT1", [1, 16], "FP32")]  # type: ignore[attr-defined]
    ins[0].set_data_from_numpy(a)
    ins[1].set_data_from_numpy(b)
    return ins


def _check(result: object) -> None:
    a = np.arange(16, dtype=np.float32).reshape(1, 16)
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), a + 2)  # type: ignore[attr-defined]
    np.testing.assert_allclose(result.as_numpy("OUTPUT1"), a - 2)  # type: ignore[attr-defined]


NAMES = ["service-S", "service-T", "gateway-1", "gateway-2"]


@pytest.mark.parametrize("name", NAMES)
def test_http_infer_over_tls(procs: dict[str, Target], pki: Pki, name: str) -> None:
    client = http_client(procs[name], pki)
    try:
        assert client.is_server_live()
        _check(client.infer("add_sub", _inputs(httpclient)))
    finally:
        client.close()


@pytest.mark.parametrize("name", [n for n in NAMES if n != "service-S"])  # (S: plaintext gRPC, the hop)
def test_grpc_infer_over_tls(procs: dict[str, Target], pki: Pki, name: str) -> None:
    target = procs[name]
    client = _grpc(target, pki)
    try:
        assert client.is_server_live()
        _check(client.infer("add_sub", _inputs(grpcclient)))
        # a stream too (ModelStreamInfer over the same TLS connection)
        results: list[object] = []
        client.start_stream(callback=lambda result, error: results.append(error or result))
        client.async_stream_infer("add_sub", _inputs(grpcclient))
        eventually(lambda: results, what="the streamed answer")
        client.stop_stream()
        assert not isinstance(results[0], Exception), results[0]
        _check(results[0])
    finally:
        client.close()


def _http_refused(target: Target, pki: Pki, **kw: object) -> None:
    client = http_client(target, pki, **kw)  # type: ignore[arg-type]
    try:
        with pytest.raises(Exception) as caught:
            client.is_server_live()
        # no HTTP answer at all (an InferenceServerException would carry a status)
        assert not isinstance(caught.value, InferenceServerException), caught.value
    finally:
        client.close()


def _grpc_refused(target: Target, pki: Pki, **kw: object) -> None:
    _unavailable(_grpc(target, pki, **kw))  # type: ignore[arg-type]


def _unavailable(client: grpcclient.InferenceServerClient) -> None:
    """The client's call fails UNAVAILABLE (a refused handshake: no gRPC status from the server)."""
    try:
        with pytest.raises(InferenceServerException) as caught:
            client.is_server_live()
        assert caught.value.status() == "StatusCode.UNAVAILABLE", caught.value
    finally:
        client.close()


@pytest.mark.parametrize("name", NAMES)
def test_wrong_ca_refused(procs: dict[str, Target], pki: Pki, name: str) -> None:
    """A client that trusts another CA does not accept the server's certificate."""
    target = procs[name]
    _http_refused(target, pki, ca=pki.other)
    if name != "service-S":
        _grpc_refused(target, pki, ca=pki.other)


MUTUAL = [("service-S", "http"), ("service-T", "grpc"), ("gateway-1", "grpc"), ("gateway-2", "http")]


@pytest.mark.parametrize("name,proto", MUTUAL)
@pytest.mark.parametrize("who", ["stranger", "expired"])
def test_mutual_tls_refuses_bad_client_certificates(procs: dict[str, Target], pki: Pki, name: str, proto: str,
                                                    who: str) -> None:
    """Under mutual TLS a client certificate from another CA, or an expired one, is refused."""
    client = pki.stranger if who == "stranger" else pki.expired
    (_http_refused if proto == "http" else _grpc_refused)(procs[name], pki, client=client)


@pytest.mark.parametrize("name,proto", MUTUAL)
def test_mutual_tls_refuses_no_client_certificate(procs: dict[str, Target], pki: Pki, name: str, proto: str) -> None:
    """Under mutual TLS a client without a certificate is refused: with a raw TLS socket, the
    server closes the connection without answering a request."""
    target = procs[name]
    ctx = ssl.create_default_context(cafile=str(pki.ca.cert))
    ctx.set_alpn_protocols(["h2"] if proto == "grpc" else ["http/1.1"])
    hostport = target.proc.grpc if proto == "grpc" else target.proc.http
    raw = connect(hostport)
    got = b""
    try:
        with ctx.wrap_socket(raw, server_hostname="localhost") as tls:
            tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" if proto == "grpc"
                        else b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            tls.settimeout(REFUSED_WITHIN_S)
            while chunk := tls.recv(65536):
                got += chunk
    except (ssl.SSLError, ConnectionResetError, BrokenPipeError):
        pass
    assert got == b"", got[:200]
    # and through tritonclient: gRPC sees UNAVAILABLE, HTTP sees no answer
    if proto == "grpc":
        _unavailable(grpcclient.InferenceServerClient(target.proc.grpc, ssl=True, root_certificates=str(pki.ca.cert)))
    else:
        h = httpclient.InferenceServerClient(target.proc.http, ssl=True, ssl_options={"ca_certs": str(pki.ca.cert)},
                                             connection_timeout=10, network_timeout=10)
        try:
            with pytest.raises(Exception) as raised:
                h.is_server_live()
            assert not isinstance(raised.value, InferenceServerException)
        finally:
            h.close()


@pytest.mark.parametrize("name,proto", [("service-T", "grpc"), ("service-T", "http"), ("gateway-1", "grpc"),
                                        ("gateway-1", "http")])
def test_plaintext_to_a_tls_port_closed_fast(procs: dict[str, Target], name: str, proto: str) -> None:
    target = procs[name]
    hostport = target.proc.grpc if proto == "grpc" else target.proc.http
    with connect(hostport) as sock:
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" if proto == "grpc"
                     else b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        took = closed_within(sock, REFUSED_WITHIN_S)
    assert took is not None and took < 1.0, took


def test_alpn(procs: dict[str, Target], pki: Pki) -> None:
    """The gRPC port negotiates h2, the HTTP port http/1.1."""
    target = procs["gateway-2"]  # gRPC TLS (no client certificate needed)
    for hostport, offered, expected in ((target.proc.grpc, ["h2", "http/1.1"], "h2"),
                                        (procs["gateway-1"].proc.http, ["h2", "http/1.1"], "http/1.1")):
        ctx = ssl.create_default_context(cafile=str(pki.ca.cert))
        ctx.set_alpn_protocols(offered)
        with socket.create_connection(tuple(hostport.rsplit(":", 1)), timeout=10) as raw:  # type: ignore[arg-type]
            with ctx.wrap_socket(raw, server_hostname="localhost") as tls:
                assert tls.selected_alpn_protocol() == expected


def test_certificate_reloaded_when_its_files_change(model_repo: Path, pki: Pki, tmp_path: Path) -> None:
    """A certificate swapped on disk is served on the next connection; a connection made with
    the old one keeps working. (meshserve's HTTP/1.1 server: aiohttp's fallback does not reload.)"""
    cert, key = tmp_path / "server.crt", tmp_path / "server.key"
    shutil.copy(pki.server.cert, cert)
    shutil.copy(pki.server.key, key)
    gateway = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", "127.0.0.1:1",
                     "--http-use-ssl", "--http-server-cert", str(cert), "--http-server-key", str(key)])
    try:
        old = http_client(Target("g", gateway, False, False), pki)
        assert old.is_server_live()  # a keep-alive connection made with the first certificate
        renewed = pki.other.issue(tmp_path, "renewed", server=True)
        # written elsewhere then renamed: a reader never sees half a file
        shutil.copy(renewed.key, tmp_path / "next.key")
        shutil.copy(renewed.cert, tmp_path / "next.crt")
        (tmp_path / "next.key").replace(key)
        (tmp_path / "next.crt").replace(cert)

        def issuer() -> str:
            ctx = ssl.create_default_context(cafile=str(pki.other.cert))
            ctx.load_verify_locations(cafile=str(pki.ca.cert))
            with socket.create_connection(("127.0.0.1", gateway.ports["http"]), timeout=10) as raw:
                with ctx.wrap_socket(raw, server_hostname="localhost") as tls:
                    peer = tls.getpeercert()
            return dict(x[0] for x in peer["issuer"])["commonName"]

        eventually(lambda: issuer() == "other-ca", timeout=10, what="the renewed certificate served")
        assert old.is_server_live()  # the old connection still answers
        new = http_client(Target("g", gateway, False, False), pki, ca=pki.other)
        try:
            assert new.is_server_live()
        finally:
            new.close()
        old.close()
    finally:
        gateway.stop()


def test_flags_need_files(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.conftest import ROOT

    run = subprocess.run([sys.executable, "-m", "meshserve", "gateway", "--grpc-use-ssl", "--upstream", "x:1"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert run.returncode != 0 and "--grpc-server-cert" in run.stderr, run.stderr


def test_meshserve_up_serves_tls_on_the_gateway(model_repo: Path, pki: Pki) -> None:
    """`meshserve up` with the TLS flags: its gateway serves HTTPS and gRPC over mutual TLS
    (the services stay plaintext on loopback); the banner says https."""
    with meshserve_up("--metrics-port", "-1", "--repository", str(model_repo), "--http-port", "0", "--grpc-port", "0",
                      *tls_flags("http", pki, False), *tls_flags("grpc", pki, True)) as up:
        assert up.scheme == "https", up.banner
        target = Target("up", up, False, True)
        client = http_client(target, pki)
        try:
            eventually(lambda: client.is_model_ready("add_sub"), timeout=60, what="add_sub ready through up")
            _check(client.infer("add_sub", _inputs(httpclient)))
        finally:
            client.close()
        g = _grpc(target, pki)
        try:
            _check(g.infer("add_sub", _inputs(grpcclient)))
        finally:
            g.close()
        _grpc_refused(target, pki, client=pki.stranger)
        assert up.stop() == 0  # Ctrl-C: a clean exit


def test_the_hop_over_mutual_tls(model_repo: Path, pki: Pki) -> None:
    """A service with gRPC mutual TLS behind a gateway with --upstream-use-ssl and a client
    certificate: inference (the hop's streams) and the model's metadata and statistics (the
    replica's channel) go through; a gateway without the client certificate cannot reach it."""
    service = start(["service", "onnx", "--repository", str(model_repo), "--grpc-port", "0", "--http-port", "0",
                     "--model-control-mode", "explicit", "--load-model", "add_sub", *tls_flags("grpc", pki, True)])
    hop_cert = pki.ca.issue(pki.directory, "gateway-hop", server=False)
    started = [service]
    try:
        good = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", service.grpc,
                      "--upstream-use-ssl", "--upstream-root-cert", str(pki.ca.cert),
                      "--upstream-client-cert", str(hop_cert.cert), "--upstream-client-key", str(hop_cert.key)])
        started.append(good)
        anonymous = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", service.grpc,
                           "--upstream-use-ssl", "--upstream-root-cert", str(pki.ca.cert)])
        started.append(anonymous)
        client = httpclient.InferenceServerClient(good.http)
        try:
            eventually(lambda: client.is_model_ready("add_sub"), timeout=30, what="add_sub through the TLS hop")
            _check(client.infer("add_sub", _inputs(httpclient)))
            assert client.get_model_metadata("add_sub")["name"] == "add_sub"
        finally:
            client.close()
        g = grpcclient.InferenceServerClient(good.grpc)
        try:
            _check(g.infer("add_sub", _inputs(grpcclient)))
        finally:
            g.close()
        other = httpclient.InferenceServerClient(anonymous.http)
        try:
            assert not other.is_model_ready("add_sub")  # the service refused its handshakes
            with pytest.raises(InferenceServerException) as caught:
                other.infer("add_sub", _inputs(httpclient))
            assert caught.value.status() is not None and not str(caught.value.status()).startswith("5"), caught.value
        finally:
            other.close()
    finally:
        for p in reversed(started):
            p.stop()


PERF_ANALYZER = Path(__file__).resolve().parents[3] / "shared" / "tools" / "perf_analyzer"


@pytest.mark.skipif(not PERF_ANALYZER.exists(), reason=f"perf_analyzer wrapper not found at {PERF_ANALYZER}")
@pytest.mark.parametrize("name,proto", [("gateway-1", "grpc"), ("gateway-2", "http"), ("service-T", "grpc"),
                                        ("service-S", "http")])
def test_perf_analyzer_over_mutual_tls(procs: dict[str, Target], pki: Pki, name: str, proto: str,
                                       tmp_path: Path) -> None:
    """Triton's perf_analyzer with its --ssl-grpc-* / --ssl-https-* options, mutual TLS."""
    import csv
    import subprocess

    target = procs[name]
    report = tmp_path / "pa.csv"
    if proto == "grpc":
        url = target.proc.grpc
        tls = ["--ssl-grpc-use-ssl", "true", "--ssl-grpc-root-certifications-file", str(pki.ca.cert),
               "--ssl-grpc-private-key-file", str(pki.client.key), "--ssl-grpc-certificate-chain-file",
               str(pki.client.cert)]
    else:
        url = "https://" + target.proc.http
        tls = ["--ssl-https-verify-peer", "1", "--ssl-https-verify-host", "2", "--ssl-https-ca-certificates-file",
               str(pki.ca.cert), "--ssl-https-client-certificate-file", str(pki.client.cert),
               "--ssl-https-private-key-file", str(pki.client.key)]
    cmd = [str(PERF_ANALYZER), "-m", "add_sub", "-u", url, "-i", proto, "--concurrency-range", "1:4:3",
           "--measurement-interval", "200", "--stability-percentage", "999", "--max-trials", "8",
           "-f", str(report), *tls]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = list(csv.DictReader(report.open()))
    assert sorted(int(r["Concurrency"]) for r in rows) == [1, 4]
    assert all(float(r["Inferences/Second"]) > 10 for r in rows), rows


def test_meshserve_up_mesh_tls(model_repo: Path) -> None:
    """`meshserve up --mesh-tls`: the services' gRPC ports serve mutual TLS with a throwaway CA
    (made in a run directory, removed at exit) that only the gateway holds a certificate of:
    inference through the gateway works; a client reaching a service port directly, plaintext
    or TLS without the CA's client certificate, is refused."""
    with meshserve_up("--metrics-port", "-1", "--repository", str(model_repo), "--http-port", "0", "--grpc-port", "0",
                      "--mesh-tls") as up:
        assert up.scheme == "http", up.banner
        client = httpclient.InferenceServerClient(up.http)
        try:
            eventually(lambda: client.is_model_ready("add_sub"), timeout=60, what="add_sub through the mTLS hop")
            _check(client.infer("add_sub", _inputs(httpclient)))
        finally:
            client.close()
        # the services' ports, from the gateway's command line (its --upstream flags)
        gateway_argv = next(argv for argv in _children_argv(up.pid) if "gateway" in argv)
        upstreams = [gateway_argv[i + 1] for i, a in enumerate(gateway_argv) if a == "--upstream"]
        root = gateway_argv[gateway_argv.index("--upstream-root-cert") + 1]
        run_dir = Path(root).parent
        assert upstreams and oct(run_dir.stat().st_mode & 0o777) == "0o700"
        for upstream in upstreams:
            _unavailable(grpcclient.InferenceServerClient(upstream))  # plaintext
            _unavailable(grpcclient.InferenceServerClient(upstream, ssl=True, root_certificates=root))  # no cert
        assert up.stop() == 0  # Ctrl-C: a clean exit
        assert not run_dir.exists()


def _children_argv(pid: int) -> list[list[str]]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                out.append(Path(f"/proc/{child}/cmdline").read_bytes().decode().split("\0"))
            except OSError:
                continue
    return out
