"""No client code without an owner (issue 29, finding 1).

- `meshserve up` as documented: a load request carrying a python model (`file:1/model.py`,
  whose initialize() would create a marker file) is refused (403 / PERMISSION_DENIED naming
  --allow-model-uploads) over HTTP and gRPC, and the model's code never runs; with
  `--allow-model-uploads` on loopback it loads and serves.
- `meshserve up --host 0.0.0.0 --allow-model-uploads` without tenants refuses to start.
- Without tenants, load and unload come from loopback clients only, at the gateway and at a
  service, unless --allow-remote-model-control; a service refuses uploads without the flag too.
- The 251-byte ONNX of two ConstantOfShape of 10^8 floats (1.9 GiB in onnxruntime's constant
  folding) is refused at load with a client error, the onnx service's RSS growing < 100 MiB.
"""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper, numpy_helper
from tritonclient.utils import InferenceServerException

from tests.adversarial.harness import ADMIN_KEY, KEY, TENANTS, RssSampler, rss
from tests.conftest import ROOT, Proc, service_and_gateway
from tests.support import up as up_helper
from tests.support.models import example_models
from tests.support.net import free_port as _free_port

MiB = 1 << 20
UPLOAD_REFUSED = ("403", "StatusCode.PERMISSION_DENIED")
REMOTE_REFUSED = UPLOAD_REFUSED

MODEL_PY = '''
import pathlib
import triton_python_backend_utils as pb_utils

MARKER = {marker!r}


class TritonPythonModel:
    def initialize(self, args):
        pathlib.Path(MARKER).write_text("initialize ran")

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(
            r, "INPUT0").as_numpy())]) for r in requests]
'''


def python_upload(name: str, marker: Path) -> tuple[str, dict[str, bytes]]:
    """A load request's config and files for a python model whose initialize() writes ``marker``."""
    config = {"name": name, "backend": "python", "max_batch_size": 0,
              "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]}],
              "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]}]}
    return json.dumps(config), {"file:1/model.py": MODEL_PY.format(marker=str(marker)).encode()}


def constant_of_shape_bomb(n: int = 10**8) -> bytes:
    """Finding 1's ONNX: two ConstantOfShape of n floats, added, summed, added to the input."""
    shape = numpy_helper.from_array(np.array([n], dtype=np.int64), "shape")
    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["a"],
                              value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0])),
             helper.make_node("ConstantOfShape", ["shape"], ["b"],
                              value=helper.make_tensor("w", TensorProto.FLOAT, [1], [2.0])),
             helper.make_node("Add", ["a", "b"], ["c"]),
             helper.make_node("ReduceSum", ["c"], ["s"], keepdims=1),
             helper.make_node("Add", ["x", "s"], ["y"])]
    graph = helper.make_graph(nodes, "bomb", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])], [shape])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model.SerializeToString()


