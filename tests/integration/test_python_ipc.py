"""How the python service hands tensors to its workers, through a gateway with the real
tritonclient: no object under /dev/shm (issue 29, finding 3: a tenant could register the
service's named regions as its own shared memory and read or write another tenant's tensors in
flight), the regions are anonymous memory passed by descriptor, and empty tensors (a 0 in the
shape, issue 30: an all-empty BYTES input was a 500) reach the model as Triton gives them."""
from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import Proc, service_and_gateway
from tests.support.waiting import eventually

MODULES = {"http": httpclient, "grpc": grpcclient}

IDENT_CONFIG = """
name: "ident"
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""

IDENT = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())]) for r in requests]
'''

# TEXT as the model sees it: the same tensor back, its shape, and whether it holds objects
# (Triton gives a BYTES input as an object array, also an empty one).
TEXT_CONFIG = """
name: "text_shape"
backend: "python"
max_batch_size: 0
input [ { name: "TEXT" data_type: TYPE_STRING dims: [ -1, -1 ] } ]
output [
  { name: "TEXT_OUT" data_type: TYPE_STRING dims: [ -1, -1 ] },
  { name: "SHAPE" data_type: TYPE_INT64 dims: [ 2 ] },
  { name: "OBJECTS" data_type: TYPE_BOOL dims: [ 1 ] }
]
"""

TEXT = '''
import numpy as np
import triton_python_backend_utils as pb_utils


def described(text):
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("TEXT_OUT", text), pb_utils.Tensor("SHAPE", np.array(text.shape, np.int64)),
        pb_utils.Tensor("OBJECTS", np.array([text.dtype == np.object_]))])


class TritonPythonModel:
    def execute(self, requests):
        return [described(pb_utils.get_input_tensor_by_name(r, "TEXT").as_numpy()) for r in requests]
'''


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc]]:
    repo = tmp_path_factory.mktemp("python_ipc")
    for name, config, model in (("ident", IDENT_CONFIG, IDENT), ("text_shape", TEXT_CONFIG, TEXT)):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(config)
        (repo / name / "1" / "model.py").write_text(model)
    with service_and_gateway("python", ["--repository", str(repo)], timeout=180) as procs:
        yield procs


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.name))
    return kids


def _memfd_maps(pid: int) -> set[str]:
    """The anonymous memory files ``pid`` maps (``/memfd:NAME (deleted)`` in its maps)."""
    try:
        lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return set()
    return {line.split("/memfd:", 1)[1].split(" ")[0] for line in lines if "/memfd:" in line}


def test_no_region_of_the_python_service_has_a_name_a_tenant_can_register(mesh: tuple[Proc, Proc]) -> None:
    service, gateway = mesh
    stop = threading.Event()
    errors: list[BaseException] = []
    x = np.arange(256 * 1024, dtype=np.float32)  # 1 MiB each way

    def load() -> None:
        try:
            with grpcclient.InferenceServerClient(gateway.grpc) as client:
                i = grpcclient.InferInput("X", list(x.shape), "FP32")
                i.set_data_from_numpy(x)
                while not stop.is_set():
                    assert np.array_equal(client.infer("ident", [i]).as_numpy("Y"), x)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        workers = _children(service.proc.pid)
        assert workers, "the python service runs its models in worker processes"
        seen_named: set[str] = set()
        # names this service or its workers would have made (other runs share the machine's /dev/shm)
        ours = (f"meshserve-py-{service.proc.pid}-", *(f"-{pid}-" for pid in workers))
        for _ in range(200):  # while requests run
            seen_named.update(n for n in os.listdir("/dev/shm") if any(mark in n for mark in ours))
        assert not seen_named, f"named objects in /dev/shm: {sorted(seen_named)}"
        # the tensors do travel through shared memory: anonymous files both sides map
        eventually(lambda: "meshserve-py-in" in _memfd_maps(service.proc.pid)
                   and any("meshserve-py-in" in _memfd_maps(w) and "meshserve-py-out" in _memfd_maps(w)
                           for w in workers), timeout=20, what="the service's and a worker's memfd regions")
        # whatever a tenant guesses, a region key reaches no worker's data
        client = httpclient.InferenceServerClient(gateway.http)
        guesses = ["meshserve-py-in", "memfd:meshserve-py-in", f"meshserve-py-{service.proc.pid}-in-1",
                   f"proc/{service.proc.pid}/fd/3"]
        for key in guesses:
            with pytest.raises(InferenceServerException) as err:
                client.register_system_shared_memory(f"probe-{len(key)}", key, 1 << 20)
            # meshserve's own prefix is reserved (403, docs/shared-memory.md); any other guess names
            # no object under /dev/shm (400)
            assert err.value.status() == ("403" if key.startswith("meshserve-") else "400"), (key, err.value)
        assert not client.get_system_shared_memory_status()
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors


@pytest.mark.parametrize("proto", ["http", "grpc"])
@pytest.mark.parametrize("shape", [[2, 0], [0, 3], [0, 0]])
def test_an_empty_bytes_input_reaches_the_model_as_an_empty_bytes_tensor(
        proto: str, shape: list[int], mesh: tuple[Proc, Proc]) -> None:
    service, gateway = mesh
    module = MODULES[proto]
    for target in (gateway, service):
        client = module.InferenceServerClient(getattr(target, proto))
        text = module.InferInput("TEXT", shape, "BYTES")
        text.set_data_from_numpy(np.empty(shape, dtype=np.object_))
        result = client.infer("text_shape", [text])
        assert result.as_numpy("SHAPE").tolist() == shape
        assert result.as_numpy("OBJECTS").tolist() == [True]
        out = result.as_numpy("TEXT_OUT")
        assert out is not None and list(out.shape) == shape
        # and a non-empty one next to it, on the same worker
        full = module.InferInput("TEXT", [1, 2], "BYTES")
        full.set_data_from_numpy(np.array([[b"a", b""]], dtype=np.object_))
        result = client.infer("text_shape", [full])
        assert result.as_numpy("TEXT_OUT").tolist() == [[b"a", b""]]
        assert result.as_numpy("SHAPE").tolist() == [1, 2]


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_an_empty_fixed_size_input_reaches_the_model_and_comes_back_empty(
        proto: str, mesh: tuple[Proc, Proc]) -> None:
    _, gateway = mesh
    module = MODULES[proto]
    client = module.InferenceServerClient(getattr(gateway, proto))
    x = module.InferInput("X", [0], "FP32")
    x.set_data_from_numpy(np.empty([0], np.float32))
    y = client.infer("ident", [x]).as_numpy("Y")
    assert y is not None and y.shape == (0,) and y.dtype == np.float32
