"""An mlp-shaped model whose graph costs onnxruntime next to nothing: the bench models' ``mlp``
config (512 FP32 in, 512 out, max_batch_size 64, dynamic batching) on one ``Mul``, so that the
service's own work per row (front door, batching, hand-off, encoding, the answer) can be counted
under callgrind at c32, where the real mlp's matrix products under valgrind make the load
generator's requests miss their deadlines.

    python -m load.bench.light_mlp DIR      # writes DIR/mlp/{config.pbtxt,1/model.onnx}
    MESHSERVE_INLINE_RUN_US=0 python -m load.bench.per_request callgrind --target service --via-gateway \\
        -m mlp --protocol grpc -c 32 -n 2000 --repository DIR

(``MESHSERVE_INLINE_RUN_US=0``: the batches go to the instance's worker thread, as the real mlp's
do; the light graph would otherwise be measured quick enough to run on the event loop.)
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from load.bench.hop_batches import bench_models


def write(out: Path, bench: str = "/tmp/bench-models") -> Path:
    """The repository at ``out`` (made if missing), with the bench models' mlp config."""
    model = out / "mlp"
    if (model / "1" / "model.onnx").is_file():
        return out
    from onnx import TensorProto, helper, save

    (model / "1").mkdir(parents=True, exist_ok=True)
    shutil.copy(bench_models(bench) / "onnx_repo" / "mlp" / "config.pbtxt", model / "config.pbtxt")
    x = helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, [None, 512])
    y = helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, [None, 512])
    half = helper.make_tensor("half", TensorProto.FLOAT, [1], [0.5])
    graph = helper.make_graph([helper.make_node("Mul", ["INPUT0", "half"], ["OUTPUT0"])], "light_mlp", [x], [y],
                              [half])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    save(m, str(model / "1" / "model.onnx"))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m load.bench.light_mlp", description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--bench-models", default="/tmp/bench-models", help="gen_models.py output (made if missing)")
    a = ap.parse_args(argv)
    print(write(a.out, a.bench_models))


if __name__ == "__main__":
    from load.bench.procs import clean_exit

    clean_exit()
    main()
