"""--model-load-thread-count (Triton's flag, default 4): a service loads up to N models of its
repository at once at start, and runs the python models' auto_complete_config side by side too.

Each model records when its own auto_complete_config and initialize() started and ended (a file
in its directory, written by the model's code), so the tests assert on the order the service ran
them in, not on wall-clock thresholds of a busy machine."""
from __future__ import annotations

import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import ROOT, start
from tests.models import python_models
from tests.support.metrics import sample, scrape
from tests.support.net import free_port
from tests.support.waiting import eventually

SLEEP_S = 1.0
SLEEPERS = 6

# initialize() sleeps SLEEP_S between two timestamps it appends to <repository>/.<model>.init_times;
# auto_complete_config does the same (a shorter sleep) to .<model>.complete_times (hidden files
# beside the model directories: a poll sees no change in the model's own files)
SLEEPER = f'''
import time
from pathlib import Path

import triton_python_backend_utils as pb_utils

HERE = Path(__file__).resolve().parent.parent


def _record(name, seconds):
    start = time.time()
    time.sleep(seconds)
    with open(HERE.parent / f".{{HERE.name}}.{{name}}", "a") as f:
        f.write(f"{{start}} {{time.time()}}\\n")


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        _record("complete_times", {SLEEP_S / 2})
        return auto_complete_model_config

    def initialize(self, args):
        _record("init_times", {SLEEP_S})

    def execute(self, requests):
        return [pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(
            r, "X").as_numpy())]) for r in requests]
'''

