"""Config pipeline: parse → autocomplete → normalize → validate → reload decision."""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format, text_format

from meshserve._proto import model_config_pb2 as mc
from meshserve.repository import (
    ConfigError,
    autocomplete,
    load_model_config,
    normalize,
    parse_config,
    problems,
    validate,
)

ModelWriter = Callable[..., Path]

# The shape of Triton's docs example (docs/user_guide/model_configuration.md).
ADD_SUB_CONFIG = """
name: "add_sub"
platform: "onnxruntime_onnx"
max_batch_size: 8
version_policy: { all { }}
input [
  {
    name: "INPUT0"
    data_type: TYPE_FP32
    dims: [ 16 ]
  },
  {
    name: "INPUT1"
    data_type: TYPE_FP32
    dims: [ 16 ]
  }
]
output [
  {
    name: "OUTPUT0"
    data_type: TYPE_FP32
    dims: [ 16 ]
  },
  {
    name: "OUTPUT1"
    data_type: TYPE_FP32
    dims: [ 16 ]
  }
]
instance_group [ { count: 2 kind: KIND_CPU } ]
dynamic_batching {
  preferred_batch_size: [ 4, 8 ]
  max_queue_delay_microseconds: 100
}
"""


def _config(text: str) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


# ------------------------------------------------------------------------------------ parse


def _config_file(tmp_path: Path, model: str, text: str) -> Path:
    """``text`` written as ``tmp_path/model/config.pbtxt``."""
    path = tmp_path / model / "config.pbtxt"
    path.parent.mkdir()
    path.write_text(text)
    return path


def test_parse_realistic_triton_config(tmp_path: Path) -> None:
    config = parse_config(_config_file(tmp_path, "add_sub", ADD_SUB_CONFIG))
    assert config.name == "add_sub"
    assert config.platform == "onnxruntime_onnx"
    assert config.max_batch_size == 8
    assert config.version_policy.WhichOneof("policy_choice") == "all"
    assert [i.name for i in config.input] == ["INPUT0", "INPUT1"]
    assert config.input[0].data_type == mc.TYPE_FP32
    assert list(config.input[0].dims) == [16]
    assert [o.name for o in config.output] == ["OUTPUT0", "OUTPUT1"]
    assert config.instance_group[0].count == 2
    assert config.instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU
    assert list(config.dynamic_batching.preferred_batch_size) == [4, 8]
    assert config.dynamic_batching.max_queue_delay_microseconds == 100
    assert config.WhichOneof("scheduling_choice") == "dynamic_batching"


def test_load_realistic_config_keeps_what_it_sets(write_model: ModelWriter) -> None:
    model_dir = write_model("add_sub", ADD_SUB_CONFIG, versions=(1, 2))
    config = load_model_config(model_dir)
    assert config.backend == "onnxruntime"
    assert config.default_model_filename == "model.onnx"
    assert config.max_batch_size == 8
    assert list(config.dynamic_batching.preferred_batch_size) == [4, 8]
    assert config.version_policy.WhichOneof("policy_choice") == "all"
    group = config.instance_group[0]
    assert (group.name, group.count, group.kind) == ("add_sub_0", 2, mc.ModelInstanceGroup.KIND_CPU)
    assert [list(i.dims) for i in config.input] == [[16], [16]]


def test_parse_error_names_file_line_and_field(tmp_path: Path) -> None:
    path = _config_file(tmp_path, "mlp", 'name: "mlp"\nplatform: "onnxruntime_onnx"\nmax_batch_sise: 8\n')
    with pytest.raises(ConfigError) as info:
        parse_config(path)
    err = info.value
    assert (err.file, err.model, err.field) == (str(path), "mlp", "max_batch_sise")
    assert "line 3, column 1" in str(err)
    assert str(err).startswith(f"{path}: model 'mlp': field 'max_batch_sise': ")


def test_parse_error_on_bad_enum_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(_config_file(tmp_path, "m", 'input [{ name: "X" data_type: TYPE_FLOAT32 dims: [1] }]\n'))
    assert info.value.field == "data_type"
    assert "TYPE_FLOAT32" in str(info.value)


def test_parse_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file not found"):
        parse_config(tmp_path / "m" / "config.pbtxt")


