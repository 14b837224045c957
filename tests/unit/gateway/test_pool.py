"""ReplicaPool: endpoints from flags and a discovery YAML, names re-resolved into replicas."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from gateway.upstream.pool import ReplicaPool, parse_discovery, split_endpoint


def test_endpoint_and_file_validation() -> None:
    assert split_endpoint("svc:9001") == ("svc", 9001)
    assert split_endpoint("[::1]:9001") == ("::1", 9001)
    for bad in ("svc", "svc:", ":9001", "svc:port"):
        with pytest.raises(ValueError):
            split_endpoint(bad)
    with pytest.raises(ValueError, match="endpoints"):
        parse_discovery("services: [{kind: onnx, endpoints: []}]")
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_discovery("services: [{kind: onnx, endpoints: [nope]}]")
    with pytest.raises(ValueError, match="at least one upstream"):
        ReplicaPool([])


async def test_names_resolve_to_every_address_and_file_reloads(tmp_path: Path) -> None:
    path = tmp_path / "discovery.yaml"
    path.write_text("resolve_interval_s: 0.5\nservices:\n  - kind: onnx\n    endpoints: ['localhost:9001']\n")
    pool = ReplicaPool(["10.1.2.3:9001"], path, resolve_interval_s=10)
    assert pool.resolve_interval_s == 0.5
    try:
        added, removed = await pool.resolve()
        assert [r.endpoint for r in pool.replicas] == ["10.1.2.3:9001", "127.0.0.1:9001"]
        assert len(added) == 2 and not removed
        same = pool.replicas[1]
        assert await pool.resolve() == ([], [])  # nothing changed: same Replica objects kept
        assert pool.replicas[1] is same
        path.write_text("services:\n  - endpoints: ['127.0.0.2:9001', 'no-such-host.invalid:9001']\n")
        os.utime(path, ns=(1, 10**18))
        added, removed = await pool.resolve()
        assert [r.endpoint for r in pool.replicas] == ["10.1.2.3:9001", "127.0.0.2:9001"]
        assert [r.endpoint for r in removed] == ["127.0.0.1:9001"]
        path.write_text("services: [")  # an invalid edit keeps the previous endpoints
        os.utime(path, ns=(1, 2 * 10**18))
        assert await pool.resolve() == ([], [])
        for r in removed:
            await r.close()
    finally:
        for r in pool.replicas:
            await r.close()
