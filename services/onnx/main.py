"""`meshserve service onnx`: the ONNX Runtime service."""
from __future__ import annotations

import argparse

from services.base import main as base_main
from services.onnx.runtime import OnnxRuntimeAdapter


def gpu_available() -> bool:
    import onnxruntime as ort
    return "CUDAExecutionProvider" in ort.get_available_providers()


def main(args: argparse.Namespace) -> None:
    base_main.main("onnx", {"onnxruntime": OnnxRuntimeAdapter()}, args, gpu_available=gpu_available())
