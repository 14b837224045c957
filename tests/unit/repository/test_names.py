"""The one rule for names (meshserve.repository.names)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from meshserve.protocol.errors import Code, InferError
from meshserve.repository import layout
from meshserve.repository.config import ConfigError, load_model_config
from meshserve.repository.names import (
    check_file_path,
    check_model_name,
    check_version,
    is_valid_model_name,
    model_file_path,
)

GOOD = ["add_sub", "m", "model-1.onnx", "a b", "ünïcode", "..x", "x..", ".hidden", "1", "x" * 255, "é" * 127]
BAD = {
    "": "empty",
    ".": "'.'",
    "..": "'..'",
    "/tmp/outside/evil": "'/'",
    "../../outside/evil": "'/'",
    "a/b": "'/'",
    "..\\..\\evil": "'\\'",
    "C:\\evil": "'\\'",
    "evil\x00": "NUL",
    "a\nb": "U+000A",
    "tab\t": "U+0009",
    "\x1b[31mred": "U+001B",
    "del\x7f": "U+007F",
    "c1\x85": "U+0085",
}
LONG = {"x" * 256: "256 bytes", "é" * 128: "256 bytes", "a" * 5000: "5000 bytes"}


@pytest.mark.parametrize("name", GOOD)
def test_valid_names_pass(name: str) -> None:
    assert is_valid_model_name(name)
    assert check_model_name(name) == name


@pytest.mark.parametrize("name", list(BAD))
def test_invalid_names_are_invalid_argument_naming_rule_and_name(name: str) -> None:
    assert not is_valid_model_name(name)
    with pytest.raises(InferError) as err:
        check_model_name(name)
    assert err.value.code is Code.INVALID_ARG and err.value.http_status == 400
    assert repr(name) in err.value.message and BAD[name] in err.value.message
    assert "one path component" in err.value.message or "empty" in err.value.message


@pytest.mark.parametrize("name", list(LONG))
def test_names_longer_than_name_max_are_invalid_argument(name: str) -> None:
    """NAME_MAX = 255 bytes of UTF-8: a longer name (over a file system's limit, a 500 naming the
    repository's path before) is refused before any path is made; the message shows its start only."""
    assert not is_valid_model_name(name)
    with pytest.raises(InferError) as err:
        check_model_name(name)
    assert err.value.code is Code.INVALID_ARG and LONG[name] in err.value.message and "longer than 255" in err.value.message
    assert len(err.value.message) < 400
    with pytest.raises(InferError) as err:
        check_file_path(f"1/{name}")
    assert err.value.code is Code.INVALID_ARG and "longer than 255" in err.value.message


def test_versions_longer_than_name_max_are_invalid() -> None:
    with pytest.raises(InferError) as err:
        check_version("1" * 256, "m")
    assert err.value.code is Code.INVALID_ARG


@pytest.mark.parametrize("version", ["", "1", "007", "123456"])
def test_versions_are_digits_or_empty(version: str) -> None:
    assert check_version(version) == version


@pytest.mark.parametrize("version", ["-1", "1.0", "../1", "１", "latest", " 1", "1/"])
def test_invalid_versions(version: str) -> None:
    with pytest.raises(InferError) as err:
        check_version(version, "m")
    assert err.value.code is Code.INVALID_ARG and repr(version) in err.value.message and "'m'" in err.value.message


def test_model_file_path_stays_inside(tmp_path: Path) -> None:
    model = tmp_path / "repo" / "m"
    (model / "1").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    assert model_file_path(model, "1/model.onnx") == (model / "1" / "model.onnx").resolve()
    # a leading '/' is the model directory, as Triton joins it (core's JoinPath): never the root
    assert model_file_path(model, "/1/model.py") == (model / "1" / "model.py").resolve()
    assert model_file_path(model, "//etc/passwd") == (model / "etc" / "passwd").resolve()
    for bad in ["", "/", "/../outside/x", "../outside/x", "1/../../outside", "1//x", "1/./x", "C:/x", "/C:/x",
                "\\x", "1\\x", "1/x\x00"]:
        with pytest.raises(InferError) as err:
            model_file_path(model, bad)
        assert err.value.code is Code.INVALID_ARG and repr(bad) in err.value.message, bad
    for bad in ["", "/../x", "../x", "1/../../x", "1\\x", "1/./x"]:  # the same rule without a filesystem
        with pytest.raises(InferError):
            check_file_path(bad)
    assert check_file_path("1/model.onnx") == ["1", "model.onnx"]
    os.symlink(tmp_path / "outside", model / "link")  # a symlink out of the model directory
    with pytest.raises(InferError, match="resolves outside"):
        model_file_path(model, "link/x")


def test_scan_skips_names_no_client_could_address(tmp_path: Path) -> None:
    (tmp_path / "ok").mkdir()
    (tmp_path / "back\\slash").mkdir()
    assert [e.name for e in layout.scan(tmp_path)] == ["ok"]


def test_config_file_names_stay_inside_the_model_directory(tmp_path: Path) -> None:
    model = tmp_path / "m"
    (model / "1").mkdir(parents=True)
    for override, field in [
        ('{"backend": "onnxruntime", "default_model_filename": "../../../outside/evil/1/model.onnx"}',
         "default_model_filename"),
        ('{"backend": "onnxruntime", "model_warmup": [{"name": "w", "inputs": {"X": {"data_type": "TYPE_FP32", '
         '"dims": [1], "input_data_file": "../../secret"}}}]}', "input_data_file"),
    ]:
        with pytest.raises(ConfigError) as err:
            load_model_config(model, override_json=override)
        assert field in str(err.value) and "not a file name inside the model directory" in str(err.value)


@pytest.mark.parametrize(("name", "message"), [
    ("", "Model name cannot be empty. Please enter a valid name to deploy."),
    (" \t\n\r\f\v ", "Model name cannot be empty. Please enter a valid name to deploy."),
    ("..", "invalid model name '..', model name must not contain path traversal characters"),
    (" ..", "invalid model name ' ..', model name must not contain path traversal characters"),
    ("a/../b", "invalid model name 'a/../b', model name must not contain path traversal characters"),
    ("model/", "invalid model name 'model/', model name must not contain path traversal characters"),
])
def test_a_load_refuses_names_in_tritons_words(name: str, message: str) -> None:
    """Triton's checks of a loaded model's name (core's ValidateModelName; NVIDIA's
    L0_input_validation ModelNameValidationTest asserts them), before meshserve's own rule."""
    from meshserve.repository.names import NAME_RULE, check_load_name

    with pytest.raises(InferError) as err:
        check_load_name(name)
    assert err.value.message == f"{message} ({NAME_RULE})"


def test_a_load_takes_names_triton_takes_and_the_rule_allows() -> None:
    from meshserve.repository.names import check_load_name

    for name in ("model123", "model.version1", "...", "..my_model", "model..1"):
        assert check_load_name(name) == name
    with pytest.raises(InferError):
        check_load_name("a\\b")  # (meshserve's own rule: one path component on every platform)
