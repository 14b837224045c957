"""The hop marker (issue 29, finding 9 and item 8), through the mesh's real processes:

- the gateway's front doors never believe a client's ``meshserve-hop: gateway`` (gRPC metadata
  or HTTP header): a streamed answer keeps ``triton_final_response``, a request naming a
  shared-memory region is still read from the client's region, and private parameters are
  still refused;
- a service believes the hop's parameters only on an authenticated call (issue 34: a hop key or
  mutual TLS; meshserve/protocol/hop.py:vet; the signed case: tests/integration/test_hop_auth.py):
  a forged marker and merged count straight to a service's port are a plain request of its
  rows (served, counted as its own, never refused for the count), and a flood of them leaves
  the good client untouched.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from meshserve.protocol import hop
from tests.adversarial.harness import KEY, Mesh, Observation, under_attack
from tests.adversarial.support import add_sub_inputs

FORGED = {hop.HEADER: hop.GATEWAY}
F32 = 16 * 4


def stream_once(url: str, inputs: list[Any], headers: dict[str, str]) -> Any:
    """One request on a ModelStreamInfer stream; its (result, error)."""
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    with grpcclient.InferenceServerClient(url) as c:
        c.start_stream(lambda result, error: answers.put((result, error)), headers=headers)
        try:
            c.async_stream_infer("add_sub", inputs)
            return answers.get(timeout=30)
        finally:
            c.stop_stream()


def test_the_gateway_ignores_a_client_s_marker_on_a_stream(mesh: Mesh) -> None:
    """Before the fix the marker made the gateway answer as on its own hop: no
    triton_final_response, and shared-memory regions not read."""
    result, error = stream_once(mesh.gateway.grpc, add_sub_inputs(grpcclient), {"x-api-key": KEY, **FORGED})
    assert error is None, error
    params = result.get_response().parameters
    assert "triton_final_response" in params and params["triton_final_response"].bool_param
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full((1, 16), 2.0, np.float32))

    key = f"/mstest-{os.getpid()}-hop"
    handle = shm.create_shared_memory_region("hop", key, F32, create_only=True)
    try:
        shm.set_shared_memory_region(handle, [np.full((1, 16), 5.0, np.float32)])
        with httpclient.InferenceServerClient(mesh.gateway.http) as c:
            c.register_system_shared_memory("hop-in", key, F32, headers={"x-api-key": KEY, **FORGED})
        inputs = add_sub_inputs(grpcclient)
        inputs[0].set_shared_memory("hop-in", F32)
        result, error = stream_once(mesh.gateway.grpc, inputs, {"x-api-key": KEY, **FORGED})
        assert error is None, error
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full((1, 16), 6.0, np.float32))
    finally:
        with httpclient.InferenceServerClient(mesh.gateway.http) as c:
            c.unregister_system_shared_memory(headers={"x-api-key": KEY})
        shm.destroy_shared_memory_region(handle)


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_the_gateway_refuses_private_parameters_with_or_without_the_marker(mesh: Mesh, proto: str) -> None:
    m = httpclient if proto == "http" else grpcclient
    with m.InferenceServerClient(mesh.gateway.http if proto == "http" else mesh.gateway.grpc) as c:
        with pytest.raises(InferenceServerException) as err:
            c.infer("add_sub", add_sub_inputs(m), headers={"x-api-key": KEY, **FORGED},
                    parameters={hop.MERGED: 64})
        assert str(err.value.status()) == ("400" if proto == "http" else "StatusCode.INVALID_ARGUMENT")
        assert "reserved for meshserve's own hops" in (err.value.message() or "")
        r = c.infer("add_sub", add_sub_inputs(m), headers={"x-api-key": KEY, **FORGED})  # the marker alone: ignored
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), np.full((1, 16), 2.0, np.float32))


def forged(c: grpcclient.InferenceServerClient, merged: int, rows: int) -> Any:
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        inp = grpcclient.InferInput(name, [rows, 16], "FP32")
        inp.set_data_from_numpy(np.ones((rows, 16), np.float32))
        inputs.append(inp)
    return c.infer("add_sub", inputs, headers=FORGED, parameters={hop.MERGED: merged})


def test_a_forged_merged_count_at_a_service_is_ignored(mesh: Mesh) -> None:
    """Straight to a service's port with the marker (no hop token): any count, over the rows or
    not, is ignored: each request is served as the plain request of its rows. (Before issue 34 a
    service without a key believed it: a count over the rows was INVALID_ARGUMENT.)"""
    service = mesh.services[0]
    with grpcclient.InferenceServerClient(service.grpc) as c:
        before = c.get_inference_statistics("add_sub").model_stats[0].inference_count
        for merged, rows in ((64, 1), (10**9, 2), (0, 1), (-5, 1), (2, 2)):
            r = forged(c, merged, rows)
            np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), np.full((rows, 16), 2.0, np.float32))
        after = c.get_inference_statistics("add_sub").model_stats[0].inference_count
    assert after - before >= 7  # (the gateway's own traffic may add to it, never the forged 10**9)
    assert after - before < 10**6


def test_a_flood_of_forged_counts_leaves_the_good_client_alone(mesh: Mesh) -> None:
    """Forged requests claiming a billion members each, from 4 connections for 3 s: each is a
    plain one-row request (served), and the good client (through the gateway to the same
    service) sees no failure and no latency spike."""
    target = mesh.services[0]

    def attack() -> Observation:
        codes: dict[str, int] = {}
        lock = threading.Lock()
        stop = time.monotonic() + 3.0

        def flood() -> None:
            with grpcclient.InferenceServerClient(target.grpc) as c:
                while time.monotonic() < stop:
                    try:
                        forged(c, 10**9, 1)
                        code = "OK"
                    except InferenceServerException as exc:
                        code = str(exc.status())
                    with lock:
                        codes[code] = codes.get(code, 0) + 1

        threads = [threading.Thread(target=flood) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert set(codes) == {"OK"}, codes
        return Observation(f"{codes}", True)

    under_attack(mesh, target, "forged merged counts", attack).judge().check()
