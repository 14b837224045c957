"""deploy/compose.yaml without Docker: its meshserve processes, started on loopback.

Every meshserve container of the default profile becomes a process with the container's
command and environment (read from the compose file), as many as `deploy.replicas` says.
Only what cannot hold on one host is rewritten: `--host 0.0.0.0` becomes 127.0.0.1, each
container port gets a free host port, compose DNS names (`onnx:8101`,
`otel-collector:4317`, ...) become 127.0.0.1 and the mapped port, and bind-mount targets
become host paths (/models: a tiny generated repository; its python model calls its onnx
model by BLS through `--bls-target gateway:8001`, the first gateway). Envoy is left out (see
test_envoy_e2e.py); an OTLP sink stands in for the collector; names of containers that do
not run here (tensorrt, redis) map to closed ports, as an unresolvable name would.

So the compose file cannot drift from what the code accepts: an unknown flag, a wrong
port, a broken health check or a kind that does not serve its models fails here.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from meshserve.repository import layout
from tests.deploy.support import (
    READY_TIMEOUT_S,
    ROOT,
    SERVICE_KINDS,
    Proc,
    active_services,
    as_env,
    as_list,
    build_repository,
    flag,
    free_port,
    http_status,
    infer_kind,
    is_job,
    is_meshserve,
    load_compose,
    missing,
    otlp_sink,
    spawn,
    stop_all,
)
from tests.support import eventually

PORT_FLAGS = ("--http-port", "--grpc-port", "--metrics-port")
# Kinds compose runs whose services land with issue #3. strict: these turn into failures the
# moment the kinds exist, so the marks cannot outlive the gap they describe.
PENDING_KINDS: set[str] = set()


def kinds_param(names: tuple[str, ...]) -> list:
    return [pytest.param(k, marks=pytest.mark.xfail(strict=True, reason=f"no {k} service yet (issue #3)"))
            if k in PENDING_KINDS else k for k in names]
_ADDR = re.compile(r"\b([a-z][a-z0-9-]*):(\d+)\b")


@dataclass
class Container:
    """One replica of a compose service, as a local process."""

    service: str
    replica: int
    argv: list[str]
    env: dict[str, str]
    ports: dict[int, int]  # container port -> host port
    healthcheck: list[str]
    proc: Proc | None = None
    error: str | None = None

    @property
    def name(self) -> str:
        return f"{self.service}-{self.replica + 1}"

    def host_port(self, container_port: int | str | None) -> int:
        return self.ports[int(container_port or 0)]


@dataclass
class Topology:
    compose: dict[str, Any]
    containers: list[Container]
    repo: Path
    otlp: Any  # the OTLP sink's handler: what the processes exported

    def of(self, service: str) -> list[Container]:
        return [c for c in self.containers if c.service == service]


def _command(svc: dict[str, Any]) -> list[str]:
    entry = as_list(svc.get("entrypoint"))
    assert not entry, "meshserve containers use the image's entrypoint (meshserve)"
    return as_list(svc.get("command"))


def _rewrite(value: str, addresses: dict[tuple[str, int], int], mounts: dict[str, Path]) -> str:
    def addr(m: re.Match[str]) -> str:
        key = (m.group(1), int(m.group(2)))
        return f"127.0.0.1:{addresses[key]}" if key in addresses else m.group(0)

    value = _ADDR.sub(addr, value)
    for target, source in mounts.items():
        if value == target or value.startswith(target + "/"):
            value = str(source) + value[len(target):]
    return value


def plan(compose: dict[str, Any], repo: Path, otlp_port: int) -> list[Container]:
    """The default profile's meshserve containers as local processes (argv, env, ports)."""
    services = compose["services"]
    active = active_services(compose, set())
    mesh = {n: s for n, s in active.items() if is_meshserve(s) and not is_job(s)}
    containers: list[Container] = []
    for name, svc in mesh.items():
        cmd = _command(svc)
        container_ports = [int(v) for f in PORT_FLAGS if (v := flag(cmd, f)) is not None]
        for replica in range(int((svc.get("deploy") or {}).get("replicas", 1))):
            ports = {p: free_port() for p in container_ports}
            containers.append(Container(name, replica, cmd, as_env(svc.get("environment")), ports,
                                        as_list((svc.get("healthcheck") or {}).get("test"))))

    # DNS name:port -> host port. A started service answers on its first replica's ports;
    # any other name compose knows (the collector, redis, gpu-profile services) is "down".
    known = set(services)
    for svc in services.values():
        known.update(((svc.get("networks") or {}).get("default") or {}).get("aliases") or [])
    addresses: dict[tuple[str, int], int] = {}
    dead = free_port()  # nothing listens there
    for text in (t for c in containers for t in (*c.argv, *c.env.values())):
        for m in _ADDR.finditer(text):
            if m.group(1) in known:
                addresses[(m.group(1), int(m.group(2)))] = dead
    for c in containers:
        if c.replica == 0:
            for cport, hport in c.ports.items():
                addresses[(c.service, cport)] = hport
    addresses[("otel-collector", 4317)] = otlp_port

    for c in containers:
        svc = services[c.service]
        mounts: dict[str, Path] = {}
        for v in svc.get("volumes", []):
            target = v["target"] if isinstance(v, dict) else str(v).split(":")[1]
            source = v.get("source") if isinstance(v, dict) else str(v).split(":")[0]
            mounts[target] = repo if target == "/models" else (ROOT / "deploy" / source).resolve()
        argv = []
        for i, a in enumerate(c.argv):
            prev = c.argv[i - 1] if i else ""
            if prev == "--host":
                a = "127.0.0.1"
            elif prev in PORT_FLAGS:
                a = str(c.host_port(a))
            else:
                a = _rewrite(a, addresses, mounts)
            argv.append(a)
        c.argv = argv
        c.env = {k: _rewrite(v, addresses, mounts) for k, v in c.env.items()}
    return containers


