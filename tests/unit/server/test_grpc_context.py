"""The gRPC front door's context per call (grpc_frontend._context): the vetted headers of a call
without the hop marker are kept by its metadata tuple (the h2 server's per-block tuple) and shared
by the next calls with the same tuple; a marked call is vetted every time (its token is checked per
call), and with mutual-TLS certificate names nothing is kept (they are the connection's)."""
from __future__ import annotations

from typing import Any

import pytest

from meshserve.protocol import hop
from meshserve.server import grpc_frontend, tls
from meshserve.server.grpc_frontend import _VETTED, _VETTED_KEPT, _context


class _Call:
    def __init__(self, md: tuple[tuple[str, Any], ...], deadline: float | None = None):
        self.md = md
        self.deadline = deadline

    def invocation_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self.md


@pytest.fixture(autouse=True)
def _fresh() -> Any:
    _VETTED.clear()
    yield
    _VETTED.clear()


def test_calls_with_the_same_metadata_tuple_share_the_vetted_headers() -> None:
    md = (("user-agent", "pa"), ("x-api-key", "k1"), ("bin-bin", b"\x00"))
    first = _context(_Call(md, 5.0), b"r1")
    second = _context(_Call(md), b"r2")
    assert first.headers == {"user-agent": "pa", "x-api-key": "k1"}  # (binary metadata left out)
    assert second.headers is first.headers
    assert (first.deadline, first.raw, second.deadline, second.raw) == (5.0, b"r1", None, b"r2")
    # an equal tuple that is another object (another block, another connection) is vetted anew
    other = _context(_Call(tuple(md)[:2] + md[2:]))
    assert other.headers == first.headers and other.headers is not first.headers
    assert _context(_Call(())).headers == {}


def test_a_marked_call_is_vetted_every_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hop, "trusted", True)
    seen: list[dict[str, str]] = []
    vet = hop.vet

    def counting(headers: dict[str, str]) -> dict[str, str]:
        seen.append(dict(headers))
        return vet(headers)

    monkeypatch.setattr(grpc_frontend.hop, "vet", counting)
    md = ((hop.HEADER, hop.GATEWAY), ("user-agent", "gw"))
    a, b = _context(_Call(md)), _context(_Call(md))
    assert len(seen) == 2 and a.headers is not b.headers and not _VETTED
    assert a.headers[hop.HEADER] is hop.FRAMED or a.headers[hop.HEADER] is hop.VERIFIED


def test_certificate_names_are_never_shared(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tls, "cert_names_grpc", True)
    md = (("user-agent", "pa"), (tls.CLIENT_CERT_HEADER, "forged"))
    a, b = _context(_Call(md)), _context(_Call(md))
    assert a.headers is not b.headers and tls.CLIENT_CERT_HEADER not in a.headers and not _VETTED
    # a tuple kept before the names were switched on is not used either
    monkeypatch.setattr(tls, "cert_names_grpc", False)
    kept = _context(_Call(md))
    assert _VETTED and kept.headers[tls.CLIENT_CERT_HEADER] == "forged"
    monkeypatch.setattr(tls, "cert_names_grpc", True)
    assert tls.CLIENT_CERT_HEADER not in _context(_Call(md)).headers


def test_the_cache_is_bounded() -> None:
    tuples = [(("n", str(i)),) for i in range(3 * _VETTED_KEPT)]
    for md in tuples:
        assert _context(_Call(md)).headers == {"n": md[0][1]}
        assert len(_VETTED) <= _VETTED_KEPT
