"""No 5xx for client mistakes (issue 17, item 5): hypothesis generates malformed HTTP requests
(JSON and binary-extension bodies with wrong sizes, datatypes and shapes, bad
Inference-Header-Content-Length, invalid UTF-8 and lone surrogates, bad or lying
Content-Encoding, random paths and methods) and gRPC requests (random and mutated serialized
ModelInferRequest bytes, wrong field combinations such as contents with raw_input_contents),
through the gateway and at a service replica: 5,000 in all (50,000 with
MESHSERVE_ADVERSARIAL_LONG=1). No answer may be a 5xx or INTERNAL/UNKNOWN, none may stall, and
every process must still serve afterwards.

Each run records every bad answer and asserts once at the end (no shrinking: the report lists
the first examples as sent), so a run costs the same whether it passes or not. Requests that
would change the mesh (repository load/unload) are not generated; trace and log settings are
only written with random bodies, which they refuse.
"""
from __future__ import annotations

import gzip
import json
import socket
import struct
import time
import zlib

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from meshserve._proto import grpc_service_pb2 as pb
from tests.adversarial.harness import KEY, LONG, Mesh
from tests.conftest import Proc

SCALE = 10 if LONG else 1
HTTP_PER_TARGET = 1500 * SCALE
GRPC_PER_TARGET = 1000 * SCALE
STALL_S = 10.0  # an answer slower than this is a stall (a failure)

MODELS = ["add_sub", "identity_fp32", "nope", "", "..", "%2e%2e", "%2F", "a/b", "\u00e9", "%ff", "%00", "x" * 300]
DATATYPES = ["FP32", "FP16", "FP64", "INT8", "INT32", "INT64", "UINT8", "BOOL", "BYTES", "BF16", "fp32", "", "COMPLEX"]


# ---- a raw keep-alive HTTP/1.1 client (load/rawhttp.py's approach, synchronous) ---------------
class RawHttp:
    def __init__(self, hostport: str):
        host, port = hostport.rsplit(":", 1)
        self.addr = (host, int(port))
        self.sock: socket.socket | None = None
        self.buf = b""

    def _conn(self) -> socket.socket:
        if self.sock is None:
            self.sock = socket.create_connection(self.addr, timeout=STALL_S)
            self.buf = b""
        return self.sock

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock = None

    def _fill(self) -> bool:
        assert self.sock is not None
        chunk = self.sock.recv(1 << 16)
        self.buf += chunk
        return bool(chunk)

    def request(self, raw: bytes, head_only: bool) -> str:
        """Send one request; its status ("EOF" if the server closed without answering)."""
        for attempt in range(2):  # a keep-alive connection the server closed in between: once more
            sock = self._conn()
            try:
                sock.sendall(raw)
                while b"\r\n\r\n" not in self.buf:
                    if not self._fill():
                        raise ConnectionResetError
                break
            except (ConnectionResetError, BrokenPipeError):
                self.close()
                if attempt == 1:
                    return "EOF"
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = lines[0].split(" ")[1]
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        if not head_only and status not in ("204", "304"):
            if headers.get("transfer-encoding", "").lower() == "chunked":
                while True:
                    while b"\r\n" not in self.buf:
                        if not self._fill():
                            break
                    size_line, _, rest = self.buf.partition(b"\r\n")
                    size = int(size_line.split(b";")[0] or b"0", 16)
                    while len(rest) < size + 2:
                        if not self._fill():
                            break
                        size_line, _, rest = self.buf.partition(b"\r\n")
                    self.buf = rest[size + 2:]
                    if size == 0:
                        break
            else:
                length = int(headers.get("content-length", "0"))
                while len(self.buf) < length:
                    if not self._fill():
                        break
                self.buf = self.buf[length:]
        if headers.get("connection", "").lower() == "close":
            self.close()
        return status


# ---- HTTP strategies -------------------------------------------------------------------------------
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                      st.text(max_size=20))
json_value = st.recursive(json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                             st.dictionaries(st.text(max_size=10), inner, max_size=5)),
                          max_leaves=20)
# names that JSON can carry but UTF-8 cannot: a lone surrogate, written as the escape
weird_name = st.sampled_from(['"\\ud800"', '"\\udfff"', '"INPUT0\\u0000"', '"INPUT0"', '"INPUT1"', '""', '"\\u00e9"'])


