"""Tree models (Triton's FIL backend: XGBoost, LightGBM, Treelite checkpoints) on CPU.

Every model type is read by Treelite (``treelite.frontend``: XGBoost JSON, UBJSON and legacy
binary, LightGBM text; ``treelite.Model.deserialize``: checkpoints) and runs through one engine:

- **compiled** (the default where ``tl2cgen`` and a C compiler are installed): the forest
  compiled to a shared library by tl2cgen (``export_lib``, its translation units built in parallel),
  kept in a cache keyed by the model's bytes (``$MESHSERVE_CACHE/fil``, ~/.cache/meshserve/fil),
  so a reload or a second instance of the same model loads it in milliseconds;
- **native** otherwise: XGBoost's ``inplace_predict``, LightGBM's ``predict``, Treelite's GTIL for
  checkpoints and legacy XGBoost binaries.

``MESHSERVE_FIL_ENGINE=compiled|native`` forces one (``auto`` by default).

Why compiled, measured per row on one thread (CPU time; 2-core VM; a 100-tree depth-6 binary
model over 32 features; ``python -m load.bench.fil engines`` measures it again, docs/perf/fil.md):

==============================  ==============  ===============
engine                          batch 1, us/row  batch 64, us/row
==============================  ==============  ===============
tl2cgen, from the XGBoost model 15.8            0.81
tl2cgen, from the LightGBM one  17.0            1.31
XGBoost inplace_predict         111.4           2.76
LightGBM predict                19.0            2.76
Treelite GTIL (XGBoost model)   27.6            7.05
Treelite GTIL (LightGBM model)  29.2            7.67
==============================  ==============  ===============

The compiled forest is the fastest at both: 2-3.4x the libraries' own predict at batch 64, and at
batch 1 as fast as LightGBM's (7x XGBoost's). Its cost is the compile at the first load (7 s of wall
time for this model on the busy 2-core VM, under 1 s for the tests' 10-25-tree models, more for
large forests; cached after).

Outputs as FIL's (Triton's fil_backend docs/model_config.md): a regressor's prediction; a
classifier's class index (a binary one: score > ``threshold``; else the top class) or, with
``predict_proba``, its class scores (a binary model's: [P(1)] for dims [1], [P(0), P(1)] for [2]).
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol.errors import InferError
from services.base.core import OVERRIDES_DIR
from services.base.runtime import InstancePlacement, RuntimeLoadError
from services.fil import params as fil_params
from services.fil.params import MODEL_FILES, FilParams

ENGINE_ENV = "MESHSERVE_FIL_ENGINE"
log = logging.getLogger("meshserve.fil")
Engine = Callable[[np.ndarray], np.ndarray]  # rows (n, features) float32 -> scores (n, width)


def _short(exc: BaseException) -> str:
    """A library's error, its last line only (Treelite prefixes its build's source path)."""
    text = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    if "] " in text and text.startswith("["):
        text = text.split(": ", 1)[-1]
    return text[:300]


def resolve_file(model_file: Path, model_type: str) -> Path:
    """The file to read: the layout's default (xgboost.model, or whichever of the kind's file
    names a version holds) stands for the model type's own default name, as in Triton, where
    the default file name follows ``model_type``; a ``default_model_filename`` of another name
    is read as it is."""
    if model_file.name in MODEL_FILES.values():
        return model_file.parent / MODEL_FILES[model_type]
    return model_file


def load_treelite(path: Path, p: FilParams) -> Any:
    import treelite

    if p.model_type == "treelite_checkpoint":
        return treelite.Model.deserialize(str(path))
    if p.model_type == "lightgbm":
        return treelite.frontend.load_lightgbm_model(path)
    if p.model_type == "xgboost":  # legacy binary; XGBoost >= 3 writes UBJSON under any other name
        try:
            return treelite.frontend.load_xgboost_model_legacy_binary(path)
        except Exception:
            return treelite.frontend.load_xgboost_model(path, format_choice="ubjson")
    fmt = "json" if p.model_type == "xgboost_json" else "ubjson"
    return treelite.frontend.load_xgboost_model(path, format_choice=fmt, allow_unknown_field=p.allow_unknown_field)


def compiler_available() -> bool:
    if importlib.util.find_spec("tl2cgen") is None:
        return False
    return shutil.which("gcc") is not None or shutil.which("cc") is not None


def _cache_dir() -> Path:
    base = Path(os.environ.get("MESHSERVE_CACHE") or Path.home() / ".cache" / "meshserve") / "fil"
    try:
        base.mkdir(parents=True, exist_ok=True)
        probe = base / f".probe-{os.getpid()}"
        probe.touch()
        probe.unlink()
        return base
    except OSError:
        fallback = Path(tempfile.gettempdir()) / f"meshserve-fil-{os.getuid()}"
        fallback.mkdir(mode=0o700, exist_ok=True)
        return fallback


def compiled_engine(model: Any, nthread: int) -> Engine:
    """The forest compiled by tl2cgen (cached by the model's bytes), run on ``nthread`` threads."""
    import tl2cgen
    import treelite

    digest = hashlib.sha256(model.serialize_bytes())
    digest.update(f"{treelite.__version__}/{tl2cgen.__version__}".encode())
    lib = _cache_dir() / f"{digest.hexdigest()[:32]}.so"
    if not lib.exists():
        tmp = lib.with_name(f"{lib.stem}.{os.getpid()}.{id(model)}.tmp.so")
        try:
            tl2cgen.export_lib(model, toolchain="gcc" if shutil.which("gcc") else "cc", libpath=str(tmp),
                               params={"parallel_comp": max(1, os.cpu_count() or 1)}, nthread=1)
            os.replace(tmp, lib)  # concurrent loads of one model: the last rename wins, same bytes
        finally:
            tmp.unlink(missing_ok=True)
    predictor = tl2cgen.Predictor(str(lib), nthread=nthread)
    wide = model.input_type == "float64"  # LightGBM's thresholds are doubles: so are its features

    def run(x: np.ndarray) -> np.ndarray:
        out = predictor.predict(tl2cgen.DMatrix(x.astype(np.float64) if wide else x))
        return np.asarray(out, dtype=np.float32).reshape(len(x), -1)

    return run


def native_engine(path: Path, model: Any, p: FilParams) -> Engine:
    """The model's own library where it is installed (XGBoost JSON/UBJSON, LightGBM), else Treelite's GTIL."""
    n = p.nthread
    if p.model_type in ("xgboost_json", "xgboost_ubj") and importlib.util.find_spec("xgboost") is not None:
        import xgboost as xgb

        booster = xgb.Booster(params={"nthread": n}, model_file=str(path))
        return lambda x: np.asarray(booster.inplace_predict(x), dtype=np.float32).reshape(len(x), -1)
    if p.model_type == "lightgbm" and importlib.util.find_spec("lightgbm") is not None:
        import lightgbm as lgb

        gbm = lgb.Booster(model_file=str(path))
        return lambda x: np.asarray(gbm.predict(x, num_threads=n), dtype=np.float32).reshape(len(x), -1)
    import treelite

    return lambda x: np.asarray(treelite.gtil.predict(model, x, nthread=n), dtype=np.float32).reshape(len(x), -1)


def engine_choice() -> str:
    choice = os.environ.get(ENGINE_ENV, "auto").strip() or "auto"
    if choice not in ("auto", "compiled", "native"):
        raise RuntimeLoadError(f"{ENGINE_ENV} is '{choice}'; it is auto, compiled or native")
    if choice == "auto":
        return "compiled" if compiler_available() else "native"
    return choice


class FilInstance:
    """One loaded forest: rows in, FIL's outputs out (one batch at a time)."""

    def __init__(self, engine: Engine, p: FilParams, names: tuple[str, str], width: int, out_width: int,
                 engine_name: str) -> None:
        self.engine, self.p, self.width, self.out_width = engine, p, width, out_width
        self.input_name, self.output_name = names
        self.engine_name = engine_name

    def run(self, inputs: dict[str, np.ndarray], output_names: list[str]) -> dict[str, np.ndarray]:
        x = inputs[self.input_name]
        if x.dtype != np.float32 or not x.flags.c_contiguous:
            x = np.ascontiguousarray(x, dtype=np.float32)
        try:
            scores = self.engine(x.reshape(len(x), -1))
        except (ValueError, TypeError) as exc:  # e.g. a shape the library refuses
            raise InferError.invalid(f"input '{self.input_name}': {_short(exc)}") from None
        return {self.output_name: self.postprocess(scores)}

    def postprocess(self, scores: np.ndarray) -> np.ndarray:
        p = self.p
        if not p.is_classifier:
            return scores
        if self.width == 1:  # a binary model's P(class 1)
            positive = scores[:, 0]
            if p.predict_proba:
                return scores if self.out_width == 1 else np.stack([1.0 - positive, positive], axis=1)
            return (positive > p.threshold).astype(np.float32).reshape(-1, 1)
        if p.predict_proba:
            return scores
        if self.width == 2:
            return (scores[:, 1] > p.threshold).astype(np.float32).reshape(-1, 1)
        return np.argmax(scores, axis=1).astype(np.float32).reshape(-1, 1)

    def close(self) -> None:
        self.engine = _closed


def _closed(x: np.ndarray) -> np.ndarray:
    raise InferError.unavailable("the model instance is closed")


def _expected_out(p: FilParams, width: int) -> tuple[int, ...]:
    if not p.is_classifier:
        return (width,)
    if not p.predict_proba:
        return (1,)
    return (1, 2) if width == 1 else (width,)


class FilAdapter:
    name = "fil"

    def guard_load(self, model_file: Path, config: mc.ModelConfig, max_bytes: int) -> None:
        """An uploaded tree model (a load request's ``file:``) is refused: the XGBoost, LightGBM and
        Treelite parsers, and the compiler that builds the forest, are not hardened against a
        hostile file. FIL models load from the repository, which is the operator's (docs/security.md)."""
        raise InferError.invalid(f"failed to load '{config.name}': fil models load from the model repository "
                                 "only; uploaded model files are refused for the fil backend")

    def load(self, model_file: Path, config: mc.ModelConfig, placement: InstancePlacement) -> FilInstance:
        if OVERRIDES_DIR in model_file.parts:  # an upload, also with --max-model-load-bytes 0 (no guard_load)
            self.guard_load(model_file, config, 0)
        p = fil_params.read(config)
        names = fil_params.check_config(config)
        features = names[2]
        path = resolve_file(model_file, p.model_type)
        if not path.is_file():
            raise RuntimeLoadError(f"model '{config.name}': model file {path.name} (model_type '{p.model_type}') "
                                   "does not exist")
        try:
            model = load_treelite(path, p)
        except Exception as exc:
            raise RuntimeLoadError(f"model '{config.name}': {path.name} is no '{p.model_type}' model: "
                                   f"{_short(exc)}") from None
        if model.num_feature != features:
            raise RuntimeLoadError(f"model '{config.name}': input '{names[0]}' has dims [ {features} ] but the "
                                   f"model takes {model.num_feature} features")
        choice = engine_choice()
        probe = np.zeros((1, features), dtype=np.float32)
        try:
            engine = compiled_engine(model, p.nthread) if choice == "compiled" else native_engine(path, model, p)
            width = engine(probe).shape[1]
        except Exception as exc:
            if choice != "compiled" or os.environ.get(ENGINE_ENV, "auto") == "compiled":
                raise RuntimeLoadError(f"model '{config.name}': the {choice} engine could not load {path.name}: "
                                       f"{_short(exc)}") from None
            # auto: a forest tl2cgen cannot compile (or no working compiler) runs on the native engine
            log.warning("model '%s': compiling the forest failed (%s); running it on the native engine",
                        config.name, _short(exc))
            choice = "native"
            try:
                engine = native_engine(path, model, p)
                width = engine(probe).shape[1]
            except Exception as exc2:
                raise RuntimeLoadError(f"model '{config.name}': the native engine could not load {path.name}: "
                                       f"{_short(exc2)}") from None
        expected = _expected_out(p, width)
        out = config.output[0]
        if out.dims[0] not in expected:
            what = ("classes" if p.predict_proba else "class index") if p.is_classifier else "targets"
            raise RuntimeLoadError(
                f"model '{config.name}': output '{out.name}' has dims [ {out.dims[0]} ]; this model's {what} "
                f"need dims [ {' or '.join(map(str, expected))} ] (output_class '{str(p.is_classifier).lower()}', "
                f"predict_proba '{str(p.predict_proba).lower()}')")
        return FilInstance(engine, p, (names[0], names[1]), width, int(out.dims[0]), choice)
