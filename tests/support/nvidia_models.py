"""A model repository for NVIDIA's own example clients (triton-inference-server/client
src/python/examples), run unchanged against meshserve (tests/e2e/test_nvidia_examples.py,
docs/nvidia-examples.md).

Each model has the name, tensors, config and arithmetic of the Triton example model the clients
call (Triton's docs/examples/model_repository and the qa models its CI adds), built here with
onnx.helper or written as a python-backend model, so the repository needs nothing downloaded:

* ``simple`` (INT32), ``simple_int8``, ``simple_string`` (numbers as strings): OUTPUT0 = INPUT0 +
  INPUT1, OUTPUT1 = INPUT0 - INPUT1 over [-1, 16] (ONNX; strings cast to INT32 and back);
* ``simple_identity`` (python, BYTES [-1]) and ``custom_identity_int32`` (ONNX, INT32 [-1]);
* ``simple_sequence`` (START, READY) and ``simple_dyna_sequence`` (START, END, READY, CORRID
  UINT64): OUTPUT = READY * (INPUT + START [+ END * CORRID]), the sequence service's ONNX;
* ``simple_string_dyna_sequence`` (python, string CORRID): Triton's qa dyna_sequence backend:
  OUTPUT = the sequence's running sum of INPUT, plus the correlation id (a number) at END;
* ``repeat_int32`` (python, decoupled): tests/models/python_models.py's, Triton's repeat model;
* ``densenet_onnx``: a tiny classifier with densenet's names and shapes (data_0 [3, 224, 224] ->
  fc6_1 [1000], both reshaped as in Triton's config, a 1000-line densenet_labels.txt): the mean of
  each channel times fixed weights, so its classes are deterministic but mean nothing;
* ``preprocess_inception_ensemble``: the ensemble ensemble_image_client.py asks for: a python
  ``image_preprocess`` (an encoded image, BYTES [1], to FP32 [299, 299, 3]; it decodes binary
  PPM (P6) itself, as no image library is a dependency) then ``inception_onnx`` (a tiny classifier
  of inception's names and shapes, 1001 labels).

    python -m tests.support.nvidia_models OUT_DIR      # the repository (and OUT_DIR.ppm: an image)

``overlay`` puts Triton's own example models (where a checkout has their files) in their place;
``model_control_repository`` writes the repositories the two model-control examples expect (they
count the index: 8 models over gRPC, 7 over HTTP, Triton's CI repositories).
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np

from meshserve.examples import add_sub, onnx_model
from tests.models.python_models import REPEAT_CONFIG, REPEAT_INT32
from tests.models.python_models import write as write_python
from tests.support.models import identity, write

PAIR = """name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [
  {{ name: "INPUT0" data_type: {t} dims: [ 16 ] }},
  {{ name: "INPUT1" data_type: {t} dims: [ 16 ] }}
]
output [
  {{ name: "OUTPUT0" data_type: {t} dims: [ 16 ] }},
  {{ name: "OUTPUT1" data_type: {t} dims: [ 16 ] }}
]
"""

SEQUENCE = """name: "{name}"
{runtime}
max_batch_size: 8
sequence_batching {{
  max_sequence_idle_microseconds: 10000000
  oldest {{ max_candidate_sequences: 1024 max_queue_delay_microseconds: 10000 }}
  control_input [
{controls}
  ]
}}
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
"""


def _control(name: str, kind: str, spec: str = "int32_false_true: [ 0, 1 ]") -> str:
    return f'    {{ name: "{name}" control [ {{ kind: CONTROL_SEQUENCE_{kind} {spec} }} ] }}'


START, END, READY = _control("START", "START"), _control("END", "END"), _control("READY", "READY")

IDENTITY_PY = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(
            request, "INPUT0").as_numpy())]) for request in requests]
'''

# The running sum of a sequence, kept by correlation id; START resets it, END adds the id (a number
# in a string) and forgets the sequence.
STRING_DYNA_PY = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.sums = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            def flag(name):
                return int(pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1)[0])

            corrid = pb_utils.get_input_tensor_by_name(request, "CORRID").as_numpy().reshape(-1)[0]
            key = corrid.decode() if isinstance(corrid, bytes) else str(corrid)
            value = int(pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy().reshape(-1)[0])
            total = value + (0 if flag("START") else self.sums.get(key, 0))
            self.sums[key] = total
            if flag("END"):
                total += int(key)
                self.sums.pop(key, None)
            out = np.array([[total]], dtype=np.int32) if flag("READY") else np.zeros((1, 1), np.int32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", out)]))
        return responses
'''

# An encoded image (binary PPM, P6) per row -> FP32 [299, 299, 3] scaled to [-1, 1] (Inception's
# scaling), nearest-neighbour resized.
PREPROCESS_PY = '''
import numpy as np
import triton_python_backend_utils as pb_utils

SIDE = 299


def decode_ppm(data):
    fields, pos = [], 0
    while len(fields) < 4:
        while data[pos:pos + 1].isspace():
            pos += 1
        if data[pos:pos + 1] == b"#":
            pos = data.index(b"\\n", pos)
            continue
        end = pos
        while not data[end:end + 1].isspace():
            end += 1
        fields.append(data[pos:end])
        pos = end
    if fields[0] != b"P6" or int(fields[3]) != 255:
        raise ValueError("expected a binary PPM (P6) of 8-bit samples")
    width, height = int(fields[1]), int(fields[2])
    pixels = np.frombuffer(data, np.uint8, width * height * 3, pos + 1)
    return pixels.reshape(height, width, 3)


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            images = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy().reshape(-1)
            try:
                batch = []
                for encoded in images:
                    image = decode_ppm(bytes(encoded))
                    rows = np.arange(SIDE) * image.shape[0] // SIDE
                    cols = np.arange(SIDE) * image.shape[1] // SIDE
                    batch.append(image[rows][:, cols].astype(np.float32) / 127.5 - 1.0)
            except (ValueError, IndexError) as exc:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))))
                continue
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", np.stack(batch))]))
        return responses
'''

DENSENET = """name: "densenet_onnx"
platform: "onnxruntime_onnx"
max_batch_size: 0
input [ { name: "data_0" data_type: TYPE_FP32 format: FORMAT_NCHW dims: [ 3, 224, 224 ]
          reshape { shape: [ 1, 3, 224, 224 ] } } ]
