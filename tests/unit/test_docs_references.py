"""The docs name the code they describe, and every name must exist (checked on the AST), so a page
cannot drift from the code unnoticed. Two forms are checked:

- ``path/to/file.py:Name`` or ``path/to/file.py:Class.method`` in backticks, in docs/*.md and
  README.md (docs/architecture.md must hold at least 20): the file exists and defines that dotted
  name (a function, class, method, nested class or module-level name).
- A bare ``Class.attr`` in backticks, in docs/*.md and README.md (``GatewayCore.start``,
  ``Upstream.call``, ``RequestContext.raw``, ``InferenceRequest.timeout()``): some class of that
  name defined in the tree's Python files (meshserve/, gateway/, services/, load/) has that
  attribute: a method, property, nested class or class attribute (an enum member, a dataclass
  field), an attribute its methods assign on ``self``, or one of its in-tree base classes' (by
  name). What counts as such a reference (the rule): the whole backtick span is
  ``Name.attr``, optionally followed by a call's parentheses, where ``Name`` starts with an
  upper-case letter (after leading underscores: ``_Stream.cancel``), as only classes are named
  in this code base, and ``attr`` is a Python identifier. Not checked, as clearly not a class's
  attribute: a lower-case first part (a module or a variable: ``observe.infer``, ``os.fork``,
  ``pb_utils.Tensor``), more than one dot (``grpc.health.v1.Health``), a file name
  (``STYLE.md``: the part after the dot is one of ``FILE_SUFFIXES``), and anything with other
  text in the same backticks (``Upstream.call → ...``). A class that is not ours would be named
  in ``EXTERNAL_CLASSES``, which is empty: every class the pages name this way is in the tree
  (the python backend's ``pb_utils`` classes are services/python/pb_utils.py).
"""
from __future__ import annotations

import ast
import re
from collections import defaultdict
from functools import cache
from pathlib import Path

import pytest

from tests.conftest import ROOT

MAP_PAGES = ("docs/architecture.md",)  # the map: it must name the code (at least 20 references)
REFERENCE = re.compile(r"`([\w./-]+\.py):([\w.]+)`")

# the pages checked: docs/*.md (not docs/perf/: measurement pages describe the code of the commit
# they measured) and README.md
DOC_PAGES = tuple(sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))) + ("README.md",)
BARE_REFERENCE = re.compile(r"`(_*[A-Z]\w*)\.([A-Za-z_]\w*)(?:\([^`]*\))?`")
FILE_SUFFIXES = frozenset({"md", "py", "txt", "json", "yaml", "yml", "toml", "pbtxt", "proto", "sh", "onnx",
                           "pt", "pt2", "plan", "model", "ubj", "tl", "log", "cfg", "ini", "html"})
CODE_PACKAGES = ("meshserve", "gateway", "services", "load")
EXTERNAL_CLASSES: frozenset[str] = frozenset()  # classes not defined in the tree that pages may name


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


@pytest.mark.parametrize("page", MAP_PAGES)
def test_the_map_names_the_code(page: str) -> None:
    refs = references(page)
    assert len(refs) >= 20, f"{page} names too little of the code ({len(refs)} references)"


@pytest.mark.parametrize("page", DOC_PAGES)
def test_every_code_reference_exists(page: str) -> None:
    refs = references(page)
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


# ---- bare `Class.attr` references ----------------------------------------------------------------

def _class_attributes(node: ast.ClassDef) -> set[str]:
    """What a class defines: methods and properties, nested classes, class-level names (enum
    members, dataclass fields, constants) and the attributes its methods assign on ``self``."""
    attrs: set[str] = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            attrs.add(item.name)
        elif isinstance(item, (ast.Assign, ast.AnnAssign)):
            targets = item.targets if isinstance(item, ast.Assign) else [item.target]
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        attrs.add(name.id)
    for sub_node in ast.walk(node):
        if isinstance(sub_node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = sub_node.targets if isinstance(sub_node, ast.Assign) else [sub_node.target]
            for target in targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                        attrs.add(sub.attr)
    return attrs


def classes_in(paths: list[Path]) -> dict[str, list[tuple[set[str], list[str]]]]:
    """Class name -> (its attributes, its bases' names) for every class the files define (a name
    may be defined in more than one file, or nested in another class)."""
    out: dict[str, list[tuple[set[str], list[str]]]] = defaultdict(list)
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                         for b in (s.value if isinstance(s, ast.Subscript) else s for s in node.bases)]
                out[node.name].append((_class_attributes(node), bases))
    return dict(out)


@cache
def tree_classes() -> dict[str, list[tuple[set[str], list[str]]]]:
    paths = [p for pkg in CODE_PACKAGES for p in (ROOT / pkg).rglob("*.py") if "_proto" not in p.parts]
    return classes_in(paths)


def has_attribute(classes: dict[str, list[tuple[set[str], list[str]]]], name: str, attr: str,
                  seen: frozenset[str] = frozenset()) -> bool:
    """Whether some class called ``name`` has ``attr``, itself or through an in-tree base class."""
    for attrs, bases in classes.get(name, []):
        if attr in attrs or any(has_attribute(classes, b, attr, seen | {name}) for b in bases
                                if b and b not in seen | {name}):
            return True
    return False


def bare_references(text: str) -> list[tuple[str, str]]:
    """The bare ``Class.attr`` references of a page's text (the rule: this module's docstring)."""
    return [(name, attr) for name, attr in BARE_REFERENCE.findall(text) if attr not in FILE_SUFFIXES]


def broken_references(text: str, classes: dict[str, list[tuple[set[str], list[str]]]]) -> list[str]:
    out = []
    for name, attr in bare_references(text):
        if name in EXTERNAL_CLASSES:
            continue
        if name not in classes:
            out.append(f"{name}.{attr} (no class {name} in the tree)")
        elif not has_attribute(classes, name, attr):
            out.append(f"{name}.{attr}")
    return out


@pytest.mark.parametrize("page", DOC_PAGES)
def test_every_bare_class_reference_exists(page: str) -> None:
    broken = broken_references((ROOT / page).read_text(), tree_classes())
    assert broken == [], f"{page} names class attributes that do not exist: {broken}"


def test_the_pages_name_classes_this_way() -> None:
    """The check has something to check: the pages use the form (a rule that matched nothing
    would pass for ever)."""
    found = [ref for page in DOC_PAGES for ref in bare_references((ROOT / page).read_text())]
    assert len(found) >= 20, found
    assert ("GatewayCore", "start") in found


def test_the_bare_checker_finds_what_is_missing(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "import enum\n"
        "class Base:\n    def run(self): ...\n"
        "class A(Base):\n    LIMIT = 1\n    size: int = 0\n"
        "    def __init__(self):\n        self.routes = {}\n"
        "    @property\n    def ready(self): ...\n"
        "class Op(enum.Enum):\n    GENERATE = 'generate'\n")
    classes = classes_in([module])
    text = ("`A.run` `A.LIMIT` `A.size` `A.routes` `A.ready()` `Op.GENERATE` `A.run(x, y)` "  # all exist
            "`A.missing` `Op.LOAD` `Gone.run` "  # three broken
            "`os.fork` `STYLE.md` `A.run → B` `a.b.C` `grpc.health.v1.Health`")  # not references
    assert broken_references(text, classes) == ["A.missing", "Op.LOAD", "Gone.run (no class Gone in the tree)"]
    assert ("A", "run") in bare_references(text) and ("STYLE", "md") not in bare_references(text)
