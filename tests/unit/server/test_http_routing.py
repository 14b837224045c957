"""meshserve/server/http1/routing.py: templates compiled once, matched by segments; and the
route table the HTTP front end dispatches by (meshserve/server/access.py:HTTP_ROUTES)."""
from __future__ import annotations

from typing import Any

import pytest

from meshserve.server.access import HTTP_ROUTES, Op
from meshserve.server.http1.routing import Router, variants
from meshserve.server.http_frontend import HttpFrontend


class Target:
    def __getattr__(self, name: str) -> Any:
        return name  # (the handler's name stands for it)


ROUTER = Router(HTTP_ROUTES, Target())


def test_variants_expand_each_optional_group() -> None:
    assert variants("/v2/models/{m}[/versions/{v}]/ready") == [
        ["v2", "models", "{m}", "versions", "{v}", "ready"], ["v2", "models", "{m}", "ready"]]
    assert variants("/v2") == [["v2"]]
    assert len(variants("/a[/{x}]/b[/{y}]")) == 4


@pytest.mark.parametrize(("path", "template", "params"), [
    ("/v2", "/v2", {}),
    ("/v2/", "/v2", {}),
    ("/metrics", "/metrics", {}),
    ("/v2/health/live", "/v2/health/live", {}),
    ("/v2/models/stats", "/v2/models/stats", {}),  # the literal before the model named "stats"
    ("/v2/models/stats/ready", "/v2/models/{m}[/versions/{v}]/ready", {"m": "stats", "v": ""}),
    ("/v2/models/add_sub/versions/3/infer?x=1", "/v2/models/{m}[/versions/{v}]/infer", {"m": "add_sub", "v": "3"}),
    ("/v2/models/a%2Fb/infer", "/v2/models/{m}[/versions/{v}]/infer", {"m": "a/b", "v": ""}),
    ("/v2/models/m/trace/setting", "/v2/models/{m}/trace/setting", {"m": "m"}),
    ("/v2/repository/index", "/v2/repository[/{r}]/index", {"r": ""}),
    ("/v2/repository/other/models/m/load", "/v2/repository[/{r}]/models/{m}/load", {"r": "other", "m": "m"}),
    ("/v2/systemsharedmemory/region/r1/register", "/v2/systemsharedmemory/region/{n}/register", {"n": "r1"}),
    ("/v2/cudasharedmemory/status", "/v2/cudasharedmemory[/region/{n}]/status", {"n": ""}),
])
def test_paths_match_their_template(path: str, template: str, params: dict[str, str]) -> None:
    found = ROUTER.match(path)
    assert found is not None and found.template == template and found.params == params


@pytest.mark.parametrize("path", ["/", "", "/v2/models", "/v2/models//ready", "/v2/health/dead", "/v3",
                                  "/v2/models/m/versions/1/trace/setting", "/v2/models/m/infer/x",
                                  "/v2/systemsharedmemory/region//register", "/metrics/x"])
def test_other_paths_match_nothing(path: str) -> None:
    assert ROUTER.match(path) is None


def test_one_template_many_methods() -> None:
    found = ROUTER.match("/v2/trace/setting")
    assert found is not None and found.allowed() == "GET or POST"
    assert found.methods["GET"].op is Op.TRACE_GET and found.methods["POST"].op is Op.TRACE_UPDATE


def test_every_row_has_its_handler_on_the_front_end() -> None:
    """The front end's live table is the access table, each row bound to an HttpFrontend method."""
    routes = HttpFrontend(None).router.routes  # type: ignore[arg-type]
    assert [(r.method, r.template, r.op, r.handler.__name__ if hasattr(r.handler, "__name__") else name)
            for r, (*_, name) in zip(routes, HTTP_ROUTES, strict=True)] == \
        [(m, t, op, name) for m, t, op, name in HTTP_ROUTES]
    assert all(callable(r.handler) for r in routes)


def test_a_row_declared_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="declared twice"):
        Router([("GET", "/a", Op.HEALTH, "x"), ("GET", "/a", Op.HEALTH, "y")], Target())
