"""routes.yaml's schema (gateway/routing/ab.py reads it): pydantic models, imported only when a
gateway has a routes file (docs/perf/suite-time.md)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gateway import yaml_file
from meshserve.repository.names import NAME_RULE, is_valid_model_name


def _model_name(v: str) -> str:
    if not is_valid_model_name(v):
        raise ValueError(f"invalid name {v!r}: {NAME_RULE}")
    return v


def _version(v: object) -> str:
    s = "" if v is None else str(v)
    if s and not s.isdigit():
        raise ValueError(f"version '{s}' is not a number")
    return s


class ModelRef(BaseModel):
    """A {model, version} that a route sends to: a target or the shadow."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1)
    version: str = ""  # "" = the model's highest ready version

    @field_validator("model")
    @classmethod
    def _model(cls, v: str) -> str:
        return _model_name(v)

    @field_validator("version", mode="before")
    @classmethod
    def _version(cls, v: object) -> str:
        return _version(v)


class Target(ModelRef):
    weight: int = Field(default=1, ge=0)
    arm: str = ""

    @property
    def name(self) -> str:
        return self.arm or (f"{self.model}:{self.version}" if self.version else self.model)


class Shadow(ModelRef):
    share: float = Field(default=1.0, gt=0, le=1)


class RouteSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    targets: list[Target] = Field(min_length=1)
    sticky: str | None = None
    shadow: Shadow | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _model_name(v)  # addressable like a model: the same rule

    @field_validator("sticky")
    @classmethod
    def _lower(cls, v: str | None) -> str | None:
        return v.lower() if v else None  # headers reach the core lower-cased

    @model_validator(mode="after")
    def _weights(self) -> RouteSpec:
        if sum(t.weight for t in self.targets) <= 0:
            raise ValueError(f"route '{self.name}': the target weights add up to 0")
        arms = [t.name for t in self.targets]
        if len(set(arms)) != len(arms):
            raise ValueError(f"route '{self.name}': two targets share the arm name {arms}")
        return self


class RoutesFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    routes: list[RouteSpec] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique(self) -> RoutesFile:
        names = [r.name for r in self.routes]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"route names listed twice: {sorted(dup)}")
        return self


def parse(text: str, source: str = "routes.yaml") -> RoutesFile:
    return yaml_file.parse(RoutesFile, text, source)
