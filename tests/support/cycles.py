"""Whether failed requests leave the project's frames in reference cycles: a frame holding the
error its traceback holds (in a local, or through a future that failed with it) is freed only
by the garbage collector, which a server runs rarely (meshserve/server/process.py), keeping
every request it holds (docs/security.md, "Session 11: error cycles")."""
from __future__ import annotations

import contextlib
import gc
import types
from collections.abc import Iterator
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
_OURS = tuple(str(_ROOT / d) for d in ("gateway", "services", "meshserve"))


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    """The garbage collector off (after a full collection) while the block runs."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def cyclic_frames() -> list[str]:
    """'function (file)' for each frame of the project's code that only a collection frees now
    (call it inside ``collector_off`` once the failed calls' errors are dropped)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        return sorted(f"{o.f_code.co_name} ({Path(o.f_code.co_filename).relative_to(_ROOT)})"
                      for o in gc.garbage
                      if isinstance(o, types.FrameType) and o.f_code.co_filename.startswith(_OURS))
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