BOMB_CONFIG = json.dumps({"name": "bomb", "backend": "onnxruntime", "max_batch_size": 0,
                          "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [1]}],
                          "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [1]}]})


def _client(proto: str, address: str) -> httpclient.InferenceServerClient | grpcclient.InferenceServerClient:
    return (httpclient if proto == "http" else grpcclient).InferenceServerClient(address)


def _refused(call: object, codes: tuple[str, ...], words: str) -> str:
    with pytest.raises(InferenceServerException) as err:
        call()  # type: ignore[operator]
    assert str(err.value.status()) in codes, err.value
    message = err.value.message() or ""
    assert words in message, message
    return message


def non_loopback_address() -> str | None:
    """An address of this host that is not loopback (a connection to it comes from it), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET: nothing is sent; the kernel picks the source address
            address = str(s.getsockname()[0])
        except OSError:
            return None
    return None if address.startswith("127.") or address == "0.0.0.0" else address


@dataclass
class Up:
    proc: subprocess.Popen[str]
    repo: Path
    http: str
    grpc: str


@contextmanager
def meshserve_up(root: Path, *flags: str) -> Iterator[Up]:
    """`meshserve up` on a repository of add_sub (onnx) and add_sub_bls (python), with ``flags``."""
    repo = example_models(root / "repo", "add_sub", "add_sub_bls")
    http_port, grpc_port = _free_port(), _free_port()
    with up_helper.meshserve_up("--metrics-port", "0", "--repository", str(repo), "--http-port", str(http_port),
                                "--grpc-port", str(grpc_port), *flags) as up:
        yield Up(up.proc, repo, f"127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}")


@pytest.mark.parametrize("uploads", [False, True], ids=["as-documented", "allow-model-uploads"])
def test_python_upload_on_meshserve_up(tmp_path: Path, uploads: bool) -> None:
    """As documented, an uploaded python model is refused and its code never runs; with the
    flag (loopback) it loads and answers."""
    with meshserve_up(tmp_path, *(["--allow-model-uploads"] if uploads else [])) as up:
        for proto, address in (("http", up.http), ("grpc", up.grpc)):
            marker = tmp_path / f"initialize-ran-{proto}"
            config, files = python_upload(f"pwn_{proto}", marker)
            with _client(proto, address) as c:
                if not uploads:
                    _refused(lambda: c.load_model(f"pwn_{proto}", config=config, files=files),  # noqa: B023
                             UPLOAD_REFUSED, "--allow-model-uploads")
                    assert not marker.exists()
                    assert not c.is_model_ready(f"pwn_{proto}")
                    assert not list((up.repo / ".meshserve-overrides").glob("*/*"))
                    assert c.is_server_live()
                    continue
                c.load_model(f"pwn_{proto}", config=config, files=files)
                assert marker.read_text() == "initialize ran"
                module = httpclient if proto == "http" else grpcclient
                inp = module.InferInput("INPUT0", [4], "FP32")
                inp.set_data_from_numpy(np.arange(4, dtype=np.float32))
                assert c.infer(f"pwn_{proto}", [inp]).as_numpy("OUTPUT0").tolist() == [0.0, 1.0, 2.0, 3.0]
                c.unload_model(f"pwn_{proto}")


def test_up_with_tenants_takes_uploads_from_admin_keys_only(tmp_path: Path) -> None:
    """`up --tenants` (the gateway's flag, now `up`'s) on every address with uploads on: a
    tenant's key is refused (403), an admin's key loads, also from a non-loopback client (with
    tenants the access table decides, not the peer address)."""
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(TENANTS)
    with meshserve_up(tmp_path, "--host", "0.0.0.0", "--tenants", str(tenants), "--allow-model-uploads") as up:
        address = non_loopback_address()
        grpc_address = f"{address}:{up.grpc.rsplit(':', 1)[1]}" if address else up.grpc
        marker = tmp_path / "initialize-ran"
        config, files = python_upload("pwn", marker)
        with grpcclient.InferenceServerClient(grpc_address) as c:
            _refused(lambda: c.load_model("pwn", config=config, files=files, headers={"x-api-key": KEY}),
                     UPLOAD_REFUSED, "admin")
            _refused(lambda: c.load_model("pwn", config=config, files=files), ("StatusCode.UNAUTHENTICATED",), "key")
            assert not marker.exists()
            c.load_model("pwn", config=config, files=files, headers={"x-api-key": ADMIN_KEY})
            assert marker.read_text() == "initialize ran"
            c.unload_model("pwn", headers={"x-api-key": ADMIN_KEY})


def test_up_on_a_public_host_with_uploads_and_no_tenants_refuses_to_start(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "meshserve", "up", "--metrics-port", "0", "--repository", str(tmp_path), "--host", "0.0.0.0",
                           "--allow-model-uploads"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "--allow-model-uploads" in done.stderr and "--tenants" in done.stderr, done.stderr
    assert "is up" not in done.stdout


@pytest.fixture(scope="module")
def locked(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc]]:
    """An onnx service and a gateway, both listening on every address, with the defaults:
    no uploads, model control from loopback only."""
    repo = tmp_path_factory.mktemp("locked") / "repo"
    shutil.copytree(model_repo / "add_sub", repo / "add_sub")
    with service_and_gateway("onnx", ["--repository", str(repo), "--model-control-mode", "explicit", "--load-model",
                                      "add_sub", "--host", "0.0.0.0"],
                             ["--discovery-interval", "0.5", "--host", "0.0.0.0"]) as procs:
        yield procs


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_model_control_is_loopback_only_without_tenants(locked: tuple[Proc, Proc], proto: str) -> None:
    """A client that reaches the gateway or a service on a non-loopback address may not load or
    unload (the model keeps serving); the same calls from loopback work."""
    address = non_loopback_address()
    if address is None:
        pytest.skip("this host has no non-loopback address to connect from")
    for proc in locked:
        port = getattr(proc, proto).rsplit(":", 1)[1]
        with _client(proto, f"{address}:{port}") as remote:
            _refused(lambda: remote.unload_model("add_sub"), REMOTE_REFUSED,
                     "--allow-remote-model-control")
            _refused(lambda: remote.load_model("add_sub", config=json.dumps(
                {"name": "add_sub", "backend": "onnxruntime", "max_batch_size": 8})),
                REMOTE_REFUSED, "--allow-remote-model-control")
            assert remote.is_model_ready("add_sub")  # reading is not control: still open
        with _client(proto, getattr(proc, proto)) as local:
            local.load_model("add_sub")
            assert local.is_model_ready("add_sub")


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_a_service_refuses_uploads_without_the_flag(locked: tuple[Proc, Proc], proto: str) -> None:
    """The service checks too (it is a full v2 server a client may reach), before a byte is written."""
    service, gateway = locked
    marker = Path(service.argv[service.argv.index("--repository") + 1]).parent / "initialize-ran"
    config, files = python_upload("pwn", marker)
    for proc in (service, gateway):
        with _client(proto, getattr(proc, proto)) as c:
            _refused(lambda: c.load_model("pwn", config=config, files=files),
                     UPLOAD_REFUSED, "--allow-model-uploads")
    repo = Path(service.argv[service.argv.index("--repository") + 1])
    assert not (repo / ".meshserve-overrides").exists() or not list((repo / ".meshserve-overrides").rglob("*"))


@pytest.fixture(scope="module")
def uploads(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc]]:
    repo = tmp_path_factory.mktemp("uploads") / "repo"
    shutil.copytree(model_repo / "add_sub", repo / "add_sub")
    with service_and_gateway("onnx", ["--repository", str(repo), "--model-control-mode", "explicit", "--load-model",
                                      "add_sub", "--allow-model-uploads"],
                             ["--discovery-interval", "0.5", "--allow-model-uploads"]) as procs:
        yield procs


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_constant_of_shape_bomb_is_refused_at_load(uploads: tuple[Proc, Proc], proto: str) -> None:
    """251 bytes that onnxruntime's constant folding turns into 1.9 GiB: 400 / INVALID_ARGUMENT
    naming --max-model-load-bytes, through the gateway and direct; the service's RSS grows by
    less than 100 MiB; a sound upload loads after it."""
    service, gateway = uploads
    bomb = constant_of_shape_bomb()
    assert len(bomb) < 400
    onnx.checker.check_model(onnx.load_from_string(bomb))
    base = rss(service.proc.pid)
    sampler = RssSampler(service.proc.pid)
    try:
        for proc in (gateway, service):
            with _client(proto, getattr(proc, proto)) as c:
                _refused(lambda: c.load_model("bomb", config=BOMB_CONFIG,
                                              files={"file:1/model.onnx": bomb}),
                         ("400", "StatusCode.INVALID_ARGUMENT"), "--max-model-load-bytes")
                assert c.is_server_live() and not c.is_model_ready("bomb")
    finally:
        peak = sampler.stop()
    assert peak - base < 100 * MiB, f"the onnx service grew by {(peak - base) / MiB:.0f} MiB"
    repo = Path(service.argv[service.argv.index("--repository") + 1])
    assert not list((repo / ".meshserve-overrides").glob("*/*")), "the bomb's files are left on disk"
    # a sound model (the bomb without its constants) still loads by upload
    sound = onnx.load_from_string(constant_of_shape_bomb(4))
    with _client(proto, getattr(gateway, proto)) as c:
        c.load_model("bomb", config=BOMB_CONFIG, files={"file:1/model.onnx": sound.SerializeToString()})
        module = httpclient if proto == "http" else grpcclient
        inp = module.InferInput("x", [1], "FP32")
        inp.set_data_from_numpy(np.array([1.0], np.float32))
        assert c.infer("bomb", [inp]).as_numpy("y").tolist() == [13.0]
        c.unload_model("bomb")
