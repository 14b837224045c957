"""Live model control through the gateway: explicit load/unload (with a config override),
poll mode picking up a new version, the API refused in 'none' mode, and a reload under
16 concurrent clients with zero failed requests."""
from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from meshserve import examples
from tests.conftest import Proc, start
from tests.support import eventually
from tests.support.models import example_models


def _repo(root: Path) -> Path:
    return example_models(root, "add_sub", "scale")


@pytest.fixture()
def explicit(tmp_path: Path) -> Iterator[tuple[Proc, Proc, Path]]:
    repo = _repo(tmp_path / "repo")
    svc = start(["service", "onnx", "--repository", str(repo), "--grpc-port", "0",
                 "--model-control-mode", "explicit", "--load-model", "add_sub"])
    gw = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", svc.grpc,
                "--discovery-interval", "0.5"])
    yield svc, gw, repo
    gw.stop()
    svc.stop()


def _add_sub(c: object, mod: object) -> np.ndarray:
    a = np.ones((1, 16), np.float32)
    ins = [mod.InferInput("INPUT0", [1, 16], "FP32"), mod.InferInput("INPUT1", [1, 16], "FP32")]  # type: ignore[attr-defined]
    for i in ins:
        i.set_data_from_numpy(a)
    return c.infer("add_sub", ins).as_numpy("OUTPUT0")  # type: ignore[attr-defined]


def test_explicit_load_and_unload(explicit: tuple[Proc, Proc, Path]) -> None:
    _, gw, _ = explicit
    with httpclient.InferenceServerClient(gw.http) as c:
        assert c.is_model_ready("add_sub")
        assert not c.is_model_ready("scale")
        index = {m["name"]: m for m in c.get_model_repository_index()}
        assert index["scale"]["state"] == "UNAVAILABLE"
        c.load_model("scale")  # blocks until loaded, as Triton's load does
        assert c.is_model_ready("scale")
        c.unload_model("scale")
    with grpcclient.InferenceServerClient(gw.grpc) as c:
        _until_unloaded(c, "scale")
        with pytest.raises(InferenceServerException) as err:
            c.load_model("no_such_model")
        assert err.value.status() == "StatusCode.NOT_FOUND"


def test_load_with_config_override(explicit: tuple[Proc, Proc, Path]) -> None:
    _, gw, repo = explicit
    with httpclient.InferenceServerClient(gw.http) as c:
        config = c.get_model_config("add_sub")
        assert config["max_batch_size"] == 64
        config["max_batch_size"] = 4
        with pytest.raises(InferenceServerException) as err:  # preferred [64] no longer fits
            c.load_model("add_sub", config=json.dumps(config))
        assert err.value.status() == "400" and "preferred_batch_size" in err.value.message()
        assert c.get_model_config("add_sub")["max_batch_size"] == 64  # the old version still serves
        config["dynamic_batching"]["preferred_batch_size"] = [4]
        c.load_model("add_sub", config=json.dumps(config))
        assert c.get_model_config("add_sub")["max_batch_size"] == 4
        assert _add_sub(c, httpclient).shape == (1, 16)


def test_api_refused_in_none_mode(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "repo")
    svc = start(["service", "onnx", "--repository", str(repo), "--grpc-port", "0", "--http-port", "0"])
    try:
        with httpclient.InferenceServerClient(svc.http) as c, pytest.raises(InferenceServerException) as err:
            c.load_model("scale")
        assert err.value.status() == "501"
        assert "--model-control-mode explicit" in err.value.message()
    finally:
        svc.stop()


def test_poll_mode_picks_up_a_new_version(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "repo")
    (repo / "scale" / "config.pbtxt").write_text(
        (repo / "scale" / "config.pbtxt").read_text().replace("version_policy: { all { } }", ""))
    shutil.rmtree(repo / "scale" / "2")
    svc = start(["service", "onnx", "--repository", str(repo), "--grpc-port", "0", "--http-port", "0",
                 "--model-control-mode", "poll", "--repository-poll-secs", "0.3"])
    try:
        with httpclient.InferenceServerClient(svc.http) as c:
            assert c.get_model_metadata("scale")["versions"] == ["1"]
            examples.save_onnx(examples.scale(2.0), repo / "scale" / "2" / "model.onnx")
            eventually(lambda: c.get_model_metadata("scale")["versions"] == ["2"], timeout=10, what="the poll")
            assert c.get_model_metadata("scale")["versions"] == ["2"]  # latest 1: v2 replaced v1
    finally:
        svc.stop()


