"""STYLE.md dependency rules, checked on the AST of every module.

An import counts wherever it is written: at module level, inside a function, or under
``if TYPE_CHECKING``. No module imports another by a name string (``importlib``).
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

from tests.conftest import ROOT


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def _modules(pkg: str) -> list[Path]:
    return [p for p in (ROOT / pkg).rglob("*.py") if "_proto" not in p.parts]


def _violations(pkg: str, forbidden: tuple[str, ...], allow: tuple[str, ...] = ()) -> list[str]:
    bad = []
    for path in _modules(pkg):
        rel = path.relative_to(ROOT).as_posix()
        if rel in allow:
            continue
        for mod in _imports(path):
            if any(mod == f or mod.startswith(f + ".") for f in forbidden):
                bad.append(f"{rel} imports {mod}")
    return bad


def _module_level_imports(path: Path) -> set[str]:
    """The imports a module runs when it is imported (not those inside its functions)."""
    out: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                out.add(node.module)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                visit(node.body)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
                visit(getattr(node, "orelse", []))
                visit(getattr(node, "finalbody", []))

    visit(ast.parse(path.read_text(), str(path)).body)
    return out


# cli.py is the entry point: each subcommand imports what it runs inside its own function (the
# services pull in their runtimes). These, and only these, are its exemption from the rule below;
# `meshserve service KIND` imports the module its kind's registry row names (Kind.entry), the one
# import by a name string (CLI_NAME_IMPORT).
CLI = "meshserve/cli.py"
CLI_ENTRY_POINTS = frozenset({
    "gateway.main", "services.base.main", "services.tensorrt.build", "load.cli", "load.tune",
})
CLI_NAME_IMPORT = f"{CLI}:_service_main"
ENTRY_PACKAGES = ("gateway", "services", "load")


def test_shared_package_imports_neither_gateway_nor_services() -> None:
    assert _violations("meshserve", ENTRY_PACKAGES, allow=(CLI,)) == []


def test_cli_imports_the_entry_points_only_inside_the_subcommands() -> None:
    path = ROOT / CLI
    entry = {m for m in _imports(path) if m.split(".")[0] in ENTRY_PACKAGES}
    assert entry == CLI_ENTRY_POINTS
    at_import = {m for m in _module_level_imports(path) if m.split(".")[0] in ENTRY_PACKAGES}
    assert at_import == set(), f"{CLI} imports {sorted(at_import)} at module level"


def _name_imports(path: Path) -> list[tuple[str, ast.Call]]:
    """(enclosing function, call) of every importlib.import_module / __import__ call in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    parent = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            if name in ("import_module", "__import__"):
                up: ast.AST | None = node
                while up is not None and not isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    up = parent.get(id(up))
                out.append((up.name if up is not None else "<module>", node))
    return out


def test_no_module_imports_by_name_string() -> None:
    """importlib.import_module / __import__ would get around every rule here: the one exemption is
    `meshserve service KIND`, which imports the entry its kind's registry row names."""
    calls = [f"{path.relative_to(ROOT).as_posix()}:{fn}" for pkg in ("meshserve", "gateway", "services")
             for path in _modules(pkg) for fn, _ in _name_imports(path)]
    assert calls == [CLI_NAME_IMPORT]
    ((_, call),) = _name_imports(ROOT / CLI)  # import_module(row.entry): the row's name, nothing else
    assert [ast.unparse(a) for a in call.args] == ["row.entry"] and not call.keywords


def test_registry_entries_are_service_mains() -> None:
    """What the CLI imports by name: each built-in kind's entry is services/<kind>/main.py, with a
    main(args), under the same rules as the entry points imported by name above."""
    from meshserve.repository.kinds import KINDS

    for kind in KINDS:
        if not kind.entry:
            assert kind.in_gateway, kind.name
            continue
        assert kind.entry == f"services.{kind.name}.main", kind.name
        tree = ast.parse((ROOT / "services" / kind.name / "main.py").read_text())
        assert any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body), kind.entry


def test_telemetry_imports_no_server_layer() -> None:
    """The server layer hands telemetry what it needs (otlp_loop's Transport: the HTTP/2 client)."""
    assert _violations("meshserve/telemetry", ("meshserve.server", *ENTRY_PACKAGES)) == []


def test_gateway_and_services_never_import_each_other() -> None:
    assert _violations("gateway", ("services",)) == []
    assert _violations("services", ("gateway",)) == []


def test_the_kinds_registry_imports_only_the_standard_library() -> None:
    """meshserve/repository/kinds.py is read by the CLI, the repository, the services and (through
    the layout) the gateway: it must pull in nothing of theirs."""
    mods = _imports(ROOT / "meshserve" / "repository" / "kinds.py")
    assert {m for m in mods if m.split(".")[0] not in sys.stdlib_module_names and m != "__future__"} == set()


