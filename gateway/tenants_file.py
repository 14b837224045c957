"""tenants.yaml's schema (gateway/auth.py reads it): pydantic models, imported only when a
gateway has a tenants file (docs/perf/suite-time.md)."""
from __future__ import annotations

import fnmatch

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gateway import yaml_file
from gateway.quotas.bucket import Limits


class TenantSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    keys_sha256: list[str] = Field(default_factory=list)
    certificate_names: list[str] = Field(default_factory=list)  # client certificates naming it (mutual TLS)
    rate: float = Field(gt=0)
    burst: float = Field(ge=1)
    max_concurrency: int | None = Field(default=None, ge=1)
    models: list[str] = Field(default_factory=lambda: ["*"])
    priority: int | None = Field(default=None, ge=0)
    admin: bool = False
    share: float | None = Field(default=None, gt=0, le=1)  # of every process-wide cap; default: the file's

    @field_validator("keys_sha256")
    @classmethod
    def _hex_digests(cls, keys: list[str]) -> list[str]:
        out = []
        for k in keys:
            k = k.strip().lower()
            if len(k) != 64 or any(c not in "0123456789abcdef" for c in k):
                raise ValueError(f"'{k}' is not a sha256 hex digest (64 hex characters)")
            out.append(k)
        return out

    @model_validator(mode="after")
    def _identified(self) -> TenantSpec:
        if not self.keys_sha256 and not self.certificate_names:
            raise ValueError(f"tenant '{self.name}' needs keys_sha256 or certificate_names (or both)")
        if any(not n.strip() or "\n" in n for n in self.certificate_names):
            raise ValueError(f"tenant '{self.name}': a certificate name is one non-empty line")
        return self

    @property
    def limits(self) -> Limits:
        return Limits(rate=self.rate, burst=self.burst, max_concurrency=self.max_concurrency)

    def may_call(self, model: str) -> bool:
        return any(fnmatch.fnmatchcase(model, pattern) for pattern in self.models)


class TenantsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    anonymous: bool | None = None
    share: float = Field(default=0.5, gt=0, le=1)  # what one tenant may hold of a process-wide cap
    tenants: list[TenantSpec] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique(self) -> TenantsFile:
        names: set[str] = set()
        keys: dict[str, str] = {}
        for t in self.tenants:
            if t.name in names:
                raise ValueError(f"tenant '{t.name}' is listed twice")
            names.add(t.name)
            for k in t.keys_sha256:
                if k in keys:
                    raise ValueError(f"a key of tenant '{t.name}' is also a key of tenant '{keys[k]}'")
                keys[k] = t.name
            for n in t.certificate_names:
                if f"cert:{n}" in keys:
                    raise ValueError(f"certificate name '{n}' of tenant '{t.name}' is also one of tenant "
                                     f"'{keys[f'cert:{n}']}'")
                keys[f"cert:{n}"] = t.name
        return self

    @property
    def anonymous_allowed(self) -> bool:
        return self.anonymous if self.anonymous is not None else not self.tenants


def parse(text: str, source: str = "tenants.yaml") -> TenantsFile:
    """Parse and validate; errors name the file and the offending field."""
    return yaml_file.parse(TenantsFile, text, source)
