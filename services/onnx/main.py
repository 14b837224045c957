"""`meshserve service onnx`: the ONNX Runtime service."""
from __future__ import annotations

import argparse
import importlib.util

from services.base import main as base_main


def require_onnxruntime(kind: str) -> None:
    """Exit saying what to install when the ONNX Runtime is missing (it is an extra: [cpu] or [gpu])."""
    if importlib.util.find_spec("onnxruntime") is None:
        raise SystemExit(f"meshserve service {kind}: ONNX Runtime is not installed; install the [cpu] extra "
                         "(pip install 'meshserve[cpu]'), or [gpu] for its CUDA build")


def gpu_available() -> bool:
    import onnxruntime as ort
    return "CUDAExecutionProvider" in ort.get_available_providers()


def main(args: argparse.Namespace) -> None:
    require_onnxruntime("onnx")
    from services.onnx.runtime import OnnxRuntimeAdapter

    base_main.main("onnx", {"onnxruntime": OnnxRuntimeAdapter()}, args, gpu_available=gpu_available())
