"""A stand-in v2 service with decoupled models, for the streaming plumbing (front ends, the
gateway's hop) before the python service runs the real ones. Its models answer as Triton's
python_backend examples do (tests/e2e/decoupled_models.py holds those, for the real tests):

- ``repeat_int32`` (decoupled): IN INT32 [-1], DELAY UINT32 [-1], WAIT UINT32 [1]: one response
  per element (OUT = IN[i], IDX = i) after DELAY[i] ms, then, WAIT ms later, the final flag alone;
- ``square_int32`` (decoupled): IN INT32 [1] = n: n responses OUT = n, then the final flag alone;
- ``faulty_stream`` (decoupled): IN INT32 [1]: one response, then an error;
- ``text_echo`` (not decoupled): text_input BYTES [1] -> text_output BYTES [1] (+ the request's
  ``suffix`` parameter), lengths INT32 [2].

Requests a client abandoned are counted (``fake_cancelled_total`` on /metrics), and so are the
requests in progress (``fake_streaming``). Run: python -m tests.integration.decoupled_service.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
from google.protobuf import text_format

from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol import datatypes
from meshserve.protocol.errors import InferError, model_not_found
from meshserve.server.core import InferResult, RequestContext, StreamAnswer, unary_decoupled_error
from tests.support.slow import work_for_async
from tests.support.stub_core import StubCore, serve_main

CONFIGS = {
    "repeat_int32": 'max_batch_size: 0 model_transaction_policy { decoupled: true } '
                    'input [{name: "IN" data_type: TYPE_INT32 dims: [-1]}, '
                    '{name: "DELAY" data_type: TYPE_UINT32 dims: [-1]}, {name: "WAIT" data_type: TYPE_UINT32 dims: [1]}] '
                    'output [{name: "OUT" data_type: TYPE_INT32 dims: [1]}, {name: "IDX" data_type: TYPE_UINT32 dims: [1]}]',
    "square_int32": 'max_batch_size: 0 model_transaction_policy { decoupled: true } '
                    'input [{name: "IN" data_type: TYPE_INT32 dims: [1]}] '
                    'output [{name: "OUT" data_type: TYPE_INT32 dims: [1]}]',
    "faulty_stream": 'max_batch_size: 0 model_transaction_policy { decoupled: true } '
                     'input [{name: "IN" data_type: TYPE_INT32 dims: [1]}] '
                     'output [{name: "OUT" data_type: TYPE_INT32 dims: [1]}]',
    "text_echo": 'max_batch_size: 0 input [{name: "text_input" data_type: TYPE_STRING dims: [1]}] '
                 'output [{name: "text_output" data_type: TYPE_STRING dims: [1]}, '
                 '{name: "lengths" data_type: TYPE_INT32 dims: [2]}]',
}


def _config(name: str) -> mc.ModelConfig:
    return text_format.Parse(f'name: "{name}" backend: "python" {CONFIGS[name]}', mc.ModelConfig())


def _inputs(request: pb.ModelInferRequest) -> dict[str, np.ndarray]:
    out = {}
    for t, raw in zip(request.inputs, request.raw_input_contents, strict=True):
        if t.datatype == "BYTES":
            out[t.name] = np.array(datatypes.deserialize_bytes(raw), dtype=np.object_)
        else:
            out[t.name] = np.frombuffer(raw, datatypes.numpy_dtype(t.datatype))
    return out


def _response(request: pb.ModelInferRequest, **outputs: np.ndarray) -> InferResult:
    resp = pb.ModelInferResponse(model_name=request.model_name, model_version="1", id=request.id)
    for name, arr in outputs.items():
        if arr.dtype == np.object_:
            resp.outputs.add(name=name, datatype="BYTES", shape=list(arr.shape))
            resp.raw_output_contents.append(datatypes.serialize_bytes(arr.tolist()))
        else:
            resp.outputs.add(name=name, datatype=datatypes.from_numpy(arr.dtype), shape=list(arr.shape))
            resp.raw_output_contents.append(arr.tobytes())
    return InferResult(message=resp)


class DecoupledCore(StubCore):
    NAME = "decoupled"
    MODELS = tuple(CONFIGS)

    def __init__(self) -> None:
        self.cancelled = 0  # streamed requests abandoned before their last response
        self.streaming = 0  # streamed requests in progress

    def _check(self, name: str, version: str) -> mc.ModelConfig:
        if name not in CONFIGS or version not in ("", "1"):
            raise model_not_found(name, version)
        return _config(name)

    async def model_metadata(self, name: str, version: str) -> pb.ModelMetadataResponse:
        config = self._check(name, version)
        md = pb.ModelMetadataResponse(name=name, versions=["1"], platform="python")
        for t in config.input:
            md.inputs.add(name=t.name, datatype=datatypes.config_to_wire(t.data_type), shape=list(t.dims))
        for t in config.output:
            md.outputs.add(name=t.name, datatype=datatypes.config_to_wire(t.data_type), shape=list(t.dims))
        return md

    async def model_config(self, name: str, version: str) -> pb.ModelConfigResponse:
        return pb.ModelConfigResponse(config=self._check(name, version))

    async def infer(self, request: pb.ModelInferRequest, ctx: RequestContext) -> InferResult:
        config = self._check(request.model_name, request.model_version)
        if config.model_transaction_policy.decoupled:
            raise unary_decoupled_error(ctx.protocol)
        x = _inputs(request)
        if "text_input" not in x:
            raise InferError.invalid("expected 1 inputs but got 0 inputs for model 'text_echo'")
        text = x["text_input"][0].decode()
        suffix = request.parameters["suffix"] if "suffix" in request.parameters else None
        answer = text + ("" if suffix is None else str(getattr(suffix, suffix.WhichOneof("parameter_choice"))))
        return _response(request, text_output=np.array([answer.encode()], np.object_),
                         lengths=np.array([len(text), len(answer)], np.int32))

    async def infer_stream(self, request: pb.ModelInferRequest, ctx: RequestContext) -> AsyncIterator[StreamAnswer]:
        config = self._check(request.model_name, request.model_version)
        if not config.model_transaction_policy.decoupled:
            yield await self.infer(request, ctx), True
            return
        x = _inputs(request)
        missing = [t.name for t in config.input if t.name not in x]
        if missing:  # (the real service checks every input against the config)
            raise InferError.invalid(f"expected inputs {[t.name for t in config.input]}, missing {missing}")
        self.streaming += 1
        try:
            if request.model_name == "repeat_int32":
                if x["IN"].shape != x["DELAY"].shape:
                    raise InferError.invalid(f"expected IN and DELAY of the same shape, got {x['IN'].shape} "
                                             f"and {x['DELAY'].shape}")
                for i, (value, delay) in enumerate(zip(x["IN"], x["DELAY"], strict=True)):
                    await work_for_async(int(delay) / 1000)
                    yield _response(request, OUT=np.array([value], np.int32), IDX=np.array([i], np.uint32)), False
                await work_for_async(int(x["WAIT"][0]) / 1000)
            elif request.model_name == "square_int32":
                n = int(x["IN"][0])
                for _ in range(n):
                    yield _response(request, OUT=np.array([n], np.int32)), False
            else:
                n = int(x["IN"][0])
                yield _response(request, OUT=np.array([n], np.int32)), False
                raise InferError.invalid(f"faulty_stream failed on {n}")
            yield None, True
        except (GeneratorExit, asyncio.CancelledError):
            self.cancelled += 1
            raise
        finally:
            self.streaming -= 1

    async def metrics_text(self) -> tuple[bytes, str]:
        return (f"fake_cancelled_total {self.cancelled}\nfake_streaming {self.streaming}\n".encode(),
                "text/plain; version=0.0.4")


def main() -> None:
    serve_main(DecoupledCore(), "decoupled")


if __name__ == "__main__":
    main()
