"""The HTTP front door's own cost per infer request, in process (json-pa and the bench mlp
included): ../2026-11-26-s4-httppath/http_path.py, run as it is.

usage: python http_path.py add_sub|mlp binary|json|json-pa N [profile]
"""
import runpy
from pathlib import Path

if __name__ == "__main__":
    runpy.run_path(str(Path(__file__).resolve().parents[1] / "2026-11-26-s4-httppath" / "http_path.py"),
                   run_name="__main__")
