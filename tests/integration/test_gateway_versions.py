"""Versioned routing through the gateway: unknown version → 404, known but unserved → 503 naming it."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import _wait_http_ready, start, take_down
from tests.support import eventually

PROTOCOLS = {"http": (httpclient, "404", "503"), "grpc": (grpcclient, "StatusCode.NOT_FOUND",
                                                          "StatusCode.UNAVAILABLE")}


def _infer(proto: str, url: str, version: str) -> np.ndarray:
    m = PROTOCOLS[proto][0]
    inp = m.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_data_from_numpy(np.ones((1, 4), np.float32))
    with m.InferenceServerClient(url) as c:
        return c.infer("scale", [inp], model_version=version).as_numpy("OUTPUT0")


def _status(proto: str, url: str, version: str) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as err:
        _infer(proto, url, version)
    return str(err.value.status()), err.value.message() or ""


def test_version_known_but_not_served_is_503_naming_it(model_repo: Path) -> None:
    service = start(["service", "onnx", "--repository", str(model_repo), "--grpc-port", "0"])
    gateway = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", service.grpc,
                     "--discovery-interval", "0.3", "--coalesce-inflight", "0"])
    try:
        _wait_http_ready(gateway.http)
        for proto in PROTOCOLS:
            url = getattr(gateway, proto)
            assert _infer(proto, url, "1").tolist() == [[1.0] * 4]
            assert _infer(proto, url, "2").tolist() == [[2.0] * 4]
            status, msg = _status(proto, url, "7")
            assert status == PROTOCOLS[proto][1] and "version 7" in msg
        take_down(service, gateway)
        # a discovery round notices the replica is gone
        eventually(lambda: _status("http", gateway.http, "1")[0] == PROTOCOLS["http"][2], timeout=10,
                   what="version 1 unavailable")
        for proto in PROTOCOLS:
            url = getattr(gateway, proto)
            status, msg = _status(proto, url, "1")
            assert status == PROTOCOLS[proto][2], msg
            assert "'scale' version 1" in msg
            status, msg = _status(proto, url, "")
            assert status == PROTOCOLS[proto][2] and "'scale'" in msg
            status, msg = _status(proto, url, "7")  # still unknown, not "unavailable"
            assert status == PROTOCOLS[proto][1], msg
    finally:
        gateway.stop()
        service.stop()
