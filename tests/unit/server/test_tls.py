"""meshserve/server/tls.py's pure parts: the flags, the reload rule, the handshake cap."""
from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

import pytest

from meshserve.server import certs, limits, tls


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path, certs.Authority]:
    ca = certs.authority(tmp_path, "ca")
    server = ca.issue(tmp_path, "server", server=True)
    return server.cert, server.key, ca


def _parse(argv: list[str]) -> limits.ServerLimits:
    ap = argparse.ArgumentParser()
    limits.add_arguments(ap)
    return limits.from_args(ap.parse_args(argv))


def test_flags_triton_forms(files: tuple[Path, Path, certs.Authority]) -> None:
    cert, key, ca = files
    assert _parse([]).tls == tls.TlsSettings()  # plaintext by default
    got = _parse(["--grpc-use-ssl=true", "--grpc-server-cert", str(cert), "--grpc-server-key", str(key),
                  "--http-use-ssl-mutual", "--http-server-cert", str(cert), "--http-server-key", str(key),
                  "--http-root-cert", str(ca.cert)]).tls
    assert got.grpc == tls.PortTls(str(cert), str(key), None, False)
    assert got.http == tls.PortTls(str(cert), str(key), str(ca.cert), True)
    assert _parse(["--grpc-use-ssl=false"]).tls.grpc is None
    with pytest.raises(SystemExit, match="--http-server-cert"):
        _parse(["--http-use-ssl"])
    with pytest.raises(SystemExit, match="--grpc-root-cert"):
        _parse(["--grpc-use-ssl-mutual", "--grpc-server-cert", str(cert), "--grpc-server-key", str(key)])
    with pytest.raises(SystemExit, match="cannot load"):
        _parse(["--grpc-use-ssl", "--grpc-server-cert", str(key), "--grpc-server-key", str(key)])


def test_reload_keeps_the_old_context_while_the_new_files_do_not_load(
        files: tuple[Path, Path, certs.Authority], tmp_path: Path) -> None:
    cert, key, ca = files
    acceptor = tls.Acceptor(tls.PortTls(str(cert), str(key)), "http", 10.0, 4)
    first = acceptor.current()
    acceptor.checked = -1e9  # (the next call looks at the files)
    assert acceptor.current() is first  # unchanged files: the same context
    cert.write_text("half a certificate")
    acceptor.checked = -1e9
    assert acceptor.current() is first  # does not load: the previous one stays
    renewed = ca.issue(tmp_path, "renewed", server=True)
    shutil.copy(renewed.key, key)
    shutil.copy(renewed.cert, cert)
    os.utime(cert, ns=(1, 1))  # (a different stamp even within the filesystem's mtime granularity)
    acceptor.checked = -1e9
    assert acceptor.current() is not first


def test_at_the_cap_the_oldest_handshake_is_closed(files: tuple[Path, Path, certs.Authority]) -> None:
    cert, key, _ = files
    acceptor = tls.Acceptor(tls.PortTls(str(cert), str(key)), "grpc", 10.0, 2)

    class Fake:
        aborted = False

        def abort(self) -> None:
            self.aborted = True

    a, b, c = Fake(), Fake(), Fake()
    for hs in (a, b, c):
        acceptor.admit(hs)  # type: ignore[arg-type]
    assert a.aborted and not b.aborted and not c.aborted
    assert list(acceptor.pending) == [b, c] and acceptor.evicted == 1
