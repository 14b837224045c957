"""NVIDIA's own Python example clients (triton-inference-server/client src/python/examples), each
run unchanged, as a subprocess, against one `meshserve up` serving tests/support/nvidia_models.py's
repository: every example exits 0 and prints its own success text (the check Triton's CI makes).

The examples are not in this tree: point MESHSERVE_NVIDIA_CLIENT_EXAMPLES at their folder
(docs/nvidia-examples.md: one `git archive` from a clone or mirror of the client repository);
without it the tests are skipped. Nothing here needs the network. MESHSERVE_NVIDIA_MODEL_REPOSITORY,
when set, names Triton's own docs/examples/model_repository: its models replace ours of the same
name (simple, simple_int8, simple_string, simple_identity, simple_sequence, simple_dyna_sequence).

The two model-control examples count the repository index (8 models over gRPC, 7 over HTTP: Triton
CI's repositories), so each gets a mesh of its own, in explicit mode with uploads allowed as in
Triton; the four examples with TLS flags get a mesh with mutual TLS; the two CUDA shared-memory
examples run where the client can make a CUDA allocation (scripts/gpu-check.sh runs them on a GPU).
NOT_RUN says why the others are not run (hard-coded ports), and the image examples are skipped
where their client-side packages (Pillow; attrdict for image_client.py over HTTP) are missing; the
one deliberate difference from Triton (a load naming a 256-byte file is INVALID_ARGUMENT here,
INTERNAL in Triton) is asserted as what it is.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import pytest

from meshserve.server.shm import cuda_devices
from tests.support import certs, nvidia_models
from tests.support.net import free_port
from tests.support.up import Up, meshserve_up

ENV = "MESHSERVE_NVIDIA_CLIENT_EXAMPLES"
EXAMPLES = Path(os.environ[ENV]) if os.environ.get(ENV) else None
# optional: Triton's docs/examples/model_repository; its models (those with files) replace ours
MODELS_ENV = "MESHSERVE_NVIDIA_MODEL_REPOSITORY"
TIMEOUT_S = 60.0

pytestmark = pytest.mark.skipif(EXAMPLES is None, reason=f"{ENV} is not set (the folder of NVIDIA's "
                                "src/python/examples; docs/nvidia-examples.md says how to get it)")


@dataclass(frozen=True)
class Example:
    script: str
    args: tuple[str, ...] = ()  # {http} / {grpc} / {image} / {ppm} filled in at run time
    expect: str = ""  # the example's own success text ("" where it prints none: exit code 0 only)
    needs: tuple[str, ...] = ()  # modules the example imports that this suite does not install

    @property
    def id(self) -> str:
        shown = [a for a in self.args if a != "-u" and not a.startswith("{")]
        return " ".join([self.script.removesuffix(".py"), *shown, *(["http"] if "{http}" in self.args else [])])


HTTP, GRPC = ("-u", "{http}"), ("-u", "{grpc}")
IMAGE = ("-m", "densenet_onnx", "-s", "INCEPTION", "-c", "1", "-b", "1")
EXAMPLES_ON_ONE_MESH = [
    Example("simple_http_health_metadata.py", HTTP),
    Example("simple_grpc_health_metadata.py", GRPC),
    Example("simple_http_infer_client.py", HTTP, "Request for unknown model: 'wrong_model_name' is not found"),
    Example("simple_http_infer_client.py", (*HTTP, "--request-compression-algorithm", "gzip",
                                            "--response-compression-algorithm", "deflate")),
    Example("simple_grpc_infer_client.py", GRPC, "PASS: infer"),
    Example("simple_grpc_infer_client.py", (*GRPC, "-C", "gzip"), "PASS: infer"),
    Example("simple_http_async_infer_client.py", HTTP, "15 - 1 = 14"),
    Example("simple_grpc_async_infer_client.py", GRPC, "PASS: Async infer"),
    Example("simple_http_aio_infer_client.py", HTTP, "PASS: infer"),
    Example("simple_grpc_aio_infer_client.py", GRPC, "PASS: grpc aio infer"),
    Example("simple_http_string_infer_client.py", HTTP, "PASS: string"),
    Example("simple_grpc_string_infer_client.py", GRPC, "PASS: string"),
    Example("simple_http_shm_client.py", HTTP, "PASS: system shared memory"),
    Example("simple_grpc_shm_client.py", GRPC, "PASS: system shared memory"),
    Example("simple_http_shm_string_client.py", HTTP, "PASS: system shared memory"),
    Example("simple_grpc_shm_string_client.py", GRPC, "PASS: system shared memory"),
    Example("simple_grpc_keepalive_client.py", GRPC, "PASS: KeepAlive"),
    Example("simple_grpc_custom_args_client.py", GRPC, "PASS: CustomArgs"),
    Example("simple_grpc_custom_repeat.py", GRPC, "PASS: Decoupled API"),
    Example("grpc_explicit_byte_content_client.py", GRPC, "PASS: explicit string"),
    Example("grpc_explicit_int_content_client.py", GRPC, "PASS: explicit int"),
    Example("grpc_explicit_int8_content_client.py", GRPC, "PASS: explicit int8"),
    Example("grpc_client.py", GRPC, "PASS"),
    Example("reuse_infer_objects_client.py", HTTP, "======== SHARED_MEMORY ========"),
    Example("reuse_infer_objects_client.py", (*GRPC, "-i", "grpc"), "======== SHARED_MEMORY ========"),
    *(Example(script, (*url, *dyna), "PASS: Sequence") for dyna in ((), ("-d",)) for script, url in (
        ("simple_grpc_sequence_stream_infer_client.py", GRPC), ("simple_grpc_sequence_sync_infer_client.py", GRPC),
        ("simple_http_sequence_sync_infer_client.py", HTTP))),
    Example("simple_grpc_aio_sequence_stream_infer_client.py", GRPC, "PASS: grpc aio sequence stream"),
    Example("simple_grpc_aio_sequence_stream_infer_client.py", (*GRPC, "-d"), "PASS: grpc aio sequence stream"),
    Example("ensemble_image_client.py", (*HTTP, "{ppm}"), "PASS"),
    Example("ensemble_image_client.py", (*GRPC, "-i", "grpc", "{ppm}"), "PASS"),
    *(Example(script, (*IMAGE, *mode, *url, "{image}"), "PASS", needs=("PIL",)) for mode in ((), ("-a",), ("-a", "--streaming"))
      for script, url in (("image_client.py", ("-i", "grpc", *GRPC)), ("grpc_image_client.py", GRPC))),
    # over HTTP it also needs attrdict (which it patches to load on Python >= 3.10); no streaming
    *(Example("image_client.py", (*IMAGE, *mode, *HTTP, "{image}"), "PASS", needs=("PIL", "attrdict"))
      for mode in ((), ("-a",))),
]

NOT_RUN = {
    "image_client.py -a --streaming over HTTP": "the example refuses it itself (streaming is gRPC only)",
    "memory_growth_test.py": "its server address is hard-coded (localhost:8000 / :8001); run by hand "
                             "(docs/nvidia-examples.md)",
}
# run only where the client can make a CUDA allocation (a GPU and cuda-python; scripts/gpu-check.sh)
CUDA_EXAMPLES = [Example("simple_http_cudashm_client.py", HTTP, "PASS: cuda shared memory"),
                 Example("simple_grpc_cudashm_client.py", GRPC, "PASS: cudashm")]


def _run(example: Example, up: Up, files: dict[str, str]) -> subprocess.CompletedProcess[str]:
    assert EXAMPLES is not None
    script = EXAMPLES / example.script
    if not script.is_file():
        pytest.fail(f"{script} is missing: {ENV} must name the whole src/python/examples folder")
    fill = {"{http}": up.http, "{grpc}": up.grpc, **files}
    argv = [sys.executable, str(script), "-v", *(fill.get(a, a) for a in example.args)]  # -v: as Triton's CI
    done = subprocess.run(argv, cwd=EXAMPLES, capture_output=True, text=True, timeout=TIMEOUT_S)
    return done


def _passed(example: Example, done: subprocess.CompletedProcess[str]) -> None:
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{example.id}: exit code {done.returncode}\n{output[-3000:]}"
    assert example.expect in output, f"{example.id}: no {example.expect!r} in its output\n{output[-3000:]}"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Up, dict[str, str]]]:
    folder = tmp_path_factory.mktemp("nvidia")
    repo = nvidia_models.build(folder / "models")
    if os.environ.get(MODELS_ENV):
        replaced = nvidia_models.overlay(repo, Path(os.environ[MODELS_ENV]))
        assert replaced, f"{MODELS_ENV}={os.environ[MODELS_ENV]}: no model of the examples' with its files there"
    files = {"{ppm}": str(nvidia_models.write_image(folder / "image.ppm")), "{image}": str(folder / "image.jpg")}
    if importlib.util.find_spec("PIL") is not None:
        from PIL import Image

        Image.open(files["{ppm}"]).save(files["{image}"])
    # --server-name triton: the health examples check the server metadata's name
    with meshserve_up("--repository", str(repo), "--http-port", str(free_port()), "--grpc-port", str(free_port()),
                      "--metrics-port", "-1", "--server-name", "triton") as up:
        yield up, files


@pytest.mark.parametrize("example", EXAMPLES_ON_ONE_MESH, ids=lambda e: e.id)
def test_example_passes(example: Example, mesh: tuple[Up, dict[str, str]]) -> None:
    missing = [m for m in example.needs if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{example.script} imports {', '.join(missing)}, not installed here (client-side packages)")
    up, files = mesh
    _passed(example, _run(example, up, files))


@pytest.mark.skipif(cuda_devices() == 0, reason="CUDA shared memory needs a GPU and cuda-python")
@pytest.mark.parametrize("example", CUDA_EXAMPLES, ids=lambda e: e.id)
def test_cuda_shared_memory_example_passes(example: Example, mesh: tuple[Up, dict[str, str]]) -> None:
    up, files = mesh
    _passed(example, _run(example, up, files))


def _model_control_mesh(repo: Path) -> AbstractContextManager[Up]:
    """A mesh in explicit mode that takes model files in load requests (Triton's default)."""
    return meshserve_up("--repository", str(repo), "--http-port", str(free_port()), "--grpc-port", str(free_port()),
                        "--metrics-port", "-1", "--allow-model-uploads")


def test_grpc_model_control_example(tmp_path: Path) -> None:
    """simple_grpc_model_control.py against 8 models: every step passes up to the load naming a
    file of a 256-byte name, which Triton answers INTERNAL (its filesystem's ENAMETOOLONG) and
    meshserve INVALID_ARGUMENT (a client's mistake is never a server error here), both with Triton's
    text "failed to poll from model repository"; the example then stops, exit code 1."""
    with _model_control_mesh(nvidia_models.model_control_repository(tmp_path / "models", 8)) as up:
        done = _run(Example("simple_grpc_model_control.py", GRPC), up, {})
    output = done.stdout + done.stderr
    assert done.returncode == 1 and "got status='StatusCode.INVALID_ARGUMENT'" in output, output[-3000:]


def test_http_model_control_example(tmp_path: Path) -> None:
    """simple_http_model_control.py against 7 models."""
    example = Example("simple_http_model_control.py", HTTP, "PASS: model control")
    with _model_control_mesh(nvidia_models.model_control_repository(tmp_path / "models", 7)) as up:
        _passed(example, _run(example, up, {}))


def test_tls_examples(tmp_path: Path) -> None:
    """The four examples with TLS flags, each given the CA and a client certificate, against a
    mesh with mutual TLS on both ports (Triton's --{grpc,http}-use-ssl[-mutual] flags)."""
    ca = certs.authority(tmp_path, "ca")
    server, client = ca.issue(tmp_path, "server", server=True), ca.issue(tmp_path, "client", server=False)
    tls = [flag for proto in ("grpc", "http") for flag in (
        f"--{proto}-use-ssl", f"--{proto}-use-ssl-mutual=true", f"--{proto}-server-cert", str(server.cert),
        f"--{proto}-server-key", str(server.key), f"--{proto}-root-cert", str(ca.cert))]
    grpc_tls = ("-s", "-r", str(ca.cert), "-p", str(client.key), "-x", str(client.cert))
    http_tls = ("-s", "--ca-certs", str(ca.cert), "--key-file", str(client.key), "--cert-file", str(client.cert))
    repo = nvidia_models.model_control_repository(tmp_path / "models", 1)
    with meshserve_up("--repository", str(repo), "--http-port", str(free_port()), "--grpc-port", str(free_port()),
                      "--metrics-port", "-1", *tls) as up:
        for example in (Example("simple_grpc_infer_client.py", (*GRPC, *grpc_tls), "PASS: infer"),
                        Example("simple_grpc_aio_infer_client.py", (*GRPC, *grpc_tls), "PASS: grpc aio infer"),
                        Example("simple_http_infer_client.py", (*HTTP, *http_tls), "Request for unknown model"),
                        Example("simple_http_aio_infer_client.py", (*HTTP, *http_tls), "PASS: infer")):
            _passed(example, _run(example, up, {}))
