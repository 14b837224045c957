"""Shared fixtures: real meshserve processes on free loopback ports."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from load.bench.procs import HOP_KEY_ENV, Endpoints, follow_ready, hop_key_file, stop_group, wait_ready

ROOT = Path(__file__).resolve().parent.parent


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Say once, at the start, where the suite writes outside the tree (and what it makes inside)."""
    factory = getattr(config, "_tmp_path_factory", None)  # pytest's own; tmp_path dirs live below it
    base = factory.getbasetemp() if factory is not None else "pytest's basetemp"
    kserve = os.environ.get("MESHSERVE_KSERVE_PYTHON")
    return [
        "meshserve: writes outside the tree:",
        f"  {base}: tmp_path dirs (model repositories, configs, process logs, reports; pytest keeps the last 3)",
        "  /dev/shm: system shared-memory regions of the shared-memory and perf_analyzer tests (removed after each)",
        f"  {Path(kserve).parent.parent if kserve else '(none)'}: the KServe SDK venv, read only "
        "(MESHSERVE_KSERVE_PYTHON; scripts/test.sh builds it under ${MESHSERVE_CACHE:-~/.cache/meshserve})",
        "meshserve: writes inside the tree (git-ignored): examples/model_repository/*/<version>/model.onnx "
        "(the example models `meshserve up` builds on first use)",
    ]


