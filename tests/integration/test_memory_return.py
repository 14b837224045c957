"""Memory that comes back (issue 32, item 2): load / infer / unload cycles of a ~51 MB model grow
a service's resident memory by less than 20 MiB per 100 cycles, for onnx, torchscript and python
models (docs/perf/memory-return.md has the full 100-cycle figures).

CI-sized: ``CYCLES`` cycles (MESHSERVE_MEMORY_CYCLES overrides it; 100 gives the page's figures)
after ``WARMUP`` cycles that let the allocators and imports settle. The bound is the issue's 20 MiB
per 100 cycles scaled to the cycles run, with a floor of 8 MiB for the resident set's own noise
(a scrape, a thread's stack, the allocator's top pad): growth that stayed under it at 20 cycles
while growing steadily would still pass 20 MiB by 100 only if it grew > 0.4 MiB per cycle, which
the per-cycle slope bound below also refuses.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from services.base import memory
from tests.conftest import Proc, start
from tests.support import sized_models

N = 3584  # 3584 x 3584 FP32 weights: 51.4 MB
WARMUP = 3
CYCLES = int(os.environ.get("MESHSERVE_MEMORY_CYCLES", "20"))
MiB = 1 << 20
BOUND_PER_100 = 20 * MiB
NOISE_FLOOR = 8 * MiB

KINDS = {  # kind -> (model writer, input name, output name)
    "onnx": (sized_models.onnx_matmul, "x", "y"),
    "torchscript": (sized_models.torch_linear, "INPUT__0", "OUTPUT__0"),
    "python": (sized_models.python_weights, "x", "y"),
}


def _tree_rss(pid: int) -> int:
    """The service's resident set plus its child processes' (a python model's workers)."""
    total = memory.rss_bytes(pid)
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        for child in task.read_text().split():
            total += _tree_rss(int(child))
    return total


@pytest.mark.parametrize("kind", list(KINDS))
def test_load_unload_cycles_return_memory(kind: str, tmp_path: Path) -> None:
    if kind == "torchscript":
        pytest.importorskip("torch")
    write, x_name, y_name = KINDS[kind]
    write(tmp_path / "repo", "big", N, 2.0)
    svc: Proc = start(["service", kind, "--repository", str(tmp_path / "repo"), "--grpc-port", "0",
                       "--http-port", "0", "--model-control-mode", "explicit"], timeout=120)
    try:
        pid = svc.proc.pid
        x = httpclient.InferInput(x_name, [1, N], "FP32")
        x.set_data_from_numpy(np.ones((1, N), np.float32))
        samples: list[int] = []
        with httpclient.InferenceServerClient(svc.http, network_timeout=120) as c:
            for i in range(WARMUP + CYCLES):
                c.load_model("big")
                y = c.infer("big", [x]).as_numpy(y_name)
                assert y is not None and abs(float(y[0, 0]) - 2.0) < 1e-3
                c.unload_model("big")
                assert not c.is_model_ready("big")
                if i >= WARMUP - 1:
                    samples.append(_tree_rss(pid))
        growth = samples[-1] - samples[0]
        half = len(samples) // 2  # slope: the second half's mean against the first half's, per cycle
        slope = (np.mean(samples[half:]) - np.mean(samples[:half])) / max(1, len(samples) - half)
        print(f"{kind}: {CYCLES} cycles after {WARMUP}: RSS {samples[0] / MiB:.1f} -> {samples[-1] / MiB:.1f} MiB "
              f"(growth {growth / MiB:+.1f} MiB, peak {max(samples) / MiB:.1f} MiB, slope {slope / MiB:+.3f} MiB/cycle)")
        assert growth < max(NOISE_FLOOR, BOUND_PER_100 * CYCLES / 100), f"{kind}: RSS grew {growth / MiB:.1f} MiB"
        assert slope * 100 < BOUND_PER_100, f"{kind}: RSS grows {slope / MiB:.3f} MiB per cycle"
    finally:
        svc.stop()
