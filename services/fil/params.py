"""Triton FIL backend's config, read as its backend reads it: every documented key honoured or
refused at load with a reason that names the key (docs/fil.md lists them).

Keys (Triton's fil_backend docs/model_config.md and src/shared_state.h, 25.09):

- ``model_type`` (default ``xgboost``): ``xgboost`` (legacy binary), ``xgboost_json``,
  ``xgboost_ubj``, ``lightgbm``, ``treelite_checkpoint``; its default file name is ``MODEL_FILES``.
- ``output_class`` (before 25.09) / ``is_classifier`` (25.09): classifier or regressor; one of
  them is required, as in Triton.
- ``predict_proba``: a classifier returns its class scores instead of the class index.
- ``threshold`` (default 0.5): a binary classifier's decision threshold.
- ``xgboost_allow_unknown_field``: XGBoost JSON models may carry fields the parser does not know.
- ``cpu_nthread``: the threads one batch runs on (Triton's default -1, all cores; meshserve's 1:
  instances scale with ``instance_group { count }`` and every core is shared with the gateway).
- Performance-only keys, which FIL documents as not changing any output: ``use_experimental_optimizations``,
  ``layout``, ``chunk_size``, ``transfer_threshold`` and the GPU keys (``algo``, ``threads_per_tree``,
  ``storage_type``, ``blocks_per_sm``): their values are checked and have no further effect.

Refused: ``KIND_GPU`` instances (this service runs on CPU), the ``treeshap_output`` output (SHAP
values), a model with ``max_batch_size: 0`` (FIL's tensors are ``[rows, features]``), any input or
output datatype but FP32.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from meshserve._proto import model_config_pb2 as mc
from services.base.runtime import RuntimeLoadError, config_parameter

# model_type -> Triton FIL's default model file name for it
MODEL_FILES = {
    "xgboost": "xgboost.model",
    "xgboost_json": "xgboost.json",
    "xgboost_ubj": "xgboost.ubj",
    "lightgbm": "model.txt",
    "treelite_checkpoint": "checkpoint.tl",
}
# keys FIL documents as performance-only (no effect on outputs): checked, then without effect here
_CHOICES = {
    "layout": ("depth_first", "breadth_first", "layered"),
    "algo": ("ALGO_AUTO", "NAIVE", "TREE_REORG", "BATCH_TREE_REORG"),
    "storage_type": ("AUTO", "DENSE", "SPARSE", "SPARSE8"),
}
_INTEGERS = ("chunk_size", "threads_per_tree", "blocks_per_sm", "transfer_threshold")
SHAP_OUTPUT = "treeshap_output"


@dataclass(frozen=True)
class FilParams:
    model_type: str
    is_classifier: bool
    predict_proba: bool
    threshold: float
    allow_unknown_field: bool
    nthread: int


def _refuse(config: mc.ModelConfig, message: str) -> RuntimeLoadError:
    return RuntimeLoadError(f"model '{config.name}': {message}")


def _bool(config: mc.ModelConfig, key: str) -> bool | None:
    raw = config_parameter(config, key)
    if raw is None or raw.strip() == "":
        return None
    value = raw.strip().lower()
    if value not in ("true", "false"):
        raise _refuse(config, f"parameter '{key}' must be 'true' or 'false', got '{raw}'")
    return value == "true"


def _int(config: mc.ModelConfig, key: str) -> int | None:
    raw = config_parameter(config, key)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise _refuse(config, f"parameter '{key}' must be an integer, got '{raw}'") from None


def read(config: mc.ModelConfig) -> FilParams:
    """The FIL parameters of ``config``; RuntimeLoadError (naming the key) for a value FIL would
    not take or that this service does not serve."""
    model_type = (config_parameter(config, "model_type") or "xgboost").strip()
    if model_type not in MODEL_FILES:
        raise _refuse(config, f"parameter 'model_type' is '{model_type}'; FIL's model types are "
                      f"{', '.join(MODEL_FILES)}")
    output_class, is_classifier = _bool(config, "output_class"), _bool(config, "is_classifier")
    if output_class is not None and is_classifier is not None and output_class != is_classifier:
        raise _refuse(config, "parameters 'output_class' and 'is_classifier' disagree (output_class is the "
                      "name before FIL 25.09 of is_classifier: give one)")
    classifier = is_classifier if is_classifier is not None else output_class
    if classifier is None:
        raise _refuse(config, "parameter 'output_class' (or 'is_classifier') is required: 'true' for a "
                      "classifier, 'false' for a regressor")
    proba = bool(_bool(config, "predict_proba"))
    if proba and not classifier:
        raise _refuse(config, "parameter 'predict_proba' is 'true' for a regressor (output_class 'false'): "
                      "class scores are a classifier's")
    threshold = 0.5
    raw = config_parameter(config, "threshold")
    if raw is not None and raw.strip():
        try:
            threshold = float(raw)
        except ValueError:
            raise _refuse(config, f"parameter 'threshold' must be a number, got '{raw}'") from None
    allow_unknown = bool(_bool(config, "xgboost_allow_unknown_field"))
    nthread = _int(config, "cpu_nthread")
    if nthread is None:
        nthread = 1
    elif nthread <= 0:
        nthread = os.cpu_count() or 1  # FIL's -1: every core
    _bool(config, "use_experimental_optimizations")
    for key, choices in _CHOICES.items():
        value = config_parameter(config, key)
        if value and value not in choices:
            raise _refuse(config, f"parameter '{key}' is '{value}'; FIL's values are {', '.join(choices)}")
    for key in _INTEGERS:
        _int(config, key)
    return FilParams(model_type, classifier, proba, threshold, allow_unknown, nthread)


def check_config(config: mc.ModelConfig) -> tuple[str, str, int]:
    """The input and output names and the input's feature count that ``config`` declares,
    refusing what FIL (or this CPU service) does not serve."""
    gpu = [g.name for g in config.instance_group if g.kind == mc.ModelInstanceGroup.KIND_GPU]
    if gpu:
        raise _refuse(config, f"instance group '{gpu[0]}' is KIND_GPU; meshserve's fil service runs tree models "
                      "on CPU (use KIND_CPU or KIND_AUTO)")
    if config.max_batch_size <= 0:
        raise _refuse(config, "max_batch_size must be > 0: FIL's input is a batch of rows, dims [ features ]")
    if len(config.input) != 1:
        raise _refuse(config, f"a FIL model has one input (input__0, dims [ features ]); the config lists "
                      f"{len(config.input)}")
    if any(o.name == SHAP_OUTPUT for o in config.output):
        raise _refuse(config, f"output '{SHAP_OUTPUT}' (SHAP values) is not served by meshserve's fil service")
    if len(config.output) != 1:
        raise _refuse(config, f"a FIL model has one output (output__0); the config lists {len(config.output)}")
    tin, tout = config.input[0], config.output[0]
    features = 0
    for kind, t in (("input", tin), ("output", tout)):
        if t.data_type != mc.TYPE_FP32:
            raise _refuse(config, f"{kind} '{t.name}' is {mc.DataType.Name(t.data_type)}; FIL's tensors are "
                          "TYPE_FP32")
        dims = list(t.reshape.shape) if t.HasField("reshape") else list(t.dims)
        if len(dims) != 1 or dims[0] <= 0:
            raise _refuse(config, f"{kind} '{t.name}' has dims {dims}; FIL's are one fixed dimension "
                          "([ features ] in, [ 1 ] or [ classes ] out)")
        features = features or dims[0]
    return tin.name, tout.name, features
