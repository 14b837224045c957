"""docs/architecture.md names the code it describes as `path/to/file.py:Name` or
`path/to/file.py:Class.method`; every such reference must exist (checked on the AST), so the
request path on that page cannot drift from the code unnoticed."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.conftest import ROOT

PAGES = ("docs/architecture.md",)
REFERENCE = re.compile(r"`([\w./-]+\.py):([\w.]+)`")


def defined_names(path: Path) -> set[str]:
    """Dotted names a module defines: functions, classes, their methods, module constants."""
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()

    def walk(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(prefix + node.name)
                walk(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and not prefix:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(t.id for t in targets if isinstance(t, ast.Name))

    walk(tree.body, "")
    return names


def references(page: str) -> list[tuple[str, str]]:
    return REFERENCE.findall((ROOT / page).read_text())


@pytest.mark.parametrize("page", PAGES)
def test_every_code_reference_exists(page: str) -> None:
    refs = references(page)
    assert len(refs) >= 20, f"{page} names too little of the code ({len(refs)} references)"
    missing = []
    for file, name in refs:
        path = ROOT / file
        if not path.is_file():
            missing.append(f"{file} (no such file)")
        elif name not in defined_names(path):
            missing.append(f"{file}:{name}")
    assert missing == [], f"{page} names code that does not exist: {missing}"


def test_the_checker_finds_a_missing_name(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("X = 1\nclass A:\n    async def run(self): ...\ndef f(): ...\n")
    assert defined_names(module) == {"X", "A", "A.run", "f"}