output [ { name: "fc6_1" data_type: TYPE_FP32 dims: [ 1000 ] reshape { shape: [ 1, 1000, 1, 1 ] }
           label_filename: "densenet_labels.txt" } ]
"""

INCEPTION = """name: "inception_onnx"
platform: "onnxruntime_onnx"
max_batch_size: 4
input [ { name: "input" data_type: TYPE_FP32 format: FORMAT_NHWC dims: [ 299, 299, 3 ] } ]
output [ { name: "predictions" data_type: TYPE_FP32 dims: [ 1001 ] label_filename: "inception_labels.txt" } ]
"""

PREPROCESS = """name: "image_preprocess"
backend: "python"
max_batch_size: 4
input [ { name: "INPUT" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 299, 299, 3 ] } ]
"""

ENSEMBLE = """name: "preprocess_inception_ensemble"
platform: "ensemble"
max_batch_size: 4
input [ { name: "INPUT" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 1001 ] } ]
ensemble_scheduling { step [
  { model_name: "image_preprocess" model_version: -1
    input_map { key: "INPUT" value: "INPUT" } output_map { key: "OUTPUT" value: "image" } },
  { model_name: "inception_onnx" model_version: -1
    input_map { key: "input" value: "image" } output_map { key: "predictions" value: "OUTPUT" } }
] }
"""


def pair(elem: int) -> object:
    """add_sub over [batch, 16] of ``elem`` computed in INT32 (Triton's simple_int8 and
    simple_string cast their inputs to INT32 and the results back)."""
    from onnx import TensorProto, helper

    if elem == TensorProto.INT32:
        return add_sub(elem)
    nodes = [helper.make_node("Cast", [f"INPUT{i}"], [f"i{i}"], to=TensorProto.INT32) for i in (0, 1)]
    nodes += [helper.make_node("Add", ["i0", "i1"], ["sum"]), helper.make_node("Sub", ["i0", "i1"], ["diff"]),
              helper.make_node("Cast", ["sum"], ["OUTPUT0"], to=elem),
              helper.make_node("Cast", ["diff"], ["OUTPUT1"], to=elem)]
    return onnx_model(nodes, "simple_pair",
                      [helper.make_tensor_value_info(f"INPUT{i}", elem, ["batch", 16]) for i in (0, 1)],
                      [helper.make_tensor_value_info(f"OUTPUT{i}", elem, ["batch", 16]) for i in (0, 1)])


def sequence(dyna: bool) -> object:
    """OUTPUT = READY * (INPUT + START), plus END * CORRID (as INT32) when ``dyna``."""
    from onnx import TensorProto, helper

    controls = ["START", "END", "READY"] if dyna else ["START", "READY"]
    ins = [helper.make_tensor_value_info(n, TensorProto.INT32, ["batch", 1]) for n in ["INPUT", *controls]]
    nodes = [helper.make_node("Add", ["INPUT", "START"], ["started"])]
    total = "started"
    if dyna:
        ins.append(helper.make_tensor_value_info("CORRID", TensorProto.UINT64, ["batch", 1]))
        nodes += [helper.make_node("Cast", ["CORRID"], ["corrid"], to=TensorProto.INT32),
                  helper.make_node("Mul", ["END", "corrid"], ["ended"]),
                  helper.make_node("Add", ["started", "ended"], ["total"])]
        total = "total"
    nodes.append(helper.make_node("Mul", ["READY", total], ["OUTPUT"]))
    return onnx_model(nodes, "simple_sequence", ins,
                      [helper.make_tensor_value_info("OUTPUT", TensorProto.INT32, ["batch", 1])])


def classifier(name: str, shape: list[int | str], channels_axis: int, classes: int, out_shape: list[int | str],
               seed: int) -> object:
    """A tiny classifier: each channel's mean (over the other axes) times fixed weights to
    ``classes`` scores, shaped ``out_shape``."""
    from onnx import TensorProto, helper, numpy_helper

    axes = [a for a in range(1, len(shape)) if a != channels_axis]
    weights = np.random.default_rng(seed).standard_normal((3, classes)).astype(np.float32)
    nodes = [helper.make_node("ReduceMean", ["x"], ["mean"], axes=axes, keepdims=0),  # opset 17: an attribute
             helper.make_node("MatMul", ["mean", "W"], ["scores"]),
             helper.make_node("Reshape", ["scores", "out_shape"], ["y"])]
    inits = [numpy_helper.from_array(weights, "W"),
             numpy_helper.from_array(np.array([-1 if d == "batch" else d for d in out_shape], np.int64), "out_shape")]
    return onnx_model(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)], inits)


def _renamed(model: object, names: dict[str, str]) -> object:
    """``model`` with its graph's tensor names replaced (``names``: old -> new)."""
    graph = model.graph  # type: ignore[attr-defined]
    for value in [*graph.input, *graph.output]:
        value.name = names.get(value.name, value.name)
    for node in graph.node:
        node.input[:] = [names.get(n, n) for n in node.input]
        node.output[:] = [names.get(n, n) for n in node.output]
    return model


