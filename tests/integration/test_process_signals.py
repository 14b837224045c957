"""A SIGTERM that comes right after a process's ready line drains it (exit 0), not kills it: the
signal handlers are in place before the line is printed (meshserve/server/process.py:serve)."""
from __future__ import annotations

import signal
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from tests.conftest import start


def test_sigterm_right_after_the_ready_line_drains(model_repo: Path) -> None:
    service = start(["service", "onnx", "--repository", str(model_repo), "--grpc-port", "0", "--http-port", "0"])
    gateway = None
    try:
        gateway = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", service.grpc])
        assert gateway.stop(signal.SIGTERM) == 0, gateway.log()
        assert service.stop(signal.SIGTERM) == 0, service.log()
    finally:
        if gateway is not None:
            gateway.stop(signal.SIGKILL)
        service.stop(signal.SIGKILL)


def test_a_service_behind_a_gateway_drains_without_waiting_out_its_grace(model_repo: Path) -> None:
    """A service stopped (SIGTERM) while a gateway is connected to it ends once its requests in
    flight are done, not after its whole grace (10 s): the gateway's health watch is ended by the
    service once it has said NOT_SERVING, and the gateway retires its hop streams to a replica
    that left its pool (they carried requests: open, idle, they held the drain for the grace)."""
    service = start(["service", "onnx", "--repository", str(model_repo), "--grpc-port", "0", "--http-port", "0"])
    gateway = None
    try:
        gateway = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", service.grpc])
        a = np.ones((1, 16), np.float32)
        with grpcclient.InferenceServerClient(gateway.grpc) as client:
            inputs = [grpcclient.InferInput(n, [1, 16], "FP32") for n in ("INPUT0", "INPUT1")]
            for i in inputs:
                i.set_data_from_numpy(a)
            for _ in range(8):  # (the hop's streams open and carry requests)
                assert client.infer("add_sub", inputs).as_numpy("OUTPUT0").tolist() == [[2.0] * 16]
        t0 = time.monotonic()
        service.proc.send_signal(signal.SIGTERM)
        code = service.proc.wait(timeout=30)
        took = time.monotonic() - t0
        assert code == 0, service.log()
        assert took < 5, f"the drain took {took:.1f} s (its grace is 10 s)\n{service.log()}"
        assert gateway.proc.poll() is None  # (the gateway lives on without its replica)
    finally:
        if gateway is not None:
            gateway.stop(signal.SIGKILL)
        service.stop(signal.SIGKILL)
