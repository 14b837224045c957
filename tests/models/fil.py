"""FIL (tree) test models, built at test time on synthetic data the way Triton's fil_backend
examples lay them out: XGBoost (JSON and UBJSON), LightGBM (text) and a scikit-learn random
forest converted with Treelite (checkpoint), each with a ``config.pbtxt`` of FIL's keys and the
library's own predictions for ``ROWS`` to compare the served answers with.

    python -m tests.models.fil OUT_DIR
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FEATURES = 8
ROWS = 64


@dataclass
class FilModel:
    name: str
    expected: np.ndarray  # the library's answer for rows(), shaped as the output
    is_class_index: bool  # a class index: rows whose score sits at the threshold may differ by rounding
    scores: np.ndarray | None = None  # the positive class's score per row (class-index binary models)
    threshold: float = 0.5


def rows(seed: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((ROWS, FEATURES)).astype(np.float32)


def config(model_type: str, classifier: bool, out_dims: int, predict_proba: bool = False,
           extra: str = "") -> str:
    proba = f'\n  {{ key: "predict_proba" value: {{ string_value: "{str(predict_proba).lower()}" }} }},' \
        if predict_proba else ""
    return f"""backend: "fil"
max_batch_size: 256
input [ {{ name: "input__0" data_type: TYPE_FP32 dims: [ {FEATURES} ] }} ]
output [ {{ name: "output__0" data_type: TYPE_FP32 dims: [ {out_dims} ] }} ]
instance_group [ {{ kind: KIND_CPU }} ]
dynamic_batching {{ max_queue_delay_microseconds: 500 }}
parameters [
  {{ key: "model_type" value: {{ string_value: "{model_type}" }} }},{proba}{extra}
  {{ key: "output_class" value: {{ string_value: "{str(classifier).lower()}" }} }}
]
"""


def _write(root: Path, name: str, filename: str, text: str) -> Path:
    (root / name / "1").mkdir(parents=True, exist_ok=True)
    (root / name / "config.pbtxt").write_text(text)
    return root / name / "1" / filename


def _data(classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((600, FEATURES)).astype(np.float32)
    score = x[:, 0] + 0.5 * x[:, 1] * x[:, 2] - x[:, 3]
    if classes == 0:
        return x, score + 0.1 * rng.standard_normal(len(x))
    edges = np.quantile(score, np.linspace(0, 1, classes + 1)[1:-1])
    return x, np.digitize(score, edges)


def lightgbm_regressor(root: Path, name: str) -> np.ndarray:
    """A LightGBM regressor under ``root/name``; returns LightGBM's own answer for rows()."""
    import lightgbm as lgb

    x, y = _data(0, 3)
    gbm = lgb.train({"objective": "regression", "num_leaves": 15, "verbose": -1, "num_threads": 1},
                    lgb.Dataset(x, label=y), 25)
    gbm.save_model(str(_write(root, name, "model.txt", config("lightgbm", False, 1))))
    return np.asarray(gbm.predict(rows()), dtype=np.float32).reshape(-1, 1)


def build(root: Path) -> list[FilModel]:
    """Write the models under ``root`` and return what each must answer for ``rows()``."""
    import lightgbm as lgb
    import treelite
    import xgboost as xgb
    from sklearn.ensemble import RandomForestClassifier

    x_test = rows()
    models: list[FilModel] = []

    # XGBoost binary classifier, JSON, the class index (threshold 0.5 on P(1))
    x, y = _data(2, 1)
    bst = xgb.train({"objective": "binary:logistic", "max_depth": 4, "nthread": 1}, xgb.DMatrix(x, label=y), 20)
    bst.save_model(_write(root, "xgb_class", "xgboost.json", config("xgboost_json", True, 1)))
    p = bst.inplace_predict(x_test)
    models.append(FilModel("xgb_class", (p > 0.5).astype(np.float32).reshape(-1, 1), True, p))

    # XGBoost 3-class, UBJSON, predict_proba: the class scores
    x, y = _data(3, 2)
    bst = xgb.train({"objective": "multi:softprob", "num_class": 3, "max_depth": 4, "nthread": 1},
                    xgb.DMatrix(x, label=y), 15)
    bst.save_model(_write(root, "xgb_proba", "xgboost.ubj", config("xgboost_ubj", True, 3, predict_proba=True)))
    models.append(FilModel("xgb_proba", bst.inplace_predict(x_test).astype(np.float32), False))

    models.append(FilModel("lgb_regression", lightgbm_regressor(root, "lgb_regression"), False))

    # LightGBM binary with predict_proba and dims [ 1 ]: P(1) alone; threshold has no effect on scores
    x, y = _data(2, 4)
    gbm = lgb.train({"objective": "binary", "num_leaves": 15, "verbose": -1, "num_threads": 1},
                    lgb.Dataset(x, label=y), 25)
    gbm.save_model(str(_write(root, "lgb_proba", "model.txt", config("lightgbm", True, 1, predict_proba=True))))
    models.append(FilModel("lgb_proba", gbm.predict(x_test).astype(np.float32).reshape(-1, 1), False))

    # scikit-learn random forest through a Treelite checkpoint: the class index (threshold 0.3) and
    # the class scores ([P(0), P(1)])
    x, y = _data(2, 5)
    rf = RandomForestClassifier(n_estimators=10, max_depth=5, random_state=0).fit(x, y)
    checkpoint = treelite.sklearn.import_model(rf)
    threshold = '\n  { key: "threshold" value: { string_value: "0.3" } },'
    checkpoint.serialize(str(_write(root, "rf_class", "checkpoint.tl",
                                    config("treelite_checkpoint", True, 1, extra=threshold))))
    checkpoint.serialize(str(_write(root, "rf_proba", "checkpoint.tl",
                                    config("treelite_checkpoint", True, 2, predict_proba=True))))
    proba = rf.predict_proba(x_test).astype(np.float32)
    models.append(FilModel("rf_class", (proba[:, 1] > 0.3).astype(np.float32).reshape(-1, 1), True, proba[:, 1], 0.3))
    models.append(FilModel("rf_proba", proba, False))
    return models


def check(model: FilModel, got: np.ndarray) -> None:
    """``got`` is the library's answer: scores within float32 rounding of the library's (a
    compiled forest compares float32 features), class indices equal except for rows whose score
    is within 1e-4 of the threshold."""
    assert got.shape == model.expected.shape, (model.name, got.shape, model.expected.shape)
    if not model.is_class_index:
        np.testing.assert_allclose(got, model.expected, rtol=1e-4, atol=1e-5, err_msg=model.name)
        return
    assert model.scores is not None
    clear = np.abs(model.scores - model.threshold) > 1e-4
    np.testing.assert_array_equal(got[clear], model.expected[clear], err_msg=model.name)
    assert clear.sum() > len(clear) // 2 and set(np.unique(model.expected[clear])) == {0.0, 1.0}, model.name


if __name__ == "__main__":
    out = Path(sys.argv[1])
    for m in build(out):
        print(m.name)