def labels(count: int, stem: str) -> str:
    return "".join(f"{stem.upper()} CLASS {i}\n" for i in range(count))


def write_image(path: Path, width: int = 64, height: int = 48) -> Path:
    """A binary PPM (P6) of a fixed gradient: the ensemble example's input."""
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 // width, y * 255 // height, (x + y) % 256], axis=-1).astype(np.uint8)
    path.write_bytes(f"P6\n{width} {height}\n255\n".encode() + pixels.tobytes())
    return path


def build(repo: Path) -> Path:
    """Every model the examples call, in ``repo``."""
    from onnx import TensorProto

    repo.mkdir(parents=True, exist_ok=True)
    for name, elem, t in (("simple", TensorProto.INT32, "TYPE_INT32"), ("simple_int8", TensorProto.INT8, "TYPE_INT8"),
                          ("simple_string", TensorProto.STRING, "TYPE_STRING")):
        write(repo, name, PAIR.format(name=name, t=t), {1: pair(elem)})
    write(repo, "custom_identity_int32", 'name: "custom_identity_int32"\nplatform: "onnxruntime_onnx"\n'
          'max_batch_size: 8\ninput [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ -1 ] } ]\n'
          'output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ -1 ] } ]\n', {1: identity(TensorProto.INT32)})
    write_python(repo, "simple_identity", IDENTITY_PY, 'name: "simple_identity"\nbackend: "python"\n'
                 'max_batch_size: 8\ninput [ { name: "INPUT0" data_type: TYPE_STRING dims: [ -1 ] } ]\n'
                 'output [ { name: "OUTPUT0" data_type: TYPE_STRING dims: [ -1 ] } ]\n')
    onnx_runtime = 'platform: "onnxruntime_onnx"'
    write(repo, "simple_sequence", SEQUENCE.format(name="simple_sequence", runtime=onnx_runtime,
                                                   controls=",\n".join([START, READY])), {1: sequence(dyna=False)})
    corrid = _control("CORRID", "CORRID", "data_type: TYPE_UINT64")
    write(repo, "simple_dyna_sequence", SEQUENCE.format(
        name="simple_dyna_sequence", runtime=onnx_runtime, controls=",\n".join([START, END, READY, corrid])),
        {1: sequence(dyna=True)})
    write_python(repo, "simple_string_dyna_sequence", STRING_DYNA_PY, SEQUENCE.format(
        name="simple_string_dyna_sequence", runtime='backend: "python"',
        controls=",\n".join([START, END, READY, _control("CORRID", "CORRID", "data_type: TYPE_STRING")])))
    write_python(repo, "repeat_int32", REPEAT_INT32, REPEAT_CONFIG.lstrip())
    densenet = classifier("densenet", [1, 3, 224, 224], 1, 1000, [1, 1000, 1, 1], seed=1)
    write(repo, "densenet_onnx", DENSENET, {1: _renamed(densenet, {"x": "data_0", "y": "fc6_1"})})
    (repo / "densenet_onnx" / "densenet_labels.txt").write_text(labels(1000, "densenet"))
    inception = classifier("inception", ["batch", 299, 299, 3], 3, 1001, ["batch", 1001], seed=2)
    write(repo, "inception_onnx", INCEPTION, {1: _renamed(inception, {"x": "input", "y": "predictions"})})
    (repo / "inception_onnx" / "inception_labels.txt").write_text(labels(1001, "inception"))
    write_python(repo, "image_preprocess", PREPROCESS_PY, PREPROCESS)
    (repo / "preprocess_inception_ensemble" / "1").mkdir(parents=True, exist_ok=True)
    (repo / "preprocess_inception_ensemble" / "config.pbtxt").write_text(ENSEMBLE)
    return repo


