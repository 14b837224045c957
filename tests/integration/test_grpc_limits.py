"""The gRPC front door's limits on real processes, through the real tritonclient: a gateway
started with small --max-request-bytes / --max-concurrent-streams / --idle-timeout-s in front of
the shared service (tests/unit/server/test_h2_limits.py drives every limit frame by frame)."""
from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.conftest import Proc, _wait_http_ready, start

LIMIT = 1 << 20


@pytest.fixture
def gateway(stack) -> Iterator[Proc]:
    gw = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", stack.service.grpc,
                "--max-request-bytes", str(LIMIT), "--max-concurrent-streams", "16", "--idle-timeout-s", "0.5"])
    _wait_http_ready(gw.http)
    yield gw
    gw.stop()


def _input(width: int) -> grpcclient.InferInput:
    inp = grpcclient.InferInput("INPUT0", [1, width], "FP32")
    inp.set_data_from_numpy(np.ones((1, width), dtype=np.float32))
    return inp


def test_a_request_over_max_request_bytes_is_resource_exhausted(gateway: Proc) -> None:
    with grpcclient.InferenceServerClient(gateway.grpc) as c:
        assert c.infer("small_mlp", [_input(64)]).as_numpy("OUTPUT0") is not None  # small: served
        with pytest.raises(InferenceServerException) as err:
            c.infer("small_mlp", [_input(LIMIT // 4)])  # 1 MiB of FP32 + the message around it
        assert err.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert f"vs. {LIMIT}" in (err.value.message() or "")
        assert c.infer("small_mlp", [_input(64)]).as_numpy("OUTPUT0") is not None  # and serves on


def test_the_gateway_advertises_its_stream_limit_and_closes_idle_connections(gateway: Proc) -> None:
    host, port = gateway.grpc.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        head = s.recv(9)
        n, typ = int.from_bytes(head[:3], "big"), head[3]
        payload = b""
        while len(payload) < n:
            payload += s.recv(n - len(payload))
        assert typ == 4  # the server's SETTINGS come first
        settings = dict(struct.unpack_from(">HI", payload, i) for i in range(0, n, 6))
        assert settings[0x3] == 16
        t0 = time.monotonic()
        while s.recv(65536):  # GOAWAY(NO_ERROR) after --idle-timeout-s, then the close
            assert time.monotonic() - t0 < 8, "an idle connection was kept"
        assert time.monotonic() - t0 < 8
