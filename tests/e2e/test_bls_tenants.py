"""BLS calls under `meshserve up --tenants` are made as the python service's own identity
(`--bls-api-key-file`): a client tenant that may use the example's `add_sub_bls` (and not
`add_sub`) gets what `add_sub` answers, also through a decoupled BLS stream; when the identity may
not use the called model, or the service has no key, the client gets a clear non-5xx error that
names the cause; the key never shows on a command line; a key file that does not exist stops the
service at start with a message naming the file and the flag."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml
from tritonclient.utils import InferenceServerException

from gateway.auth import hash_key
from tests.conftest import ROOT
from tests.models import python_models as pm
from tests.support import eventually
from tests.support.models import example_models
from tests.support.up import meshserve_up

APP_KEY = "app-key-3f9c1e"  # the client tenant: add_sub_bls and bls_decoupled, not what they call
BLS_KEY = "bls-key-8a27d4"  # the python service's identity
APP = {"x-api-key": APP_KEY}


def _tenants(path: Path, bls_models: list[str]) -> None:
    path.write_text(yaml.safe_dump({"tenants": [
        {"name": "app", "keys_sha256": [hash_key(APP_KEY)], "rate": 1e5, "burst": 1e5,
         "models": ["add_sub_bls", "bls_decoupled"]},
        {"name": "bls", "keys_sha256": [hash_key(BLS_KEY)], "rate": 1e5, "burst": 1e5, "models": bls_models}]}))


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = example_models(tmp_path_factory.mktemp("bls") / "repo", "add_sub", "add_sub_bls")
    pm.write(repo, "square_int32", pm.SQUARE_INT32, pm.SQUARE_CONFIG.lstrip())
    pm.write(repo, "bls_decoupled", pm.BLS_DECOUPLED, pm.config(
        "bls_decoupled", [("IN", "TYPE_INT32", "1")], [("SUM", "TYPE_INT32", "1"), ("COUNT", "TYPE_INT32", "1")]))
    return repo


@contextmanager
def _up(repo: Path, *flags: str) -> Iterator[tuple[str, str, str, int]]:
    """`meshserve up` with ``flags``: (its banner, gRPC address, HTTP address, its pid)."""
    with meshserve_up("--metrics-port", "0", "--repository", str(repo), "--http-port", "0", "--grpc-port", "0",
                      *flags) as up:
        grpc_port = re.search(r"gRPC\s+localhost:(\d+)", up.banner)
        http_port = re.search(r"HTTP/REST\s+http://localhost:(\d+)", up.banner)
        assert grpc_port and http_port, up.banner
        yield up.banner, up.grpc, up.http, up.pid


def _pair(client: type[grpcclient.InferInput] | type[httpclient.InferInput], x: np.ndarray) -> list:
    ins = [client(n, [1, 16], "FP32") for n in ("INPUT0", "INPUT1")]
    ins[0].set_data_from_numpy(x)
    ins[1].set_data_from_numpy(x * 2)
    return ins


def _descendants(pid: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, pp in parents.items() if pp in frontier]
        found += children
        frontier = children
    return found


def _command_lines(pids: list[int]) -> list[str]:
    out = []
    for p in pids:
        try:
            out.append(Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue
    return out


def test_bls_calls_carry_the_services_key(repo: Path, tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.yaml"
    _tenants(tenants, ["add_sub", "square_int32"])
    key_file = tmp_path / "bls.key"
    key_file.write_text(BLS_KEY + "\n")
    x = np.arange(16, dtype=np.float32).reshape(1, 16)
    with _up(repo, "--tenants", str(tenants), "--bls-api-key-file", str(key_file)) as (banner, grpc_at, _, pid):
        assert "--bls-api-key-file" not in banner  # no warning: the service has its identity
        lines = _command_lines(_descendants(pid))
        assert any("--bls-api-key-file" in line for line in lines), lines  # passed on as a path ...
        assert not [line for line in lines if BLS_KEY in line]  # ... the key itself on no command line
        with grpcclient.InferenceServerClient(grpc_at) as c:
            with pytest.raises(InferenceServerException) as direct:  # the client tenant may not call add_sub ...
                c.infer("add_sub", _pair(grpcclient.InferInput, x), headers=APP)
            assert direct.value.status() == "StatusCode.PERMISSION_DENIED"
            # ... but add_sub_bls calls it as the service's identity, and answers what add_sub answers
            res = c.infer("add_sub_bls", _pair(grpcclient.InferInput, x), headers=APP)
            ref = c.infer("add_sub", _pair(grpcclient.InferInput, x), headers={"x-api-key": BLS_KEY})
            for name in ("OUTPUT0", "OUTPUT1"):
                np.testing.assert_array_equal(res.as_numpy(name), ref.as_numpy(name))
            np.testing.assert_allclose(res.as_numpy("OUTPUT0"), x * 3)
            np.testing.assert_allclose(res.as_numpy("OUTPUT1"), -x)
            # a decoupled BLS stream (ModelStreamInfer) carries the key too: 3 responses of 3
            n = grpcclient.InferInput("IN", [1], "INT32")
            n.set_data_from_numpy(np.array([3], dtype=np.int32))
            summed = c.infer("bls_decoupled", [n], headers=APP)
            assert (int(summed.as_numpy("SUM")[0]), int(summed.as_numpy("COUNT")[0])) == (9, 3)

            # the operator takes add_sub away from the BLS identity (the tenants file is re-read)
            _tenants(tenants, ["square_int32"])
            later = tenants.stat().st_mtime + 2
            os.utime(tenants, (later, later))

            def refused() -> InferenceServerException:
                try:
                    c.infer("add_sub_bls", _pair(grpcclient.InferInput, x), headers=APP)
                except InferenceServerException as exc:
                    return exc
                raise AssertionError("add_sub_bls still answers")

            err = eventually(refused, 30, "the BLS identity's grant withdrawn")
            assert err.status() == "StatusCode.INVALID_ARGUMENT", (err.status(), err.message())
            assert "Model add_sub - Error when running inference" in (err.message() or "")
            assert "may not" in (err.message() or "") and "--bls-api-key-file" in (err.message() or "")


def test_without_a_bls_key_up_warns_and_bls_calls_fail_clearly(repo: Path, tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.yaml"
    _tenants(tenants, ["add_sub", "square_int32"])
    x = np.arange(16, dtype=np.float32).reshape(1, 16)
    with _up(repo, "--tenants", str(tenants)) as (banner, grpc_at, http_at, _):
        assert "warning: --tenants without --bls-api-key-file" in banner, banner
        assert "refused unless the tenants file allows anonymous callers" in banner
        with grpcclient.InferenceServerClient(grpc_at) as c:
            with pytest.raises(InferenceServerException) as over_grpc:
                c.infer("add_sub_bls", _pair(grpcclient.InferInput, x), headers=APP)
        assert over_grpc.value.status() == "StatusCode.INVALID_ARGUMENT", over_grpc.value
        assert "without --bls-api-key-file" in (over_grpc.value.message() or ""), over_grpc.value
        with httpclient.InferenceServerClient(http_at) as h:
            with pytest.raises(InferenceServerException) as over_http:
                h.infer("add_sub_bls", _pair(httpclient.InferInput, x), headers=APP)
        assert over_http.value.status() == "400", over_http.value
        assert "without --bls-api-key-file" in (over_http.value.message() or ""), over_http.value


@pytest.mark.parametrize("content", [None, "", "two words\n"], ids=["missing", "empty", "not-a-key"])
def test_a_bad_bls_key_file_stops_the_service_at_start(tmp_path: Path, content: str | None) -> None:
    key_file = tmp_path / "nowhere" / "bls.key" if content is None else tmp_path / "bls.key"
    if content is not None:
        key_file.write_text(content)
    out = subprocess.run([sys.executable, "-m", "meshserve", "service", "python", "--repository", str(tmp_path),
                          "--grpc-port", "0", "--bls-api-key-file", str(key_file)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert f"--bls-api-key-file {key_file}" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
