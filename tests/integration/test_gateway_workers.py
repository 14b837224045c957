"""`meshserve gateway --workers 2`: two gateway processes on the same ports (SO_REUSEPORT), through
real processes and the real tritonclient. Each new client below is a new connection, which the
kernel hands to either worker; the gateway's /metrics (every worker's counts, labelled
``worker``) says which workers served, so the tests know both took part."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from tests.conftest import ROOT, Proc, service_and_gateway, start
from tests.support.metrics import scrape
from tests.support.shm import in_regions
from tests.support.up import meshserve_up
from tests.support.waiting import eventually

F32 = 16 * 4
IN0 = np.arange(16, dtype=np.float32).reshape(1, 16)
IN1 = np.full((1, 16), 2.5, np.float32)
FRESH = 40  # fresh connections tried before giving up on reaching both workers (2^-39 by chance)


def lib(proto: str) -> Any:
    return httpclient if proto == "http" else grpcclient


@pytest.fixture(scope="module")
def stack(model_repo: Path) -> Iterator[tuple[Proc, Proc]]:
    with service_and_gateway("onnx", ["--repository", str(model_repo), "--model-control-mode", "explicit",
                                      "--load-model", "add_sub"], ["--workers", "2"]) as pair:
        yield pair


def gateway_url(gw: Proc, proto: str) -> str:
    return gw.http if proto == "http" else gw.grpc


def served(gw: Proc, model: str = "add_sub") -> dict[str, float]:
    """Requests each worker has answered (meshserve_gateway_requests_total by its worker label)."""
    out: dict[str, float] = {}
    for (name, labels), value in scrape(gw.http).items():
        lab = dict(labels)
        if name == "meshserve_gateway_requests_total" and lab.get("model") == model:
            out[lab["worker"]] = out.get(lab["worker"], 0) + value
    return out


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (a supervisor's: its workers)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return sorted(int(p) for p in f.read().split())


def alive(pid: int) -> bool:
    """Is ``pid`` running (not gone, not a zombie)?"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def infer(url: str, proto: str) -> None:
    """One add_sub request on a new connection (a new client), its answer checked."""
    mod = lib(proto)
    inputs = [mod.InferInput("INPUT0", [1, 16], "FP32"), mod.InferInput("INPUT1", [1, 16], "FP32")]
    inputs[0].set_data_from_numpy(IN0)
    inputs[1].set_data_from_numpy(IN1)
    with mod.InferenceServerClient(url) as c:
        result = c.infer("add_sub", inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), IN0 + IN1)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), IN0 - IN1)


def until_both_served(gw: Proc, send: Callable[[int], None]) -> dict[str, float]:
    """send(i) on fresh connections until both workers answered at least two more requests."""
    before = served(gw)
    for i in range(FRESH):
        send(i)
        after = served(gw)
        if i >= 3 and all(after.get(w, 0) - before.get(w, 0) >= 2 for w in ("0", "1")):
            return after
    raise AssertionError(f"{FRESH} fresh connections did not reach both workers: {before} -> {served(gw)}")


def test_one_ready_line_and_two_workers(stack: tuple[Proc, Proc]) -> None:
    _, gw = stack
    assert sum(line.startswith("MESHSERVE_READY") for line in gw.output) == 1, gw.log()
    assert len(children(gw.proc.pid)) == 2


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_inference_spreads_over_both_workers(stack: tuple[Proc, Proc], proto: str) -> None:
    _, gw = stack
    until_both_served(gw, lambda i: infer(gateway_url(gw, proto), proto))


@pytest.fixture
def region() -> Iterator[tuple[str, Any]]:
    key = f"/mstest-{os.getpid()}-workers"
    handle = shm.create_shared_memory_region("workers", key, 4 * F32, create_only=True)
    yield key, handle
    shm.destroy_shared_memory_region(handle)


def test_shared_memory_registered_on_one_worker_used_on_every_other(stack: tuple[Proc, Proc],
                                                                     region: tuple[str, Any]) -> None:
    """Register on one connection; infer, status and unregister on fresh ones, over HTTP and gRPC:
    every worker answers as the one that registered."""
    _, gw = stack
    key, handle = region
    shm.set_shared_memory_region(handle, [IN0, IN1])
    with httpclient.InferenceServerClient(gw.http) as c:
        c.unregister_system_shared_memory()
        c.register_system_shared_memory("io", key, 4 * F32)

    def shm_infer(i: int) -> None:
        infer_in_region(gw, ("http", "grpc")[i % 2], handle, "io")

    until_both_served(gw, shm_infer)
    for proto in ("http", "grpc") * 4:  # the status from fresh connections: the same everywhere
        with lib(proto).InferenceServerClient(gateway_url(gw, proto)) as c:
            status = c.get_system_shared_memory_status()
        found = {r["name"]: r["key"] for r in status} if proto == "http" else \
            {n: r.key for n, r in status.regions.items()}
        assert found == {"io": key}
    with grpcclient.InferenceServerClient(gw.grpc) as c:
        c.register_system_shared_memory("twice", key, F32)
    for proto in ("http", "grpc") * 2:  # a name taken through any worker is taken in every worker
        with lib(proto).InferenceServerClient(gateway_url(gw, proto)) as c, \
                pytest.raises(InferenceServerException, match="already in manager"):
            c.register_system_shared_memory("twice", key, F32)
    with grpcclient.InferenceServerClient(gw.grpc) as c:
        c.unregister_system_shared_memory()

    for i in range(8):  # gone from every worker
        proto = ("http", "grpc")[i % 2]
        with pytest.raises(InferenceServerException, match="Unable to find shared memory region: 'io'"):
            shm_infer(i)


