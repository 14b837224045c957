"""Every v2 datatype and shape edge, enumerated, through real services and one gateway with the
real tritonclient: identity models per datatype (ONNX, TorchScript, python; generated here) ×
zero-size and scalar-like shapes × edge values (extremes, NaN payloads, subnormals, signed
zeros, infinities, empty, NUL-bearing and non-UTF-8 strings) × HTTP binary, HTTP JSON and gRPC ×
direct and through the gateway (its coalescer, for bursts) and shared memory. An answer's bytes
must equal the request's (JSON: the values, a NaN's payload aside); what a backend cannot take
is refused with its reason (docs/datatypes.md)."""
from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from tests.conftest import Proc, _wait_http_ready, start, start_all
from tests.models.tensors import (
    ONNX_TYPES,
    TORCH_TYPES,
    build_onnx_identities,
    build_python_identities,
    build_torch_identities,
)
from tests.support.metrics import sample as _sample
from tests.support.metrics import scrape as _scrape

DATATYPES = tuple(ONNX_TYPES)
KINDS = ("onnx", "torchscript", "python")
WIRES = ("http-binary", "http-json", "grpc")
HOPS = ("service", "gateway")

# the raw bits of each float type's edges: NaN with a payload (both signs), the smallest subnormal,
# +-inf, -0, the largest finite, 1
_FLOAT_BITS = {
    "FP16": (np.uint16, [0x7E01, 0xFE42, 0x0001, 0x7C00, 0xFC00, 0x8000, 0x7BFF, 0x3C00]),
    "BF16": (np.uint16, [0x7FC1, 0xFFA2, 0x0001, 0x7F80, 0xFF80, 0x8000, 0x7F7F, 0x3F80]),
    "FP32": (np.uint32, [0x7FC00001, 0xFFC12345, 0x00000001, 0x7F800000, 0xFF800000, 0x80000000, 0x7F7FFFFF,
                         0x3F800000]),
    "FP64": (np.uint64, [0x7FF8000000000001, 0xFFF8000000012345, 0x1, 0x7FF0000000000000, 0xFFF0000000000000,
                         0x8000000000000000, 0x7FEFFFFFFFFFFFFF, 0x3FF0000000000000]),
}
_NUMPY = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
          "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "FP16": np.float16,
          "FP32": np.float32, "FP64": np.float64}
NON_UTF8 = b"\xff\xfe\x00\x80"
STRINGS = [b"", b"a\x00b", "\u00e9\u4e2d".encode(), b"\x00", b"x" * 300]


def edge_values(dt: str, count: int, utf8_only: bool = False) -> np.ndarray:
    """``count`` edge values of ``dt`` (cycled): BF16 as ml_dtypes.bfloat16 (what tritonclient
    takes), BYTES as bytes objects."""
    if dt == "BYTES":
        pool: list[Any] = STRINGS + ([] if utf8_only else [NON_UTF8])
        return np.array([pool[i % len(pool)] for i in range(count)], dtype=np.object_)
    if dt in _FLOAT_BITS:
        carrier, bits = _FLOAT_BITS[dt]
        raw = np.array([bits[i % len(bits)] for i in range(count)], dtype=carrier)
        return raw.view(ml_dtypes.bfloat16) if dt == "BF16" else raw.view(_NUMPY[dt])
    if dt == "BOOL":
        return np.array([i % 2 == 0 for i in range(count)], dtype=np.bool_)
    info = np.iinfo(_NUMPY[dt])
    pool = [info.min, info.max, 0, 1, info.max - 1, info.min + 1]
    return np.array([pool[i % len(pool)] for i in range(count)], dtype=_NUMPY[dt])


ZERO_SIZE = ([1, 0], [3, 0])  # batch 1 and 3


def _shapes(kind: str) -> list[list[int]]:
    """Zero-size, scalar-like, plain (python: test_python_zero_size_tensors)."""
    return [[1, 1], [2, 3]] + ([] if kind == "python" else [list(s) for s in ZERO_SIZE])


def value(dt: str, shape: list[int], utf8_only: bool = False) -> np.ndarray:
    return edge_values(dt, int(np.prod(shape)), utf8_only).reshape(shape)


