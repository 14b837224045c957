"""Tenants isolated by construction (issue 29, finding 3 and item 3), through real gateway and
service processes with the real tritonclient:

- a system shared-memory object belongs to the tenant that registered it first (device and
  inode): another tenant registering the same key, or a hard link to it, is refused (403 /
  PERMISSION_DENIED) and never reads a byte of it, through any of a gateway's --workers too;
- keys naming meshserve's own IPC objects (``meshserve-*``) are refused to everyone;
- one tenant holds at most its share (the tenants file's ``share``, default 0.5) of every cap
  the process shares: shared-memory regions, and requests in flight (429 / RESOURCE_EXHAUSTED
  naming the limit), while another tenant still gets its own.
"""
from __future__ import annotations

import contextlib
import os
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

from gateway.auth import hash_key
from tests.adversarial.harness import KEY, OTHER_KEY, Mesh
from tests.conftest import Proc, _wait_http_ready, start
from tests.integration.test_gateway_tenants import redis_url as redis_url  # (a fixture)
from tests.support.waiting import eventually

A, M = {"x-api-key": KEY}, {"x-api-key": OTHER_KEY}  # acme (the victim), mallory (the attacker)
F32 = 16 * 4
SECRET = np.arange(16, dtype=np.float32).reshape(1, 16) * 7.0
DENIED = {"http": "403", "grpc": "StatusCode.PERMISSION_DENIED"}
EXHAUSTED = {"http": "429", "grpc": "StatusCode.RESOURCE_EXHAUSTED"}


def lib(proto: str) -> Any:
    return httpclient if proto == "http" else grpcclient


def url(p: Proc, proto: str) -> str:
    return p.http if proto == "http" else p.grpc


def key(name: str) -> str:
    return f"/mstest-{os.getpid()}-iso-{name}"


@pytest.fixture
def regions() -> Iterator[Callable[[str, int], Any]]:
    made: list[Any] = []

    def create(name: str, byte_size: int) -> Any:
        handle = shm.create_shared_memory_region(name, key(name), byte_size, create_only=True)
        made.append(handle)
        return handle

    yield create
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def refused(fn: Callable[[], object], status: str, *fragments: str) -> str:
    with pytest.raises(InferenceServerException) as err:
        fn()
    assert str(err.value.status()) == status, err.value
    for fragment in fragments:
        assert fragment in (err.value.message() or ""), err.value
    return err.value.message() or ""


def shm_infer(proto: str, client: Any, region: str, headers: dict[str, str]) -> np.ndarray:
    m = lib(proto)
    inputs = [m.InferInput("INPUT0", [1, 16], "FP32"), m.InferInput("INPUT1", [1, 16], "FP32")]
    inputs[0].set_shared_memory(region, F32)
    inputs[1].set_data_from_numpy(np.zeros((1, 16), np.float32))
    return client.infer("add_sub", inputs, headers=dict(headers)).as_numpy("OUTPUT0")


def cleanup(g: Proc) -> None:
    with httpclient.InferenceServerClient(g.http) as c:
        for who in (A, M):
            c.unregister_system_shared_memory(headers=dict(who))


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_a_key_registered_by_one_tenant_is_refused_to_another(mesh: Mesh, proto: str,
                                                             regions: Callable[[str, int], Any]) -> None:
    """acme registers its object; mallory names the same key, or a hard link to it (another name,
    the same inode), and is refused with 403 while acme holds it; acme's data never reaches
    mallory. Once acme lets it go, the object is free again (first come)."""
    g = mesh.gateway
    handle = regions(f"victim-{proto}", F32)
    shm.set_shared_memory_region(handle, [SECRET])
    link = f"/dev/shm/{key(f'link-{proto}').lstrip('/')}"
    os.link(f"/dev/shm/{key(f'victim-{proto}').lstrip('/')}", link)
    try:
        with lib(proto).InferenceServerClient(url(g, proto)) as c:
            c.register_system_shared_memory("secret", key(f"victim-{proto}"), F32, headers=dict(A))
            np.testing.assert_array_equal(shm_infer(proto, c, "secret", A), SECRET)
            for stolen in (key(f"victim-{proto}"), key(f"link-{proto}")):
                for offset, size in ((0, F32), (8, 8)):
                    text = refused(lambda s=stolen, o=offset, n=size: c.register_system_shared_memory(  # type: ignore[misc]
                        "loot", s, n, offset=o, headers=dict(M)), DENIED[proto], "registered by another tenant")
                    assert "7.0" not in text and "acme" not in text  # says nothing of the owner
            for who_asks in (M,):
                status = c.get_system_shared_memory_status(headers=dict(who_asks))
                assert (status == [] if proto == "http" else not status.regions), status
                refused(lambda: shm_infer(proto, c, "secret", M), "400" if proto == "http"
                        else "StatusCode.INVALID_ARGUMENT", "Unable to find shared memory region: 'secret'")
            c.unregister_system_shared_memory("secret", headers=dict(A))
            c.register_system_shared_memory("mine-now", key(f"link-{proto}"), F32, headers=dict(M))
            refused(lambda: c.register_system_shared_memory("back", key(f"victim-{proto}"), F32, headers=dict(A)),
                    DENIED[proto], "registered by another tenant")
    finally:
        os.unlink(link)
        cleanup(g)


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_meshserve_s_own_ipc_keys_are_refused(mesh: Mesh, proto: str) -> None:
    """Even where such an object exists and is readable, ``meshserve-*`` keys are never a region."""
    name = f"meshserve-py-{os.getpid()}-iso-{proto}"
    with open(f"/dev/shm/{name}", "wb") as f:
        f.write(SECRET.tobytes())
    try:
        with lib(proto).InferenceServerClient(url(mesh.gateway, proto)) as c:
            for k in (f"/{name}", name):
                refused(lambda k=k: c.register_system_shared_memory("ipc", k, F32, headers=dict(M)),  # type: ignore[misc]
                        DENIED[proto], "reserved for meshserve's own processes")
            status = c.get_system_shared_memory_status(headers=dict(M))
            assert (status == [] if proto == "http" else not status.regions), status
    finally:
        os.unlink(f"/dev/shm/{name}")


