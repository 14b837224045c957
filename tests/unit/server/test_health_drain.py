"""grpc.health.v1 at a drain (meshserve/server/health.py): ``HealthState.close`` says NOT_SERVING
for every service, for good, and each open Watch ends once it has said so, so that a watcher (a
gateway's) does not hold the server's stop for its grace."""
from __future__ import annotations

import asyncio

from meshserve._proto import health_pb2
from meshserve.server.health import NOT_SERVING, SERVING, HealthServicer, HealthState


async def test_close_ends_every_watch_after_its_not_serving() -> None:
    state = HealthState()
    state.set("", SERVING)
    state.set("m", SERVING)
    servicer = HealthServicer(state)
    seen: dict[str, list[int]] = {"": [], "m": []}

    async def watch(service: str) -> None:
        async for resp in servicer.Watch(health_pb2.HealthCheckRequest(service=service), None):  # type: ignore[arg-type]
            seen[service].append(resp.status)

    tasks = [asyncio.ensure_future(watch(s)) for s in seen]
    for _ in range(100):  # (each watch says SERVING within a few loop passes)
        if all(seen.values()):
            break
        await asyncio.sleep(0)
    assert seen == {"": [SERVING], "m": [SERVING]}
    state.close()
    await asyncio.wait_for(asyncio.gather(*tasks), 2)  # both ended
    assert seen == {"": [SERVING, NOT_SERVING], "m": [SERVING, NOT_SERVING]}
    state.set("", SERVING)  # (a late set changes nothing once closed)
    assert state.get("") == NOT_SERVING
    # a watch begun after the close says NOT_SERVING and ends
    late = [r.status async for r in servicer.Watch(health_pb2.HealthCheckRequest(service=""), None)]  # type: ignore[arg-type]
    assert late == [NOT_SERVING]
