"""`meshserve service python`: Triton python-backend models (model.py), a worker process per instance."""
from __future__ import annotations

import argparse

from meshserve.repository.config import BACKEND_COMPLETERS
from services.base import main as base_main
from services.python.autocomplete import complete
from services.python.core import PythonOptions, PythonServiceCore


def main(args: argparse.Namespace) -> None:
    BACKEND_COMPLETERS["python"] = complete  # auto_complete_config, in this process only
    PythonServiceCore.options = PythonOptions(bls_target=args.bls_target or "",
                                              execute_timeout_s=args.python_execute_timeout,
                                              log_level=args.log_level)
    base_main.main("python", {}, args, core_cls=PythonServiceCore)
