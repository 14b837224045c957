"""ResponseEncoder writes ModelInferResponse in protobuf's wire format by hand: its bytes must be
exactly what building the message and SerializeToString gives (the reference below is the
message-building encoder it replaced), for every kind of output it handles."""
from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format

from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol import datatypes
from meshserve.server.core import NO_HOP
from services.base.classification import MAX_CLASSIFIED, classify
from services.base.serialization import ResponseEncoder, scatter
from services.base.validation import ModelTensors, Pending, prepare


def _reference(encoder: ResponseEncoder, payloads: list[Pending], produced: dict[str, np.ndarray]) -> list[bytes]:
    """One response per request built as a message (services/base/serialization.py before it wrote bytes)."""
    model = encoder.model
    batched = model.max_batch_size > 0
    scattered = scatter(model, payloads, produced)  # (unchanged)
    bodies, row = [], 0
    for i, p in enumerate(payloads):
        resp = pb.ModelInferResponse(model_name=model.name, model_version=encoder.version, id=p.request.id)
        for out_name, k in p.outputs:
            spec = model.outputs[out_name]
            full = produced[out_name]
            part = full[row:row + p.rows] if batched else full
            if out_name in scattered:
                part = scattered[out_name][i]
            elif batched and spec.reshape is not None:
                part = part.reshape((p.rows, *spec.dims))
            elif not batched and spec.reshape is not None:
                part = part.reshape(spec.dims)
            datatype = spec.datatype
            if k:
                part = classify(part, k, datatype, encoder.labels.get(out_name, ()), batched, MAX_CLASSIFIED, "")
                datatype = "BYTES"
            tensor = resp.outputs.add(name=out_name, datatype=datatype)
            tensor.shape.extend(part.shape)
            if datatype == "BYTES":
                data = datatypes.serialize_bytes(part.reshape(-1).tolist())
            else:
                data = part.astype(datatypes.numpy_dtype(datatype)).tobytes()
            resp.raw_output_contents.append(data)
        bodies.append(resp.SerializeToString())
        row += p.rows
    return bodies


def _tensors(text: str) -> ModelTensors:
    return ModelTensors.from_config(text_format.Parse(text, mc.ModelConfig()))


def _payload(model: ModelTensors, inputs: dict[str, tuple[str, np.ndarray]], request_id: str = "",
             outputs: tuple[tuple[str, int], ...] = ()) -> Pending:
    r = pb.ModelInferRequest(model_name=model.name, id=request_id)
    for name, (datatype, arr) in inputs.items():
        r.inputs.add(name=name, datatype=datatype, shape=arr.shape)
        r.raw_input_contents.append(datatypes.serialize_bytes(arr.reshape(-1).tolist()) if datatype == "BYTES"
                                    else arr.tobytes())
    for name, k in outputs:
        o = r.outputs.add(name=name)
        if k:
            o.parameters["classification"].int64_param = k
    return prepare(model, r, NO_HOP)


BATCHED = """name: "m" max_batch_size: 64
input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "SUM" data_type: TYPE_FP32 dims: [ -1 ] },
         { name: "WIDE" data_type: TYPE_INT64 dims: [ 200 ] },
         { name: "FLAT" data_type: TYPE_INT32 dims: [ 2, 2 ] reshape { shape: [ 4 ] } },
         { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]"""


def _batched_outputs(rows: int, width: int) -> dict[str, np.ndarray]:
    return {"SUM": np.arange(rows * width, dtype=np.float64).reshape(rows, width),  # converted to FP32
            "WIDE": np.arange(rows * 200, dtype=np.int64).reshape(rows, 200)[:, ::-1],  # not contiguous
            "FLAT": np.arange(rows * 4, dtype=np.int32).reshape(rows, 4),
            "TEXT": np.array([[f"row {i}".encode()] for i in range(rows)], dtype=np.object_)}


@pytest.mark.parametrize("version", ["1", "12"])
def test_batched_responses_are_the_bytes_the_message_gives(version: str) -> None:
    model = _tensors(BATCHED)
    encoder = ResponseEncoder(model, version)
    width = 150  # rows of 600 bytes: two-byte lengths
    sizes = [1, 3, 1, 2]
    payloads = [
        _payload(model, {"IN": ("FP32", np.ones((n, width), np.float32))}, request_id=rid, outputs=outs)
        for n, rid, outs in zip(sizes, ["", "a", "ünïcode-id", "x" * 200],
                                [(), (("WIDE", 0), ("SUM", 0)), (("SUM", 3), ("TEXT", 0)), (("FLAT", 0),)],
                                strict=True)]
    produced = _batched_outputs(sum(sizes), width)
    assert encoder.encode(payloads, produced) == _reference(encoder, payloads, produced)
    # the same shapes again: the cached output entries give the same bytes
    assert encoder.encode(payloads, produced) == _reference(encoder, payloads, produced)


def test_an_output_with_other_rows_than_the_batch_is_sliced_as_before() -> None:
    model = _tensors(BATCHED)
    encoder = ResponseEncoder(model, "1")
    payloads = [_payload(model, {"IN": ("FP32", np.ones((2, 3), np.float32))}, outputs=(("SUM", 0),))
                for _ in range(2)]
    produced = {"SUM": np.arange(9, dtype=np.float32).reshape(3, 3)}  # 3 rows for a batch of 4
    assert encoder.encode(payloads, produced) == _reference(encoder, payloads, produced)


def test_unbatched_and_scattered_outputs_are_the_bytes_the_message_gives() -> None:
    plain = _tensors("""name: "p" max_batch_size: 0
        input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
        output [ { name: "OUT" data_type: TYPE_FP16 dims: [ 2, 2 ] reshape { shape: [ 4 ] } },
                 { name: "SCALAR" data_type: TYPE_BOOL dims: [ 1 ] reshape { shape: [ ] } } ]""")
    encoder = ResponseEncoder(plain, "3")
    payloads = [_payload(plain, {"IN": ("FP32", np.ones(4, np.float32))}, request_id="q")]
    produced = {"OUT": np.arange(4, dtype=np.float16), "SCALAR": np.array(True)}
    assert encoder.encode(payloads, produced) == _reference(encoder, payloads, produced)

    ragged = _tensors("""name: "r" max_batch_size: 8
        input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true } ]
        output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
        batch_output [ { target_name: "OUT" kind: BATCH_SCATTER_WITH_INPUT_SHAPE source_input: "IN" } ]""")
    encoder = ResponseEncoder(ragged, "1")
    payloads = [_payload(ragged, {"IN": ("FP32", np.ones((1, n), np.float32))}, request_id=str(n)) for n in (2, 5)]
    produced = {"OUT": np.arange(7, dtype=np.float32)}
    assert encoder.encode(payloads, produced) == _reference(encoder, payloads, produced)