BROKEN = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("broken on purpose: no weights")
'''


def _repository(root: Path) -> Path:
    repo = root / "repo"
    for i in range(SLEEPERS):
        name = f"sleeper_{i}"
        python_models.write(repo, name, SLEEPER, python_models.config(
            name, [("X", "TYPE_FP32", "1")], [("Y", "TYPE_FP32", "1")],
            extra="instance_group [ { count: 1 kind: KIND_CPU } ]\n"))
    python_models.write(repo, "broken", BROKEN, python_models.config(
        "broken", [("X", "TYPE_FP32", "1")], [("Y", "TYPE_FP32", "1")],
        extra="instance_group [ { count: 1 kind: KIND_CPU } ]\n"))
    return repo


def _intervals(repo: Path, file: str) -> list[tuple[float, float]]:
    out = []
    for i in range(SLEEPERS):
        lines = (repo / f".sleeper_{i}.{file}").read_text().split("\n")
        rows = [tuple(float(x) for x in ln.split()) for ln in lines if ln.strip()]
        assert len(rows) == 1, f"sleeper_{i} ran {file} {len(rows)} times"
        out.append((rows[0][0], rows[0][1]))
    return out


def _most_at_once(intervals: list[tuple[float, float]]) -> int:
    """The largest number of intervals running at one moment."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])  # an end before a start
    running = most = 0
    for _, step in events:
        running += step
        most = max(most, running)
    return most


def _serve(repo: Path, threads: int):
    return start(["service", "python", "--repository", str(repo), "--grpc-port", "0", "--http-port", "0",
                  "--model-load-thread-count", str(threads)], timeout=180)


@pytest.mark.parametrize("threads", [4, 1])
def test_models_load_at_once_up_to_the_thread_count(tmp_path: Path, threads: int) -> None:
    repo = _repository(tmp_path)
    proc = _serve(repo, threads)
    try:
        http = httpclient.InferenceServerClient(proc.http)
        grpc = grpcclient.InferenceServerClient(proc.grpc)
        assert http.is_server_ready() and grpc.is_server_ready()
        for i in range(SLEEPERS):  # every load ended before the ready line
            assert http.is_model_ready(f"sleeper_{i}") and grpc.is_model_ready(f"sleeper_{i}")
        # the broken model's failure is its own: UNAVAILABLE with its own reason, the others READY
        index = {m["name"]: m for m in http.get_model_repository_index()}
        assert index["broken"]["state"] == "UNAVAILABLE"
        assert "broken on purpose: no weights" in index["broken"]["reason"]
        assert not http.is_model_ready("broken")
        assert {index[f"sleeper_{i}"]["state"] for i in range(SLEEPERS)} == {"READY"}
        grpc_index = {m.name: m for m in grpc.get_model_repository_index().models}
        assert grpc_index["broken"].state == "UNAVAILABLE" and "broken on purpose" in grpc_index["broken"].reason

        inits = _intervals(repo, "init_times")
        completes = _intervals(repo, "complete_times")
        # everything the service ran for a model stays within the bound
        assert _most_at_once(inits) <= threads, inits
        assert _most_at_once(completes) <= threads, completes
        span = max(e for _, e in inits) - min(s for s, _ in inits)
        serial = sum(e - s for s, e in inits)
        if threads == 1:  # one after the other: no two initialize() overlap, the span is the sum or more
            assert _most_at_once(inits) == 1 and _most_at_once(completes) == 1
            assert span >= serial
        else:  # side by side: several at once, the whole well under the serial time
            assert _most_at_once(inits) >= 2, inits
            assert _most_at_once(completes) >= 2, completes
            assert span < 0.75 * serial, (span, serial)
    finally:
        proc.stop(signal.SIGKILL)


@pytest.mark.parametrize("value", ["0", "-2", "four"])
@pytest.mark.parametrize("kind", ["python", "onnx"])
def test_bad_thread_counts_are_refused_naming_the_flag(tmp_path: Path, kind: str, value: str) -> None:
    done = subprocess.run([sys.executable, "-m", "meshserve", "service", kind, "--repository", str(tmp_path),
                           "--grpc-port", "0", "--model-load-thread-count", value],
                          capture_output=True, text=True, cwd=ROOT, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert "--model-load-thread-count" in done.stderr, done.stderr
    assert ("at least 1" if value.lstrip("-").isdigit() else "not a whole number") in done.stderr, done.stderr


def test_load_requests_run_at_once_up_to_the_thread_count(tmp_path: Path) -> None:
    """As in Triton, whose load requests share its load thread pool: loads of different models
    asked for at once run side by side, at most N at a time; the broken one fails on its own."""
    repo = _repository(tmp_path)
    proc = start(["service", "python", "--repository", str(repo), "--grpc-port", "0", "--http-port", "0",
                  "--model-control-mode", "explicit", "--model-load-thread-count", "2"], timeout=120)
    try:
        names = [f"sleeper_{i}" for i in range(SLEEPERS)] + ["broken"]

        def load(name: str) -> str:
            client = httpclient.InferenceServerClient(proc.http, network_timeout=120)
            try:
                client.load_model(name)
                return ""
            except InferenceServerException as exc:
                return str(exc)
            finally:
                client.close()

        with ThreadPoolExecutor(len(names)) as pool:
            outcomes = dict(zip(names, pool.map(load, names), strict=True))
        assert "broken on purpose: no weights" in outcomes.pop("broken")
        assert outcomes == dict.fromkeys(outcomes, ""), outcomes
        grpc = grpcclient.InferenceServerClient(proc.grpc)
        assert all(grpc.is_model_ready(n) for n in outcomes)
        inits = _intervals(repo, "init_times")
        assert _most_at_once(inits) == 2, inits  # the bound, and reached
        assert _most_at_once(_intervals(repo, "complete_times")) <= 2
    finally:
        proc.stop(signal.SIGKILL)


def test_a_poll_loads_the_models_it_finds_at_once_up_to_the_thread_count(tmp_path: Path) -> None:
    """Poll mode: the models that appear between two polls load side by side, at most N at once."""
    repo = tmp_path / "repo"
    repo.mkdir()
    proc = start(["service", "python", "--repository", str(repo), "--grpc-port", "0", "--http-port", "0",
                  "--model-control-mode", "poll", "--repository-poll-secs", "0.5",
                  "--model-load-thread-count", "2"], timeout=120)
    try:
        staging = _repository(tmp_path / "staging")
        for d in sorted(staging.iterdir()):
            d.rename(repo / d.name)  # (whole directories at once: a poll never sees half of one)
        grpc = grpcclient.InferenceServerClient(proc.grpc)
        eventually(lambda: all(grpc.is_model_ready(f"sleeper_{i}") for i in range(SLEEPERS)), 120,
                   what="the models the poll found, loaded")
        inits = _intervals(repo, "init_times")
        assert _most_at_once(inits) == 2, inits
        index = {m.name: m for m in grpc.get_model_repository_index().models}
        assert index["broken"].state == "UNAVAILABLE" and "broken on purpose" in index["broken"].reason
    finally:
        proc.stop(signal.SIGKILL)


def test_loads_at_once_share_the_memory_budget(tmp_path: Path) -> None:
    """Explicit mode enforces the memory budget: 6 ONNX models of 16 MiB (each estimated at 19.2
    MiB) loaded 4 at once at start under a 50 MiB budget. Each load in flight holds its estimate,
    so only two fit, as one at a time would; the others are refused with the budget's reason."""
    from load.bench import mesh_models

    repo = tmp_path / "repo"
    repo.mkdir()
    names = [mesh_models.write(repo, i, (16 << 20) // mesh_models.WIDTH // 4) for i in range(6)]
    metrics_port = free_port()
    proc = start(["service", "onnx", "--repository", str(repo), "--grpc-port", "0", "--http-port", "0",
                  "--metrics-port", str(metrics_port), "--model-control-mode", "explicit", "--load-model", "*",
                  "--memory-budget", "50Mi", "--model-load-thread-count", "4"], timeout=120)
    try:
        index = {m["name"]: m for m in httpclient.InferenceServerClient(proc.http).get_model_repository_index()}
        ready = [n for n in names if index[n]["state"] == "READY"]
        refused = [n for n in names if n not in ready]
        assert len(ready) == 2, index
        for n in refused:
            assert index[n]["state"] == "UNAVAILABLE" and "memory budget" in index[n]["reason"], index[n]
        used = sample(scrape(f"127.0.0.1:{metrics_port}"), "meshserve_memory_used_bytes")
        assert 0 < used <= 50 << 20
    finally:
        proc.stop(signal.SIGKILL)