# Under pytest-xdist (scripts/test.sh: -n CORES+1 --dist loadfile --no-loadscope-reorder) a worker
# takes a whole file at a time, except tests/adversarial/, which is one unit: one worker runs it
# from start to end, one attack at a time on one mesh (its good client's p99 is the verdict),
# while the other workers go through the rest. The chain is handed out first (the longest unit);
# the other files keep the plain run's order (tests/load/ after tests/integration/). A file that
# shares a worker's session `stack` with another may find its traffic still draining: a test that
# compares two reads of the service waits until they are still
# (test_metrics.py's test_metrics_agree_with_the_statistics_extension).
ADVERSARIAL = "tests/adversarial/"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: it collects; the controller hands out the units
        items.sort(key=lambda item: not item.nodeid.startswith(ADVERSARIAL))  # stable: the order kept within


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """--dist loadfile, with tests/adversarial/ as one unit (see ADVERSARIAL)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FilesAndTheAdversarialChain(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return ADVERSARIAL if nodeid.startswith(ADVERSARIAL) else super()._split_scope(nodeid)

    return FilesAndTheAdversarialChain(config, log)


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, the controller generates the example models before any worker starts:
    `meshserve up` (tests/e2e/test_up.py) writes them on first use, not atomically, and a worker
    copying the example repository (tests/adversarial/test_uploads.py) must not see a half-written one."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        from meshserve import examples

        examples.ensure(ROOT / "examples" / "model_repository", progress=lambda _: None)


@dataclass
class Proc(Endpoints):
    """A meshserve process started by a test; ports parsed from its ready line."""

    argv: list[str]
    proc: subprocess.Popen[str]
    ports: dict[str, int] = field(default_factory=dict)
    output: list[str] = field(default_factory=list)

    def log(self) -> str:
        return "".join(self.output[-200:])

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        """Stop the process (``sig``, SIGKILL after ``timeout`` s), then kill and wait out what is
        left of its process group after a short grace (``start`` gives each process its own
        group): no worker outlives the test."""
        code, left = stop_group(self.proc, sig, timeout, leader=True)  # (``start``: a session of its own)
        if left and sig != signal.SIGKILL:  # (a SIGKILLed process leaves its workers: killed here)
            warnings.warn(f"{len(left)} process(es) of {' '.join(self.argv[2:5])} outlived its stop, "
                          f"killed: {left}", stacklevel=2)
        return code


def start(args: list[str], timeout: float = 90, env: dict[str, str] | None = None,
          module: str = "meshserve") -> Proc:
    """Start `python -m meshserve ARGS` (or another server module) and wait for its ready line.
    It gets the suite's hop key (load/bench/procs.py:hop_key_file: one per test process, as `meshserve
    up` gives its gateway and services a throwaway one, so that a gateway and a service started
    by hand authenticate their hop and keep its extras: merged counts, coalescer waits, deadlines,
    traces across the hop; docs/security.md, "The authenticated hop") unless ``env`` names
    another (or "": none, ``env={HOP_KEY_ENV: ""}``)."""
    return _ready(*_launch(args, env, module), timeout)


def start_all(*argss: list[str], timeout: float = 90) -> list[Proc]:
    """``start`` each of ``argss`` side by side: all are launched, then waited for, so that their
    start-ups overlap (one that imports torch, one that spawns python workers, ...). If one does
    not become ready, all are stopped."""
    launched = [_launch(args, None, "meshserve") for args in argss]
    try:
        return [_ready(p, ready, timeout) for p, ready in launched]
    except BaseException:
        for p, _ in launched:
            p.stop(signal.SIGKILL)
        raise


def _launch(args: list[str], env: dict[str, str] | None, module: str) -> tuple[Proc, threading.Event]:
    argv = [sys.executable, "-m", module, *args]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            cwd=ROOT, env={**os.environ, HOP_KEY_ENV: str(hop_key_file()), **(env or {})},
                            start_new_session=True)
    p = Proc(argv, proc)
    return p, follow_ready(proc, p.ports, p.output.append)


def _ready(p: Proc, ready: threading.Event, timeout: float) -> Proc:
    if not ready.wait(timeout) or not p.ports:
        p.stop(signal.SIGKILL)
        raise RuntimeError(f"{' '.join(p.argv[3:])} did not become ready in {timeout}s:\n{p.log()}")
    return p


def take_down(service: Proc, gateway: Proc, timeout: float = 20) -> None:
    """``service`` goes down behind ``gateway`` as a stopped one does: SIGTERM (its health watch
    says NOT_SERVING, it stops listening), and once the gateway's log says the replica left its
    pool, SIGKILL, so the test goes on with the process gone. Not ``service.stop()``: the drain
    would wait out the grace period (10 s) for the gateway's hop streams, which stay open."""
    from tests.support import eventually

    left = f"replica {service.grpc} left the pool"
    service.proc.send_signal(signal.SIGTERM)
    eventually(lambda: any(left in line for line in list(gateway.output)), timeout,
               what=f"the gateway's word that {service.grpc} left the pool")
    service.stop(signal.SIGKILL)


@pytest.fixture(scope="session")
def model_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.models.generate import build

    return build(tmp_path_factory.mktemp("models"))


@dataclass
class Stack:
    service: Proc
    gateway: Proc


@pytest.fixture(scope="session")
def stack(model_repo: Path) -> Iterator[Stack]:
    """One ONNX service (gRPC + HTTP) and a gateway in front of it."""
    service = start(["service", "onnx", "--repository", str(model_repo), "--grpc-port", "0", "--http-port", "0",
                     "--model-control-mode", "explicit", "--load-model", "*"])
    try:
        gateway = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", service.grpc])
    except Exception:
        service.stop()
        raise
    _wait_http_ready(gateway.http)
    yield Stack(service, gateway)
    gateway.stop()
    service.stop()


def _wait_http_ready(hostport: str, timeout: float = 30) -> None:
    wait_ready(hostport, timeout)  # the load bench's readiness poll (GET /v2/health/ready)


@contextmanager
def service_and_gateway(kind: str, service_args: Sequence[str], gateway_args: Sequence[str] = (),
                        timeout: float = 90, module: str | None = None,
                        env: dict[str, str] | None = None) -> Iterator[tuple[Proc, Proc]]:
    """``meshserve service KIND SERVICE_ARGS`` (gRPC and HTTP on free ports) and a gateway
    (GATEWAY_ARGS) in front of it, ready; both stopped on exit. ``module``: a stand-in service
    run as ``python -m MODULE SERVICE_ARGS`` instead (``kind`` unused). ``env``: both
    processes' environment on top of this one's (``start``)."""
    ports = ["--grpc-port", "0", "--http-port", "0"]
    service = start([*ports, *service_args], timeout=timeout, module=module, env=env) if module is not None \
        else start(["service", kind, *ports, *service_args], timeout=timeout, env=env)
    try:
        gateway = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", service.grpc,
                         *gateway_args], env=env)
    except Exception:
        service.stop()
        raise
    try:
        _wait_http_ready(gateway.http)
        yield service, gateway
    finally:
        gateway.stop()
        service.stop()


@dataclass
class Served:
    """A service on a model repository a test wrote, and the gateway in front of it."""
    service: Proc
    gateway: Proc
    repo: Path


@contextmanager
def served(kind: str, repo: Path, service_args: Sequence[str] = (), gateway_args: Sequence[str] = (),
           timeout: float = 90) -> Iterator[Served]:
    """``service_and_gateway`` on ``repo`` (``--repository`` is added), as one record."""
    with service_and_gateway(kind, ["--repository", str(repo), *service_args], gateway_args, timeout) as procs:
        yield Served(*procs, repo)

