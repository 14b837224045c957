"""Scenario files: a weighted mix of (model, protocol, tenant) targets, validated with pydantic.

```yaml
name: mixed
http: 127.0.0.1:8000          # host:port of the HTTP endpoint
grpc: 127.0.0.1:8001          # host:port of the gRPC endpoint
mode: closed                  # closed (fixed concurrency) | open (Poisson arrivals)
concurrency: 8                # closed loop
rate: 200                     # open loop, requests/s
duration_s: 10                # or requests: N
warmup_s: 1
tenants:
  alice: {api_key: key-a}
targets:
  - {model: add_sub, protocol: grpc, weight: 3, tenant: alice}
  - {model: mlp, protocol: http-binary, weight: 1, input_file: perf_data/mlp.json}
```
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

Protocol = Literal["http-json", "http-binary", "grpc", "grpc-stream"]
PROTOCOLS: tuple[str, ...] = ("http-json", "http-binary", "grpc", "grpc-stream")


class Tenant(BaseModel):
    model_config = ConfigDict(extra="forbid")
    api_key: str = Field(min_length=1, description="sent as `Authorization: Bearer <key>` (header / metadata)")


class Target(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())
    model: str = Field(min_length=1)
    version: str = ""
    protocol: Protocol = "http-binary"
    weight: float = Field(default=1.0, gt=0)
    tenant: str | None = None
    batch: int = Field(default=1, ge=1)
    input_file: Path | None = None

    @property
    def label(self) -> str:
        t = f"@{self.tenant}" if self.tenant else ""
        b = f":b{self.batch}" if self.batch != 1 else ""
        return f"{self.model}{'/' + self.version if self.version else ''}:{self.protocol}{b}{t}"


class Scenario(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = "adhoc"
    http: str = "127.0.0.1:8000"
    grpc: str = "127.0.0.1:8001"
    mode: Literal["closed", "open"] = "closed"
    concurrency: int = Field(default=1, ge=1)
    rate: float | None = Field(default=None, gt=0)
    duration_s: float | None = Field(default=10.0, gt=0)
    requests: int | None = Field(default=None, ge=1)
    warmup_s: float = Field(default=1.0, ge=0)
    max_inflight: int = Field(default=4096, ge=1, description="open loop: cap on outstanding requests")
    timeout_s: float = Field(default=30.0, gt=0)
    http_client: Literal["raw", "aiohttp"] = Field(
        default="raw", description="raw: the generator's own keep-alive HTTP/1.1 client (cheap); aiohttp")
    grpc_client: Literal["h2", "aio"] = Field(
        default="h2", description="unary gRPC: h2 = meshserve's own HTTP/2 client (cheap); aio = grpc.aio")
    seed: int = 0
    tenants: dict[str, Tenant] = Field(default_factory=dict)
    targets: list[Target] = Field(min_length=1)

    @model_validator(mode="after")
    def _check(self) -> Scenario:
        if self.mode == "open" and self.rate is None:
            raise ValueError("mode 'open' needs `rate` (requests/s)")
        if self.requests is None and self.duration_s is None:
            raise ValueError("give `duration_s` or `requests`")
        for t in self.targets:
            if t.tenant is not None and t.tenant not in self.tenants:
                raise ValueError(f"target {t.label}: tenant '{t.tenant}' is not defined under `tenants` "
                                 f"(defined: {', '.join(self.tenants) or 'none'})")
        return self


def load_scenario(path: Path, overrides: dict[str, object] | None = None) -> Scenario:
    raw = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a scenario is a mapping")
    raw.update({k: v for k, v in (overrides or {}).items() if v is not None})
    base = Path(path).parent
    for t in raw.get("targets", []) or []:
        if isinstance(t, dict) and t.get("input_file") and not Path(t["input_file"]).is_absolute():
            t["input_file"] = str(base / t["input_file"])
    return Scenario.model_validate(raw)
