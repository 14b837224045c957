"""`meshserve service torchscript`: the PyTorch (TorchScript / torch.export) service."""
from __future__ import annotations

import argparse

from services.base import main as base_main


def main(args: argparse.Namespace) -> None:
    try:
        import torch
    except ImportError:
        raise SystemExit("meshserve service torchscript: PyTorch is not installed; install the [torch] "
                         "extra (pip install 'meshserve[torch]', i.e. torch==2.13.0)") from None
    from services.torchscript.runtime import TorchScriptAdapter

    base_main.main("torchscript", {"pytorch": TorchScriptAdapter()}, args,
                   gpu_available=torch.cuda.is_available())
