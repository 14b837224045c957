"""A flood of large requests that the service refuses, through a real gateway with the real
tritonclient: the gateway gives back their memory at once. Before, each refused request's error
kept the gateway's frames that forwarded it alive (its future and its error in their locals, a
reference cycle), with the request's bytes, until the next collection, which a server runs
rarely (docs/security.md, "Session 11: error cycles")."""
from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.adversarial.harness import rss
from tests.conftest import service_and_gateway
from tests.integration.refusing_service import REFUSAL

MiB = 1 << 20
SIZE = 16 * MiB  # each request's tensor
REQUESTS = 40  # 640 MiB of refused requests, one after the other


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_refused_large_requests_leave_nothing_in_the_gateway(protocol: str) -> None:
    with service_and_gateway("", [], module="tests.integration.refusing_service") as (_, gateway):
        x = np.zeros(SIZE // 4, np.float32)
        if protocol == "http":
            client = httpclient.InferenceServerClient(gateway.http, network_timeout=60)
            inp = httpclient.InferInput("IN", [x.size], "FP32")
            inp.set_data_from_numpy(x, binary_data=True)
        else:
            client = grpcclient.InferenceServerClient(gateway.grpc, channel_args=[
                ("grpc.max_send_message_length", 2 * SIZE), ("grpc.max_receive_message_length", 2 * SIZE)])
            inp = grpcclient.InferInput("IN", [x.size], "FP32")
            inp.set_data_from_numpy(x)

        def refused() -> None:
            with pytest.raises(InferenceServerException) as err:
                client.infer("big", [inp])
            assert REFUSAL in str(err.value)

        for _ in range(3):
            refused()  # (warm: the first requests' allocations)
        before = rss(gateway.proc.pid)
        peak = before
        for _ in range(REQUESTS):
            refused()
            peak = max(peak, rss(gateway.proc.pid))
        client.close()
        grown = (peak - before) / MiB
        print(f"{protocol}: gateway RSS {before / MiB:.0f} MiB, peak +{grown:.0f} MiB")  # (the figures, shown with -s)
        assert grown < 100, f"gateway RSS grew {grown:.0f} MiB over {REQUESTS} refused {SIZE // MiB} MiB requests"
