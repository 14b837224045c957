"""Failed requests' log lines, within a budget per caller (meshserve/server/observe.py:
LineBudget, _log_error): a flood of bad requests writes at most the burst, then a line a
1 / ERROR_LINES_PER_S seconds, the next line saying how many were left out; one tenant's
flood leaves another's lines alone."""
from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol.errors import Code, InferError
from meshserve.server import inflate, observe
from meshserve.server.core import RequestContext
from meshserve.server.observe import ERROR_LINES_BURST, ERROR_LINES_PER_S, LineBudget


@pytest.fixture(autouse=True)
def fresh_budgets() -> Iterator[None]:
    observe._line_budgets.clear()
    yield
    observe._line_budgets.clear()


def test_the_burst_then_the_rate_then_what_was_left_out() -> None:
    budget = LineBudget(now=100.0)
    taken = [budget.take(100.0) for _ in range(int(ERROR_LINES_BURST) + 50)]
    assert taken[:int(ERROR_LINES_BURST)] == [0] * int(ERROR_LINES_BURST)
    assert taken[int(ERROR_LINES_BURST):] == [None] * 50
    step = 0.625 / ERROR_LINES_PER_S  # (0.625 of a token: exact in binary)
    assert budget.take(100.0 + step) is None  # not yet a whole token (51 left out)
    assert budget.take(100.0 + 2 * step) == 51  # 1.25 tokens: a line, saying so
    assert budget.take(100.0 + 2 * step) is None
    assert budget.take(100.0 + 4 * step) == 1


def fail(model: str, headers: Mapping[str, Any] | None = None) -> None:
    request = pb.ModelInferRequest(model_name=model)
    observe._log_error(request, RequestContext("grpc", dict(headers or {})), InferError.not_found("no such model"), "", 0)


def test_one_tenants_flood_leaves_anothers_lines(caplog: pytest.LogCaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    def tenant_of(headers: Mapping[str, Any]) -> inflate.Caller:
        key = headers.get("x-api-key")
        if key is None:
            raise InferError(Code.UNAUTHENTICATED, "no key")
        return key, 0.5

    monkeypatch.setattr(inflate, "tenant_of", tenant_of)
    caplog.set_level(logging.WARNING, logger="meshserve.request")
    for _ in range(500):
        fail("flooded", {"x-api-key": "mallory"})
    fail("calm", {"x-api-key": "acme"})
    fail("keyless")
    messages = [r.getMessage() for r in caplog.records]
    assert sum("infer flooded/" in m for m in messages) == int(ERROR_LINES_BURST)
    assert sum("infer calm/" in m for m in messages) == 1
    assert sum("infer keyless/" in m for m in messages) == 1