def infer_in_region(gw: Proc, proto: str, handle: Any, region: str) -> None:
    """add_sub on a new connection, inputs and outputs in ``region`` (4 tensors, IN0 and IN1 first)."""
    mod = lib(proto)
    shm.set_shared_memory_region(handle, [np.zeros((2, 16), np.float32)], offset=2 * F32)
    inputs, outputs = in_regions(mod, "FP32", [1, 16], [("INPUT0", region, F32, 0), ("INPUT1", region, F32, F32)],
                                 [("OUTPUT0", region, F32, 2 * F32), ("OUTPUT1", region, F32, 3 * F32)])
    with mod.InferenceServerClient(gateway_url(gw, proto)) as c:
        c.infer("add_sub", inputs, outputs=outputs)
    np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.float32, [1, 16], offset=2 * F32), IN0 + IN1)
    np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.float32, [1, 16], offset=3 * F32), IN0 - IN1)


def test_trace_and_log_settings_updated_through_one_worker_apply_to_all(stack: tuple[Proc, Proc]) -> None:
    """A trace setting update is read back from every worker; a log setting update reaches the
    request path of every worker (each worker's requests log their DEBUG line)."""
    _, gw = stack
    with httpclient.InferenceServerClient(gw.http) as c:
        c.update_trace_settings(settings={"trace_rate": "7", "log_frequency": "3"})
    for proto in ("http", "grpc") * 6:
        with lib(proto).InferenceServerClient(gateway_url(gw, proto)) as c:
            settings = c.get_trace_settings()
        if proto == "http":
            assert (settings["trace_rate"], settings["log_frequency"]) == ("7", "3"), settings
        else:
            assert (settings.settings["trace_rate"].value, settings.settings["log_frequency"].value) == (["7"], ["3"])

    with grpcclient.InferenceServerClient(gw.grpc) as c:
        c.update_log_settings({"log_verbose_level": 1})
    try:
        def every_request_logged() -> bool:
            start_lines = sum("infer add_sub/" in line for line in gw.output)
            before = served(gw)
            for i in range(12):
                infer(gateway_url(gw, ("http", "grpc")[i % 2]), ("http", "grpc")[i % 2])
            after = served(gw)
            assert all(after[w] > before.get(w, 0) for w in ("0", "1")), (before, after)  # both answered
            return eventually(lambda: sum("infer add_sub/" in line for line in gw.output) - start_lines == 12,
                              timeout=5, what="one DEBUG line per request") or True

        eventually(every_request_logged, timeout=30, what="the log update on both workers' request paths")
    finally:
        with httpclient.InferenceServerClient(gw.http) as c:
            c.update_log_settings({"log_verbose_level": 0})


def test_a_killed_worker_is_restarted_and_serving_goes_on(stack: tuple[Proc, Proc], region: tuple[str, Any]) -> None:
    _, gw = stack
    key, handle = region
    shm.set_shared_memory_region(handle, [IN0, IN1])
    with httpclient.InferenceServerClient(gw.http) as c:
        c.register_system_shared_memory("kept", key, 4 * F32)
    try:
        old = children(gw.proc.pid)
        os.kill(old[0], signal.SIGKILL)
        # once it is dead (its listening sockets closed; a connection queued on them in between is
        # reset, as with any SO_REUSEPORT server), the other worker takes every new connection. Dead
        # means reaped by the supervisor (its log line): a killed process's leader thread shows as a
        # zombie while its other threads, which share its open sockets, are still exiting
        eventually(lambda: not alive(old[0]), what="the killed worker gone")
        eventually(lambda: any("exited with code -9; restarting" in line for line in gw.output), timeout=10,
                   what="the supervisor reaped the killed worker")
        for i in range(4):
            infer(gateway_url(gw, ("http", "grpc")[i % 2]), ("http", "grpc")[i % 2])

        def replaced() -> list[int]:
            now = children(gw.proc.pid)
            return now if len(now) == 2 and old[0] not in now else []

        new = eventually(replaced, what="a new worker in place of the killed one")
        assert old[1] in new
        eventually(lambda: sum("gateway worker" in line and " serving: " in line for line in gw.output) == 3, timeout=60,
                   what="the new worker serving")
        # serving from both again, the new worker with the region registered before it started
        until_both_served(gw, lambda i: infer_in_region(gw, ("http", "grpc")[i % 2], handle, "kept"))
    finally:
        with httpclient.InferenceServerClient(gw.http) as c:
            c.unregister_system_shared_memory()