def _map_local(c: Container, text: str) -> str:
    """127.0.0.1:<container port> -> 127.0.0.1:<host port> in a health check argument."""
    return re.sub(r"127\.0\.0\.1:(\d+)", lambda m: f"127.0.0.1:{c.host_port(m.group(1))}", text)


def _ready_url(c: Container) -> str:
    """The URL the compose health check asks, with the container port mapped."""
    m = re.search(r"http://127\.0\.0\.1:(\d+)(/[^'\" ]*)", " ".join(c.healthcheck))
    assert m, f"{c.service}: health check has no local URL: {c.healthcheck}"
    return f"http://127.0.0.1:{c.host_port(m.group(1))}{m.group(2)}"


def _start(containers: list[Container], log_dir: Path, timeout: float = READY_TIMEOUT_S) -> None:
    """Start the containers' processes and wait for all of them at once; a process that
    exits or is not ready in time is recorded in `error` (its tests fail, the rest go on)."""
    for c in containers:
        c.proc = spawn(c.name, [sys.executable, "-m", "meshserve", *c.argv], log_dir,
                       env={**os.environ, **c.env})
    pending = {c.name: c for c in containers}

    def all_settled() -> bool:  # ready, or recorded as exited
        for name, c in list(pending.items()):
            assert c.proc is not None
            if not c.proc.alive():
                c.error = f"{c.name} exited before it was ready\n{c.proc.describe()}"
                del pending[name]
            elif http_status(_ready_url(c)) == 200:
                del pending[name]
        return not pending

    with contextlib.suppress(AssertionError):
        eventually(all_settled, timeout, interval=0.2)
    for c in pending.values():
        assert c.proc is not None
        c.error = f"{c.name} not ready within {timeout:.0f} s\n{c.proc.describe()}"


@pytest.fixture(scope="module")
def topology(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    work = tmp_path_factory.mktemp("compose")
    kinds = ("onnx", "sequence", "python", "fil") + (("torchscript",) if _has_torch() else ())
    repo = build_repository(work / "models", kinds=kinds)
    compose = load_compose()
    with otlp_sink() as (otlp_port, otlp):
        containers = plan(compose, repo, otlp_port)
        topo = Topology(compose, containers, repo, otlp)
        # depends_on order: the services first, then the gateways that route to them. A
        # service that does not come up is recorded (its tests fail) and the rest go on.
        try:
            _start([c for c in containers if c.service != "gateway"], work)
            _start(topo.of("gateway"), work)
            yield topo
        finally:
            stop_all([c.proc for c in reversed(containers) if c.proc is not None])


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _require_up(c: Container) -> None:
    if c.error is not None:
        pytest.fail(f"{c.name} did not come up with the compose arguments:\n{c.error}")


def test_compose_gives_the_expected_processes(topology: Topology) -> None:
    names = sorted(c.name for c in topology.containers)
    assert names == ["fil-1", "gateway-1", "gateway-2", "onnx-1", "python-1", "sequence-1", "torchscript-1"]


@pytest.mark.parametrize("service", kinds_param(("gateway", *SERVICE_KINDS)))
def test_service_comes_up_and_its_healthcheck_passes(topology: Topology, service: str) -> None:
    for c in topology.of(service):
        _require_up(c)
        test = c.healthcheck
        assert test[0] == "CMD" and test[1] == "python", "meshserve health checks run the image's Python"
        argv = [sys.executable, *(_map_local(c, a) for a in test[2:])]
        res = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, f"{c.name}: compose health check failed\n{res.stderr}"


@pytest.mark.parametrize("kind", kinds_param(SERVICE_KINDS))
def test_request_through_each_gateway_to_kind(topology: Topology, kind: str) -> None:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    if kind == "torchscript" and not _has_torch():
        missing("torch, which builds the TorchScript test model,", "pip install torch==2.13.0")
    (service,) = topology.of(kind)
    _require_up(service)
    # The service is a complete v2 server on its own HTTP port...
    http = httpclient.InferenceServerClient(f"127.0.0.1:{flag(service.argv, '--http-port')}")
    infer_kind(httpclient, http, kind)
    http.close()
    # ... and every gateway replica routes to it, over HTTP and gRPC.
    for gw in topology.of("gateway"):
        _require_up(gw)
        http = httpclient.InferenceServerClient(f"127.0.0.1:{gw.host_port(8000)}")
        infer_kind(httpclient, http, kind)
        http.close()
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{gw.host_port(8001)}")
        infer_kind(grpcclient, grpc, kind)
        grpc.close()


def _gateway_requests(gw: Container, model: str) -> float:
    """meshserve_gateway_requests_total of `model` at this gateway replica, all outcomes."""
    from prometheus_client.parser import text_string_to_metric_families

    text = _metrics(f"http://127.0.0.1:{gw.host_port(8000)}/metrics")
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "meshserve_gateway_requests_total" and s.labels.get("model") == model)


