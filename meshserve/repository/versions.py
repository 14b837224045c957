"""Version directories of a model and the version_policy that selects among them."""
from __future__ import annotations

from pathlib import Path

from meshserve._proto import model_config_pb2 as mc
from meshserve.repository.errors import ConfigError


def is_version_dir_name(name: str) -> bool:
    """True for a decimal version directory name; like Triton, '007' (leading zeros) is not one."""
    return name.isascii() and name.isdigit() and (len(name) == 1 or not name.startswith("0"))


def available_versions(model_dir: Path) -> list[int]:
    """Numeric version subdirectories of ``model_dir``, ascending. Anything else is ignored."""
    try:
        children = list(Path(model_dir).iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(p.name) for p in children if is_version_dir_name(p.name) and p.is_dir())


def select_versions(policy: mc.ModelVersionPolicy, available: list[int]) -> list[int]:
    """Versions that ``policy`` selects from ``available``, ascending.

    ``latest {num_versions: N}`` picks the highest N, ``all {}`` every version, ``specific
    {versions: [...]}`` exactly those listed; a listed version without a directory raises
    ConfigError naming it. A policy with no choice set selects all versions, as Triton does
    (``normalize`` fills the default ``latest {num_versions: 1}`` when version_policy is absent).
    """
    versions = sorted(set(available))
    choice = policy.WhichOneof("policy_choice")
    if choice == "latest":
        n = policy.latest.num_versions
        return versions[-n:] if n > 0 else []
    if choice == "specific":
        present = set(versions)
        for i, v in enumerate(policy.specific.versions):
            if v not in present:
                shown = ", ".join(map(str, versions)) or "none"
                raise ConfigError("", "", f"version_policy.specific.versions[{i}]",
                                  f"version {v} has no version directory (available: {shown})")
        return sorted(set(policy.specific.versions))
    return versions
