"""A python model with `sequence_batching` gets Triton's control tensors (START, END, READY,
CORRID as configured) and implicit state (its last `output_name` tensor back as `input_name`),
driven by tritonclient's sequence calls (sequence_id, sequence_start, sequence_end), straight to
the python service and through the gateway (issue 30, item 6).

`seq_acc` adds IN to its state ACC (0 at START) and answers the sum with the control values it
saw; it batches (max_batch_size 4), so its control tensors are [1, 1] and its state [1, 1]."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.conftest import Proc, service_and_gateway
from tests.models import python_models

SEQ_ACC = '''
import numpy as np
import triton_python_backend_utils as pb_utils


def value(request, name):
    return pb_utils.get_input_tensor_by_name(request, name).as_numpy()


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            acc = value(r, "ACC") + value(r, "IN")
            flags = np.concatenate([value(r, "START"), value(r, "END"), value(r, "READY")], axis=1)
            shapes = np.array([[len(value(r, "START").shape), len(value(r, "ACC").shape)]], dtype=np.int32)
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("SUM", acc), pb_utils.Tensor("FLAGS", flags.astype(np.int32)),
                pb_utils.Tensor("ID", value(r, "CORRID").astype(np.uint64)),
                pb_utils.Tensor("RANKS", shapes), pb_utils.Tensor("ACC_NEXT", acc)]))
        return out
'''

CONFIG = """
name: "seq_acc"
backend: "python"
max_batch_size: 4
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [
  { name: "SUM" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "FLAGS" data_type: TYPE_INT32 dims: [ 3 ] },
  { name: "ID" data_type: TYPE_UINT64 dims: [ 1 ] },
  { name: "RANKS" data_type: TYPE_INT32 dims: [ 2 ] }
]
sequence_batching {
  max_sequence_idle_microseconds: 10000000
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]
  state [ { input_name: "ACC" output_name: "ACC_NEXT" data_type: TYPE_INT32 dims: [ 1 ] } ]
}
instance_group [ { count: 1 kind: KIND_CPU } ]
"""


@pytest.fixture(scope="module")
def procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    """The python service and a gateway in front of it, by name."""
    repo = tmp_path_factory.mktemp("sequence_models")
    python_models.write(repo, "seq_acc", SEQ_ACC, CONFIG.lstrip())
    with service_and_gateway("python", ["--repository", str(repo)]) as (service, gateway):
        yield {"service": service, "gateway": gateway}


MODULES = {"grpc": grpcclient, "http": httpclient}


def _step(client: object, m: object, sequence: int, value: int, **flags: bool) -> dict[str, list[int]]:
    inp = m.InferInput("IN", [1, 1], "INT32")  # type: ignore[attr-defined]
    inp.set_data_from_numpy(np.array([[value]], dtype=np.int32))
    result = client.infer("seq_acc", [inp], sequence_id=sequence, **flags)  # type: ignore[attr-defined]
    names = [o.name if m is grpcclient else o["name"]
             for o in (result.get_response().outputs if m is grpcclient else result.get_response()["outputs"])]
    assert "ACC_NEXT" not in names  # the state output stays in the service
    return {n: result.as_numpy(n).reshape(-1).tolist() for n in ("SUM", "FLAGS", "ID", "RANKS")}


@pytest.mark.parametrize("where", ["service", "gateway"])
@pytest.mark.parametrize("proto", ["grpc", "http"])
def test_control_tensors_and_implicit_state_of_a_python_model(procs: dict[str, Proc], proto: str, where: str) -> None:
    m = MODULES[proto]
    base = {"grpc": 7000, "http": 8000}[proto] + (100 if where == "gateway" else 0)
    a, b = base + 1, base + 2
    with m.InferenceServerClient(getattr(procs[where], proto)) as c:
        first = _step(c, m, a, 5, sequence_start=True)
        assert first == {"SUM": [5], "FLAGS": [1, 0, 1], "ID": [a], "RANKS": [2, 2]}
        other = _step(c, m, b, 100, sequence_start=True)  # another sequence: its own state
        assert other["SUM"] == [100] and other["ID"] == [b]
        assert _step(c, m, a, 2) == {"SUM": [7], "FLAGS": [0, 0, 1], "ID": [a], "RANKS": [2, 2]}
        assert _step(c, m, b, 1)["SUM"] == [101]
        last = _step(c, m, a, 3, sequence_end=True)
        assert last["SUM"] == [10] and last["FLAGS"] == [0, 1, 1]
        # the id again, from START: the state starts over
        again = _step(c, m, a, 4, sequence_start=True, sequence_end=True)
        assert again["SUM"] == [4] and again["FLAGS"] == [1, 1, 1]
        assert _step(c, m, b, 1, sequence_end=True)["SUM"] == [102]