def test_one_tenant_cannot_take_every_region_slot(mesh: Mesh, regions: Callable[[str, int], Any]) -> None:
    """--max-shm-regions (256) is shared: mallory holds at most its share (0.5: 128), then gets
    429 naming the limit; acme still registers its own (before the fix: all 256 were mallory's)."""
    g = mesh.gateway
    regions("hog", 256)
    regions("acme-own", F32)
    try:
        with httpclient.InferenceServerClient(g.http) as c:
            taken = 0
            for i in range(300):
                try:
                    c.register_system_shared_memory(f"r{i}", key("hog"), 1, offset=i % 256, headers=dict(M))
                except InferenceServerException as exc:
                    assert str(exc.status()) == "429", exc
                    assert "tenant 'mallory' holds 128 regions" in (exc.message() or ""), exc
                    assert "0.5 of --max-shm-regions 256: 128" in (exc.message() or ""), exc
                    break
                taken += 1
            assert taken == 128
            with grpcclient.InferenceServerClient(g.grpc) as gc:
                gc.register_system_shared_memory("mine", key("acme-own"), F32, headers=dict(A))
                refused(lambda: gc.register_system_shared_memory("more", key("hog"), 1, headers=dict(M)),
                        EXHAUSTED["grpc"], "--max-shm-regions")
    finally:
        cleanup(g)


TENANTS = f"""
share: 0.5
tenants:
  - name: acme
    keys_sha256: ["{hash_key(KEY)}"]
    rate: 100000
    burst: 100000
  - name: mallory
    keys_sha256: ["{hash_key(OTHER_KEY)}"]
    rate: 100000
    burst: 100000
"""


def test_key_binding_holds_across_gateway_workers(mesh: Mesh, tmp_path: Path, redis_url: str,
                                                  regions: Callable[[str, int], Any]) -> None:
    """With --workers 2 (registrations shared through the supervisor; tenants need a shared
    quota store there), acme's object is refused to mallory on every fresh connection, whichever
    worker takes it."""
    (tmp_path / "tenants.yaml").write_text(TENANTS)
    g = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--workers", "2", "--tenants",
               str(tmp_path / "tenants.yaml"), "--quota-store", redis_url, "--upstream", mesh.services[0].grpc])
    try:
        _wait_http_ready(g.http)
        handle = regions("workers", F32)
        shm.set_shared_memory_region(handle, [SECRET])
        with httpclient.InferenceServerClient(g.http) as c:
            c.register_system_shared_memory("secret", key("workers"), F32, headers=dict(A))
        for i in range(12):  # fresh connections: the kernel spreads them over both workers
            proto = ("http", "grpc")[i % 2]
            with lib(proto).InferenceServerClient(url(g, proto)) as c:
                refused(lambda c=c, i=i: c.register_system_shared_memory(  # type: ignore[misc]
                    f"loot{i}", key("workers"), F32, headers=dict(M)),
                        DENIED[proto], "registered by another tenant")
                np.testing.assert_array_equal(shm_infer(proto, c, "secret", A), SECRET)
        with httpclient.InferenceServerClient(g.http) as c:
            c.unregister_system_shared_memory(headers=dict(A))
    finally:
        g.stop()


