"""`meshserve up`'s flags for the hop and BLS (meshserve/cli.py): a throwaway hop key by default,
the mesh CA with --mesh-tls, the operator's key file when given; BLS over TLS when the gateway's
gRPC port serves TLS; `meshserve hop-key FILE` for processes started by hand."""
from __future__ import annotations

from pathlib import Path

import pytest

from meshserve.cli import _hop_auth, _up_python_flags, build_parser, main
from meshserve.server.tls import load_hop_key


def test_a_throwaway_key_unless_one_is_given(tmp_path: Path) -> None:
    services, gateway = _hop_auth(build_parser().parse_args(["up"]), tmp_path)
    key = tmp_path / "hop.key"
    assert services == gateway == ["--hop-key-file", str(key)]
    assert oct(key.stat().st_mode & 0o777) == "0o600" and len(key.read_text()) == 64
    mine = tmp_path / "mine.key"
    mine.write_text("k" * 40)
    services, gateway = _hop_auth(build_parser().parse_args(["up", "--hop-key-file", str(mine)]), tmp_path / "x")
    assert services == gateway == ["--hop-key-file", str(mine)]


def test_hop_key_writes_a_new_key_and_never_overwrites_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key = tmp_path / "hop.key"
    main(["hop-key", str(key)])
    assert oct(key.stat().st_mode & 0o777) == "0o600" and len(load_hop_key(str(key))) == 64
    assert f"--hop-key-file {key}" in capsys.readouterr().out
    first = key.read_text()
    with pytest.raises(SystemExit, match="exists"):
        main(["hop-key", str(key)])
    assert key.read_text() == first
    with pytest.raises(SystemExit, match="cannot write"):
        main(["hop-key", str(tmp_path / "no-such-dir" / "hop.key")])


def test_mesh_tls_uses_the_mesh_ca(tmp_path: Path) -> None:
    pytest.importorskip("cryptography")
    services, gateway = _hop_auth(build_parser().parse_args(["up", "--mesh-tls"]), tmp_path)
    assert "--grpc-use-ssl-mutual=true" in services and "--upstream-client-cert" in gateway
    assert "--hop-key-file" not in services + gateway and not (tmp_path / "mesh-ca.key").exists()


def test_bls_follows_the_gateways_grpc_tls(tmp_path: Path) -> None:
    plain = _up_python_flags(build_parser().parse_args(["up"]), 8001)
    assert "--bls-use-ssl" not in plain
    args = build_parser().parse_args(["up", "--grpc-use-ssl-mutual", "--grpc-root-cert", "ca.pem",
                                      "--bls-client-cert", "c.pem", "--bls-client-key", "k.pem"])
    flags = _up_python_flags(args, 8001)
    assert flags[flags.index("--bls-root-cert") + 1] == "ca.pem" and "--bls-use-ssl" in flags
    assert flags[flags.index("--bls-client-cert") + 1] == "c.pem" and flags[flags.index("--bls-client-key") + 1] == "k.pem"
