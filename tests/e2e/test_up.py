"""`meshserve up` on the bundled example repository, driven with tritonclient; Ctrl-C stops all."""
from __future__ import annotations

import os
import re
import subprocess
import urllib.request

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families

from tests.support import eventually
from tests.support.net import free_port
from tests.support.up import meshserve_up


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _triton_metrics_on_the_printed_url(banner: str) -> None:
    """The /metrics `up` prints carries the services' Triton families (federated by the gateway)."""
    url = re.search(r"Metrics\s+(http://\S+/metrics)", banner)
    assert url, banner

    def scraped() -> tuple[dict, dict[str, float]] | None:
        with urllib.request.urlopen(url.group(1).replace("localhost", "127.0.0.1"), timeout=10) as r:
            families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
        success = {s.labels["model"]: s.value for s in families["nv_inference_request_success"].samples}
        return (families, success) if success.get("add_sub", 0) >= 1 and success.get("add_sub_bls", 0) >= 1 else None

    # the gateway reuses one scrape of the services for half a second
    families, success = eventually(scraped, timeout=30, interval=0.2, what="add_sub counted on the printed /metrics")
    assert success.get("add_sub", 0) >= 1 and success.get("mlp", 0) >= 1, success
    # each model labelled with the replica that serves it: one onnx service, one python service
    replica = {s.labels["model"]: s.labels.get("replica") for s in families["nv_inference_request_success"].samples}
    assert None not in replica.values() and len(set(replica.values())) == 2, replica
    assert replica["add_sub"] == replica["mlp"] != replica["add_sub_bls"], replica
    loaded = {s.labels["model"] for s in families["nv_model_load_duration_secs"].samples if s.value > 0}
    assert {"add_sub", "mlp", "add_sub_bls"} <= loaded, loaded
    assert "meshserve_gateway_requests" in families


def test_up_serves_examples_and_stops_cleanly() -> None:
    http_port = free_port()
    # a gRPC port of 0: `up` picks the gateway's port before the python service starts (its BLS
    # calls go there) and holds it until the gateway listens (cli.py:_reserve_port)
    with meshserve_up("--metrics-port", "0", "--http-port", str(http_port), "--grpc-port", "0") as up:
        grpc_port = up.ports["grpc"]
        text = up.banner
        assert f"http://localhost:{http_port}/v2" in text and "curl" in text
        assert "starting the python service" in text  # for add_sub_bls (backend "python")
        children = _children(up.pid)
        assert len(children) == 3  # the onnx service, the python service and the gateway

        with httpclient.InferenceServerClient(f"127.0.0.1:{http_port}") as c:
            assert c.is_server_ready()
            a = np.ones((2, 16), np.float32)
            inputs = [httpclient.InferInput("INPUT0", [2, 16], "FP32"), httpclient.InferInput("INPUT1", [2, 16], "FP32")]
            for i in inputs:
                i.set_data_from_numpy(a)
            np.testing.assert_array_equal(c.infer("add_sub", inputs).as_numpy("OUTPUT0"), a * 2)
            # the python model: its BLS call reaches add_sub through the gateway
            b = np.arange(32, dtype=np.float32).reshape(2, 16)
            inputs[1].set_data_from_numpy(b)
            res = c.infer("add_sub_bls", inputs)
            np.testing.assert_array_equal(res.as_numpy("OUTPUT0"), a + b)
            np.testing.assert_array_equal(res.as_numpy("OUTPUT1"), a - b)
        with grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}") as c:
            x = np.random.default_rng(0).standard_normal((3, 512)).astype(np.float32)
            inp = grpcclient.InferInput("INPUT0", [3, 512], "FP32")
            inp.set_data_from_numpy(x)
            assert c.infer("mlp", [inp]).as_numpy("OUTPUT0").shape == (3, 512)
            xi = np.arange(16, dtype=np.int32).reshape(1, 16)
            ins = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"), grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
            for i in ins:
                i.set_data_from_numpy(xi)
            np.testing.assert_array_equal(c.infer("add_sub_int32", ins).as_numpy("OUTPUT1"), xi * 0)
            v = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
            v.set_data_from_numpy(np.ones((1, 4), np.float32))
            assert c.infer("scale", [v], model_version="1").as_numpy("OUTPUT0").tolist() == [[1.0] * 4]
            assert c.infer("scale", [v]).as_numpy("OUTPUT0").tolist() == [[2.0] * 4]
        _triton_metrics_on_the_printed_url(text)

        assert up.interrupt() == 0  # Ctrl-C
        for pid in children:  # no orphans
            try:
                os.kill(pid, 0)
                alive = True
            except ProcessLookupError:
                alive = False
            assert not alive, f"child {pid} survived meshserve up"
