"""A stand-in v2 service whose model `big` (FP32 [-1], no batching) refuses every request
(INVALID_ARGUMENT, after it reached the service): the gateway's upstream error path under a
flood of large requests. Run: python -m tests.integration.refusing_service."""
from __future__ import annotations

from google.protobuf import text_format

from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol.errors import InferError
from meshserve.server.core import InferResult, RequestContext
from tests.support.stub_core import StubCore, serve_main

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
    serve_main(RefusingCore(), "refusing")


if __name__ == "__main__":
    main()
