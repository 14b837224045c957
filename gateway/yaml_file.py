"""The gateway's YAML files (tenants, routes, discovery): read with yaml, checked by their
pydantic schema (gateway/tenants_file.py, gateway/routing/routes_file.py,
gateway/upstream/discovery_file.py). Imported by those modules only, so pydantic and yaml load
only in a gateway that has such a file (docs/perf/suite-time.md)."""
from __future__ import annotations

from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

_Schema = TypeVar("_Schema", bound=BaseModel)


def parse(schema: type[_Schema], text: str, source: str) -> _Schema:
    """``text`` read as YAML (empty: ``{}``) and validated by ``schema``; ValueError naming
    ``source`` and the offending field otherwise."""
    try:
        return schema.model_validate(yaml.safe_load(text) or {})
    except (yaml.YAMLError, ValidationError) as exc:
        raise ValueError(f"{source}: {exc}") from None
