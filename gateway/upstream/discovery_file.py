"""The discovery file's schema (gateway/upstream/pool.py reads it): pydantic models, imported only
when a gateway has a discovery file (docs/perf/suite-time.md)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway import yaml_file
from gateway.upstream.pool import split_endpoint


class ServiceEndpoints(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: str = ""
    endpoints: list[str] = Field(min_length=1)

    @field_validator("endpoints")
    @classmethod
    def _host_port(cls, eps: list[str]) -> list[str]:
        for ep in eps:
            split_endpoint(ep)
        return eps


class DiscoveryFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    resolve_interval_s: float | None = Field(default=None, gt=0)  # default: --resolve-interval
    services: list[ServiceEndpoints] = Field(default_factory=list)

    @property
    def endpoints(self) -> list[str]:
        return [ep for s in self.services for ep in s.endpoints]


def parse(text: str, source: str = "discovery.yaml") -> DiscoveryFile:
    return yaml_file.parse(DiscoveryFile, text, source)
