"""A client certificate's subject names the tenant (issue 34; gateway/auth.py, tenants'
``certificate_names``), through a gateway with --tenants and mutual TLS on both ports, with the
real tritonclient: a certificate whose CN a tenant lists is that tenant (its models, its
refusals) without any key; an API key, when sent, wins over the certificate; a certificate no
tenant lists is a caller without a key (401 here: no anonymous callers); a client's own
``x-meshserve-client-cert`` header is never believed."""
from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from meshserve.server.tls import CLIENT_CERT_HEADER
from tests.conftest import Proc, start
from tests.support import certs

BETA_KEY = "beta-key-0123456789"
TENANTS = f"""
tenants:
  - name: acme
    certificate_names: ["acme-client"]
    rate: 1000
    burst: 1000
    models: ["add_sub"]
  - name: beta
    keys_sha256: ["{hashlib.sha256(BETA_KEY.encode()).hexdigest()}"]
    rate: 1000
    burst: 1000
    models: ["small_mlp"]
"""


@dataclass
class Setup:
    gateway: Proc
    ca: certs.Authority
    acme: certs.Issued  # CN acme-client: the tenant acme
    nobody: certs.Issued  # CN nobody: no tenant lists it


@pytest.fixture(scope="module")
def setup(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    d = tmp_path_factory.mktemp("tls-tenants")
    ca = certs.authority(d, "ca")
    server = ca.issue(d, "server", server=True)
    (d / "tenants.yaml").write_text(TENANTS)
    mutual = []
    for proto in ("grpc", "http"):
        mutual += [f"--{proto}-use-ssl-mutual=true", f"--{proto}-server-cert", str(server.cert),
                   f"--{proto}-server-key", str(server.key), f"--{proto}-root-cert", str(ca.cert)]
    service = start(["service", "onnx", "--repository", str(model_repo), "--grpc-port", "0",
                     "--model-control-mode", "explicit", "--load-model", "add_sub", "--load-model", "small_mlp"])
    try:
        gateway = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", service.grpc,
                         "--tenants", str(d / "tenants.yaml"), *mutual])
    except Exception:
        service.stop()
        raise
    yield Setup(gateway, ca, ca.issue(d, "acme-client", server=False), ca.issue(d, "nobody", server=False))
    gateway.stop()
    service.stop()


def _add_sub(m: Any) -> list[Any]:
    ins = [m.InferInput(n, [1, 16], "FP32") for n in ("INPUT0", "INPUT1")]
    for i in ins:
        i.set_data_from_numpy(np.ones((1, 16), np.float32))
    return ins


def _mlp(m: Any) -> list[Any]:
    inp = m.InferInput("INPUT0", [1, 64], "FP32")
    inp.set_data_from_numpy(np.ones((1, 64), np.float32))
    return [inp]


def _client(proto: str, s: Setup, who: certs.Issued) -> Any:
    """tritonclient over mutual TLS presenting ``who``'s certificate (file paths for both modules)."""
    if proto == "grpc":
        return grpcclient.InferenceServerClient(s.gateway.grpc, ssl=True, root_certificates=str(s.ca.cert),
                                                private_key=str(who.key), certificate_chain=str(who.cert))
    return httpclient.InferenceServerClient(s.gateway.http, ssl=True, ssl_options={
        "ca_certs": str(s.ca.cert), "certfile": str(who.cert), "keyfile": str(who.key)})


def _refused(c: Any, model: str, inputs: list[Any], **kw: Any) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as err:
        c.infer(model, inputs, **kw)
    return str(err.value.status()), err.value.message() or ""


MODULES = {"http": httpclient, "grpc": grpcclient}
DENIED = {"http": "403", "grpc": "StatusCode.PERMISSION_DENIED"}
UNAUTHENTICATED = {"http": "401", "grpc": "StatusCode.UNAUTHENTICATED"}


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_the_certificate_names_the_tenant(setup: Setup, proto: str) -> None:
    m = MODULES[proto]
    c = _client(proto, setup, setup.acme)
    try:
        r = c.infer("add_sub", _add_sub(m))  # acme's model, no key at all
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), np.full((1, 16), 2.0, np.float32))
        code, message = _refused(c, "small_mlp", _mlp(m))  # not acme's
        assert code == DENIED[proto] and "tenant 'acme'" in message, (code, message)
        # an API key wins over the certificate: beta's models, not acme's
        assert c.infer("small_mlp", _mlp(m), headers={"x-api-key": BETA_KEY}).as_numpy("OUTPUT0").shape == (1, 64)
        code, message = _refused(c, "add_sub", _add_sub(m), headers={"x-api-key": BETA_KEY})
        assert code == DENIED[proto] and "tenant 'beta'" in message, (code, message)
    finally:
        c.close()


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_a_certificate_no_tenant_lists_is_a_caller_without_a_key(setup: Setup, proto: str) -> None:
    """CN nobody (signed by the same CA: the handshake passes) is no tenant, and claiming acme's
    name in the header the gateway uses inside does not make it one."""
    m = MODULES[proto]
    c = _client(proto, setup, setup.nobody)
    try:
        for headers in ({}, {CLIENT_CERT_HEADER: "acme-client"}):
            code, message = _refused(c, "add_sub", _add_sub(m), headers=headers)
            assert code == UNAUTHENTICATED[proto], (code, message)
    finally:
        c.close()