@st.composite
def infer_json(draw: st.DrawFn) -> tuple[bytes, int | None]:
    """A v2 infer body, mostly right and wrong in a few places; maybe with binary tensors."""
    inputs = []
    binary = b""
    for _ in range(draw(st.integers(0, 3))):
        shape = draw(st.lists(st.integers(-3, 40), max_size=4) | st.just([1, 16]))
        dt = draw(st.sampled_from(DATATYPES))
        fields = [f'"name":{draw(weird_name)}', f'"datatype":{json.dumps(dt)}', f'"shape":{json.dumps(shape)}']
        if draw(st.booleans()):
            size = draw(st.integers(-5, 200))
            fields.append(f'"parameters":{{"binary_data_size":{size}}}')
            binary += draw(st.binary(max_size=max(0, size) + 8))
        else:
            fields.append(f'"data":{json.dumps(draw(st.lists(json_leaf, max_size=20)))}')
        inputs.append("{" + ",".join(fields) + "}")
    extra = draw(st.sampled_from(["", ',"outputs":[{"name":"OUTPUT0","parameters":{"binary_data":true}}]',
                                  ',"parameters":{"priority":-1}', ',"parameters":{"sequence_id":"x"}',
                                  ',"parameters":{"meshserve_merged_requests":-7}', ',"id":5',
                                  ',"outputs":"x"', ',"parameters":{"binary_data_output":1}']))
    header = ('{"inputs":[' + ",".join(inputs) + "]" + extra + "}").encode()
    header_length = len(header) if binary or draw(st.booleans()) else None
    if header_length is not None and draw(st.booleans()):
        header_length = draw(st.integers(-10, len(header) + 10))
    return header + binary, header_length


@st.composite
def generate_json(draw: st.DrawFn) -> tuple[bytes, None]:
    """A generate body: input names (add_sub's, and others) and parameters with any JSON value,
    or add_sub's [16] floats."""
    doc = {}
    for key in draw(st.lists(st.sampled_from(["INPUT0", "INPUT1", "parameters", "text_input", "x"]), max_size=4)):
        doc[key] = draw(json_value | st.lists(st.floats(-1e3, 1e3, width=32), min_size=16, max_size=16))
    return json.dumps(doc).encode(), None


body_strategy = st.one_of(
    infer_json(),
    generate_json(),
    st.tuples(st.binary(max_size=300), st.none() | st.integers(-5, 400)),
    st.tuples(st.sampled_from([b"\xff\xfe{", b'{"inputs":[{"name":"\xc3\x28"}]}', b'{"a":"\xed\xa0\x80"}',
                               b"{" * 5000, b"[" * 100_000, b'{"inputs":' + b"1" * 5000 + b"}", b"\x00" * 64]),
              st.none()),
    st.tuples(json_value.map(lambda v: json.dumps(v).encode()), st.none()),
)


