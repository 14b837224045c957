"""Scheduling imports neither grpc nor the server nor the runtime (DESIGN §3 layering)."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import services.base.scheduling as scheduling

PACKAGE = Path(scheduling.__file__).parent


def test_scheduling_imports_only_the_standard_library_and_itself() -> None:
    offenders: list[str] = []
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: inside the package
                    continue
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top != "__future__" and top not in sys.stdlib_module_names:
                    offenders.append(f"{path.name}: import {name}")
    assert offenders == []
