"""Repository layout: version policies, scan, service kinds, model file paths."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import text_format

from meshserve._proto import model_config_pb2 as mc
from meshserve.repository import (
    ConfigError,
    ModelEntry,
    available_versions,
    model_file,
    scan,
    scan_model,
    select_versions,
    service_kind,
)
from tests.support import models

ModelWriter = Callable[..., Path]


def _policy(text: str) -> mc.ModelVersionPolicy:
    return text_format.Parse(text, mc.ModelVersionPolicy())


def _config(text: str) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


# --------------------------------------------------------------------------- version policy


@pytest.mark.parametrize(("policy", "expected"), [
    ("latest { num_versions: 1 }", [7]),
    ("latest { num_versions: 2 }", [3, 7]),
    ("latest { num_versions: 9 }", [1, 3, 7]),
    ("all { }", [1, 3, 7]),
    ("specific { versions: [7, 1] }", [1, 7]),
    ("", [1, 3, 7]),  # no choice: all, as Triton's VersionsToLoad does
])
def test_select_versions(policy: str, expected: list[int]) -> None:
    assert select_versions(_policy(policy), [3, 1, 7]) == expected


def test_specific_version_that_does_not_exist_is_named() -> None:
    with pytest.raises(ConfigError) as info:
        select_versions(_policy("specific { versions: [1, 4] }"), [1, 2])
    assert info.value.field == "version_policy.specific.versions[1]"
    assert "version 4" in str(info.value)
    assert "available: 1, 2" in str(info.value)


def test_available_versions_are_numeric_directories_only(tmp_path: Path) -> None:
    for name in ("1", "10", "2", "007", "abc", "-1", ".3", "0"):
        (tmp_path / name).mkdir()
    (tmp_path / "5").write_text("a file, not a version")
    assert available_versions(tmp_path) == [0, 1, 2, 10]
    assert available_versions(tmp_path / "missing") == []


# ----------------------------------------------------------------------------- service kind


@pytest.mark.parametrize(("text", "kind"), [
    ('platform: "onnxruntime_onnx"', "onnx"),
    ('backend: "onnxruntime"', "onnx"),
    ('platform: "pytorch_libtorch"', "torchscript"),
    ('backend: "tensorrt"', "tensorrt"),
    ('platform: "ensemble"', "ensemble"),
    ('backend: "onnxruntime" sequence_batching { }', "sequence"),
    ('platform: "pytorch_libtorch" sequence_batching { direct { } }', "sequence"),
    ('backend: "tensorrt" sequence_batching { }', None),
    ('backend: "python"', "python"),
    ('backend: "python" sequence_batching { }', "python"),
    ("", None),
])
def test_service_kind(text: str, kind: str | None) -> None:
    assert service_kind(_config(text)) == kind


def test_model_file(tmp_path: Path) -> None:
    onnx_cfg = _config('name: "m" backend: "onnxruntime"')
    assert model_file(tmp_path / "m", onnx_cfg, 3) == tmp_path / "m" / "3" / "model.onnx"
    assert model_file(tmp_path / "m", _config('platform: "pytorch_libtorch"'), 1).name == "model.pt"
    assert model_file(tmp_path / "m", _config('platform: "tensorrt_plan"'), 1).name == "model.plan"
    custom = _config('backend: "onnxruntime" default_model_filename: "net.onnx"')
    entry = ModelEntry(name="m", path=tmp_path / "m")
    assert model_file(entry, custom, 2) == tmp_path / "m" / "2" / "net.onnx"
    with pytest.raises(ValueError, match="ensemble"):
        model_file(tmp_path / "e", _config('name: "e" platform: "ensemble"'), 1)


# ------------------------------------------------------------------------------------- scan

ENSEMBLE = models.ensemble_config("pipeline", {"IN": 16}, {"OUT": 16}, [
    models.step("add_sub", {"INPUT0": "IN", "INPUT1": "IN"}, {"OUTPUT0": "OUT"})])


def test_scan_with_broken_models_next_to_good_ones(
        tmp_path: Path, write_model: ModelWriter, onnx_models: Any) -> None:
    repo = tmp_path / "models"
    write_model("add_sub", 'platform: "onnxruntime_onnx" max_batch_size: 8 version_policy { all { } }',
                versions=(1, 2))
    write_model("auto", None, model=onnx_models.fixed)
    write_model("broken_syntax", 'name: "broken_syntax" max_batch_size: [')
    write_model("wrong_name", 'name: "other" backend: "onnxruntime"')
    missing = write_model("missing_file", 'backend: "onnxruntime" version_policy { all { } }', versions=(1,))
    (missing / "2").mkdir()  # a version directory without model.onnx
    write_model("pipeline", ENSEMBLE, model=None)
    write_model("pre", 'backend: "python"', model=None)
    write_model("pinned", 'backend: "onnxruntime" version_policy { specific { versions: [3] } }')
    write_model("no_versions", 'backend: "onnxruntime"', versions=())
    (repo / ".hidden").mkdir()
    (repo / "README.md").write_text("not a model")

    entries = {e.name: e for e in scan(repo)}
    assert list(entries) == sorted(entries)
    assert ".hidden" not in entries and "README.md" not in entries

    good = entries["add_sub"]
    assert good.error is None and good.ok
    assert (good.kind, good.available_versions, good.versions) == ("onnx", [1, 2], [1, 2])
    assert good.config is not None and good.config.max_batch_size == 8

    auto = entries["auto"]
    assert auto.ok and auto.kind == "onnx" and auto.versions == [1]
    assert auto.config is not None and auto.config.name == "auto"

    broken = entries["broken_syntax"]
    assert broken.config is None and broken.kind is None
    assert broken.error is not None and "config.pbtxt" in broken.error and "line 1" in broken.error
    assert broken.available_versions == [1]

    wrong = entries["wrong_name"]
    assert wrong.error is not None and "field 'name'" in wrong.error and "'other'" in wrong.error

    missing_entry = entries["missing_file"]
    assert missing_entry.config is not None
    assert missing_entry.versions == [1, 2]
    assert missing_entry.error is not None and str(missing / "2" / "model.onnx") in missing_entry.error
    assert list(missing_entry.version_errors) == [2]
    assert missing_entry.loadable_versions == [1]

    pipeline = entries["pipeline"]
    assert pipeline.ok and pipeline.kind == "ensemble" and pipeline.versions == [1]

    pre = entries["pre"]
    assert pre.kind == "python" and pre.error is not None and "model file not found" in pre.error
    assert str(repo / "pre" / "1" / "model.py") in pre.error

    pinned = entries["pinned"]
    assert pinned.error is not None and "version_policy.specific.versions[0]" in pinned.error
    assert "version 3" in pinned.error

    none = entries["no_versions"]
    assert none.error is not None and "selects no version" in none.error


def test_scan_missing_repository_names_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        scan(tmp_path / "nowhere")
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError):
        scan(tmp_path / "file")


def test_scan_model_with_override(write_model: ModelWriter) -> None:
    model_dir = write_model("add_sub", 'backend: "unknown_thing"')
    assert scan_model(model_dir).error is not None
    entry = scan_model(model_dir, override_json='{"backend": "onnxruntime", "max_batch_size": 2}')
    assert entry.ok and entry.config is not None and entry.config.max_batch_size == 2


def test_scan_unreadable_onnx_is_a_problem_not_a_crash(write_model: ModelWriter) -> None:
    def garbage(path: Path) -> Path:
        path.write_bytes(b"\x00not an onnx model\xff" * 10)
        return path

    entry = scan_model(write_model("junk", None, model=garbage))
    assert entry.config is None
    assert entry.error is not None and "model.onnx" in entry.error


def test_scan_reports_every_validation_problem(write_model: ModelWriter) -> None:
    entry = scan_model(write_model("bad", """
        backend: "onnxruntime"
        input [{ name: "INPUT0" }]
        output [{ name: "OUTPUT0" dims: [-2] }]
        dynamic_batching { }
    """))
    assert entry.config is None
    assert [p.split("field ")[1].split(":")[0] for p in entry.problems] == [
        "'output[0].dims[0]'", "'dynamic_batching'"]
    assert all(p.startswith(f"{entry.path / 'config.pbtxt'}: model 'bad': ") for p in entry.problems)


@pytest.mark.parametrize(("config", "files", "kind"), [
    ('{"platform": "onnxruntime_onnx"}', [], "onnx"),
    ('{"backend": "pytorch"}', ["1/model.pt"], "torchscript"),
    ('{"platform": "ensemble"}', [], "ensemble"),
    ('{"backend": "onnxruntime", "sequence_batching": {}}', [], "sequence"),
    ("{}", ["1/model.onnx"], "onnx"),  # no platform or backend: the model files say it
    ('{"sequence_batching": {}}', ["1/model.pt"], "sequence"),
    ("{}", ["1/model.plan", "2/model.onnx"], None),  # files of two kinds: unknown
    ('{"backend": "python"}', ["1/model.py"], "python"),
    ("{}", ["1/model.py"], "python"),
    ('{"sequence_batching": {}}', ["1/model.py"], "python"),  # the python service batches its sequences
])
def test_override_kind(config: str, files: list[str], kind: str | None) -> None:
    from meshserve.repository.layout import override_kind

    assert override_kind("m", config, files) == kind


def test_override_kind_of_bad_json_names_the_model() -> None:
    from meshserve.repository.errors import ConfigError
    from meshserve.repository.layout import override_kind

    with pytest.raises(ConfigError, match="model 'm'"):
        override_kind("m", '{"max_batch_size": "many"}')
