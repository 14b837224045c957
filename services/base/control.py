"""Model control: Triton's --model-control-mode none | poll | explicit for a service.

none:     load every model at start; the load/unload API is refused.
explicit: load the --load-model names at start ("*" = all); load/unload through the API.
poll:     load every model at start, then rescan the repository every --repository-poll-secs
          and reload what changed (a new config, a new or removed version directory, a
          replaced model file): load the new version set, then drain and retire the old one.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

MODES = ("none", "poll", "explicit")


@dataclass(frozen=True)
class ModelControl:
    mode: str = "none"
    startup_models: frozenset[str] = field(default_factory=frozenset)
    poll_secs: float = 15.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--model-control-mode must be one of {', '.join(MODES)}, got '{self.mode}'")
        if self.startup_models and self.mode != "explicit":
            raise ValueError("--load-model needs --model-control-mode explicit")
        if self.poll_secs <= 0:
            raise ValueError(f"--repository-poll-secs must be > 0, got {self.poll_secs}")

    def loads_at_start(self, name: str) -> bool:
        return self.mode != "explicit" or "*" in self.startup_models or name in self.startup_models

    def api_error(self) -> str | None:
        """Why the load/unload API is refused in this mode, or None when it is allowed."""
        if self.mode == "explicit":
            return None
        return ("explicit model load / unload is not allowed if polling is enabled (Triton's words in every mode but "
                f"explicit; this one is '{self.mode}': start with --model-control-mode explicit)")


def fingerprint(model_dir: Path) -> tuple:
    """What a reload depends on: config.pbtxt and every version directory's files (mtime, size)."""
    items: list[tuple[str, int, int]] = []
    try:
        entries = sorted(os.scandir(model_dir), key=lambda e: e.name)
    except OSError:
        return ()
    for e in entries:
        if e.name == "config.pbtxt" and e.is_file():
            st = e.stat()
            items.append((e.name, st.st_mtime_ns, st.st_size))
        elif e.is_dir() and e.name.isdigit():
            items.append((e.name, 0, 0))
            for f in sorted(os.scandir(e.path), key=lambda x: x.name):
                if f.is_file():
                    st = f.stat()
                    items.append((f"{e.name}/{f.name}", st.st_mtime_ns, st.st_size))
    return tuple(items)
