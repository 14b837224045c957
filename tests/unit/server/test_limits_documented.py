"""Every limit is documented: each ServerLimits flag appears in docs/security.md with its default."""
from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

from meshserve.server import limits

DOC = (Path(__file__).resolve().parents[3] / "docs" / "security.md").read_text()


def test_every_limit_flag_is_in_docs_security() -> None:
    names = [limits.flag(f.name) for f in fields(limits.ServerLimits) if f.name != "tls"]
    names += [f"--{proto}-{flag}" for proto in ("grpc", "http")  # the `tls` field: the TLS flags
              for flag in ("use-ssl", "use-ssl-mutual", "server-cert", "server-key", "root-cert")]
    missing = [name for name in names if f"`{name}`" not in DOC]
    assert not missing, f"docs/security.md does not list {missing}"


def test_flags_round_trip_into_the_record() -> None:
    ap = argparse.ArgumentParser()
    limits.add_arguments(ap)
    got = limits.from_args(ap.parse_args(["--max-inflight", "7", "--header-timeout-s", "0.5"]))
    assert got.max_inflight == 7 and got.header_timeout_s == 0.5
    assert got.max_request_bytes == limits.ServerLimits().max_request_bytes
