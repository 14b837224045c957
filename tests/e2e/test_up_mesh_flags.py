"""`meshserve up` passes the services' mesh flags on: --eviction-grace, --gpu-memory-budget
(services/base/main.py:add_eviction_arguments, docs/model-mesh.md) and --model-load-thread-count
(docs/model-control.md) reach every service process it starts, as --memory-budget and --pin do; a value a service would refuse is refused by `up`
itself, before anything starts."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from load.bench import mesh_models
from tests.conftest import ROOT
from tests.support.up import meshserve_up


def _services(family: dict[int, str]) -> list[list[str]]:
    """The argv of each service process of `up` (split on spaces: no value here has one)."""
    return [line.split() for line in family.values() if " service " in f" {line} "]


def _values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]


def test_up_passes_the_eviction_grace_and_gpu_budgets_to_every_service(tmp_path: Path) -> None:
    mesh_models.write(tmp_path, 0, 64)
    with meshserve_up("--repository", str(tmp_path), "--http-port", "0", "--grpc-port", "0", "--metrics-port", "-1",
                      "--model-control-mode", "lazy", "--replicas", "2", "--eviction-grace", "7.5",
                      "--gpu-memory-budget", "50%", "--gpu-memory-budget", "0=1Gi",
                      "--model-load-thread-count", "3") as up:
        services = _services(up.family())
        assert len(services) == 2, up.family()
        for argv in services:
            assert _values(argv, "--eviction-grace") == ["7.5"], argv
            assert _values(argv, "--model-load-thread-count") == ["3"], argv
            assert _values(argv, "--gpu-memory-budget") == ["50%", f"0={1 << 30}"], argv
    with meshserve_up("--repository", str(tmp_path), "--http-port", "0", "--grpc-port", "0", "--metrics-port", "-1",
                      "--model-control-mode", "lazy") as up:
        (argv,) = _services(up.family())
        assert _values(argv, "--eviction-grace") == ["2.0"], argv  # the service's default, said out loud
        assert _values(argv, "--gpu-memory-budget") == [], argv  # the service's own default (80% per GPU)
        assert _values(argv, "--model-load-thread-count") == [], argv  # the service's own default (4)


def test_up_refuses_what_a_service_would_refuse(tmp_path: Path) -> None:
    for flags, said in ((["--eviction-grace", "61"], "--eviction-grace must be between 0 and 60"),
                        (["--gpu-memory-budget", "x=1G"], "expected SIZE, NN%, GPU=SIZE or GPU=NN%"),
                        (["--model-load-thread-count", "0"], "must be at least 1")):
        out = subprocess.run([sys.executable, "-m", "meshserve", "up", "--repository", str(tmp_path), *flags],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and said in out.stderr, (flags, out.stderr)