def test_sigterm_drains_every_worker() -> None:
    """Requests in flight on both workers finish; the supervisor and its workers exit 0."""
    with service_and_gateway("", ["--delay-ms", "800"], ["--workers", "2"],
                             module="tests.integration.slow_service", timeout=60) as (_, gw):
        pids = children(gw.proc.pid)
        results: list[Any] = []

        def one() -> None:
            inp = httpclient.InferInput("IN", [1, 4], "FP32")
            inp.set_data_from_numpy(np.ones((1, 4), np.float32))
            try:
                with httpclient.InferenceServerClient(gw.http, network_timeout=30) as c:
                    results.append(c.infer("sleep_a", [inp]).as_numpy("OUT"))
            except Exception as exc:  # reported by the assertion below
                results.append(exc)

        threads = [threading.Thread(target=one) for _ in range(8)]
        for t in threads:
            t.start()

        def outstanding() -> float:
            return sum(v for (n, _), v in scrape(gw.http).items() if n == "meshserve_gateway_replica_outstanding")

        eventually(lambda: outstanding() >= 8, timeout=10, what="8 requests in flight", interval=0.02)
        gw.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        assert gw.proc.wait(30) == 0, gw.log()
        assert len(results) == 8 and all(isinstance(r, np.ndarray) for r in results), results
        assert not any(alive(pid) for pid in pids)
        assert sum("gateway worker" in line and line.rstrip().endswith(") stopped") for line in gw.output) == 2, gw.log()


def run_gateway(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "meshserve", "gateway", "--grpc-port", "0", "--http-port", "0",
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_memory_quotas_with_several_workers_are_refused(tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("tenants:\n  - name: a\n    keys: [k]\n    rate: 10\n")
    done = run_gateway("--workers", "2", "--tenants", str(tenants), "--upstream", "127.0.0.1:1")
    assert done.returncode != 0
    assert "--workers 2 with --tenants and --quota-store memory" in done.stderr, done.stderr
    assert "MESHSERVE_READY" not in done.stdout


def test_workers_that_cannot_start_fail_the_supervisor(tmp_path: Path) -> None:
    done = run_gateway("--workers", "2", "--upstream", "127.0.0.1:1", "--routes", str(tmp_path / "missing.yaml"))
    assert done.returncode == 1, done.stderr
    assert "exited with code" in done.stderr and "before every worker was ready" in done.stderr, done.stderr
    assert "MESHSERVE_READY" not in done.stdout


def test_ports_of_zero_are_chosen_once() -> None:
    """Port 0: one port each, chosen by the supervisor (which holds it, bound and not listening),
    that both workers listen on."""
    gw = start(["gateway", "--workers", "2", "--grpc-port", "0", "--http-port", "0", "--metrics-port", "0",
                "--upstream", "127.0.0.1:1"])
    try:
        assert set(gw.ports) == {"grpc", "http", "metrics"}
        for port in gw.ports.values():  # every worker listens on each port
            listening = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True).stdout
            assert len(listening.strip().splitlines()) == 2, listening
    finally:
        assert gw.stop() == 0


def test_meshserve_up_passes_gateway_workers_and_stops_them_all(model_repo: Path) -> None:
    """`meshserve up --gateway-workers 2`: the gateway runs two workers; the services' Triton
    families are on its /metrics once (not once per worker); Ctrl-C stops every process."""
    with meshserve_up("--metrics-port", "0", "--repository", str(model_repo), "--http-port", "0", "--grpc-port", "0",
                      "--gateway-workers", "2") as up:
        hostport = up.http
        up_children = children(up.pid)
        gateway_workers = next(w for w in map(children, up_children) if len(w) == 2)  # the supervisor's
        infer(hostport, "http")

        def federated_once() -> bool:
            samples = scrape(hostport)
            success = [dict(lab) for (name, lab), v in samples.items()
                       if name == "nv_inference_request_success" and dict(lab).get("model") == "add_sub" and v >= 1]
            assert len(success) == 1 and "worker" not in success[0], success  # one replica, read once
            return {dict(lab).get("worker") for (name, lab), _ in samples.items()
                    if name == "meshserve_gateway_merged_sends_total"} == {"0", "1"}

        eventually(federated_once, timeout=30, interval=0.2, what="the services' families once, both workers")
        assert up.interrupt() == 0  # Ctrl-C
        assert not any(alive(p) for p in [*up_children, *gateway_workers])