# ----------------------------------------------------------------------------- autocomplete


def test_no_config_pbtxt_is_autocompleted_from_onnx(write_model: ModelWriter) -> None:
    model_dir = write_model("add_sub", None)
    config = load_model_config(model_dir)
    assert config.name == "add_sub"
    assert (config.platform, config.backend) == ("onnxruntime_onnx", "onnxruntime")
    assert config.default_model_filename == "model.onnx"
    assert config.max_batch_size == 4  # Triton's default-max-batch-size
    assert config.HasField("dynamic_batching")
    assert list(config.dynamic_batching.preferred_batch_size) == [4]
    assert [(i.name, i.data_type, list(i.dims)) for i in config.input] == [
        ("INPUT0", mc.TYPE_FP32, [16]), ("INPUT1", mc.TYPE_FP32, [16])]
    assert [(o.name, list(o.dims)) for o in config.output] == [("OUTPUT0", [16]), ("OUTPUT1", [16])]
    assert config.version_policy.latest.num_versions == 1
    assert [(g.name, g.count, g.kind) for g in config.instance_group] == [
        ("add_sub", 2, mc.ModelInstanceGroup.KIND_CPU)]


def test_fixed_first_dim_means_no_batching(write_model: ModelWriter, onnx_models: Any) -> None:
    config = load_model_config(write_model("fixed", None, model=onnx_models.fixed))
    assert config.max_batch_size == 0
    assert not config.HasField("dynamic_batching")
    assert [(i.name, list(i.dims)) for i in config.input] == [("X", [1, 4])]
    assert [(o.name, list(o.dims)) for o in config.output] == [("Y", [1, 4])]


def test_string_model_batch_only_dim_becomes_scalar_with_reshape(write_model: ModelWriter, onnx_models: Any) -> None:
    config = load_model_config(write_model("strings", None, model=onnx_models.strings))
    assert config.max_batch_size == 4
    text_in = config.input[0]
    assert (text_in.name, text_in.data_type, list(text_in.dims)) == ("TEXT", mc.TYPE_STRING, [1])
    assert text_in.HasField("reshape") and list(text_in.reshape.shape) == []
    assert config.output[0].data_type == mc.TYPE_STRING


def test_initializers_are_not_inputs_and_output_shape_is_inferred(write_model: ModelWriter, onnx_models: Any) -> None:
    config = load_model_config(write_model("init", None, model=onnx_models.with_initializer_input))
    assert [i.name for i in config.input] == ["X"]
    assert config.input[0].data_type == mc.TYPE_INT64
    assert config.max_batch_size == 4
    assert [(o.name, list(o.dims)) for o in config.output] == [("Y", [3])]


def test_partial_config_fills_listed_entries_and_missing_outputs(write_model: ModelWriter) -> None:
    model_dir = write_model("add_sub", """
        platform: "onnxruntime_onnx"
        max_batch_size: 8
        input [{ name: "INPUT1" }, { name: "INPUT0" data_type: TYPE_FP32 dims: [16] }]
    """)
    config = load_model_config(model_dir)
    assert config.name == "add_sub"
    assert [(i.name, i.data_type, list(i.dims)) for i in config.input] == [
        ("INPUT1", mc.TYPE_FP32, [16]), ("INPUT0", mc.TYPE_FP32, [16])]
    assert [o.name for o in config.output] == ["OUTPUT0", "OUTPUT1"]
    assert config.max_batch_size == 8
    # Triton's onnxruntime backend turns on the dynamic batcher for a batching model.
    assert list(config.dynamic_batching.preferred_batch_size) == [8]


def test_full_io_listed_skips_batch_autocomplete_like_triton(write_model: ModelWriter) -> None:
    model_dir = write_model("add_sub", """
        backend: "onnxruntime"
        input [{ name: "INPUT0" data_type: TYPE_FP32 dims: [-1, 16] },
               { name: "INPUT1" dims: [-1, 16] }]
        output [{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [-1, 16] }]
    """)
    config = load_model_config(model_dir)
    assert config.max_batch_size == 0
    assert not config.HasField("dynamic_batching")
    assert config.input[1].data_type == mc.TYPE_FP32  # filled from the graph
    assert config.platform == "onnxruntime_onnx"


