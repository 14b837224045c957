"""Requests that fail at the front ends (HTTP infer / generate / generate_stream, gRPC
ModelInfer and ModelStreamInfer; refused, unknown, or failed by the model) leave no frame of
the project's code in a reference cycle (tests/support/cycles.py; docs/security.md,
"Session 11: error cycles"). The servers of test_decoupled_frontends, in process."""
from __future__ import annotations

import grpc

from tests.support.cycles import collector_off, cyclic_frames
from tests.unit.server.test_decoupled_frontends import INFER, Servers, one_int, post, repeat, servers, stream

__all__ = ["servers"]  # (the fixture)


async def _failures(s: Servers) -> list[object]:
    got: list[object] = []
    for path, body in (("/v2/models/repeat_int32/generate", {"IN": [1, 2], "DELAY": [0], "WAIT": 0}),
                       ("/v2/models/faulty_stream/generate_stream", {"IN": 3}),
                       ("/v2/models/faulty_stream/generate", {"IN": 3}),
                       ("/v2/models/nope/generate", {"text_input": "hi"}),
                       ("/v2/models/nope/infer", {"inputs": []}),
                       ("/v2/models/repeat_int32/infer", b"{not json")):
        got.append((await post(s, path, body))[0])
    answers = await stream(s.grpc, [one_int("faulty_stream", "f1", 3), one_int("nope", "n1", 3),
                                    repeat("r1", [1, 2], [0])])
    got.append([a.error_message != "" for a in answers])
    async with grpc.aio.insecure_channel(s.grpc) as channel:
        for request in (one_int("nope", "n2", 1), repeat("r2", [1])):
            try:
                await channel.unary_unary(INFER)(request.SerializeToString())
            except grpc.aio.AioRpcError as exc:
                got.append(exc.code())
    return got


async def test_failed_requests_at_the_front_ends_leave_no_cycle(servers: Servers) -> None:
    first = await _failures(servers)
    assert first[:6] == [400, 200, 400, 404, 404, 400], first  # (generate_stream: 200, the error an event)
    with collector_off():
        for _ in range(3):
            assert await _failures(servers) == first
        assert cyclic_frames() == []
