"""The failed requests' log lines through real processes and the real tritonclient: each caller
has a budget of them (meshserve/server/observe.py:ERROR_LINES_PER_S, ERROR_LINES_BURST), so a
flood of bad requests is not a flood of lines, and what it left out is said in the caller's
next line; and a client's string (a model name, a request id) cannot start a line of its own in
the text log (meshserve/telemetry/text_lines.py). docs/security.md, "Session 20: messages in a
row, and the log lines of failed requests"."""
from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from meshserve.server.observe import ERROR_LINES_BURST, ERROR_LINES_PER_S
from tests.conftest import Proc, service_and_gateway
from tests.support import eventually

FLOOD = 600


@pytest.fixture(scope="module")
def gateway(model_repo: Path) -> Iterator[Proc]:
    with service_and_gateway("onnx", ["--repository", str(model_repo)]) as (_, g):
        yield g


def lines(g: Proc, needle: str) -> list[str]:
    return [line for line in g.output if needle in line]


def settled(g: Proc, needle: str) -> int:
    """How many lines have ``needle`` once the test's reader of the process's output has caught
    up (a line is written before its request's answer, but read here by a thread): the count
    polled until it holds for half a second."""
    seen = [-1, time.monotonic()]

    def holds() -> bool:
        n = len(lines(g, needle))
        if n != seen[0]:
            seen[:] = [n, time.monotonic()]
        return time.monotonic() - seen[1] >= 0.5

    eventually(holds, timeout=20, interval=0.1, what=f"the lines with {needle!r} read")
    return int(seen[0])


def unknown_model_requests(g: Proc, model: str, count: int) -> None:
    """``count`` requests for a model nobody serves, on one ModelStreamInfer call (errors in
    band), 50 at a time: within the gateway's --max-inflight (128), so that each is answered
    NOT_FOUND (a WARNING line each on the code before), not refused as busy (DEBUG)."""
    answered = threading.Semaphore(0)
    errors: list[str] = []
    inp = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 4), np.float32))

    def got(result: object, error: InferenceServerException | None) -> None:
        errors.append(error.message() if error is not None else "OK")  # (in band: no status)
        answered.release()

    with grpcclient.InferenceServerClient(g.grpc) as c:
        c.start_stream(got)
        for start in range(0, count, 50):
            for i in range(start, min(count, start + 50)):
                c.async_stream_infer(model, [inp], request_id=str(i))
            for _ in range(start, min(count, start + 50)):
                assert answered.acquire(timeout=30), "a request was never answered"
        c.stop_stream()
    assert set(errors) == {f"Request for unknown model: '{model}' is not found"}, collections.Counter(errors)


def test_a_flood_of_failed_requests_logs_within_the_callers_budget(gateway: Proc) -> None:
    t0 = time.monotonic()
    unknown_model_requests(gateway, "nobody_serves_this", FLOOD)
    took = time.monotonic() - t0
    logged = settled(gateway, "infer nobody_serves_this/")
    allowed = ERROR_LINES_BURST + ERROR_LINES_PER_S * (took + 1.0)
    assert 0 < logged <= allowed < FLOOD, (logged, allowed)  # (the code before: one line each, 600)

    def said_what_it_left_out() -> bool:  # a token comes back in 1 / ERROR_LINES_PER_S seconds
        unknown_model_requests(gateway, "nobody_serves_this", 1)
        return bool(lines(gateway, "failed requests of this caller not logged before this one"))

    eventually(said_what_it_left_out, timeout=10, interval=0.2, what="a line saying how many were left out")


def test_a_clients_string_cannot_start_a_line_in_the_text_log(gateway: Proc) -> None:
    forged = "2026-11-30 00:00:00,000 ERROR meshserve.gateway: FORGED"
    inp = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 4), np.float32))
    with grpcclient.InferenceServerClient(gateway.grpc) as c, pytest.raises(InferenceServerException):
        c.infer(f"nope\n{forged} by name", [inp], request_id=f"id\r\n{forged} by id")
    hinp = httpclient.InferInput("INPUT0", [1, 4], "FP32")
    hinp.set_data_from_numpy(np.zeros((1, 4), np.float32))
    with httpclient.InferenceServerClient(gateway.http) as c, pytest.raises(InferenceServerException):
        c.infer("add_sub", [hinp], request_id=f"id\n{forged} by an HTTP id")

    def both_logged() -> bool:
        return len(lines(gateway, "FORGED by")) >= 2

    eventually(both_logged, timeout=10, what="the two failed requests' lines")
    started = [line for line in gateway.output if line.lstrip().startswith(forged)]
    assert not started, started  # (the code before: a line of the client's making)
    assert lines(gateway, f"nope\\n{forged} by name"), "the model name, escaped, in its request's line"