def slow_mesh(tmp_path: Path, delay_ms: int) -> tuple[Proc, Proc]:
    """A gateway (--max-inflight 8, acme and mallory with a share of 0.5 each, no coalescing) in
    front of the slow stand-in service whose models answer after ``delay_ms``; the caller stops both."""
    (tmp_path / "tenants.yaml").write_text(TENANTS)
    slow = start(["--grpc-port", "0", "--http-port", "0", "--delay-ms", str(delay_ms)],
                 module="tests.integration.slow_service")
    try:
        return slow, start(["gateway", "--grpc-port", "0", "--http-port", "0", "--tenants",
                            str(tmp_path / "tenants.yaml"), "--upstream", slow.grpc, "--max-inflight", "8",
                            "--coalesce-inflight", "0"])
    except Exception:
        slow.stop()
        raise


def test_one_tenant_cannot_take_every_in_flight_slot(tmp_path: Path) -> None:
    """--max-inflight 8 in front of a slow service: mallory's 8 concurrent requests get 4 slots
    (its share) and 4 refusals naming the limit; acme's 4 concurrent requests, sent meanwhile,
    all run (before the fix mallory held all 8 and acme got 429)."""
    slow, g = slow_mesh(tmp_path, 1500)
    outcomes: dict[str, list[str]] = {"acme": [], "mallory": []}
    lock = threading.Lock()

    def one(who: str, headers: dict[str, str]) -> None:
        with grpcclient.InferenceServerClient(g.grpc) as c:
            inp = grpcclient.InferInput("IN", [1, 4], "FP32")
            inp.set_data_from_numpy(np.ones((1, 4), np.float32))
            try:
                c.infer("sleep_a", [inp], headers=dict(headers), client_timeout=30)
                result = "ok"
            except InferenceServerException as exc:
                result = f"{exc.status()}: {exc.message()}"
        with lock:
            outcomes[who].append(result)

    try:
        _wait_http_ready(g.http)
        attackers = [threading.Thread(target=one, args=("mallory", M)) for _ in range(8)]
        for t in attackers:
            t.start()
        with contextlib.suppress(AssertionError):  # its 4 refusals come at once (the asserts below judge)
            eventually(lambda: len(outcomes["mallory"]) >= 4, 10, "mallory's 4 refusals")
        victims = [threading.Thread(target=one, args=("acme", A)) for _ in range(4)]
        for t in victims:
            t.start()
        for t in attackers + victims:
            t.join(60)
        assert outcomes["acme"] == ["ok"] * 4, outcomes
        assert sorted(outcomes["mallory"])[-4:] == ["ok"] * 4, outcomes
        refusals = [o for o in outcomes["mallory"] if o != "ok"]
        assert len(refusals) == 4, outcomes
        for text in refusals:
            assert text.startswith("StatusCode.RESOURCE_EXHAUSTED"), text
            assert "tenant 'mallory' has 4 inference requests in flight" in text, text
            assert "0.5 of --max-inflight 8: 4" in text, text
    finally:
        g.stop()
        slow.stop()