def test_max_batch_size_on_non_batching_onnx_model_is_an_error(write_model: ModelWriter, onnx_models: Any) -> None:
    model_dir = write_model("fixed", 'platform: "onnxruntime_onnx" max_batch_size: 8', model=onnx_models.fixed)
    with pytest.raises(ConfigError) as info:
        load_model_config(model_dir)
    assert info.value.field == "max_batch_size"
    assert info.value.model == "fixed"
    assert info.value.file.endswith("model.onnx")


def test_existing_scheduler_is_kept(write_model: ModelWriter) -> None:
    model_dir = write_model("seq", 'backend: "onnxruntime" sequence_batching { }')
    config = load_model_config(model_dir)
    assert config.max_batch_size == 4
    assert config.WhichOneof("scheduling_choice") == "sequence_batching"
    assert config.sequence_batching.max_sequence_idle_microseconds == 1_000_000


def test_config_input_missing_from_graph(write_model: ModelWriter) -> None:
    model_dir = write_model("add_sub", 'backend: "onnxruntime" input [{ name: "INPUT9" }]')
    with pytest.raises(ConfigError) as info:
        load_model_config(model_dir)
    assert info.value.field == "input[0].name"
    assert "INPUT0, INPUT1" in str(info.value)


def test_unsupported_onnx_element_type(write_model: ModelWriter, onnx_models: Any) -> None:
    with pytest.raises(ConfigError) as info:
        load_model_config(write_model("bf16", None, model=onnx_models.bf16))
    assert info.value.field == "input[0].data_type"
    assert "BFLOAT16" in str(info.value)


def test_autocomplete_uses_highest_selected_version(write_model: ModelWriter, tmp_path: Path, onnx_models: Any) -> None:
    model_dir = write_model("m", None, versions=(1,), model=onnx_models.fixed)
    onnx_models.add_sub(model_dir / "2" / "model.onnx")
    assert [i.name for i in autocomplete(mc.ModelConfig(), model_dir).input] == ["INPUT0", "INPUT1"]
    pinned = _config("version_policy { specific { versions: [1] } }")
    assert [i.name for i in autocomplete(pinned, model_dir).input] == ["X"]


def test_autocomplete_with_explicit_model_file_and_no_mutation(tmp_path: Path, onnx_models: Any) -> None:
    model = onnx_models.add_sub(tmp_path / "elsewhere.onnx", batch=False)
    original = _config('backend: "onnxruntime"')
    completed = autocomplete(original, tmp_path / "m", model)
    assert not original.input
    assert completed.name == "m"
    assert [list(i.dims) for i in completed.input] == [[16], [16]]
    assert completed.max_batch_size == 0


def test_directory_without_config_or_versions(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError) as info:
        load_model_config(tmp_path / "empty")
    assert "config.pbtxt" in info.value.file


def test_non_onnx_backend_is_detected_from_the_file(write_model: ModelWriter) -> None:
    model_dir = write_model("engine", None, model=lambda p: (p.write_bytes(b"plan"), p)[1], filename="model.plan")
    config = normalize(autocomplete(mc.ModelConfig(), model_dir), "engine")
    assert (config.platform, config.backend, config.default_model_filename) == (
        "tensorrt_plan", "tensorrt", "model.plan")


# -------------------------------------------------------------------------------- normalize


def test_normalize_fills_defaults() -> None:
    config = normalize(_config('platform: "pytorch_libtorch" instance_group [{ kind: KIND_AUTO }, { count: 3 name: "big" }]'),
                       "resnet")
    assert config.name == "resnet"
    assert config.backend == "pytorch"
    assert config.default_model_filename == "model.pt"
    assert config.version_policy.latest.num_versions == 1
    assert config.optimization.input_pinned_memory.enable
    groups = [(g.name, g.count, g.kind) for g in config.instance_group]
    assert groups == [("resnet_0", 1, mc.ModelInstanceGroup.KIND_CPU), ("big", 3, mc.ModelInstanceGroup.KIND_CPU)]


def test_normalize_kind_auto_with_gpu() -> None:
    config = normalize(_config('backend: "tensorrt"'), "trt", gpu_available=True)
    assert config.platform == "tensorrt_plan"
    assert config.instance_group[0].kind == mc.ModelInstanceGroup.KIND_GPU


