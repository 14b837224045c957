"""`meshserve service sequence`: stateful models on the ONNX (and TorchScript) runtimes."""
from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol.errors import InferError
from services.base import main as base_main
from services.base.runtime import InstancePlacement, RuntimeAdapter, RuntimeInstance
from services.onnx.main import gpu_available, require_onnxruntime
from services.sequence.core import SequenceServiceCore


class LazyTorchScriptAdapter:
    """The TorchScript adapter, imported (with torch) only when a pytorch sequence model loads."""

    name = "pytorch"

    def __init__(self) -> None:
        self._inner: RuntimeAdapter | None = None

    def prime(self) -> None:
        """torch's one-time start, before the first pytorch model loads (services/base/memory.py)."""
        with contextlib.suppress(InferError):  # no torch: the load itself says so
            getattr(self._adapter(""), "prime", lambda: None)()

    def _adapter(self, model: str) -> RuntimeAdapter:
        if self._inner is None:
            try:
                from services.torchscript.runtime import TorchScriptAdapter
            except ImportError as exc:
                raise InferError.unavailable(
                    f"model '{model}': the TorchScript runtime is not available ({exc}); install "
                    "the [torch] extra") from None
            self._inner = TorchScriptAdapter()
        return self._inner

    def load(self, model_file: Path, config: mc.ModelConfig, placement: InstancePlacement) -> RuntimeInstance:
        return self._adapter(config.name).load(model_file, config, placement)


def adapters() -> dict[str, RuntimeAdapter]:
    """ONNX Runtime, and TorchScript loaded lazily (torch is heavy and optional)."""
    from services.onnx.runtime import OnnxRuntimeAdapter

    return {"onnxruntime": OnnxRuntimeAdapter(), "pytorch": LazyTorchScriptAdapter()}


def main(args: argparse.Namespace) -> None:
    require_onnxruntime("sequence")
    base_main.main("sequence", adapters(), args, gpu_available=gpu_available(),
                   core_cls=SequenceServiceCore)
