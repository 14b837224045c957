"""BLS over TLS (issue 34): a python model's InferenceRequest.exec() reaches a gateway whose gRPC
port serves mutual TLS, through the python service's --bls-use-ssl, --bls-root-cert and
--bls-client-cert / --bls-client-key; without the client certificate the call is refused at the
handshake and the model gets Triton's BLS error (UNAVAILABLE), never a 5xx."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import Proc, _wait_http_ready, start
from tests.models import python_models
from tests.support import certs
from tests.support.net import free_port

W = python_models.WIDTH


@dataclass
class Mesh:
    gateway: Proc
    uncertified: Proc  # a gateway in front of the python service that has no client certificate


@pytest.fixture(scope="module")
def mesh(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    d = tmp_path_factory.mktemp("bls-tls")
    ca = certs.authority(d, "ca")
    server, client = ca.issue(d, "server", server=True), ca.issue(d, "bls", server=False)
    repo = tmp_path_factory.mktemp("bls-tls-models")
    python_models.write(repo, "bls_sync", python_models.BLS_SYNC, python_models.config(
        "bls_sync", [*python_models.PAIR_IN, ("MODEL_NAME", "TYPE_STRING", "1")], python_models.PAIR_OUT))
    gateway_grpc = free_port()
    mutual = ["--grpc-use-ssl-mutual=true", "--grpc-server-cert", str(server.cert), "--grpc-server-key",
              str(server.key), "--grpc-root-cert", str(ca.cert)]
    bls = ["--bls-target", f"127.0.0.1:{gateway_grpc}", "--bls-root-cert", str(ca.cert)]
    procs: list[Proc] = []
    try:
        procs.append(start(["service", "onnx", "--repository", str(model_repo), "--grpc-port", "0",
                            "--model-control-mode", "explicit", "--load-model", "add_sub"]))
        procs.append(start(["service", "python", "--repository", str(repo), "--grpc-port", "0", *bls,
                            "--bls-client-cert", str(client.cert), "--bls-client-key", str(client.key)]))
        procs.append(start(["service", "python", "--repository", str(repo), "--grpc-port", "0", *bls]))
        procs.append(start(["gateway", "--grpc-port", str(gateway_grpc), "--http-port", "0", *mutual,
                            "--upstream", procs[0].grpc, "--upstream", procs[1].grpc]))
        procs.append(start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", procs[0].grpc,
                            "--upstream", procs[2].grpc]))
        _wait_http_ready(procs[3].http)
        _wait_http_ready(procs[4].http)
        yield Mesh(procs[3], procs[4])
    finally:
        for p in reversed(procs):
            p.stop()


def _call(url: str) -> httpclient.InferResult:
    x, y = np.arange(W, dtype=np.float32), np.full(W, 0.5, np.float32)
    ins = [httpclient.InferInput("INPUT0", [W], "FP32"), httpclient.InferInput("INPUT1", [W], "FP32"),
           httpclient.InferInput("MODEL_NAME", [1], "BYTES")]
    ins[0].set_data_from_numpy(x)
    ins[1].set_data_from_numpy(y)
    ins[2].set_data_from_numpy(np.array([b"add_sub"], dtype=np.object_))
    with httpclient.InferenceServerClient(url) as c:
        return c.infer("bls_sync", ins)


def test_bls_reaches_a_mutual_tls_gateway(mesh: Mesh) -> None:
    res = _call(mesh.gateway.http)
    np.testing.assert_allclose(res.as_numpy("OUTPUT0"), np.arange(W, dtype=np.float32) + 0.5)
    np.testing.assert_allclose(res.as_numpy("OUTPUT1"), np.arange(W, dtype=np.float32) - 0.5)


def test_bls_without_a_client_certificate_is_refused(mesh: Mesh) -> None:
    """The second python service (same CA, no client certificate) calls the mutual-TLS gateway:
    its handshake is refused, the model's BLS call fails (Triton's BLS error text, the cause in it)."""
    with pytest.raises(InferenceServerException) as err:
        _call(mesh.uncertified.http)
    message = err.value.message() or ""
    # (a model's exception in execute: Triton's 500 and text, the BLS error in it; see test_python_backend.py)
    assert "Model add_sub - Error when running inference" in message, message
    assert "failed to connect" in message.lower() or "handshake" in message.lower() or "unavailable" in message.lower(), message