def test_normalize_python_and_ensemble() -> None:
    py = normalize(_config('backend: "python"'), "pre")
    assert py.platform == "" and py.default_model_filename == "model.py"
    ens = normalize(_config('platform: "ensemble" ensemble_scheduling { step [{ model_name: "a" }] }'), "ens")
    assert ens.backend == "" and not ens.instance_group
    assert not ens.HasField("optimization")


def test_normalize_does_not_mutate_its_input() -> None:
    original = _config('backend: "onnxruntime"')
    normalize(original, "m")
    assert original == _config('backend: "onnxruntime"')


# --------------------------------------------------------------------------------- validate


BASE = """
name: "mlp"
platform: "pytorch_libtorch"
max_batch_size: 8
input [{ name: "X" data_type: TYPE_FP32 dims: [4] }]
output [{ name: "Y" data_type: TYPE_FP32 dims: [2] }]
"""


@pytest.mark.parametrize(("extra", "replace", "field"), [
    ("", ('name: "mlp"', 'name: "other"'), "name"),
    ("", ('platform: "pytorch_libtorch"', 'backend: "tensorflow"'), "backend"),
    ("", ('platform: "pytorch_libtorch"', 'platform: "caffe2_netdef"'), "platform"),
    ("", ('platform: "pytorch_libtorch"', 'platform: "pytorch_libtorch" backend: "onnxruntime"'), "backend"),
    ("", ('platform: "pytorch_libtorch"', ""), "backend"),
    ("", ("max_batch_size: 8", "max_batch_size: -1"), "max_batch_size"),
    ("", ('name: "X" ', ""), "input[0].name"),
    ('input [{ name: "X" data_type: TYPE_FP32 dims: [4] }]', None, "input[1].name"),
    ("", ("data_type: TYPE_FP32 dims: [4]", "dims: [4]"), "input[0].data_type"),
    ("", ("data_type: TYPE_FP32 dims: [2]", "dims: [2]"), "output[0].data_type"),
    ('input [{ name: "Z" data_type: TYPE_FP32 }]', ("max_batch_size: 8", "max_batch_size: 0"), "input[1].dims"),
    ("", ("dims: [4]", "dims: [4, -2]"), "input[0].dims[1]"),
    ("", ("dims: [4]", "dims: [0]"), "input[0].dims[0]"),
    ("dynamic_batching { preferred_batch_size: [4, 16] }", None, "dynamic_batching.preferred_batch_size[1]"),
    ("dynamic_batching { preferred_batch_size: [0] }", None, "dynamic_batching.preferred_batch_size[0]"),
    ("dynamic_batching { }", ("max_batch_size: 8", ""), "dynamic_batching"),
    ("dynamic_batching { priority_levels: 2 }", None, "dynamic_batching.default_priority_level"),
    ("version_policy { specific { } }", None, "version_policy.specific.versions"),
    ("version_policy { latest { num_versions: 0 } }", None, "version_policy.latest.num_versions"),
    ("instance_group [{ count: -1 }]", None, "instance_group[0].count"),
    ("instance_group [{ kind: KIND_CPU gpus: [0] }]", None, "instance_group[0].gpus"),
    ("ensemble_scheduling { step [{ model_name: \"a\" }] }", None, "ensemble_scheduling"),
    ("", ('platform: "pytorch_libtorch"', 'platform: "ensemble"'), "ensemble_scheduling"),
    ("sequence_batching { control_input [{ name: \"START\" control [{ kind: CONTROL_SEQUENCE_START }] }] }",
     None, "sequence_batching.control_input[0].control[0]"),
    ("sequence_batching { control_input [{ name: \"C\" control [{ kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_FP32 }] }] }",
     None, "sequence_batching.control_input[0].control[0].data_type"),
    ("", ("dims: [2]", "dims: [2] reshape { shape: [3] }"), "output[0].reshape"),
])
def test_every_validation_error_names_file_model_and_field(
        write_model: ModelWriter, extra: str, replace: tuple[str, str] | None, field: str) -> None:
    text = BASE + extra
    if replace is not None:
        assert replace[0] in text
        text = text.replace(replace[0], replace[1], 1)
    model_dir = write_model("mlp", text, model=None)
    with pytest.raises(ConfigError) as info:
        load_model_config(model_dir)
    err = info.value
    assert err.file == str(model_dir / "config.pbtxt")
    assert err.model in ("mlp", "other")
    assert err.field == field
    assert str(err).startswith(f"{err.file}: model '{err.model}': field '{field}': ")


