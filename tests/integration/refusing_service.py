"""A stand-in v2 service whose model `big` (FP32 [-1], no batching) refuses every request
(INVALID_ARGUMENT, after it reached the service): the gateway's upstream error path under a
flood of large requests. Run: python -m tests.integration.refusing_service."""
from __future__ import annotations

import argparse

from google.protobuf import text_format

from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol.errors import InferError
from meshserve.server import limits as server_limits
from meshserve.server.core import InferResult, RequestContext
from meshserve.server.process import run, serve
from tests.support.stub_core import StubCore

REFUSAL = "model 'big' refuses every request"


class RefusingCore(StubCore):
    NAME = "refusing"
    MODELS = ("big",)

    async def model_metadata(self, name: str, version: str) -> pb.ModelMetadataResponse:
        meta = pb.ModelMetadataResponse(name=name, versions=["1"], platform="onnxruntime_onnx")
        meta.inputs.add(name="IN", datatype="FP32", shape=[-1])
        meta.outputs.add(name="OUT", datatype="FP32", shape=[-1])
        return meta

    async def model_config(self, name: str, version: str) -> pb.ModelConfigResponse:
        return pb.ModelConfigResponse(config=text_format.Parse(
            f'name: "{name}" platform: "onnxruntime_onnx" input [{{name: "IN" data_type: TYPE_FP32 dims: [-1]}}] '
            'output [{name: "OUT" data_type: TYPE_FP32 dims: [-1]}]', mc.ModelConfig()))

    async def infer(self, request: pb.ModelInferRequest, ctx: RequestContext) -> InferResult:
        raise InferError.invalid(REFUSAL)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--grpc-port", type=int, default=0)
    ap.add_argument("--http-port", type=int, default=None)
    server_limits.add_arguments(ap)
    args = ap.parse_args()
    run(serve(RefusingCore(), name="refusing", host="127.0.0.1", grpc_port=args.grpc_port,
              http_port=args.http_port, limits=server_limits.from_args(args)))


if __name__ == "__main__":
    main()
