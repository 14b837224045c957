"""load/bench/tls_transport.py: one run of its server and its client, without callgrind."""
from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("label", ["plain", "tls"])
def test_a_run_answers_every_request(label: str) -> None:
    """The server answers all n requests of the client (each sent as head and body, in two
    writes), then exits; a client that gets no answer or a closed connection fails the run."""
    done = subprocess.run([sys.executable, "-m", "load.bench.tls_transport", "--serve", label, "20"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
