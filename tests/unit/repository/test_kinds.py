"""The registry of backend kinds (meshserve/repository/kinds.py): its rows agree with each other,
the tables derived from it are the ones the config pipeline always had, and extra rows are checked."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshserve._proto import model_config_pb2 as mc
from meshserve.repository import config, kinds, layout
from meshserve.repository.kinds import KINDS, kind_for, kind_of_files, parse_rows


def test_every_backend_and_platform_has_one_kind() -> None:
    backends = [b for k in KINDS for b in k.backends]
    assert len(backends) == len(set(backends))
    for k in KINDS:
        for platform, backend in k.platforms.items():
            assert backend in k.backends or (not backend and k.in_gateway), (k.name, platform)
        for backend in k.sequence_backends:  # its model files are those of the kind that owns the backend
            assert backend in backends, (k.name, backend)
        assert bool(k.entry) != k.in_gateway, k.name  # a service process, or the gateway runs it
        assert not k.requires or k.extra, f"{k.name}: say which extra installs {k.requires}"


def test_the_derived_tables_are_tritons() -> None:
    assert config.PLATFORM_TO_BACKEND == {"onnxruntime_onnx": "onnxruntime", "pytorch_libtorch": "pytorch",
                                          "tensorrt_plan": "tensorrt"}
    assert config.KNOWN_BACKENDS == {"onnxruntime", "pytorch", "tensorrt", "python", "fil"}
    assert config.KNOWN_PLATFORMS == {*config.PLATFORM_TO_BACKEND, "ensemble"}
    assert list(config.DEFAULT_MODEL_FILENAMES.items()) == [  # the order autocomplete looks for them in
        ("onnxruntime", "model.onnx"), ("pytorch", "model.pt"), ("tensorrt", "model.plan"), ("python", "model.py"),
        ("fil", "xgboost.model")]


@pytest.mark.parametrize(("platform", "backend", "sequence", "kind"), [
    ("", "onnxruntime", False, "onnx"),
    ("", "onnxruntime", True, "sequence"),
    ("", "pytorch", True, "sequence"),
    ("", "tensorrt", True, None),
    ("", "python", True, "python"),
    ("ensemble", "", False, "ensemble"),
    ("", "tensorflow", False, None),
])
def test_kind_for(platform: str, backend: str, sequence: bool, kind: str | None) -> None:
    assert kind_for(platform, backend, sequence) == kind


@pytest.mark.parametrize(("files", "sequence", "kind"), [
    (["1/model.pt", "2/model.pt2"], False, "torchscript"),  # two files of one backend
    (["1/model.onnx", "2/model.plan"], False, None),
    (["1/model.py"], True, "python"),
    (["1/model.plan"], True, None),
    (["1/weights.bin"], False, None),
    (["1/model.txt"], False, "fil"),  # Triton FIL's file names (LightGBM, Treelite, XGBoost UBJSON)
    (["1/checkpoint.tl", "2/xgboost.ubj"], False, "fil"),
    # a backend's own file name wins over another's suffix: a label file beside an ONNX model
    (["1/model.onnx", "1/labels.txt"], False, "onnx"),
    (["1/model.py", "1/vocab.json"], False, "python"),
    (["1/net.onnx", "1/labels.txt"], False, None),  # two suffixes, no file name of a backend: no telling
])
def test_kind_of_files(files: list[str], sequence: bool, kind: str | None) -> None:
    assert kind_of_files(files, sequence) == kind


def test_extra_rows_are_checked() -> None:
    row = {"name": "identity", "backends": {"identity": ["model.identity"]}, "entry": "x.main"}
    (parsed,) = parse_rows(json.dumps([row]))
    assert parsed.backends == {"identity": ("model.identity",)} and parsed.suffixes == (".identity",)
    for bad, words in [
        ({**row, "name": "onnx"}, "name ['onnx'] belong to another kind"),
        ({**row, "backends": {"pytorch": ["model.x"]}}, "backends ['pytorch']"),
        ({**row, "backends": {"identity": ["model.pt"]}}, "file suffixes ['.pt']"),
        ({**row, "platforms": {"ensemble": ""}}, "platforms ['ensemble']"),
        ({**row, "sequence_backends": ["python"]}, "sequence backends ['python']"),
        ({**row, "colour": "blue"}, "only the fields"),
        ({**row, "requires": "numpy"}, "expected a list of strings"),
    ]:
        with pytest.raises(ValueError, match=kinds.EXTRA_KINDS_ENV) as info:
            parse_rows(json.dumps([bad]))
        assert words in str(info.value), (bad, str(info.value))
    with pytest.raises(ValueError, match="not JSON"):
        parse_rows("[{")
    with pytest.raises(ValueError, match="name ..identity.. belong"):
        parse_rows(json.dumps([row, row]))  # two new rows clash too


def test_a_python_based_backend_is_the_python_kinds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's python-based backends: with a backend directory, ``backend: "X"`` whose
    ``<dir>/X/model.py`` exists is a python model served by that model.py; a backend a kind serves,
    a name that is no plain folder name, or no such file is not one."""
    (tmp_path / "add_sub").mkdir()
    (tmp_path / "add_sub" / "model.py").write_text("class TritonPythonModel: ...\n")
    (tmp_path / "onnxruntime").mkdir()
    (tmp_path / "onnxruntime" / "model.py").write_text("")
    model = mc.ModelConfig(name="add", backend="add_sub")
    assert kinds.python_based_backend("add_sub") is None  # no directory set
    assert [e for e in config.config_errors(model, "config.pbtxt", "add") if e.field == "backend"]
    monkeypatch.setenv(kinds.BACKEND_DIR_ENV, str(tmp_path))
    assert kinds.python_based_backend("add_sub") == tmp_path / "add_sub" / "model.py"
    assert kinds.kind_for("", "add_sub", False) == kinds.kind_for("", "add_sub", True) == "python"
    assert kinds.kind_for("", "onnxruntime", False) == "onnx"  # a kind's own backend stays its own
    for name in ("nothere", "..", "../add_sub", "add_sub/..", ".hidden", ""):
        assert kinds.python_based_backend(name) is None, name
    assert layout.model_file(tmp_path, model, 1) == tmp_path / "add_sub" / "model.py"
    assert not [e for e in config.config_errors(model, "config.pbtxt", "add") if e.field == "backend"]