def same(dt: str, got: np.ndarray, want: np.ndarray, wire: str) -> bool:
    """Byte-equal on binary wires; JSON carries values (a NaN's payload and sign do not survive
    JSON: Triton's JSON has one NaN too)."""
    if got.shape != want.shape:
        return False
    if dt == "BYTES":
        return [_bytes(x) for x in got.reshape(-1)] == [_bytes(x) for x in want.reshape(-1)]
    if wire == "http-json" and dt.startswith("FP"):
        g, w = got.astype(np.float64), want.astype(np.float64)
        return bool(np.array_equal(np.isnan(g), np.isnan(w)) and np.array_equal(g[~np.isnan(g)], w[~np.isnan(w)])
                    and np.array_equal(np.signbit(g[~np.isnan(g)]), np.signbit(w[~np.isnan(w)])))
    return got.tobytes() == want.tobytes()


def _bytes(x: object) -> bytes:
    return x.encode() if isinstance(x, str) else bytes(x)  # type: ignore[call-overload]  # (JSON answers: str)


def model_name(kind: str, dt: str) -> str:
    return {"onnx": "identity_", "torchscript": "ts_identity_", "python": "py_identity_"}[kind] + dt.lower()


def tensor_names(kind: str) -> tuple[str, str]:
    return ("INPUT__0", "OUTPUT__0") if kind == "torchscript" else ("INPUT0", "OUTPUT0")


def served(kind: str) -> tuple[str, ...]:
    """The datatypes a kind serves (the rest are refused at load: test_unservable_types_are_refused_at_load)."""
    return {"onnx": DATATYPES, "torchscript": TORCH_TYPES, "python": DATATYPES}[kind]


@dataclass
class Stack:
    services: dict[str, Proc]
    gateway: Proc

    def url(self, kind: str, hop: str, proto: str) -> str:
        proc = self.gateway if hop == "gateway" else self.services[kind]
        return proc.http if proto == "http" else proc.grpc


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    pytest.importorskip("torch", reason="the TorchScript leg needs torch (the [torch] extra)")
    base = tmp_path_factory.mktemp("datatypes")
    repos = {"onnx": build_onnx_identities(base / "onnx"), "torchscript": build_torch_identities(base / "torchscript"),
             "python": build_python_identities(base / "python")}
    procs: list[Proc] = []
    try:
        argss = []
        for kind in KINDS:
            args = ["service", kind, "--repository", str(repos[kind]), "--grpc-port", "0", "--http-port", "0",
                    "--model-control-mode", "explicit"]
            for dt in served(kind):
                args += ["--load-model", model_name(kind, dt)]
            argss.append(args)
        procs += start_all(*argss, timeout=180)
        services = dict(zip(KINDS, procs, strict=True))
        upstreams = [a for kind in KINDS for a in ("--upstream", services[kind].grpc)]
        gateway = start(["gateway", "--grpc-port", "0", "--http-port", "0", *upstreams])
        procs.append(gateway)
        _wait_http_ready(gateway.http)
        yield Stack(services, gateway)
    finally:
        for p in reversed(procs):
            p.stop()


def infer(url: str, wire: str, model: str, names: tuple[str, str], dt: str, data: np.ndarray) -> np.ndarray:
    """One request through tritonclient; the answer checked against its own metadata."""
    proto = "grpc" if wire == "grpc" else "http"
    mod: Any = grpcclient if proto == "grpc" else httpclient
    inp = mod.InferInput(names[0], list(data.shape), dt)
    if proto == "http":
        inp.set_data_from_numpy(data, binary_data=wire == "http-binary")
        out = mod.InferRequestedOutput(names[1], binary_data=wire == "http-binary")
    else:
        inp.set_data_from_numpy(data)
        out = mod.InferRequestedOutput(names[1])
    with mod.InferenceServerClient(url) as c:
        res = c.infer(model, [inp], outputs=[out])
    meta = res.get_output(names[1])
    shape = list(meta["shape"]) if proto == "http" else list(meta.shape)
    datatype = meta["datatype"] if proto == "http" else meta.datatype
    assert (shape, datatype) == (list(data.shape), dt), (model, wire, shape, datatype)
    got = res.as_numpy(names[1])
    assert got is not None
    return got


def _cases(kind: str, wire: str) -> list[tuple[str, list[int]]]:
    return [(dt, shape) for dt in served(kind) for shape in _shapes(kind)
            if not (wire == "http-json" and dt == "BF16")]  # tritonclient sends no BF16 as JSON (nor does Triton take it)


