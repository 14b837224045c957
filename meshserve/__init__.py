import os as _os

if _os.environ.get("MESHSERVE_NATIVE", "") not in ("", "0"):  # the compiled hot path when built: meshserve/native.py
    from meshserve import native as _native

    _native.enable()
