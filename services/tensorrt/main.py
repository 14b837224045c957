"""`meshserve service tensorrt`: the TensorRT service (needs the [tensorrt] extra and a GPU)."""
from __future__ import annotations

import argparse

from services.base import main as base_main

MISSING = ("meshserve service tensorrt: the TensorRT Python package is not installed ({error}); install the "
           "[tensorrt] extra: pip install 'meshserve[tensorrt]' (tensorrt>=10 and cuda-python, from NVIDIA's "
           "package index, on a machine with an NVIDIA GPU)")


def require_tensorrt(command: str = "meshserve service tensorrt") -> None:
    """Exit with a clear message when tensorrt or cuda-python cannot be imported."""
    try:
        import tensorrt  # noqa: F401
    except ImportError as exc:
        raise SystemExit(MISSING.replace("meshserve service tensorrt", command).format(error=exc)) from None
    try:
        from services.tensorrt import trt_engine  # noqa: F401  (cuda-python)
    except ImportError as exc:
        raise SystemExit(MISSING.replace("meshserve service tensorrt", command).format(error=exc)) from None


def main(args: argparse.Namespace) -> None:
    require_tensorrt()
    from services.tensorrt.runtime import TensorRTAdapter
    from services.tensorrt.trt_engine import gpu_count

    gpus = gpu_count()
    if gpus == 0:
        raise SystemExit("meshserve service tensorrt: no CUDA device is visible; TensorRT plans need an NVIDIA GPU")
    base_main.main("tensorrt", {"tensorrt": TensorRTAdapter()}, args, gpu_available=True)
