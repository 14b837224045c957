"""The model-control rule (meshserve.server.repository_control): uploads, loopback-only control."""
from __future__ import annotations

import pytest

from meshserve.protocol.errors import Code, InferError
from meshserve.server.repository_control import ControlPolicy, is_loopback

UPLOAD = {"config": object(), "file:1/model.py": object()}


@pytest.mark.parametrize("peer", ["127.0.0.1", "127.8.9.10", "::1", "ipv4:127.0.0.1:5000", "ipv6:[::1]:5000",
                                  "ipv6:%5B::1%5D:5000", "::ffff:127.0.0.1", "ipv6:[::ffff:127.0.0.1]:1"])
def test_loopback_peers(peer: str) -> None:
    assert is_loopback(peer)


@pytest.mark.parametrize("peer", [None, "", "10.0.0.1", "192.0.2.2", "ipv4:10.1.2.3:5000", "ipv6:[fd00::2]:5000",
                                  "::ffff:10.0.0.1", "unix:/tmp/s", "localhost", "127.0.0.1.evil", "garbage"])
def test_other_peers(peer: str | None) -> None:
    assert not is_loopback(peer)


def _code(policy: ControlPolicy, parameters: dict[str, object], peer: str | None, tenants: bool) -> Code | None:
    try:
        policy.check("load", "m", parameters, peer, tenants)
    except InferError as exc:
        return exc.code
    return None


def test_uploads_need_the_flag_whoever_asks() -> None:
    for peer, tenants in (("127.0.0.1", False), ("10.0.0.1", True)):
        assert _code(ControlPolicy(), UPLOAD, peer, tenants) is Code.PERMISSION_DENIED
        assert _code(ControlPolicy(allow_uploads=True), UPLOAD, peer, tenants) is None
    with pytest.raises(InferError) as err:
        ControlPolicy(allow_remote=True).check("load", "m", UPLOAD, "127.0.0.1", False)
    assert "--allow-model-uploads" in err.value.message and err.value.http_status == 403


def test_without_tenants_control_is_loopback_only_unless_opened() -> None:
    assert _code(ControlPolicy(), {}, "127.0.0.1", False) is None
    assert _code(ControlPolicy(), {"config": object()}, "ipv4:10.0.0.1:1", False) is Code.PERMISSION_DENIED
    assert _code(ControlPolicy(), {}, None, False) is Code.PERMISSION_DENIED  # unknown peer: refused
    assert _code(ControlPolicy(allow_remote=True), {}, "10.0.0.1", False) is None
    assert _code(ControlPolicy(), {}, "10.0.0.1", True) is None  # tenants: the access table decided