def test_missing_message_matches_the_documented_format() -> None:
    config = normalize(_config(BASE.replace("data_type: TYPE_FP32 dims: [4]", "dims: [4]")), "mlp")
    with pytest.raises(ConfigError) as info:
        validate(config, "models/mlp/config.pbtxt", "mlp")
    assert str(info.value) == "models/mlp/config.pbtxt: model 'mlp': field 'input[0].data_type': missing"


def test_valid_configs_pass() -> None:
    ok = [
        BASE,
        BASE + "dynamic_batching { preferred_batch_size: [4, 8] max_queue_delay_microseconds: 100 }",
        BASE.replace("dims: [4]", "dims: [1] reshape { shape: [] }"),
        BASE.replace("dims: [4]", "reshape { shape: [] }"),  # empty dims with a reshape
        BASE.replace("dims: [4]", "dims: [2, -1, 6] reshape { shape: [2, -1, 2, 3] }"),
        BASE + 'sequence_batching { oldest { } control_input [{ name: "S" control [{ kind: CONTROL_SEQUENCE_START '
               'int32_false_true: [0, 1] }] }, { name: "C" control [{ kind: CONTROL_SEQUENCE_CORRID '
               'data_type: TYPE_UINT64 }] }] }',
        'name: "ens" platform: "ensemble" input [{ name: "A" data_type: TYPE_FP32 dims: [1] }] '
        'ensemble_scheduling { step [{ model_name: "m" input_map { key: "x" value: "A" } '
        'output_map { key: "y" value: "B" } }] }',
        'name: "pre" backend: "python" input [{ name: "A" data_type: TYPE_STRING dims: [-1] }]',
    ]
    for text in ok:
        config = normalize(_config(text), "")
        assert problems(config) == [], text
        validate(config, "x/config.pbtxt", config.name)


def test_problems_lists_everything() -> None:
    config = normalize(_config("""
        name: "m" backend: "nope" max_batch_size: 2
        input [{ name: "A" }, { name: "A" data_type: TYPE_FP32 dims: [-3] }]
        dynamic_batching { preferred_batch_size: [4] }
    """), "m")
    found = problems(config, "m")
    assert found == [
        "field 'backend': unknown backend 'nope' (known: fil, onnxruntime, python, pytorch, tensorrt; a backend "
        "written in Python: --backend-directory DIR with DIR/nope/model.py)",
        "field 'input[0].data_type': missing",
        "field 'input[0].dims': missing",
        "field 'input[1].name': duplicate input name 'A'",
        "field 'input[1].dims[0]': must be >= 1, or -1 for a variable dimension, got -3",
        "field 'dynamic_batching.preferred_batch_size[0]': 4 exceeds max_batch_size 2",
    ]


# ----------------------------------------------------------------------------- override json


def test_override_json_replaces_config_pbtxt(write_model: ModelWriter) -> None:
    model_dir = write_model("add_sub", 'platform: "bogus"')
    override = json_format.MessageToJson(_config("""
        name: "add_sub" backend: "onnxruntime" max_batch_size: 2
        instance_group [{ count: 3 }]
    """), preserving_proto_field_name=True)
    config = load_model_config(model_dir, override_json=override)
    assert config.max_batch_size == 2
    assert config.instance_group[0].count == 3
    assert [i.name for i in config.input] == ["INPUT0", "INPUT1"]


def test_override_json_parse_error(write_model: ModelWriter) -> None:
    model_dir = write_model("add_sub", None)
    with pytest.raises(ConfigError) as info:
        load_model_config(model_dir, override_json='{"max_batch_sizes": 2}')
    assert info.value.field == "max_batch_sizes"
    assert info.value.model == "add_sub"
    assert "load request" in info.value.file


def test_repository_package_imports_neither_grpc_nor_onnx() -> None:
    code = "import sys, meshserve.repository; print(sorted(m for m in ('grpc', 'onnx') if m in sys.modules))"
    repo_root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo_root)
    assert out.stdout.strip() == "[]"