@pytest.mark.parametrize("hop", HOPS)
@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("kind", KINDS)
def test_identity_answers_the_bytes_it_was_given(stack: Stack, kind: str, wire: str, hop: str) -> None:
    """Every served datatype × shape: the answer is the request's bytes (values over JSON), with
    the request's shape and datatype; every failure is listed, not just the first."""
    url = stack.url(kind, hop, "grpc" if wire == "grpc" else "http")
    failures: list[str] = []
    for dt, shape in _cases(kind, wire):
        # JSON carries text: non-UTF-8 BYTES cannot be written as JSON (tritonclient refuses);
        # onnxruntime takes UTF-8 text only (test_non_utf8_bytes_into_onnxruntime_is_a_client_error)
        data = value(dt, shape, utf8_only=wire == "http-json" or kind == "onnx")
        try:
            got = infer(url, wire, model_name(kind, dt), tensor_names(kind), dt, data)
        except (InferenceServerException, AssertionError) as exc:
            failures.append(f"{dt} {shape}: {exc}")
            continue
        if not same(dt, got, data, wire):
            failures.append(f"{dt} {shape}: sent {data.reshape(-1)[:8]!r} got {got.reshape(-1)[:8]!r}")
    assert not failures, f"{kind} over {wire} via {hop}:\n" + "\n".join(failures)


@pytest.mark.parametrize("wire", ["http-binary", "grpc"])  # (JSON cannot carry non-UTF-8 text)
def test_non_utf8_bytes_into_onnxruntime_is_a_client_error(stack: Stack, wire: str) -> None:
    """onnxruntime's string tensors take text (its Python API turns bytes objects into their
    repr): a non-UTF-8 element is a 400 naming the input (Triton passes the bytes through: a
    documented difference, docs/datatypes.md); a python model passes them through."""
    data = np.array([[NON_UTF8, b"ok"]], dtype=np.object_)
    for hop in HOPS:
        url = stack.url("onnx", hop, "grpc" if wire == "grpc" else "http")
        with pytest.raises(InferenceServerException) as err:
            infer(url, wire, "identity_bytes", ("INPUT0", "OUTPUT0"), "BYTES", data)
        text = str(err.value)
        assert "UTF-8" in text and ("[400]" in text or "INVALID_ARGUMENT" in text), text
        got = infer(stack.url("python", hop, "grpc" if wire == "grpc" else "http"), wire, "py_identity_bytes",
                    ("INPUT0", "OUTPUT0"), "BYTES", data)
        assert same("BYTES", got, data, wire)


@pytest.mark.parametrize("wire", WIRES)
def test_bytes_elements_past_the_bound_are_refused_by_their_shape(stack: Stack, wire: str) -> None:
    """A request's BYTES elements are at most infer_checks.MAX_BYTES_ELEMENTS, checked from the
    declared shape before any element is walked (each costs ~280 bytes and a loop step per walk
    once a model runs: one 16 MB message of 4 million empty elements took a service 8 s and
    1.1 GB). Past it 400 / INVALID_ARGUMENT naming the input, at a service and through the
    gateway, for an onnx and a python model; at the bound, served (gRPC: the JSON of 262,144
    strings is a slow request of its own). The code before ran them."""
    from meshserve.protocol.infer_checks import MAX_BYTES_ELEMENTS

    past = np.array([[b""] * (MAX_BYTES_ELEMENTS + 1)], dtype=np.object_)
    for hop in HOPS:
        for kind, model in (("onnx", "identity_bytes"), ("python", "py_identity_bytes")):
            url = stack.url(kind, hop, "grpc" if wire == "grpc" else "http")
            with pytest.raises(InferenceServerException) as err:
                infer(url, wire, model, ("INPUT0", "OUTPUT0"), "BYTES", past)
            text = str(err.value)
            assert f"hold {MAX_BYTES_ELEMENTS + 1} elements, more than {MAX_BYTES_ELEMENTS}" in text, text
            assert "[400]" in text or "INVALID_ARGUMENT" in text, text
            if wire == "grpc":
                at = np.array([[b"x"] * MAX_BYTES_ELEMENTS], dtype=np.object_)
                assert same("BYTES", infer(url, wire, model, ("INPUT0", "OUTPUT0"), "BYTES", at), at, wire)


