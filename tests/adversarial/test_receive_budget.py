"""The process-wide receive budget (--max-receive-bytes; issue 29 item 4): bodies being
received count as they arrive (all of an announced Content-Length at once), before decoding
and admission; one that does not fit is 429 with Retry-After before its body is read, and the
bytes come back when the requests holding them are answered. A service runs with an 8 MiB
budget here; three clients hold 3 MiB bodies half sent."""
from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Proc, start
from tests.support.http1 import connect, read_answer

MiB = 1 << 20
BUDGET = 8 * MiB


@pytest.fixture(scope="module")
def service(model_repo: Path) -> Iterator[Proc]:
    p = start(["service", "onnx", "--repository", str(model_repo), "--grpc-port", "0", "--http-port", "0",
               "--model-control-mode", "explicit", "--load-model", "add_sub", "--max-receive-bytes", str(BUDGET)])
    yield p
    p.stop()


def _begin(hostport: str, length: int, sent: int) -> socket.socket:
    s = connect(hostport, timeout=10)
    s.sendall((f"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: {hostport}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {length}\r\n\r\n").encode() + b" " * sent)
    return s


def test_bodies_over_the_receive_budget_are_refused_before_they_are_read(service: Proc) -> None:
    held = [_begin(service.http, 3 * MiB, 2 * MiB) for _ in range(2)]  # 6 MiB of 8 charged
    try:
        late = _begin(service.http, 3 * MiB, 0)
        try:
            answer = read_answer(late.makefile("rb"))
        finally:
            late.close()
        assert answer.status == 429, answer
        assert answer.headers.get("retry-after") == "1"
        assert b"--max-receive-bytes" in answer.body
        for s in held:  # the held bodies end (an invalid JSON document: 400), and give their bytes back
            s.sendall(b" " * MiB)
            assert read_answer(s.makefile("rb")).status == 400
    finally:
        for s in held:
            s.close()
    again = _begin(service.http, 3 * MiB, 3 * MiB)
    try:
        assert read_answer(again.makefile("rb")).status == 400  # judged by its content, not refused for room
    finally:
        again.close()
