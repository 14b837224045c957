"""http_codec alone: parse_infer + render_infer_response of N all-JSON add_sub / mlp requests
(perf_analyzer's body: compact JSON, Inference-Header-Content-Length = its length), answers of
the same shape with other numbers. usage: codec_cg.py add_sub|mlp N (run under callgrind with N
and with 0: the difference / N is the codec's instructions per request)."""
from __future__ import annotations

import gc
import sys

import numpy as np

from load import inputs
from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol import http_codec

MODELS = {"add_sub": ([("INPUT0", [16]), ("INPUT1", [16])], ["OUTPUT0", "OUTPUT1"]),
          "mlp": ([("INPUT0", [512])], ["OUTPUT0"])}


def main(model: str, n: int) -> None:
    specs, outs = MODELS[model]
    info = inputs.ModelInfo(model, 64, [inputs.TensorSpec(name, "FP32", shape) for name, shape in specs], outs)
    rng = np.random.default_rng(0)
    bodies, answers = [], []
    for _ in range(8):
        arrays = {name: rng.random((1, *shape), dtype=np.float32) for name, shape in specs}
        bodies.append(inputs.encode(model, "", arrays, info).http_json)
        answer = pb.ModelInferResponse(model_name=model, model_version="1")
        for (name, shape), out in zip(specs, outs, strict=True):
            answer.outputs.add(name=out, datatype="FP32", shape=[1, *shape])
            answer.raw_output_contents.append(arrays[name].tobytes())
        answers.append(answer)
    parse = getattr(http_codec, "parse_infer", None)
    gc.freeze()  # (a full collection of the imports' objects in one run and not the other: +-40k per request)
    for i in range(20 + n):
        body = bodies[i % 8]
        request, plan, _raw = parse(body, len(body), model, "")
        http_codec.render_infer_response(answers[i % 8], request, plan)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
