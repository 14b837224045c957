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
    assert [(r.method, r.template, r.op) for r in routes] == [(m, t, op) for m, t, op, _ in HTTP_ROUTES]
    assert all(callable(getattr(HttpFrontend, name)) for *_, name in HTTP_ROUTES)
    assert all(callable(r.handler) for r in routes)


def test_a_row_declared_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="declared twice"):
        Router([("GET", "/a", Op.HEALTH, "x"), ("GET", "/a", Op.HEALTH, "y")], Target())


class Core:
    """Only what the routes below call."""

    def live(self) -> bool:
        return True

    def authorize(self, op: Op, model: str, ctx: Any) -> Any:
        from meshserve.server.access import ALL

        return ALL

    def server_metadata(self) -> Any:
        from meshserve._proto import grpc_service_pb2 as pb

        return pb.ServerMetadataResponse(name="m", version="1")


def _answer(frontend: HttpFrontend, method: str, target: str) -> Any:
    import asyncio

    from meshserve.server.http1 import Request

    request = Request(None, method, target, "1.1", [("host", "x")], True)  # type: ignore[arg-type]  # (no body read)
    return asyncio.run(frontend.answer(request))


def test_dispatch_statuses() -> None:
    frontend = HttpFrontend(Core())  # type: ignore[arg-type]
    assert _answer(frontend, "GET", "/v2/health/live").status == 200
    assert _answer(frontend, "GET", "//v2/").status == 200  # (slashes around the path are dropped)
    missing = _answer(frontend, "GET", "/v2/nothing")
    assert missing.status == 404 and b"no route for GET /v2/nothing" in missing.body
    wrong = _answer(frontend, "DELETE", "/v2/trace/setting")
    assert wrong.status == 400 and b"use GET or POST" in wrong.body
    assert _answer(frontend, "HEAD", "/v2/health/live").status == 400  # (no route is HEAD)
    bad = _answer(frontend, "GET", "/v2/models/m/versions/x1/ready")
    assert bad.status == 400 and b"invalid version" in bad.body


def test_the_seen_paths_are_bounded() -> None:
    frontend = HttpFrontend(Core())  # type: ignore[arg-type]
    for i in range(HttpFrontend.SEEN_MAX + 10):
        _answer(frontend, "GET", f"/v2/health/live?{i}")
        assert len(frontend.seen) <= HttpFrontend.SEEN_MAX
    _answer(frontend, "GET", "/v2/unknown")
    assert "/v2/unknown" not in frontend.seen  # (only paths that matched a row are kept)
