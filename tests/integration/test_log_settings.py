"""Triton's logging extension on a gateway process, through tritonclient (HTTP and gRPC)."""
from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import Proc, _wait_http_ready, start
from tests.support import eventually
from tests.support.net import free_port

SEVERITIES = ("log_info", "log_warning", "log_error", "log_verbose_level", "log_format")


@contextlib.contextmanager
def _gateway_over(stack, *more_upstreams: str) -> Iterator[Proc]:
    """A gateway of its own (its log settings change) over the shared service (and
    ``more_upstreams``). Its updates go on to the service (GatewayCore.log_settings_changed): the
    service's settings are put back after it, for the other tests that share it."""
    with httpclient.InferenceServerClient(stack.service.http) as service:
        before = {k: v for k, v in service.get_log_settings().items() if k in SEVERITIES}
    gw = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", stack.service.grpc,
                *(arg for u in more_upstreams for arg in ("--upstream", u))])
    try:
        _wait_http_ready(gw.http)
        yield gw
    finally:
        gw.stop()
        with httpclient.InferenceServerClient(stack.service.http) as service:
            service.update_log_settings(before)


@pytest.fixture
def gateway(stack) -> Iterator[Proc]:
    """A gateway of its own over the shared service, at INFO (``_gateway_over``)."""
    with _gateway_over(stack) as gw:
        yield gw


def _infer(c: grpcclient.InferenceServerClient, width: int = 64) -> None:
    inp = grpcclient.InferInput("INPUT0", [1, width], "FP32")
    inp.set_data_from_numpy(np.ones((1, width), dtype=np.float32))
    if width == 64:
        c.infer("small_mlp", [inp])
    else:
        with pytest.raises(InferenceServerException):
            c.infer("small_mlp", [inp])


def _new_lines(gw: Proc, since: int, needle: str, expect: int = 0) -> list[str]:
    """The process's lines with ``needle`` since line ``since``, once the pump thread has read
    ``expect`` of them; with ``expect`` 0 (none may come) only a fixed wait can show it."""
    def lines() -> list[str]:
        return [line for line in gw.output[since:] if needle in line]

    if expect:
        eventually(lambda: len(lines()) >= expect, what=f"{expect} line(s) with {needle!r}")
    else:
        time.sleep(0.3)  # the point: a line that must not come would have been read by now
    return lines()


def test_log_settings_switch_request_lines_and_formats(gateway: Proc) -> None:
    http = httpclient.InferenceServerClient(gateway.http)
    assert "logging" in http.get_server_metadata()["extensions"]
    assert http.get_log_settings() == {"log_file": "", "log_info": True, "log_warning": True, "log_error": True,
                                       "log_verbose_level": 0, "log_format": "default"}
    with grpcclient.InferenceServerClient(gateway.grpc) as c:
        mark = len(gateway.output)
        _infer(c)
        assert _new_lines(gateway, mark, "infer small_mlp") == []  # INFO: no line per request
        got = c.update_log_settings({"log_verbose_level": 1}, as_json=True)["settings"]
        assert got["log_verbose_level"] == {"uint32_param": 1} and got["log_info"] == {"bool_param": True}
        mark = len(gateway.output)
        _infer(c)
        assert len(_new_lines(gateway, mark, "infer small_mlp", 1)) == 1  # DEBUG: one line per request

        assert http.update_log_settings({"log_verbose_level": 0, "log_format": "json"})["log_format"] == "json"
        mark = len(gateway.output)
        _infer(c, width=63)  # a client error: one WARNING line, as JSON now
        (line,) = _new_lines(gateway, mark, "small_mlp", 1)
        record = json.loads(line)
        assert record["level"] == "WARNING" and record["model"] == "small_mlp" and record["status"] == "INVALID_ARG"

        c.update_log_settings({"log_warning": False})
        mark = len(gateway.output)
        _infer(c, width=63)
        assert _new_lines(gateway, mark, "small_mlp") == []  # warnings off: the same error leaves no line

        with pytest.raises(InferenceServerException, match="'log_info' must be a boolean"):
            http.update_log_settings({"log_info": "yes"})
        with pytest.raises(InferenceServerException, match="'log_file' cannot be set") as caught:
            c.update_log_settings({"log_file": "/tmp/meshserve.log"})
        assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
        req = urllib.request.Request(f"http://{gateway.http}/v2/logging", data=b"[]", method="POST")
        with pytest.raises(urllib.error.HTTPError) as bad:
            urllib.request.urlopen(req, timeout=10)
        assert bad.value.code == 400 and b"JSON object" in bad.value.read()
        assert c.get_log_settings(as_json=True)["settings"]["log_warning"] == {"bool_param": False}
    http.close()


def test_a_service_that_joins_later_gets_the_settings_the_gateway_was_given(stack, model_repo: Path) -> None:
    """/v2/logging at a gateway goes on to its services; one that joins the pool afterwards (a
    replica down at the update, started after it) gets the settings when the gateway finds it."""
    port = free_port()
    with _gateway_over(stack, f"127.0.0.1:{port}") as gw:
        with httpclient.InferenceServerClient(gw.http) as http:
            http.update_log_settings({"log_verbose_level": 1})
        with httpclient.InferenceServerClient(stack.service.http) as service:
            assert service.get_log_settings()["log_verbose_level"] == 1  # (the replica that was there)
        late = start(["service", "onnx", "--repository", str(model_repo), "--grpc-port", str(port),
                      "--http-port", "0"])
        try:
            with httpclient.InferenceServerClient(late.http) as joined:
                eventually(lambda: joined.get_log_settings()["log_verbose_level"] == 1, timeout=30,
                           what="the late replica given the gateway's log settings")
        finally:
            late.stop()
