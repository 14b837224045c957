"""Triton model repository: config pipeline, layout scan, version policy, check-repo report."""
from meshserve.repository.check import check_repository
from meshserve.repository.config import (
    ConfigError,
    autocomplete,
    config_errors,
    load_model_config,
    normalize,
    parse_config,
    parse_config_json,
    prepare_config,
    problems,
    validate,
)
from meshserve.repository.layout import (
    ModelEntry,
    available_versions,
    model_file,
    scan,
    scan_model,
    select_versions,
    service_kind,
)

__all__ = [
    "ConfigError",
    "ModelEntry",
    "autocomplete",
    "available_versions",
    "check_repository",
    "config_errors",
    "load_model_config",
    "model_file",
    "normalize",
    "parse_config",
    "parse_config_json",
    "prepare_config",
    "problems",
    "scan",
    "scan_model",
    "select_versions",
    "service_kind",
    "validate",
]
