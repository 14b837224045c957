"""A/B routes end to end with the real tritonclient: the arm that answered (parameter + HTTP
header + metrics), weights roughly held, sticky users, and a shadow that never hurts the reply."""
from __future__ import annotations

import json
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import Proc, service_and_gateway
from tests.support import eventually

ROUTES = """
routes:
  - name: scale-ab
    targets:
      - {model: scale, version: 1, weight: 3, arm: v1}
      - {model: scale, version: 2, weight: 1, arm: v2}
    sticky: x-user-id
  - name: mirrored
    targets: [{model: scale, version: 1}]
    shadow: {model: no_such_model, share: 1.0}
"""


@pytest.fixture(scope="module")
def gateway(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    routes = tmp_path_factory.mktemp("routes") / "routes.yaml"
    routes.write_text(ROUTES)
    with service_and_gateway("onnx", ["--repository", str(model_repo)], ["--routes", str(routes)]) as (_, g):
        yield g


def call(proto: str, url: str, route: str, headers: dict[str, str] | None = None) -> tuple[str, float]:
    """(arm, the scale factor that answered)."""
    m = httpclient if proto == "http" else grpcclient
    inp = m.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_data_from_numpy(np.ones((1, 4), np.float32))
    with m.InferenceServerClient(url) as c:
        res = c.infer(route, [inp], headers=headers)
    resp = res.get_response()
    arm = resp["parameters"]["meshserve_route_arm"] if proto == "http" \
        else resp.parameters["meshserve_route_arm"].string_param
    return arm, float(res.as_numpy("OUTPUT0")[0, 0])


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_route_splits_by_weight_and_reports_the_arm(proto: str, gateway: Proc) -> None:
    url = getattr(gateway, proto)
    m = httpclient if proto == "http" else grpcclient
    with m.InferenceServerClient(url) as c:  # a route answers as its heaviest target, under its own name
        assert c.is_model_ready("scale-ab")
        md = c.get_model_metadata("scale-ab")
        assert (md["name"] if proto == "http" else md.name) == "scale-ab"
        cfg = c.get_model_config("scale-ab")
        assert (cfg["max_batch_size"] if proto == "http" else cfg.config.max_batch_size) == 8
    counts: Counter[str] = Counter()
    for _ in range(400):
        arm, factor = call(proto, url, "scale-ab")
        assert factor == {"v1": 1.0, "v2": 2.0}[arm]  # the arm named is the one that answered
        counts[arm] += 1
    assert abs(counts["v1"] / 400 - 0.75) <= 0.08, counts  # ±2% is checked over 10,000 in unit tests
    # sticky: one user always lands on the same arm
    for user in ("alice", "bob", "carol"):
        arms = {call(proto, url, "scale-ab", {"x-user-id": user})[0] for _ in range(10)}
        assert len(arms) == 1, (user, arms)


def test_http_header_shadow_and_metrics(gateway: Proc) -> None:
    body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32",
                                   "data": [1, 1, 1, 1]}]}).encode()
    req = urllib.request.Request(f"http://{gateway.http}/v2/models/scale-ab/infer", data=body, method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        arm = r.headers["x-meshserve-route-arm"]
        doc = json.loads(r.read())
    assert arm in ("v1", "v2") and doc["parameters"]["meshserve_route_arm"] == arm
    # the shadow target does not exist: every copy fails, every reply still succeeds
    for proto in ("http", "grpc"):
        for _ in range(5):
            assert call(proto, getattr(gateway, proto), "mirrored") == ("scale:1", 1.0)
    # a client-given version on a route is a client mistake
    with httpclient.InferenceServerClient(gateway.http) as c, pytest.raises(InferenceServerException) as err:
        inp = httpclient.InferInput("INPUT0", [1, 4], "FP32")
        inp.set_data_from_numpy(np.ones((1, 4), np.float32))
        c.infer("scale-ab", [inp], model_version="1")
    assert str(err.value.status()) == "400"
    shadowed = 'meshserve_gateway_shadow_requests_total{route="mirrored",model="no_such_model",outcome="NOT_FOUND"} 10'

    def metrics_text() -> str:  # once the shadow copies (answered after the replies) are counted
        with urllib.request.urlopen(f"http://{gateway.http}/metrics", timeout=5) as r:
            text = r.read().decode()
        return text if shadowed in text else ""

    text = eventually(metrics_text, what="the 10 shadow copies answered")
    assert 'meshserve_gateway_route_requests_total{route="scale-ab",arm="v1",outcome="OK"}' in text, text
    assert 'meshserve_gateway_route_requests_total{route="mirrored",arm="scale:1",outcome="OK"} 10' in text
    assert 'meshserve_gateway_shadow_requests_total{route="mirrored",model="no_such_model",outcome="NOT_FOUND"} 10' \
        in text