def test_a_bytes_buffer_of_more_elements_than_its_shape_is_refused_at_the_first_past_it(stack: Stack) -> None:
    """A BYTES input's buffer is walked at most one element past its shape's count, as Triton
    walks it, and refused in Triton's words: 300,000 empty elements declared as one are refused
    at the second. Before, every element was counted on the service's event loop first (16 MB of
    them: 1.6 s of it) and the refusal was meshserve's own text."""
    data = b"\0\0\0\0" * 300_000
    for hop in HOPS:
        for kind, model in (("onnx", "identity_bytes"), ("python", "py_identity_bytes")):
            inp = grpcclient.InferInput("INPUT0", [1, 300_000], "BYTES")
            inp.set_data_from_numpy(np.array([[b""] * 300_000], dtype=np.object_))
            inp.set_shape([1, 1])  # (the buffer stays: 300,000 elements for a shape of one, as NVIDIA's QA sends)
            with grpcclient.InferenceServerClient(stack.url(kind, hop, "grpc")) as c, \
                    pytest.raises(InferenceServerException) as err:
                c.infer(model, [inp])
            assert err.value.status() == "StatusCode.INVALID_ARGUMENT", (hop, kind)
            assert err.value.message() == (f"unexpected number of string elements 2 for inference input 'INPUT0' "
                                           f"for model '{model}', expecting 1"), (hop, kind)
            assert len(inp._raw_content) == len(data)  # (tritonclient kept the whole buffer)


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_unservable_types_are_refused_at_load(stack: Stack, proto: str) -> None:
    """TorchScript takes no UINT16/32/64, BF16 or BYTES (Triton's pytorch backend neither): each
    refused at load with Triton's text, never READY."""
    mod: Any = grpcclient if proto == "grpc" else httpclient
    proc = stack.services["torchscript"]
    with mod.InferenceServerClient(proc.http if proto == "http" else proc.grpc) as c:
        for dt in DATATYPES:
            if dt in TORCH_TYPES:
                continue
            name = model_name("torchscript", dt)
            with pytest.raises(InferenceServerException) as err:
                c.load_model(name)
            want = "TYPE_STRING (BYTES)" if dt == "BYTES" else \
                f"unsupported datatype TYPE_{dt} for input 'INPUT__0' for model '{name}'"
            assert want in str(err.value), str(err.value)
            assert not c.is_model_ready(name)
        assert c.is_server_live()


@pytest.mark.parametrize("wire", ["http-binary", "grpc"])
def test_python_zero_size_tensors(stack: Stack, wire: str) -> None:
    """Triton answers a python model's zero-size request with the empty output."""
    url = stack.url("python", "service", "grpc" if wire == "grpc" else "http")
    for dt in served("python"):
        for shape in ZERO_SIZE:
            data = value(dt, list(shape))
            assert same(dt, infer(url, wire, model_name("python", dt), ("INPUT0", "OUTPUT0"), dt, data), data, wire)


def _merged(gw: Proc) -> float:
    return _sample(_scrape(gw.http), "meshserve_gateway_merged_requests_total")


@pytest.mark.parametrize("kind", ["onnx", "torchscript"])
def test_bursts_through_the_coalescer(stack: Stack, kind: str) -> None:
    """Concurrent gRPC requests of every datatype, zero-size and not, through the gateway (whose
    coalescer merges requests of one model and shape and splits the answer): each client gets
    its own bytes back."""
    url = stack.gateway.grpc
    before = _merged(stack.gateway)
    jobs = [(dt, shape, i) for dt in served(kind) for shape in ([1, 0], [1, 2]) for i in range(6)]

    def one(job: tuple[str, list[int], int]) -> str | None:
        dt, shape, i = job
        data = np.roll(value(dt, [1, 12], utf8_only=True).reshape(-1), i)[:int(np.prod(shape))].reshape(shape)
        try:
            got = infer(url, "grpc", model_name(kind, dt), tensor_names(kind), dt, data)
        except (InferenceServerException, AssertionError) as exc:
            return f"{dt} {shape} #{i}: {exc}"
        return None if same(dt, got, data, "grpc") else f"{dt} {shape} #{i}: got {got!r} for {data!r}"

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        failures = [f for f in pool.map(one, jobs) if f]
    assert not failures, "\n".join(failures)
    assert _merged(stack.gateway) > before  # the coalescer merged some (measured: 30-50 of the 108-126)


def _key(name: str) -> str:
    return f"/dtmatrix-{os.getpid()}-{name}"


