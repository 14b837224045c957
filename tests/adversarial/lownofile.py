"""Run meshserve with RLIMIT_NOFILE lowered, so that the descriptor tests are cheap:
``python -m tests.adversarial.lownofile SOFT HARD <meshserve arguments>``."""
from __future__ import annotations

import resource
import runpy
import sys

if __name__ == "__main__":
    soft, hard = int(sys.argv[1]), int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    sys.argv = ["meshserve", *sys.argv[3:]]
    runpy.run_module("meshserve", run_name="__main__", alter_sys=True)
