"""STYLE.md dependency rules, checked on the AST of every module."""
from __future__ import annotations

import ast
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


def test_shared_package_imports_neither_gateway_nor_services() -> None:
    # cli.py is the entry point: it loads them by name (importlib) only for the subcommand that runs them.
    assert _violations("meshserve", ("gateway", "services")) == []


def test_gateway_and_services_never_import_each_other() -> None:
    assert _violations("gateway", ("services",)) == []
    assert _violations("services", ("gateway",)) == []


def test_scheduling_and_runtime_layers() -> None:
    sched = [p for p in _modules("services") if "scheduling" in p.parts]
    for path in sched:
        for mod in _imports(path):
            assert not mod.startswith(("grpc", "meshserve.server", "services.onnx", "services.base.runtime")), \
                f"{path}: scheduling imports {mod}"
    for path in _modules("services"):
        if path.name == "runtime.py":
            mods = _imports(path)
            assert "asyncio" not in mods and not any(m.startswith("grpc") for m in mods), path


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
            ROOT / "gateway" / "ensemble" / "plan.py", ROOT / "gateway" / "routing" / "ab.py"]
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
