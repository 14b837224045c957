"""A SIGTERM that comes right after a process's ready line drains it (exit 0), not kills it: the
signal handlers are in place before the line is printed (meshserve/server/process.py:serve)."""
from __future__ import annotations

import signal
from pathlib import Path

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