def test_reload_under_16_concurrent_clients_fails_no_request(explicit: tuple[Proc, Proc, Path]) -> None:
    _, gw, _ = explicit
    stop = threading.Event()
    failures: list[str] = []
    counts = [0] * 16

    def client(i: int) -> None:
        with grpcclient.InferenceServerClient(gw.grpc) as c:
            while not stop.is_set():
                try:
                    out = _add_sub(c, grpcclient)
                    assert out.tolist() == [[2.0] * 16]
                    counts[i] += 1
                except Exception as exc:  # any failure fails the test
                    failures.append(repr(exc))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    try:
        eventually(lambda: all(counts), what="every client answered")
        with httpclient.InferenceServerClient(gw.http) as c:
            for delay in (100, 2000, 500):  # three reloads, each a new config
                config = c.get_model_config("add_sub")
                config["dynamic_batching"]["max_queue_delay_microseconds"] = delay
                c.load_model("add_sub", config=json.dumps(config))
                done = list(counts)  # every client gets answers from the new config before the next
                eventually(lambda done=done: all(n > d for n, d in zip(counts, done, strict=True)) or failures,
                           what=f"every client answered after the reload to {delay} us")
            assert c.get_model_config("add_sub")["dynamic_batching"]["max_queue_delay_microseconds"] == 500
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert failures == []
    assert all(n > 0 for n in counts)


def test_load_over_two_replicas_reports_a_partial_failure(tmp_path: Path) -> None:
    """A load goes to every replica of the model's kind; one replica whose copy of the model is
    broken fails, and the error names that replica and why, and where the load worked."""
    good, bad = _repo(tmp_path / "a"), _repo(tmp_path / "b")
    for version in ("1", "2"):
        (bad / "scale" / version / "model.onnx").write_bytes(b"not an onnx model")
    services = [start(["service", "onnx", "--repository", str(r), "--grpc-port", "0",
                       "--model-control-mode", "explicit", "--load-model", "add_sub"]) for r in (good, bad)]
    gw = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--discovery-interval", "0.5",
                *(a for s in services for a in ("--upstream", s.grpc))])
    try:
        with httpclient.InferenceServerClient(gw.http) as c:
            _until_ready(c)
            with pytest.raises(InferenceServerException) as err:
                c.load_model("scale")
            message = err.value.message()
            assert err.value.status() == "400", message
            assert message.startswith("failed to load 'scale' on 1 of 2 replicas: "), message
            assert f"service {services[1].grpc}: failed to load 'scale'" in message, message
            assert message.endswith(f"; loaded on {services[0].grpc}"), message
            v = httpclient.InferInput("INPUT0", [1, 4], "FP32")
            v.set_data_from_numpy(np.ones((1, 4), np.float32))
            for _ in range(4):  # served by the replica where the load worked
                assert c.infer("scale", [v]).as_numpy("OUTPUT0").tolist() == [[2.0] * 4]
            index = {(m["name"], m.get("version", "")): m for m in c.get_model_repository_index()}
            assert index[("scale", "2")]["state"] == "READY"
        with grpcclient.InferenceServerClient(gw.grpc) as g:
            g.unload_model("scale")  # both replicas
            _until_unloaded(g, "scale")
            with pytest.raises(InferenceServerException) as gerr:
                g.load_model("scale")
            assert gerr.value.status() == "StatusCode.INVALID_ARGUMENT"
            assert services[1].grpc in gerr.value.message()
    finally:
        gw.stop()
        for s in services:
            s.stop()


def _until_ready(c: httpclient.InferenceServerClient, timeout: float = 10) -> None:
    """Both replicas discovered: add_sub answers from the pool."""
    eventually(lambda: c.is_server_ready() and c.is_model_ready("add_sub"), timeout,
               what="the gateway and add_sub ready")


def _until_unloaded(c: grpcclient.InferenceServerClient, name: str, timeout: float = 5) -> None:
    """Unload returns before readiness turns false everywhere (as in Triton): poll."""
    eventually(lambda: not c.is_model_ready(name), timeout, what=f"'{name}' unloaded")
    assert not c.is_model_ready(name)
