"""Process hygiene of the python service (issue 29, finding 7): a model that starts processes
(``subprocess.Popen``, ``os.fork``) keeps nothing alive past its instance or the service, and a
child that holds the worker's socket does not keep a killed instance from restarting (the
service watches the worker by its pid, not by the socket's end).

Each worker leads a process group of its own; the model's children are in it. Checked by
scanning /proc: the group's members and the recorded pids are gone after a worker is killed, the
model is unloaded, the service stops, and the service is killed with SIGKILL; nothing is left as
a zombie of the service (it is its workers' descendants' subreaper)."""
from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import Proc, start
from tests.support.waiting import eventually

FORKER_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ -1 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ -1 ] }} ]
parameters {{ key: "escape" value: {{ string_value: "{escape}" }} }}
"""

# initialize() starts `sleep 1000` and forks a child that sleeps holding everything the worker
# holds (its socket too); with the "escape" parameter, one more child leaves the group (setsid)
# and holds the socket as well. One line per start in <model dir>/pids: worker popen fork [escaped]
FORKER = '''
import json
import os
import signal
import subprocess

import triton_python_backend_utils as pb_utils


def _child(escape):
    if escape:
        os.setsid()
    while True:  # holds what it inherited until killed (a handler that returns does not end it)
        signal.pause()


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        escape = config["parameters"]["escape"]["string_value"] == "1"
        popen = subprocess.Popen(["sleep", "1000"])
        pids = [os.getpid(), popen.pid]
        for leave in ([False, True] if escape else [False]):
            pid = os.fork()
            if pid == 0:
                _child(leave)
            pids.append(pid)
        with open(os.path.join(args["model_repository"], "pids"), "a") as f:
            f.write(" ".join(map(str, pids)) + "\\n")

    def execute(self, requests):
        return [pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())]) for r in requests]
'''


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def gone(pid: int) -> bool:
    stat = _stat(pid)
    return stat is None or stat[0] == "Z"  # (a zombie waits for init to reap it: it runs nothing)


def zombies_of(ppid: int) -> set[int]:
    """Children of ``ppid`` that ended and were never reaped."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None and stat[0] == "Z" and int(stat[1]) == ppid:
                found.add(int(entry.name))
    return found


def group(pgid: int) -> set[int]:
    """The live processes of process group ``pgid``."""
    members = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None and stat[0] != "Z" and int(stat[2]) == pgid:
                members.add(int(entry.name))
    return members


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    for name, escape in (("forker", "0"), ("forker_escape", "1")):
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "config.pbtxt").write_text(FORKER_CONFIG.format(name=name, escape=escape))
        (tmp_path / name / "1" / "model.py").write_text(FORKER)
    return tmp_path


@contextlib.contextmanager
def service(repo: Path, model: str) -> Iterator[Proc]:
    proc = start(["service", "python", "--repository", str(repo), "--grpc-port", "0", "--http-port", "0",
                  "--model-control-mode", "explicit", "--load-model", model], timeout=120)
    try:
        yield proc
    finally:
        if proc.proc.poll() is None:
            proc.stop()


def starts(repo: Path, model: str) -> list[list[int]]:
    path = repo / model / "pids"
    return [[int(p) for p in line.split()] for line in path.read_text().splitlines()] if path.exists() else []


def infer(proc: Proc, model: str) -> None:
    client = httpclient.InferenceServerClient(proc.http)
    x = httpclient.InferInput("X", [3], "FP32")
    x.set_data_from_numpy(np.arange(3, dtype=np.float32))
    assert client.infer(model, [x]).as_numpy("Y").tolist() == [0.0, 1.0, 2.0]


def serves(proc: Proc, model: str) -> bool:
    """The model's answer is right (True), or it is refused because its instance is still
    restarting (False); any other error fails the test."""
    try:
        infer(proc, model)
    except InferenceServerException as exc:
        if exc.status() == "503" and "is not healthy" in (exc.message() or ""):
            return False
        raise
    return True


def test_a_killed_worker_restarts_though_children_of_its_model_hold_its_socket(repo: Path) -> None:
    try:
        with service(repo, "forker_escape") as proc:
            ((worker, popen, forked, escaped_pid),) = starts(repo, "forker_escape")
            # (the escaping child calls setsid() right after its fork)
            def without_escaped() -> set[int] | None:
                members = group(worker)
                return members if escaped_pid not in members else None

            members = eventually(without_escaped, timeout=10, what="the escaping child out of the worker's group")
            assert {worker, popen, forked} <= members
            infer(proc, "forker_escape")
            os.kill(worker, signal.SIGKILL)
            # (an instance watched only by its socket's end never comes back: the children hold it)
            eventually(lambda: len(starts(repo, "forker_escape")) == 2, timeout=30,
                       what="the killed instance restarted (initialize() ran again)")
            eventually(lambda: all(gone(p) for p in members), timeout=10,
                       what=f"the killed worker's process group {sorted(members)} gone")
            # initialize() has run in the new worker; the instance serves once the service has its
            # handshake (until then a request is refused: Triton's "Stub process ... is not healthy")
            eventually(lambda: serves(proc, "forker_escape"), timeout=30, what="the restarted instance serving")
            # what the model left behind became the service's (its subreaper) and was reaped
            assert not zombies_of(proc.proc.pid)
    finally:  # a child that left the group (setsid) is out of the service's reach, as in Triton
        for *_, pid in starts(repo, "forker_escape"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_unloading_the_model_ends_everything_its_instance_started(repo: Path) -> None:
    with service(repo, "forker") as proc:
        ((worker, popen, forked),) = starts(repo, "forker")
        members = group(worker)
        assert {worker, popen, forked} < members  # and the worker's guard
        infer(proc, "forker")
        httpclient.InferenceServerClient(proc.http).unload_model("forker")
        eventually(lambda: all(gone(p) for p in members), timeout=30,
                   what=f"the unloaded instance's processes {sorted(members)} gone")
        assert proc.proc.poll() is None
        # (a dead process reads as gone before the service reaps it)
        eventually(lambda: not zombies_of(proc.proc.pid), timeout=10, what="nothing left as the service's zombie")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_nothing_a_model_started_survives_the_service(sig: signal.Signals, repo: Path) -> None:
    with service(repo, "forker") as proc:
        ((worker, popen, forked),) = starts(repo, "forker")
        members = group(worker)
        assert {worker, popen, forked} < members
        os.kill(proc.proc.pid, sig)
        proc.proc.wait(30)
        eventually(lambda: all(gone(p) for p in members), timeout=30,
                   what=f"after {sig.name} to the service, its worker's processes {sorted(members)} gone")