def overlay(repo: Path, theirs: Path) -> list[str]:
    """Replace the models of ``repo`` by those of the same name in ``theirs`` (e.g. Triton's own
    docs/examples/model_repository) that have a model file in a version folder (its densenet_onnx
    and inception_onnx are downloaded by a script, so a checkout lacks them). Returns their names."""
    replaced = []
    for model in sorted(p for p in theirs.iterdir() if (repo / p.name).is_dir() and (p / "config.pbtxt").is_file()):
        if any(f.is_file() for v in model.iterdir() if v.is_dir() and v.name.isdigit() for f in v.iterdir()):
            shutil.rmtree(repo / model.name)
            shutil.copytree(model, repo / model.name)
            replaced.append(model.name)
    return replaced


def model_control_repository(repo: Path, count: int) -> Path:
    """``simple`` plus copies of it under other names: ``count`` models in all (what the
    model-control examples' index check counts)."""
    from onnx import TensorProto

    for i in range(count):
        name = "simple" if i == 0 else f"simple_{i}"
        write(repo, name, PAIR.format(name=name, t="TYPE_INT32"), {1: pair(TensorProto.INT32)})
    return repo


if __name__ == "__main__":
    out = Path(sys.argv[1])
    print(build(out), write_image(out.with_suffix(".ppm")))
