"""The fil service's adapter in process (services/fil/): every FIL key honoured or refused with
a reason naming it, the model file FIL's model_type picks, both engines against the libraries'
own predictions, uploads refused. The service itself: tests/integration/test_fil.py."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from google.protobuf import text_format

from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol.errors import InferError
from services.base.core import OVERRIDES_DIR
from services.base.runtime import InstancePlacement, RuntimeLoadError
from services.fil import params, runtime
from tests.models import fil

pytest.importorskip("treelite", reason="the fil tests need the [fil] extra")
pytest.importorskip("sklearn", reason="the fil tests build a scikit-learn random forest (the [dev] extra)")

CPU = InstancePlacement(0, "g", "cpu")


def _config(text: str, name: str = "m") -> mc.ModelConfig:
    config = text_format.Parse(text, mc.ModelConfig())
    config.name = name
    return config


def _with(**parameters: str) -> mc.ModelConfig:
    config = _config(fil.config("lightgbm", False, 1))
    del config.parameters["model_type"], config.parameters["output_class"]
    for key, value in parameters.items():
        config.parameters[key].string_value = value
    return config


@pytest.mark.parametrize(("parameters", "key"), [
    ({"model_type": "lightgbm"}, "output_class"),  # classifier or regressor: required, as in Triton
    ({"model_type": "catboost", "output_class": "false"}, "model_type"),
    ({"output_class": "yes"}, "output_class"),
    ({"output_class": "true", "is_classifier": "false"}, "is_classifier"),
    ({"output_class": "false", "predict_proba": "true"}, "predict_proba"),
    ({"output_class": "true", "threshold": "half"}, "threshold"),
    ({"output_class": "true", "xgboost_allow_unknown_field": "1"}, "xgboost_allow_unknown_field"),
    ({"output_class": "true", "cpu_nthread": "many"}, "cpu_nthread"),
    ({"output_class": "true", "use_experimental_optimizations": "maybe"}, "use_experimental_optimizations"),
    ({"output_class": "true", "layout": "sideways"}, "layout"),
    ({"output_class": "true", "algo": "FAST"}, "algo"),
    ({"output_class": "true", "storage_type": "COMPACT"}, "storage_type"),
    ({"output_class": "true", "threads_per_tree": "x"}, "threads_per_tree"),
    ({"output_class": "true", "blocks_per_sm": "x"}, "blocks_per_sm"),
    ({"output_class": "true", "chunk_size": "x"}, "chunk_size"),
    ({"output_class": "true", "transfer_threshold": "x"}, "transfer_threshold"),
])
def test_a_value_fil_would_not_take_is_refused_by_its_key(parameters: dict[str, str], key: str) -> None:
    with pytest.raises(RuntimeLoadError, match=f"'{key}'"):
        params.read(_with(**parameters))


def test_the_keys_fil_documents_are_read() -> None:
    p = params.read(_with(model_type="xgboost_json", is_classifier="true", predict_proba="true", threshold="0.3",
                          xgboost_allow_unknown_field="true", cpu_nthread="2", use_experimental_optimizations="true",
                          layout="breadth_first", algo="NAIVE", storage_type="SPARSE", threads_per_tree="4",
                          blocks_per_sm="2", chunk_size="4", transfer_threshold="2"))
    assert p == params.FilParams("xgboost_json", True, True, 0.3, True, 2)
    assert params.read(_with(output_class="false")) == params.FilParams("xgboost", False, False, 0.5, False, 1)
    assert params.read(_with(output_class="true", cpu_nthread="-1")).nthread >= 1  # FIL's -1: every core


@pytest.mark.parametrize(("edit", "words"), [
    ('instance_group [ { name: "gpus" kind: KIND_GPU } ]', "KIND_GPU"),
    ("max_batch_size: 0", "max_batch_size"),
    ('output [ { name: "treeshap_output" data_type: TYPE_FP32 dims: [ 9 ] } ]', "treeshap_output"),
    ('input [ { name: "input__1" data_type: TYPE_FP32 dims: [ 2 ] } ]', "one input"),
    ('input [ { name: "input__0" data_type: TYPE_FP64 dims: [ 8 ] } ]', "TYPE_FP32"),
    ('input [ { name: "input__0" data_type: TYPE_FP32 dims: [ -1 ] } ]', "dims"),
])
def test_a_config_fil_does_not_serve_is_refused(edit: str, words: str) -> None:
    config = _config(fil.config("lightgbm", False, 1))
    if edit.startswith("instance_group"):
        del config.instance_group[:]
    if "input__0" in edit:  # in place of the config's input
        del config.input[:]
    text_format.Merge(edit, config)
    with pytest.raises(RuntimeLoadError, match=words):
        params.check_config(config)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[fil.FilModel]]:
    root = tmp_path_factory.mktemp("fil-unit")
    return root, fil.build(root)


@pytest.mark.parametrize("engine", ["compiled", "native"])
def test_each_engine_answers_as_the_library(repo: tuple[Path, list[fil.FilModel]], engine: str,
                                            monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if engine == "compiled" and not runtime.compiler_available():
        pytest.skip("tl2cgen and a C compiler")
    monkeypatch.setenv(runtime.ENGINE_ENV, engine)
    monkeypatch.setenv("MESHSERVE_CACHE", str(tmp_path))
    root, models = repo
    for m in models:
        config = _config((root / m.name / "config.pbtxt").read_text(), m.name)
        # the layout's default file name (xgboost.model) stands for the model type's own
        instance = runtime.FilAdapter().load(root / m.name / "1" / "xgboost.model", config, CPU)
        assert instance.engine_name == engine
        fil.check(m, instance.run({"input__0": fil.rows()}, ["output__0"])["output__0"])
        instance.close()
    if engine == "compiled":
        assert len(list((tmp_path / "fil").glob("*.so"))) == 5  # rf_class and rf_proba share one forest


def test_a_model_that_does_not_fit_its_config_is_refused(repo: tuple[Path, list[fil.FilModel]]) -> None:
    root, _ = repo
    text = (root / "xgb_proba" / "config.pbtxt").read_text()
    cases = {
        text.replace("dims: [ 3 ]", "dims: [ 2 ]"): "need dims [ 3 ]",
        text.replace("dims: [ 8 ]", "dims: [ 5 ]"): "takes 8 features",
        text.replace("xgboost_ubj", "lightgbm"): "model file model.txt",
        text.replace("xgboost_ubj", "xgboost_json"): "model file xgboost.json",
    }
    for edited, words in cases.items():
        with pytest.raises(RuntimeLoadError, match=re.escape(words)):
            runtime.FilAdapter().load(root / "xgb_proba" / "1" / "xgboost.model", _config(edited), CPU)
    (root / "garbage" / "1").mkdir(parents=True)
    (root / "garbage" / "1" / "model.txt").write_text("not a model\n")
    with pytest.raises(RuntimeLoadError, match="model.txt is no 'lightgbm' model") as err:
        runtime.FilAdapter().load(root / "garbage" / "1" / "xgboost.model",
                                  _config(fil.config("lightgbm", False, 1)), CPU)
    assert str(root) not in str(err.value)


def test_uploaded_model_files_are_refused(tmp_path: Path) -> None:
    config = _config(fil.config("lightgbm", False, 1))
    with pytest.raises(InferError, match="uploaded model files are refused") as err:
        runtime.FilAdapter().guard_load(tmp_path / "model.txt", config, 1 << 20)
    assert err.value.http_status == 400
    # with no load bound (--max-model-load-bytes 0) the service asks no guard: the load refuses it
    uploaded = tmp_path / OVERRIDES_DIR / "0123" / "m" / "1" / "model.txt"
    uploaded.parent.mkdir(parents=True)
    uploaded.write_text("tree\n")
    with pytest.raises(InferError, match="uploaded model files are refused"):
        runtime.FilAdapter().load(uploaded, config, CPU)


def test_a_forest_that_does_not_compile_runs_natively(repo: tuple[Path, list[fil.FilModel]],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """auto: a compile failure falls back to the native engine; a forced compiled engine fails the load."""
    root, models = repo
    m = models[0]

    def broken(model: object, nthread: int) -> runtime.Engine:
        raise RuntimeError("no compiler today")

    monkeypatch.setattr(runtime, "compiled_engine", broken)
    monkeypatch.setattr(runtime, "compiler_available", lambda: True)
    monkeypatch.delenv(runtime.ENGINE_ENV, raising=False)
    config = _config((root / m.name / "config.pbtxt").read_text(), m.name)
    instance = runtime.FilAdapter().load(root / m.name / "1" / "xgboost.model", config, CPU)
    assert instance.engine_name == "native"
    fil.check(m, instance.run({"input__0": fil.rows()}, ["output__0"])["output__0"])
    monkeypatch.setenv(runtime.ENGINE_ENV, "compiled")
    with pytest.raises(RuntimeLoadError, match="the compiled engine could not load xgboost.json: no compiler today"):
        runtime.FilAdapter().load(root / m.name / "1" / "xgboost.model", config, CPU)