def test_a_caller_at_its_share_is_refused_before_its_request_is_read(tmp_path: Path) -> None:
    """A caller holding its whole share of --max-inflight is refused at the front door, before its
    request is parsed or its body read (gateway/core.py: grpc_door, http_door; a flood past a share
    costs a refusal each, no more). With mallory's 4 slow requests in flight (0.5 of --max-inflight
    8), a gRPC message that names the model and then is no ModelInferRequest, and an HTTP infer,
    generate or generate_stream body that is no JSON, get mallory 429 / RESOURCE_EXHAUSTED naming
    its share, while acme's same bytes get the parse's 400 / INVALID_ARGUMENT; the HTTP connection
    goes on to its next request; each refusal is counted once (meshserve_gateway_requests_total,
    the share rejections); once mallory's requests have ended, its bytes are parsed again."""
    import http.client

    import grpc

    from tests.support.metrics import sample, scrape

    slow, g = slow_mesh(tmp_path, 6000)
    garbled = b"\x0a\x07sleep_a\xff\xff\xff"  # field 1 (the model's name), then no valid field
    outcomes: list[str] = []

    def held() -> None:
        with grpcclient.InferenceServerClient(g.grpc) as c:
            inp = grpcclient.InferInput("IN", [1, 4], "FP32")
            inp.set_data_from_numpy(np.ones((1, 4), np.float32))
            try:
                c.infer("sleep_a", [inp], headers=dict(M), client_timeout=60)
                outcomes.append("ok")
            except InferenceServerException as exc:
                outcomes.append(f"{exc.status()}: {exc.message()}")

    def raw_grpc(headers: dict[str, str]) -> tuple[grpc.StatusCode, str]:
        with grpc.insecure_channel(g.grpc) as channel:
            call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            with pytest.raises(grpc.RpcError) as err:
                call(garbled, metadata=tuple(headers.items()), timeout=10)
        return err.value.code(), err.value.details() or ""  # type: ignore[attr-defined]

    def raw_http(conn: http.client.HTTPConnection, headers: dict[str, str], route: str = "infer"
                 ) -> tuple[int, str, str | None]:
        conn.request("POST", f"/v2/models/sleep_a/{route}", body=b"{not json" + b" " * 4096,
                     headers={**headers, "Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read().decode(), r.getheader("Retry-After")

    threads = [threading.Thread(target=held) for _ in range(4)]
    try:
        _wait_http_ready(g.http)
        assert raw_grpc(M)[0] is grpc.StatusCode.INVALID_ARGUMENT  # below its share: the parse answers
        for t in threads:
            t.start()
        refusals = 0

        def at_share() -> bool:
            nonlocal refusals
            code, details = raw_grpc(M)
            if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
                refusals += 1
                assert "tenant 'mallory' has 4 inference requests in flight, its share (0.5 of --max-inflight 8: 4)" \
                    in details, details
                return True
            assert code is grpc.StatusCode.INVALID_ARGUMENT, (code, details)
            return False

        eventually(at_share, 5, "mallory's 4 requests in flight")
        code, details = raw_grpc(A)
        assert code is grpc.StatusCode.INVALID_ARGUMENT and "malformed ModelInferRequest" in details, details
        host, port = g.http.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            status, text, retry = raw_http(conn, M)
            assert status == 429 and retry is not None and "its share (0.5 of --max-inflight 8: 4)" in text, text
            refusals += 1
            conn.request("GET", "/v2/health/ready")  # the same connection, past the body it did not read
            ready = conn.getresponse()
            ready.read()
            assert ready.status == 200
            status, text, _ = raw_http(conn, A)
            assert status == 400, text
            for route in ("generate", "generate_stream"):  # Triton's generate extension: the same door
                status, text, retry = raw_http(conn, M, route)
                assert status == 429 and retry is not None and "its share (0.5 of --max-inflight 8: 4)" in text, text
                refusals += 1
                status, text, _ = raw_http(conn, A, route)
                assert status == 400, text
        finally:
            conn.close()
        samples = scrape(g.http)
        assert sample(samples, "meshserve_gateway_requests_total", model="sleep_a",
                      outcome="RESOURCE_EXHAUSTED") == refusals
        assert sample(samples, "meshserve_gateway_quota_rejections_total", tenant="mallory", reason="share") == refusals
        for t in threads:
            t.join(60)
        assert outcomes == ["ok"] * 4, outcomes
        assert raw_grpc(M)[0] is grpc.StatusCode.INVALID_ARGUMENT  # its share given back: parsed again
    finally:
        g.stop()
        slow.stop()


def test_a_sequence_belongs_to_the_tenant_that_started_it(tmp_path: Path) -> None:
    """A stateful model's sequence (seq_accum: OUTPUT = state + INPUT) through a gateway with
    tenants: mallory naming acme's sequence id can neither read acme's state nor reset it (403),
    before or after acme's requests; once acme ends it, the id is free. (Before: mallory read
    1005 and reset acme's sum.)"""
    from tests.models.sequence import build

    repo = build(tmp_path / "models")
    (tmp_path / "tenants.yaml").write_text(TENANTS)
    svc = start(["service", "sequence", "--repository", str(repo), "--grpc-port", "0", "--http-port", "0"])
    try:
        g = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--tenants", str(tmp_path / "tenants.yaml"),
                   "--upstream", svc.grpc])
    except Exception:
        svc.stop()
        raise

    def step(proto: str, who: dict[str, str], value: float, **flags: bool) -> float | str:
        m = lib(proto)
        inp = m.InferInput("INPUT", [1, 1], "FP32")
        inp.set_data_from_numpy(np.array([[value]], np.float32))
        with m.InferenceServerClient(url(g, proto)) as c:
            try:
                r = c.infer("seq_accum", [inp], sequence_id=42, headers=dict(who), **flags)
            except InferenceServerException as exc:
                return str(exc.status())
        return float(r.as_numpy("OUTPUT")[0, 0])

    try:
        _wait_http_ready(g.http)
        assert step("grpc", A, 1000.0, sequence_start=True) == 1000.0
        assert step("http", A, 5.0) == 1005.0
        for proto in ("http", "grpc"):
            for flags in ({}, {"sequence_start": True}, {"sequence_end": True}):
                assert step(proto, M, 0.0, **flags) == DENIED[proto], (proto, flags)
        assert step("grpc", A, 1.0, sequence_end=True) == 1006.0  # acme's sum, untouched
        assert step("http", M, 7.0, sequence_start=True) == 7.0  # ended: the id is free
        assert step("grpc", A, 1.0) == DENIED["grpc"]  # and now mallory's
        assert step("grpc", M, 1.0, sequence_end=True) == 8.0
    finally:
        g.stop()
        svc.stop()