def test_python_bls_goes_through_the_gateway(topology: Topology) -> None:
    """The python service's --bls-target (compose: gateway:8001) is a gateway: a request to the
    python model, sent to the service itself, shows up as add_sub requests at that gateway."""
    import tritonclient.grpc as grpcclient

    (service,) = topology.of("python")
    _require_up(service)
    target = flag(service.argv, "--bls-target")
    assert target is not None, "compose gives the python service no --bls-target"
    targets = [g for g in topology.of("gateway") if target == f"127.0.0.1:{g.host_port(8001)}"]
    assert len(targets) == 1, f"--bls-target {target} is no gateway's gRPC port"
    gw = targets[0]
    _require_up(gw)
    before = _gateway_requests(gw, "add_sub")
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{flag(service.argv, '--grpc-port')}")
    for _ in range(3):
        infer_kind(grpcclient, client, "python")
    client.close()
    eventually(lambda: _gateway_requests(gw, "add_sub") >= before + 3, 10, interval=0.1,
               what=f"3 BLS calls to add_sub counted at {gw.name}")


def _metrics(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


@pytest.mark.parametrize("service", kinds_param(("gateway", *SERVICE_KINDS)))
def test_prometheus_can_scrape(topology: Topology, service: str) -> None:
    """/metrics where deploy/prometheus.yml looks: the gateway's HTTP port, a service's
    --metrics-port."""
    for c in topology.of(service):
        _require_up(c)
        if service == "gateway":
            text = _metrics(f"http://127.0.0.1:{c.host_port(8000)}/metrics")
            assert "meshserve_gateway_requests_total" in text
        else:
            port = flag(c.argv, "--metrics-port")
            assert port is not None, f"{c.name}: no --metrics-port in compose"
            text = _metrics(f"http://127.0.0.1:{port}/metrics")
            assert "nv_inference_request_success" in text


def test_example_models_job(tmp_path: Path) -> None:
    """The one-shot example-models container fills a copy of the example repository."""
    job = active_services(load_compose(), set())["example-models"]
    entry, cmd = as_list(job["entrypoint"]), as_list(job["command"])
    assert entry[0] == "python" and cmd == ["/models"]
    (mount,) = [str(v) for v in job["volumes"]]
    assert mount.split(":")[0] == "../examples/model_repository" and mount.split(":")[1] == "/models"
    examples = ROOT / "examples" / "model_repository"
    for config in examples.glob("*/config.pbtxt"):
        (tmp_path / config.parent.name).mkdir()
        shutil.copy(config, tmp_path / config.parent.name / "config.pbtxt")
    res = subprocess.run([sys.executable, *entry[1:], str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    onnx = [e.name for e in layout.scan(examples) if e.kind == "onnx"]
    assert len(onnx) >= 4, onnx
    for name in onnx:
        assert list((tmp_path / name).glob("[0-9]*/model.onnx")), name
    # The python model's source is committed (what the services mount is the checkout itself).
    python = [e.name for e in layout.scan(examples) if e.kind == "python"]
    assert python == ["add_sub_bls"], python
    for name in python:
        assert list((examples / name).glob("[0-9]*/model.py")), name
        assert not list((tmp_path / name).glob("[0-9]*/*")), f"the job generates nothing for {name}"