@st.composite
def http_request(draw: st.DrawFn, hostport: str) -> tuple[bytes, bool, str]:
    model = draw(st.sampled_from(MODELS))
    path = draw(st.sampled_from([
        f"/v2/models/{model}/infer", f"/v2/models/{model}/infer", f"/v2/models/{model}/infer",
        f"/v2/models/{model}/versions/{draw(st.sampled_from(['1', '0', '-1', 'x', '99999999999999999999']))}/infer",
        f"/v2/models/{model}", f"/v2/models/{model}/config", f"/v2/models/{model}/ready", f"/v2/models/{model}/stats",
        "/v2/models/stats", "/v2/repository/index", "/v2/health/ready", "/v2", "/metrics", "/v2/trace/setting",
        f"/v2/models/{model}/trace/setting", "/v2/logging", "/", "/v2/models", "/v2/models/", "//v2//models",
        "/v2/systemsharedmemory/status", f"/v2/systemsharedmemory/region/{model}/register",
        f"/v2/cudasharedmemory/region/{model}/register", f"/v2/systemsharedmemory/region/{model}/status",
        f"/v2/models/{model}/generate", f"/v2/models/{model}/generate_stream",
        "/v2/models/add_sub/infer?x=1&y", "/v2/%zz", "/\u00e9", "/" + "a/" * 200,
    ]))
    if path.rstrip("/").endswith(("trace/setting", "logging")):
        method = "GET"  # writes are admin-only; a random body never is a valid setting anyway
    else:
        method = draw(st.sampled_from(["POST", "POST", "POST", "GET", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH", "BREW"]))
    body, header_length = draw(body_strategy)
    headers = {"Host": hostport}
    if draw(st.integers(0, 4)):
        headers["x-api-key"] = KEY if draw(st.integers(0, 5)) else draw(st.sampled_from(["", "wrong", "\u00e9"]))
    if header_length is not None:
        headers["Inference-Header-Content-Length"] = str(header_length)
    elif draw(st.integers(0, 8)) == 0:
        headers["Inference-Header-Content-Length"] = draw(st.sampled_from(["x", "-1", "1e3", "", " 5", "9" * 30]))
    encoding = draw(st.sampled_from([None, None, None, "gzip", "deflate", "br", "identity", "x-zip", "gzip, deflate",
                                     "GZIP", "compress"]))
    if encoding is not None:
        headers["Content-Encoding"] = encoding
        how = draw(st.sampled_from(["right", "garbage", "truncated"]))
        if encoding.lower() == "gzip" and how != "garbage":
            body = gzip.compress(body)
        elif encoding == "deflate" and how != "garbage":
            body = zlib.compress(body)
        elif how != "right":
            body = draw(st.binary(min_size=1, max_size=64))
        if how == "truncated":
            body = body[: max(1, len(body) // 2)]
    headers["Content-Type"] = draw(st.sampled_from(["application/json", "application/octet-stream", "text/plain",
                                                    "application/json; charset=latin-1", ""]))
    if draw(st.integers(0, 10)) == 0:
        headers["Accept-Encoding"] = draw(st.sampled_from(["gzip", "deflate", "br", "*", "gzip;q=0", "\u00e9"]))
    if draw(st.integers(0, 20)) == 0:
        headers[draw(st.sampled_from(["X-\u00e9", "Bad Header", "X-Long"]))] = draw(st.sampled_from(["v", "x" * 8000]))
    headers["Content-Length"] = str(len(body))
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    return head.encode("utf-8") + body, method == "HEAD", f"{method} {path} {headers} body={body[:120]!r}"


def fuzz_http(hostport: str, n: int) -> tuple[int, list[str]]:
    client = RawHttp(hostport)
    bad: list[str] = []
    count = [0]

    @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def run(data: st.DataObject) -> None:
        raw, head_only, what = data.draw(http_request(hostport))
        t0 = time.monotonic()
        try:
            status = client.request(raw, head_only)
        except (TimeoutError, OSError) as exc:
            client.close()
            status = f"stall/{type(exc).__name__}"
        count[0] += 1
        if status.startswith("5") or status.startswith("stall") or time.monotonic() - t0 > STALL_S:
            bad.append(f"{status}: {what}")

    try:
        run()
    finally:
        client.close()
    return count[0], bad


# ---- gRPC --------------------------------------------------------------------------------------------
def valid_infer() -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="add_sub", id="fuzz")
    for name in ("INPUT0", "INPUT1"):
        req.inputs.add(name=name, datatype="FP32", shape=[1, 16])
        req.raw_input_contents.append(np.ones(16, np.float32).tobytes())
    return req


VALID = valid_infer().SerializeToString()


@st.composite
def structured_infer(draw: st.DrawFn) -> bytes:
    req = valid_infer() if draw(st.booleans()) else pb.ModelInferRequest()
    req.model_name = draw(st.sampled_from([m for m in MODELS if "%" not in m] + ["add_sub"] * 4))
    req.model_version = draw(st.sampled_from(["", "", "1", "0", "-1", "x"]))
    choice = draw(st.integers(0, 8))
    if choice == 0 and req.inputs:  # contents and raw_input_contents together (Triton refuses)
        req.inputs[0].contents.fp32_contents.extend([1.0] * 16)
    elif choice == 1:
        del req.raw_input_contents[:]
        for inp in req.inputs:
            getattr(inp.contents, draw(st.sampled_from(["fp32_contents", "int_contents", "bytes_contents",
                                                        "bool_contents", "uint64_contents"]))).extend([])
    elif choice == 2:
        for inp in req.inputs:
            inp.datatype = draw(st.sampled_from(DATATYPES))
            del inp.shape[:]
            inp.shape.extend(draw(st.lists(st.integers(-2**40, 2**40), max_size=4)))
    elif choice == 3 and req.raw_input_contents:
        req.raw_input_contents[0] = draw(st.binary(max_size=100))
        if draw(st.booleans()):
            req.raw_input_contents.append(b"extra")
    elif choice == 4:
        key = draw(st.sampled_from(["meshserve_merged_requests", "priority", "timeout", "sequence_id",
                                    "sequence_start", "binary_data_output", "traceparent", "meshserve_queued_us"]))
        p = req.parameters[key]
        which = draw(st.sampled_from(["int64_param", "string_param", "bool_param", "double_param", "uint64_param"]))
        value = {"int64_param": draw(st.integers(-2**63, 2**63 - 1)), "string_param": draw(st.text(max_size=40)),
                 "bool_param": draw(st.booleans()), "double_param": draw(st.floats()),
                 "uint64_param": draw(st.integers(0, 2**64 - 1))}[which]
        setattr(p, which, value)
    elif choice == 5:
        req.outputs.add(name=draw(st.sampled_from(["OUTPUT0", "NOPE", ""]))).parameters["classification"].int64_param = \
            draw(st.integers(-3, 2**40))
    elif choice == 6:
        req.inputs.add(name=draw(st.sampled_from(["INPUT0", "INPUT2", ""])), datatype="FP32", shape=[1, 16])
    elif choice == 7:  # shared-memory parameters of any type (the regions named are not registered)
        on_input = bool(req.inputs) and draw(st.booleans())
        tensor = req.inputs[0] if on_input else req.outputs.add(name=draw(st.sampled_from(["OUTPUT0", "NOPE"])))
        if on_input and req.raw_input_contents and draw(st.booleans()):
            del req.raw_input_contents[0]  # as a client sends a shared-memory input
        for key in draw(st.lists(st.sampled_from(["shared_memory_region", "shared_memory_byte_size",
                                                  "shared_memory_offset"]), min_size=1, max_size=3)):
            which = draw(st.sampled_from(["int64_param", "string_param", "bool_param", "uint64_param"]))
            setattr(tensor.parameters[key], which, {
                "int64_param": draw(st.integers(-2**63, 2**63 - 1)), "string_param": draw(st.text(max_size=12)),
                "bool_param": draw(st.booleans()), "uint64_param": draw(st.integers(0, 2**64 - 1))}[which])
    return req.SerializeToString()


@st.composite
def mutated_infer(draw: st.DrawFn) -> bytes:
    raw = bytearray(VALID)
    for _ in range(draw(st.integers(1, 8))):
        op = draw(st.integers(0, 3))
        i = draw(st.integers(0, max(0, len(raw) - 1)))
        if op == 0 and raw:
            raw[i] = draw(st.integers(0, 255))
        elif op == 1:
            raw = raw[:i]
        elif op == 2:
            raw[i:i] = draw(st.binary(min_size=1, max_size=16))
        else:
            raw[i:i] = struct.pack("B", draw(st.integers(0, 255))) + b"\xff" * draw(st.integers(1, 10))
    return bytes(raw)


grpc_body = st.one_of(structured_infer(), mutated_infer(), st.binary(max_size=200))
METHODS = ["ModelInfer"] * 6 + ["ModelMetadata", "ModelConfig", "ModelReady", "ModelStatistics", "RepositoryIndex",
                                "ServerMetadata", "ServerLive", "ServerReady", "SystemSharedMemoryStatus",
                                "SystemSharedMemoryRegister", "CudaSharedMemoryRegister"]


def fuzz_grpc(hostport: str, n: int) -> tuple[int, list[str]]:
    bad: list[str] = []
    count = [0]
    with grpc.insecure_channel(hostport, options=[("grpc.max_receive_message_length", -1),
                                                  ("grpc.enable_retries", 0)]) as channel:
        calls = {m: channel.unary_unary(f"/inference.GRPCInferenceService/{m}") for m in METHODS}

        @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(st.sampled_from(METHODS), grpc_body, st.sampled_from([KEY, KEY, KEY, "wrong", ""]))
        def run(method: str, body: bytes, key: str) -> None:
            metadata = (("x-api-key", key),) if key else ()
            count[0] += 1
            try:
                calls[method](body, timeout=STALL_S, metadata=metadata)
            except grpc.RpcError as exc:
                code = exc.code()  # type: ignore[attr-defined]
                if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED):
                    bad.append(f"{code.name} {exc.details()!r}: {method} {body[:120]!r}")  # type: ignore[attr-defined]

        run()
    return count[0], bad


def _check(what: str, proc: Proc, result: tuple[int, list[str]], n: int) -> None:
    count, bad = result
    assert count >= n, f"{what}: only {count} of {n} requests generated"
    assert not bad, f"{what} at {proc.http}: {len(bad)} of {count} answers were 5xx/INTERNAL/UNKNOWN/stalls:\n" + \
        "\n".join(bad[:15])


@pytest.mark.parametrize("which", ["gateway", "service"])
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_fuzz(mesh: Mesh, protocol: str, which: str) -> None:
    proc = mesh.gateway if which == "gateway" else mesh.services[0]
    if protocol == "http":
        n, result = HTTP_PER_TARGET, fuzz_http(proc.http, HTTP_PER_TARGET)
    else:
        n, result = GRPC_PER_TARGET, fuzz_grpc(proc.grpc, GRPC_PER_TARGET)
    _check(f"{protocol} fuzz, {which}", proc, result, n)
    assert mesh.healthy(), "a process stopped serving after the fuzz"
