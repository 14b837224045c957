"""A stand-in v2 service for timing tests: models `sleep_a` and `sleep_b` (FP32 [4], max batch 8)
echo their input after sleeping `--delay-ms`. Run: python -m tests.integration.slow_service."""
from __future__ import annotations

import argparse

from google.protobuf import text_format

from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc
from meshserve.server import limits as server_limits
from meshserve.server.core import InferResult, RequestContext
from meshserve.server.process import run, serve
from tests.support.slow import work_for_async
from tests.support.stub_core import StubCore

MODELS = ("sleep_a", "sleep_b")


def _config(name: str) -> mc.ModelConfig:
    return text_format.Parse(f'name: "{name}" platform: "onnxruntime_onnx" max_batch_size: 8 '
                             'input [{name: "IN" data_type: TYPE_FP32 dims: [4]}] '
                             'output [{name: "OUT" data_type: TYPE_FP32 dims: [4]}]', mc.ModelConfig())


class SlowCore(StubCore):
    NAME = "slow"
    MODELS = MODELS

    def __init__(self, delay_s: float):
        self.delay_s = delay_s

    async def model_metadata(self, name: str, version: str) -> pb.ModelMetadataResponse:
        return pb.ModelMetadataResponse(name=name, versions=["1"])

    async def model_config(self, name: str, version: str) -> pb.ModelConfigResponse:
        return pb.ModelConfigResponse(config=_config(name))

    async def infer(self, request: pb.ModelInferRequest, ctx: RequestContext) -> InferResult:
        await work_for_async(self.delay_s)
        resp = pb.ModelInferResponse(model_name=request.model_name, model_version="1", id=request.id)
        resp.outputs.add(name="OUT", datatype="FP32", shape=list(request.inputs[0].shape))
        resp.raw_output_contents.append(request.raw_input_contents[0])
        return InferResult(message=resp)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--grpc-port", type=int, default=0)
    ap.add_argument("--http-port", type=int, default=None)
    ap.add_argument("--delay-ms", type=float, default=100)
    server_limits.add_arguments(ap)  # e.g. --max-inflight, as on a real service
    args = ap.parse_args()
    run(serve(SlowCore(args.delay_ms / 1000), name="slow", host="127.0.0.1", grpc_port=args.grpc_port,
              http_port=args.http_port, limits=server_limits.from_args(args)))


if __name__ == "__main__":
    main()
