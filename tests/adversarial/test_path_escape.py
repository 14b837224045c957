"""Path escape: a model name (or a file name in a load request's config) that would leave the
repository is 400 / INVALID_ARGUMENT at a service and through the gateway, over HTTP and gRPC,
and the model placed outside the repository is never loaded or listed.

A real model directory sits next to the repository (``<tmp>/outside/evil``); before the name
rule, ``POST /v2/repository/models/%2F<tmp>%2Foutside%2Fevil/load`` at a service answered 200
and served it."""
from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.adversarial.support import add_sub_inputs, raw_http
from tests.conftest import Proc, service_and_gateway

RULE = "one path component"


@dataclass
class Mesh:
    service: Proc
    gateway: Proc
    outside: Path  # <tmp>/outside/evil: a loadable model outside the repository


@pytest.fixture(scope="module")
def mesh(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    root = tmp_path_factory.mktemp("escape")
    repo = root / "repo"
    shutil.copytree(model_repo / "add_sub", repo / "add_sub")
    evil = root / "outside" / "evil"
    shutil.copytree(model_repo / "add_sub", evil)
    (evil / "config.pbtxt").write_text((evil / "config.pbtxt").read_text().replace('"add_sub"', '"evil"'))
    # uploads on: the `file:` path tests need the paths checked, not the upload refused
    with service_and_gateway("onnx", ["--repository", str(repo), "--model-control-mode", "explicit", "--load-model",
                              "add_sub", "--allow-model-uploads"],
                             ["--discovery-interval", "0.5", "--allow-model-uploads"]) as (service, gateway):
        yield Mesh(service, gateway, evil)


def escapes(outside: Path) -> list[str]:
    return [str(outside), "../outside/evil", "../../outside/evil", "add_sub/../../outside/evil",
            "..\\outside\\evil", "evil\x00", "..", ".", f"{outside}\x00"]


def encoded(name: str) -> str:
    """Every byte percent-encoded: the front end decodes it back to ``name``."""
    return "".join(f"%{b:02X}" for b in name.encode())


def http_text(hostport: str, method: str, path: str, body: bytes = b"") -> tuple[int, str]:
    status, data = raw_http(hostport, method, path, body=body)
    return status, data.decode("utf-8", "replace")


def index_names(hostport: str) -> set[str]:
    status, body = raw_http(hostport, "POST", "/v2/repository/index", body=b"{}")
    assert status == 200, body
    return {m["name"] for m in json.loads(body)}


@pytest.mark.parametrize("where", ["service", "gateway"])
def test_escapes_over_http_are_400_and_never_loaded(mesh: Mesh, where: str) -> None:
    url = getattr(mesh, where).http
    for name in escapes(mesh.outside):
        for path in (f"/v2/repository/models/{encoded(name)}/load", f"/v2/repository/models/{encoded(name)}/unload",
                     f"/v2/repository/myrepo/models/{encoded(name)}/load"):
            status, body = http_text(url, "POST", path, b"{}")
            assert status == 400 and RULE in body and "invalid model name" in body, (where, name, status, body)
        for path in (f"/v2/models/{encoded(name)}", f"/v2/models/{encoded(name)}/ready",
                     f"/v2/models/{encoded(name)}/config", f"/v2/models/{encoded(name)}/stats",
                     f"/v2/models/{encoded(name)}/versions/1"):
            status, body = http_text(url, "GET", path)
            assert status == 400 and RULE in body, (where, name, path, status, body)
        status, body = http_text(url, "POST", f"/v2/models/{encoded(name)}/infer",
                                b'{"inputs":[{"name":"INPUT0","shape":[1],"datatype":"FP32","data":[1]}]}')
        assert status == 400 and RULE in body, (where, name, status, body)
        # tritonclient percent-encodes every character but '/': what it can express, it gets the same answer
        if "/" not in name:
            with httpclient.InferenceServerClient(url) as c, pytest.raises(InferenceServerException) as err:
                c.load_model(name)
            assert err.value.status() == "400" and RULE in (err.value.message() or ""), (where, name)
    assert index_names(url) == {"add_sub"}


@pytest.mark.parametrize("where", ["service", "gateway"])
def test_escapes_over_grpc_are_invalid_argument_and_never_loaded(mesh: Mesh, where: str) -> None:
    with grpcclient.InferenceServerClient(getattr(mesh, where).grpc) as c:
        for name in escapes(mesh.outside):
            for call in (c.load_model, c.unload_model, c.get_model_metadata, c.get_model_config,
                         c.get_inference_statistics, c.is_model_ready):
                with pytest.raises(InferenceServerException) as err:
                    call(name)
                assert str(err.value.status()) == "StatusCode.INVALID_ARGUMENT", (where, name, call, err.value)
                assert RULE in (err.value.message() or ""), err.value
            with pytest.raises(InferenceServerException) as err:
                c.infer(name, add_sub_inputs(grpcclient))
            assert str(err.value.status()) == "StatusCode.INVALID_ARGUMENT", (where, name, err.value)
        with pytest.raises(InferenceServerException) as err:
            c.get_model_metadata("add_sub", model_version="../1")
        assert str(err.value.status()) == "StatusCode.INVALID_ARGUMENT" and "version" in (err.value.message() or "")
        assert {m.name for m in c.get_model_repository_index().models} == {"add_sub"}


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_config_override_cannot_name_a_file_outside(mesh: Mesh, proto: str) -> None:
    """A load request's config may not point default_model_filename (read while loading) outside."""
    config = json.dumps({"name": "add_sub", "backend": "onnxruntime", "max_batch_size": 8,
                         "default_model_filename": "../../../outside/evil/1/model.onnx"})
    module = httpclient if proto == "http" else grpcclient
    for proc in (mesh.service, mesh.gateway):
        with module.InferenceServerClient(getattr(proc, proto)) as c:
            with pytest.raises(InferenceServerException) as err:
                c.load_model("add_sub", config=config)
            assert str(err.value.status()) in ("400", "StatusCode.INVALID_ARGUMENT"), err.value
            assert "default_model_filename" in (err.value.message() or ""), err.value
            assert c.is_model_ready("add_sub")  # the old version keeps serving


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_file_override_paths_cannot_escape(mesh: Mesh, proto: str) -> None:
    """`file:<path>` load parameters (model files in the request) are written under the
    repository only: a path that climbs out or hides a separator is refused before a byte is
    written, by the gateway and by the service alike; an absolute one is the model directory's,
    as Triton joins it (never the root): here no version directory, so the load fails, 400."""
    config = json.dumps({"name": "dropped", "backend": "onnxruntime", "max_batch_size": 8})
    outside = mesh.outside.parent
    module = httpclient if proto == "http" else grpcclient
    for proc in (mesh.service, mesh.gateway):
        with module.InferenceServerClient(getattr(proc, proto)) as c:
            for rel in ("../../../outside/dropped.onnx", "1/../../../../outside/dropped.onnx",
                        "1/..\\..\\dropped.onnx", "1/dropped\x00.onnx", "/../outside/dropped.onnx"):
                with pytest.raises(InferenceServerException) as err:
                    c.load_model("dropped", config=config, files={f"file:{rel}": b"x"})
                assert str(err.value.status()) in ("400", "StatusCode.INVALID_ARGUMENT"), (proc.argv, rel, err.value)
                assert "file path" in (err.value.message() or ""), err.value
            with pytest.raises(InferenceServerException) as err:
                c.load_model("dropped", config=config, files={f"file:{outside}/dropped.onnx": b"x"})
            assert str(err.value.status()) in ("400", "StatusCode.INVALID_ARGUMENT"), (proc.argv, err.value)
            assert "at least one version must be available under the version policy of model 'dropped'" in \
                (err.value.message() or ""), err.value
            assert not c.is_model_ready("dropped")
    assert not list(outside.rglob("dropped*"))
    assert not list(outside.parent.rglob("dropped*.onnx"))


def long_and_control_names() -> list[str]:
    """Names the one rule refuses that are not escapes (issue 29, finding 8): over NAME_MAX
    (255 bytes of UTF-8; a 300-character name was a 500 echoing the repository's absolute path),
    multi-byte characters past NAME_MAX in bytes but not in characters, and control characters
    (a newline loaded and ended up in text logs)."""
    return ["m" * 256, "m" * 4096, "é" * 128, "bad\nname", "bad\rname", "bad\x1bname", "bad\x7fname", "bad\x85name"]


@pytest.mark.parametrize("where", ["service", "gateway"])
def test_long_and_control_names_are_client_errors_that_name_no_path(mesh: Mesh, where: str) -> None:
    proc = getattr(mesh, where)
    repo = str(mesh.outside.parent.parent / "repo")
    config = json.dumps({"name": "m", "backend": "onnxruntime", "max_batch_size": 8})
    with httpclient.InferenceServerClient(proc.http) as h, grpcclient.InferenceServerClient(proc.grpc) as g:
        for name in long_and_control_names():
            for status, text in (_http_load(proc.http, name), _grpc_load(g, name)):
                assert status in ("400", "StatusCode.INVALID_ARGUMENT"), (where, name[:20], status, text)
                assert repo not in text and "/tmp" not in text, (where, text)  # no path in any answer
            status, body = http_text(proc.http, "GET", f"/v2/models/{encoded(name)}")
            assert status == 400 and repo not in body, (where, status, body)
            # a `file:` path component over NAME_MAX or with a control character: 400 naming the
            # component's rule, nothing written (it was a 503: an OSError taken for an outage)
            for rel in ("1/" + "f" * 300, "1/a\nb.onnx"):
                for call in (h.load_model, g.load_model):
                    with pytest.raises(InferenceServerException) as err:
                        call("m", config=config, files={f"file:{rel}": b"x"})
                    assert str(err.value.status()) in ("400", "StatusCode.INVALID_ARGUMENT"), (where, rel, err.value)
                    assert repo not in (err.value.message() or "")
        assert h.is_server_live() and g.is_server_live()
        assert {m.name for m in g.get_model_repository_index().models} == {"add_sub"}


def _http_load(hostport: str, name: str) -> tuple[str, str]:
    status, body = http_text(hostport, "POST", f"/v2/repository/models/{encoded(name)}/load", b"{}")
    return str(status), body


def _grpc_load(client: grpcclient.InferenceServerClient, name: str) -> tuple[str, str]:
    try:
        client.load_model(name)
    except InferenceServerException as exc:
        return str(exc.status()), exc.message() or ""
    return "OK", ""
