"""ReplicaPool: the service endpoints the gateway forwards to.

Endpoints come from `--upstream HOST:PORT` flags and/or a discovery YAML (`--discovery FILE`,
re-read when it changes). A DNS name is resolved again every `resolve_interval_s`: every address
it resolves to is a replica (compose scale, k8s headless services); an IP literal is one replica.
A failed lookup keeps the previous addresses.

    # discovery.yaml
    resolve_interval_s: 10
    services:
      - kind: onnx
        endpoints: ["onnx:9001", "10.0.0.7:9001"]
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.upstream.replica import Replica

if TYPE_CHECKING:
    from gateway.upstream.discovery_file import DiscoveryFile

log = logging.getLogger("meshserve.gateway.pool")


def parse_discovery(text: str, source: str = "discovery.yaml") -> DiscoveryFile:
    from gateway.upstream.discovery_file import (
        parse,  # (pydantic and yaml only with such a file: docs/perf/suite-time.md)
    )

    return parse(text, source)


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"endpoint '{endpoint}' is not HOST:PORT")
    return host.strip("[]"), int(port)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _join(addr: str, port: int) -> str:
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


class ReplicaPool:
    """The live replica list (one list object, updated in place, shared with discovery and core)."""

    def __init__(self, upstreams: list[str], discovery_file: str | Path | None = None,
                 resolve_interval_s: float = 10.0):
        for ep in upstreams:
            split_endpoint(ep)
        self.upstreams = list(upstreams)
        self.file = Path(discovery_file) if discovery_file else None
        self._file_stamp: tuple[int, int] | None = None
        self._file_endpoints: list[str] = []
        self.resolve_interval_s = resolve_interval_s
        if self.file is not None:
            self._read_file(initial=True)
        if not self.endpoints():
            raise ValueError("the gateway needs at least one upstream (--upstream or --discovery)")
        self.replicas: list[Replica] = []
        self._resolved: dict[str, list[str]] = {}  # endpoint spec -> addresses last resolved

    def endpoints(self) -> list[str]:
        return list(dict.fromkeys(self.upstreams + self._file_endpoints))

    def _read_file(self, initial: bool = False) -> None:
        assert self.file is not None
        try:
            st = os.stat(self.file)
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp == self._file_stamp:
                return
            spec = parse_discovery(self.file.read_text(), str(self.file))
        except (OSError, ValueError) as exc:
            if initial:
                raise ValueError(str(exc)) from None
            log.error("keeping the previous endpoints: %s", exc)
            return
        self._file_stamp = stamp
        self._file_endpoints = spec.endpoints
        if spec.resolve_interval_s is not None:
            self.resolve_interval_s = spec.resolve_interval_s
        if not initial:
            log.info("reloaded %s: %d endpoints", self.file, len(spec.endpoints))

    async def _addresses(self, endpoint: str) -> list[str]:
        host, port = split_endpoint(endpoint)
        if _is_ip(host):
            return [endpoint]
        loop = asyncio.get_running_loop()
        for family in (socket.AF_INET, socket.AF_INET6):
            try:
                infos = await loop.getaddrinfo(host, port, family=family, type=socket.SOCK_STREAM)
            except OSError:
                continue
            addrs = sorted({str(info[4][0]) for info in infos})
            if addrs:
                return [_join(a, port) for a in addrs]
        previous = self._resolved.get(endpoint)
        log.warning("cannot resolve %s; keeping %s", endpoint, previous or "no replicas")
        return previous or []

    async def resolve(self) -> tuple[list[Replica], list[Replica]]:
        """Re-read the file, re-resolve every name; returns (added, removed) replicas."""
        if self.file is not None:
            self._read_file()
        specs = self.endpoints()
        found = await asyncio.gather(*(self._addresses(ep) for ep in specs))
        self._resolved = dict(zip(specs, found, strict=True))
        wanted = list(dict.fromkeys(a for addrs in found for a in addrs))
        have = {r.endpoint: r for r in self.replicas}
        added = [Replica(ep) for ep in wanted if ep not in have]
        removed = [r for r in self.replicas if r.endpoint not in set(wanted)]
        if added or removed:
            self.replicas[:] = [r for r in self.replicas if r.endpoint in set(wanted)] + added
            for r in added:
                log.info("replica %s joined the pool", r.endpoint)
            for r in removed:
                log.info("replica %s left the pool (no longer resolved)", r.endpoint)
        return added, removed
