"""The coalescer at the shape edges: zero-size tensors merge and split back exactly, and a model
whose config makes an input a scalar per request (reshape to []) is never merged."""
from __future__ import annotations

import numpy as np
from google.protobuf import text_format

from gateway.upstream.merging import ModelShape, merge, merge_key, split
from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc

IDENTITY = """
name: "identity" max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_INT16 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT16 dims: [ -1 ] } ]
dynamic_batching { }
"""


def _config(text: str) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


def _request(a: np.ndarray, rid: str) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="identity", id=rid)
    r.inputs.add(name="INPUT0", datatype="INT16", shape=list(a.shape))
    r.raw_input_contents.append(a.astype(np.int16).tobytes())
    return r


def _identity_service(req: pb.ModelInferRequest) -> pb.ModelInferResponse:
    resp = pb.ModelInferResponse(model_name=req.model_name, model_version="1", id=req.id)
    resp.outputs.add(name="OUTPUT0", datatype="INT16", shape=list(req.inputs[0].shape))
    resp.raw_output_contents.append(req.raw_input_contents[0])
    return resp


def test_zero_size_requests_merge_and_split_exactly() -> None:
    shape = ModelShape.of(_config(IDENTITY))
    assert shape is not None
    reqs = [_request(np.zeros((n, 0)), f"id{i}") for i, n in enumerate((1, 3, 2))]
    keys = [merge_key(r, shape, r.SerializeToString()) for r in reqs]
    assert all(k is not None for k in keys) and len({k[0] for k in keys if k}) == 1
    rows = [k[1] for k in keys if k]
    merged = merge(reqs, rows, shape)
    assert [list(t.shape) for t in merged.inputs] == [[6, 0]] and merged.raw_input_contents[0] == b""
    for req, raw in zip(reqs, split(_identity_service(merged), reqs, rows), strict=True):
        assert raw == _identity_service(req).SerializeToString()  # what the service answers it alone
        out = pb.ModelInferResponse.FromString(raw)
        assert list(out.outputs[0].shape) == list(req.inputs[0].shape)


def test_zero_size_and_sized_requests_do_not_share_a_key() -> None:
    shape = ModelShape.of(_config(IDENTITY))
    assert shape is not None
    empty, full = merge_key(_request(np.zeros((1, 0)), "a"), shape), merge_key(_request(np.ones((1, 2)), "b"), shape)
    assert empty is not None and full is not None and empty[0] != full[0]


def test_inputs_reshaped_to_a_scalar_are_never_merged() -> None:
    """dims [1] reshape [] (Triton's auto-complete for a scalar per request): the service may
    feed it to a graph that takes one true scalar a run, so requests travel alone."""
    scalar = IDENTITY.replace("dims: [ -1 ] }", "dims: [ 1 ] reshape: { shape: [ ] } }", 1)
    assert "reshape" in scalar
    assert ModelShape.of(_config(IDENTITY)) is not None and ModelShape.of(_config(scalar)) is None