# the shared modules of standard-library code the schedulers may import: the rule of priority
# levels that the gateway's queue shares follow too (each imports only the standard library itself)
SCHEDULING_SHARED = ("meshserve.priorities",)


def test_scheduling_imports_only_the_standard_library_and_itself() -> None:
    """Scheduling imports neither grpc nor the server nor the runtime (docs/architecture.md, "Layers and their import rules"): only
    the standard library, its own modules relatively, and SCHEDULING_SHARED."""
    offenders = []
    for path in _modules("services/base/scheduling"):
        for mod in _imports(path):  # absolute imports only: relative ones stay inside the package
            top = mod.split(".")[0]
            if top != "__future__" and top not in sys.stdlib_module_names and mod not in SCHEDULING_SHARED:
                offenders.append(f"{path.name}: import {mod}")
    assert offenders == []


def test_the_modules_scheduling_shares_import_only_the_standard_library() -> None:
    """SCHEDULING_SHARED import nothing outside the standard library, so scheduling pulls in
    nothing more through them."""
    for name in SCHEDULING_SHARED:
        path = ROOT.joinpath(*name.split(".")).with_suffix(".py")
        mods = _imports(path)
        assert {m for m in mods if m.split(".")[0] not in sys.stdlib_module_names and m != "__future__"} == set(), path


# The service layer: the event loop, batching and the gRPC/HTTP front ends (services/base), and the
# sequence service, a scheduler over the onnx and torchscript adapters (it has none of its own), and
# the python service, whose models run in worker processes it talks to (asyncio, and grpc for BLS).
# Every other module under services/ is a backend's adapter (its RuntimeAdapter, what that builds
# on, its main): it loads a model file and runs one batch, synchronously, on the calling thread.
SERVICE_LAYER = ("services/base/", "services/sequence/", "services/python/")
BASE_INTERFACE = "services/base/runtime.py"  # the adapters' interface (RuntimeAdapter) is theirs


def test_backend_adapters_use_no_asyncio_grpc_or_server() -> None:
    adapters = [p for p in _modules("services") if (rel := p.relative_to(ROOT).as_posix()) == BASE_INTERFACE
                or not rel.startswith(SERVICE_LAYER)]
    assert {p.relative_to(ROOT).as_posix() for p in _modules("services") if p.name == "runtime.py"} \
        <= {p.relative_to(ROOT).as_posix() for p in adapters}
    bad = [f"{p.relative_to(ROOT).as_posix()} imports {m}" for p in adapters for m in _imports(p)
           if m == "asyncio" or m.startswith(("asyncio.", "grpc", "meshserve.server"))]
    assert bad == []


def test_protocol_layer_has_no_upward_imports() -> None:
    assert _violations("meshserve/protocol", ("meshserve.server", "meshserve.repository",
                                              "meshserve.telemetry")) == []
    assert _violations("meshserve/repository", ("meshserve.server", "grpc")) == []


def test_gateway_pure_modules_do_no_io() -> None:
    for path in (ROOT / "gateway" / "routing").rglob("*.py"):
        mods = _imports(path)
        assert not any(m.startswith(("grpc", "asyncio", "aiohttp", "socket", "redis")) for m in mods), path


def test_gateway_quota_maths_and_ensemble_plan_do_no_io() -> None:
    pure = [ROOT / "gateway" / "quotas" / "bucket.py", ROOT / "gateway" / "quotas" / "memory.py",
            ROOT / "gateway" / "ensemble" / "plan.py", ROOT / "gateway" / "routing" / "ab.py",
            ROOT / "gateway" / "upstream" / "merging.py"]
    for path in pure:
        mods = _imports(path)
        assert not any(m.startswith(("grpc", "asyncio", "aiohttp", "socket", "redis", "os", "pathlib",
                                     "meshserve.server")) for m in mods), (path, mods)


def test_gateway_upstream_imports_no_server_front_end() -> None:
    # the hop's message limit is the protocol's (meshserve.protocol.wire.MAX_MESSAGE_BYTES)
    assert _violations("gateway/upstream", ("meshserve.server.grpc_frontend", "meshserve.server.http_frontend",
                                            "meshserve.server.process")) == []


def test_gateway_core_is_protocol_free() -> None:
    # gRPC statuses and channel states are gateway/upstream/replica.py's business
    mods = _imports(ROOT / "gateway" / "core.py")
    assert not any(m == "grpc" or m.startswith("grpc.") for m in mods), mods