@pytest.mark.parametrize("hop", HOPS)
@pytest.mark.parametrize("proto", ["http", "grpc"])
@pytest.mark.parametrize("kind", KINDS)
def test_shared_memory_carries_every_datatype(stack: Stack, kind: str, proto: str, hop: str) -> None:
    """Inputs read from and outputs written to system shared memory, zero-size tensors included:
    the output region holds the input's bytes."""
    mod: Any = grpcclient if proto == "grpc" else httpclient
    size = 4096
    tag = f"{kind}-{proto}-{hop}"
    region_in = shm.create_shared_memory_region(f"in-{tag}", _key(f"in-{tag}"), size, create_only=True)
    region_out = shm.create_shared_memory_region(f"out-{tag}", _key(f"out-{tag}"), size, create_only=True)
    failures: list[str] = []
    try:
        with mod.InferenceServerClient(stack.url(kind, hop, proto)) as c:
            c.register_system_shared_memory(f"in-{tag}", _key(f"in-{tag}"), size)
            c.register_system_shared_memory(f"out-{tag}", _key(f"out-{tag}"), size)
            names = tensor_names(kind)
            for dt in served(kind):
                for shape in _shapes(kind):
                    data = value(dt, shape)
                    raw = _raw(dt, data)
                    if raw:
                        shm.set_shared_memory_region(region_in, [np.frombuffer(raw, dtype=np.uint8)])
                    inp = mod.InferInput(names[0], shape, dt)
                    inp.set_shared_memory(f"in-{tag}", len(raw))
                    out = mod.InferRequestedOutput(names[1])
                    out.set_shared_memory(f"out-{tag}", size)
                    try:
                        res = c.infer(model_name(kind, dt), [inp], outputs=[out])
                    except InferenceServerException as exc:
                        if kind == "onnx" and dt == "BYTES" and "UTF-8" in str(exc):
                            continue  # (non-UTF-8 into onnxruntime: see above)
                        failures.append(f"{dt} {shape}: {exc}")
                        continue
                    meta = res.get_output(names[1])
                    got_shape = list(meta["shape"]) if proto == "http" else list(meta.shape)
                    back = bytes(shm.get_contents_as_numpy(region_out, np.uint8, [len(raw)])) if raw else b""
                    if got_shape != shape or back != raw:
                        failures.append(f"{dt} {shape}: shape {got_shape}, bytes equal: {back == raw}")
            c.unregister_system_shared_memory(f"in-{tag}")
            c.unregister_system_shared_memory(f"out-{tag}")
    finally:
        shm.destroy_shared_memory_region(region_in)
        shm.destroy_shared_memory_region(region_out)
    assert not failures, f"{kind} over {proto} via {hop}:\n" + "\n".join(failures)


def _raw(dt: str, data: np.ndarray) -> bytes:
    if dt == "BYTES":
        return b"".join(len(x).to_bytes(4, "little") + bytes(x) for x in data.reshape(-1))
    return data.tobytes()


def test_repository_models_are_ready(stack: Stack) -> None:
    for kind in KINDS:
        with httpclient.InferenceServerClient(stack.services[kind].http) as c:
            for dt in served(kind):
                assert c.is_model_ready(model_name(kind, dt)), (kind, dt)


def test_model_file_layout(tmp_path: Path) -> None:
    """The generators write one version folder per model (a failing build shows here first)."""
    repo = build_onnx_identities(tmp_path / "r")
    assert sorted(p.name for p in repo.iterdir()) == sorted(model_name("onnx", d) for d in DATATYPES)


@pytest.mark.parametrize("hop", HOPS)
def test_json_writes_nan_and_infinities_as_triton_does(stack: Stack, hop: str) -> None:
    """Triton's JSON (rapidjson with its NaN/Inf flag, server#3870) writes NaN, Infinity and
    -Infinity as bare words, and reads them; FP16 travels as the number it holds."""
    import json
    import urllib.request

    for dt, sent in (("FP32", "[NaN, Infinity, -Infinity, -0.0, 1e-45]"), ("FP16", "[NaN, -Infinity, 6e-08, 65504.0]")):
        body = (f'{{"inputs": [{{"name": "INPUT0", "shape": [1, {sent.count(",") + 1}], "datatype": "{dt}", '
                f'"data": {sent}}}]}}').encode()
        url = f"http://{stack.url('onnx', hop, 'http')}/v2/models/identity_{dt.lower()}/infer"
        with urllib.request.urlopen(urllib.request.Request(url, body, method="POST")) as resp:
            text = resp.read().decode()
        data = json.loads(text)["outputs"][0]["data"]
        assert "NaN" in text and "-Infinity" in text, text
        want = np.array(json.loads(sent), dtype=_NUMPY[dt])
        assert same(dt, np.array(data, dtype=_NUMPY[dt]), want, "http-json"), (data, want)
