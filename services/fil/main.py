"""`meshserve service fil`: tree models, as Triton's FIL backend serves them (docs/fil.md)."""
from __future__ import annotations

import argparse
import importlib.util

from services.base import main as base_main


def main(args: argparse.Namespace) -> None:
    if importlib.util.find_spec("treelite") is None:
        raise SystemExit("meshserve service fil: Treelite is not installed; install the [fil] extra "
                         "(pip install 'meshserve[fil]': treelite, tl2cgen, XGBoost and LightGBM, CPU builds)")
    from services.fil.runtime import FilAdapter

    base_main.main("fil", {"fil": FilAdapter()}, args)
