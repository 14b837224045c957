"""``meshserve check-repo``: a human report on every model of a repository."""
from __future__ import annotations

from pathlib import Path

from meshserve.repository.layout import ModelEntry, scan

__all__ = ["check_repository", "format_entry"]


def _versions(values: list[int]) -> str:
    return ",".join(map(str, values)) or "-"


def _columns(entry: ModelEntry) -> list[str]:
    config = entry.config
    if config is None:
        runtime, batch = "-", "-"
    else:
        runtime = "/".join(x for x in (config.platform, config.backend) if x) or "-"
        batch = f"max_batch_size {config.max_batch_size}"
    return [
        "ok" if entry.ok else "FAIL",
        entry.name,
        entry.kind or ("unsupported" if config is not None else "-"),
        f"versions {_versions(entry.versions)} of {_versions(entry.available_versions)}",
        runtime,
        batch,
    ]


def format_entry(entry: ModelEntry, widths: list[int] | None = None) -> list[str]:
    """The report lines of one model: a summary line, then one indented line per problem."""
    cols = _columns(entry)
    if widths is not None:
        cols = [c.ljust(w) for c, w in zip(cols, widths, strict=False)]
    return ["  ".join(cols).rstrip(), *(f"    - {p}" for p in entry.problems)]


def check_repository(path: str | Path, *, gpu_available: bool = False) -> tuple[str, bool]:
    """Scan a repository and report every model: status, name, service kind, versions selected
    of available, platform/backend, max_batch_size, then its problems indented.
    Returns ``(report, ok)``; ok is False when any model has a problem or the path is no
    repository. Never raises for a bad repository."""
    try:
        entries = scan(path, gpu_available=gpu_available)
    except (FileNotFoundError, NotADirectoryError, PermissionError) as e:
        return f"model repository {path}: {e}", False
    if not entries:
        return f"model repository {path}: no model directories", True
    rows = [_columns(e) for e in entries]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"model repository {path}:"]
    for entry in entries:
        lines.extend(format_entry(entry, widths))
    failed = sum(1 for e in entries if not e.ok)
    lines.append(f"{len(entries)} model(s), {failed} with problems")
    return "\n".join(lines), failed == 0
