"""Tree models (the fil service): `python -m load.bench.fil engines|serve` (docs/perf/fil.md).

``engines``: the CPU engines the fil service could run a forest on, per row at batch 1 and at
batch 64 on one thread: tl2cgen-compiled (from the XGBoost and the LightGBM model), XGBoost's
``inplace_predict``, LightGBM's ``predict`` and Treelite's GTIL (the median of ``--repeat`` runs).
Its table is the one in services/fil/runtime.py's docstring.

``serve``: rows/s through the gateway (closed-loop gRPC, ``--batch`` rows per request, ``python -m
load``) at each concurrency, against the fil service's own instance called in process (the
physical limit: the same compiled forest at batch 1 and at the batch a closed loop of that
concurrency can at best form, rows per request x concurrency, at most max_batch_size 256). The model: a binary XGBoost classifier (``--trees`` trees of depth ``--depth``
over ``--features`` features), one instance on one thread, dynamic batching.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from load.bench import procs

ROOT = Path(__file__).resolve().parents[2]


def _data(features: int, rows: int = 4000) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, features)).astype(np.float32)
    return x, (x[:, 0] + x[:, 1] * x[:, 2] - 0.5 * x[:, 3] > 0).astype(np.int32)


def _xgboost(path: Path, args: argparse.Namespace) -> Any:
    import xgboost as xgb

    x, y = _data(args.features)
    bst = xgb.train({"objective": "binary:logistic", "max_depth": args.depth, "nthread": 1},
                    xgb.DMatrix(x, label=y), args.trees)
    bst.set_param({"nthread": 1})
    bst.save_model(path)
    return bst


def _lightgbm(path: Path, args: argparse.Namespace) -> Any:
    import lightgbm as lgb

    x, y = _data(args.features)
    gbm = lgb.train({"objective": "binary", "num_leaves": 2 ** args.depth - 1, "max_depth": args.depth,
                     "verbose": -1, "num_threads": 1}, lgb.Dataset(x, label=y), args.trees)
    gbm.save_model(str(path))
    return gbm


def per_row_us(fn: Callable[[np.ndarray], Any], x: np.ndarray, repeat: int, budget_s: float = 0.4) -> float:
    """The median over ``repeat`` runs of the CPU time (this process, all its threads) per row of
    ``fn(x)``, each run ~``budget_s``: CPU time, not wall time, as the 2-core VM is shared."""
    fn(x)
    t0 = time.process_time()
    fn(x)
    n = max(10, int(budget_s / max(1e-6, time.process_time() - t0)))
    runs = []
    for _ in range(repeat):
        t0 = time.process_time()
        for _ in range(n):
            fn(x)
        runs.append((time.process_time() - t0) / n / len(x))
    return statistics.median(runs) * 1e6


def engines(args: argparse.Namespace) -> None:
    import tl2cgen
    import treelite

    from services.fil.runtime import compiled_engine

    tmp = Path(tempfile.mkdtemp(prefix="fil-engines-"))
    try:
        bst, gbm = _xgboost(tmp / "xgboost.json", args), _lightgbm(tmp / "model.txt", args)
        tl_xgb = treelite.frontend.load_xgboost_model(tmp / "xgboost.json", format_choice="json")
        tl_lgb = treelite.frontend.load_lightgbm_model(tmp / "model.txt")
        candidates: dict[str, Callable[[np.ndarray], Any]] = {
            "tl2cgen (XGBoost model)": compiled_engine(tl_xgb, 1),
            "tl2cgen (LightGBM model)": compiled_engine(tl_lgb, 1),
            "XGBoost inplace_predict": lambda a: bst.inplace_predict(a),
            "LightGBM predict": lambda a: gbm.predict(a, num_threads=1),
            "Treelite GTIL (XGBoost model)": lambda a: treelite.gtil.predict(tl_xgb, a, nthread=1),
            "Treelite GTIL (LightGBM model)": lambda a: treelite.gtil.predict(tl_lgb, a, nthread=1),
        }
        x, _ = _data(args.features, 64)
        print(f"{args.trees} trees, depth {args.depth}, {args.features} features; treelite {treelite.__version__}, "
              f"tl2cgen {tl2cgen.__version__}; median of {args.repeat} runs, one thread\n")
        print("| engine | batch 1, CPU us/row | batch 64, CPU us/row |\n|---|---|---|")
        for name, fn in candidates.items():
            one, many = per_row_us(fn, x[:1].copy(), args.repeat), per_row_us(fn, x, args.repeat)
            print(f"| {name} | {one:.1f} | {many:.2f} |", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


CONFIG = """backend: "fil"
max_batch_size: 256
input [ {{ name: "input__0" data_type: TYPE_FP32 dims: [ {features} ] }} ]
output [ {{ name: "output__0" data_type: TYPE_FP32 dims: [ 1 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
dynamic_batching {{ max_queue_delay_microseconds: {delay} }}
parameters [
  {{ key: "model_type" value: {{ string_value: "xgboost_json" }} }},
  {{ key: "output_class" value: {{ string_value: "true" }} }},
  {{ key: "predict_proba" value: {{ string_value: "true" }} }}
]
"""


def serve(args: argparse.Namespace) -> None:
    from google.protobuf import text_format

    from meshserve._proto import model_config_pb2 as mc
    from services.base.runtime import InstancePlacement
    from services.fil.runtime import FilAdapter

    tmp = Path(tempfile.mkdtemp(prefix="fil-serve-"))
    repo = tmp / "repo"
    (repo / "trees" / "1").mkdir(parents=True)
    text = CONFIG.format(features=args.features, delay=args.delay_us)
    (repo / "trees" / "config.pbtxt").write_text(text)
    _xgboost(repo / "trees" / "1" / "xgboost.json", args)
    env = {"MESHSERVE_CACHE": str(tmp / "cache")}

    # the physical limit: the service's own instance, in process, at the batch sizes a closed loop can form
    config = text_format.Parse(text, mc.ModelConfig())
    config.name = "trees"
    import os
    os.environ.update(env)
    instance = FilAdapter().load(repo / "trees" / "1" / "xgboost.model", config, InstancePlacement(0, "g", "cpu"))
    x, _ = _data(args.features, 256)
    sizes = sorted({min(256, b * c) for b in args.batch for c in [1, *args.concurrency]})
    limit = {b: 1e6 / per_row_us(lambda a: instance.run({"input__0": a}, ["output__0"]), x[:b].copy(), 3)
             for b in sizes}
    print(f"engine: {instance.engine_name}; in process, rows/s: "
          + ", ".join(f"batch {b}: {r:,.0f}" for b, r in limit.items()), flush=True)

    service = procs.Server(["service", "fil", "--repository", str(repo), "--grpc-port", "0", "--http-port", "0",
                            "--log-level", "WARNING"], tmp / "fil.log", env=env)
    gateway = procs.gateway([service.grpc], tmp / "gateway.log")
    rows = []
    try:
        for batch in args.batch:
            for c in args.concurrency:
                out = tmp / f"b{batch}c{c}.json"
                subprocess.run([sys.executable, "-m", "load", "--http", gateway.http, "--grpc", gateway.grpc,
                                "-m", "trees", "--protocol", "grpc", "-c", str(c), "--batch", str(batch),
                                "-d", str(args.seconds), "--warmup", "1", "--quiet", "--json", str(out)],
                               cwd=ROOT, capture_output=True, check=True)
                result = json.loads(out.read_text())
                per_exec = (result.get("server_stats") or {}).get("trees", {}).get("rows_per_execution")
                lat = result.get("latency_ms", {})
                rows.append((batch, c, result["rows_per_s"], lat.get("p50"), lat.get("p99"), per_exec,
                             result["failed"]))
                print(f"batch {batch} c{c}: {result['rows_per_s']:.0f} rows/s", flush=True)
    finally:
        gateway.stop()
        service.stop()
        instance.close()
        shutil.rmtree(tmp, ignore_errors=True)
    print("\n| rows/request | concurrency | gateway rows/s | p50 ms | p99 ms | rows/execution | in process, "
          "batch 1 | in process, batch c x rows | errors |\n|---|---|---|---|---|---|---|---|---|")
    for batch, c, rps, p50, p99, per_exec, failed in rows:
        best = limit.get(min(256, batch * c), limit[max(limit)])
        print(f"| {batch} | {c} | {rps:,.0f} | {p50:.2f} | {p99:.2f} | {per_exec} | {limit[1]:,.0f} | "
              f"{best:,.0f} | {failed} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m load.bench.fil", description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("engines", "serve"))
    ap.add_argument("--trees", type=int, default=100)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--features", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=5, help="engines: runs per cell (the median is shown)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--seconds", type=float, default=10.0, help="serve: measured seconds per cell")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64], help="serve: rows per request")
    ap.add_argument("--delay-us", type=int, default=500, help="serve: max_queue_delay_microseconds")
    args = ap.parse_args(argv)
    (engines if args.what == "engines" else serve)(args)


if __name__ == "__main__":
    procs.clean_exit()
    main()
