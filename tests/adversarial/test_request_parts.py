"""One request of many small parts (session 21; docs/security.md, "Session 21: the parts of one
request").

A ModelInferRequest's parts are cheap to send: an empty input, requested output or
raw_input_contents entry is 2 bytes, and so is a model name sent again (protobuf keeps the last).
Each cost Python work at every hop: the gateway's shared-memory check read every input's
parameters, its merging and response-cache scans walked every top-level field, a service
prepared every input. One 9.5 MiB message of 5 million empty inputs held a gateway's event loop
for 7 s (a service's for 4.7 s). Now a request may have at most MAX_TENSORS tensors of each kind
and MAX_PARAMETERS parameters (meshserve/protocol/infer_checks.py:check_counts, before anything
reads the parts), and the byte-level scans stop after wire.SCAN_FIELDS_MAX fields. What remains
is protobuf's own parse of the message (C, ~40 ms per MiB of 2-byte fields on a slow 2-core box).

A message over infer_checks.HEAVY_FROM (1 MiB) whose fields other than raw_input_contents hold
more than HEAVY_BYTES is parsed by the body worker (http_codec.parse_grpc_infer_request), which
counts its parts and sends back a message that parses at memcpy speed: the loop only walks its
first SCAN_FIELDS_MAX top-level fields.

Each message below is ~1 MiB (500,000 parts: counted on the loop) or ~8 MiB (4 million: parsed by
the worker) of one kind of part, sent unary on a gRPC channel of the attacker's while the good
client runs. Before the bounds: ~1.5 s of the loop per 1 MiB message. With the bounds and the
parse on the loop, ~0.3-0.6 s per 8 MiB message: the good client's p99 went over the suite's
limit either way.
"""
from __future__ import annotations

import grpc
import pytest

from tests.adversarial.harness import LONG, OTHER_KEY, Mesh, Observation, under_attack

INFER = "/inference.GRPCInferenceService/ModelInfer"
SIZES = (500_000, 4_000_000)  # parts per message: ~1 MiB (counted in place), ~8 MiB (the worker's)
KINDS = {  # one field of ModelInferRequest, empty, repeated
    "inputs": b"\x2a\x00",  # inputs (5)
    "requested outputs": b"\x32\x00",  # outputs (6)
    "raw_input_contents": b"\x3a\x00",  # raw_input_contents (7)
    "model names": b"\x0a\x00",  # model_name (1), the last one kept
    "parameters of one key": b"\x22\x00",  # parameters (4): one entry in the end, past every count
}
NAME = b"\x0a\x0didentity_fp32"  # (last: the model named is one the mesh serves)


@pytest.mark.parametrize("which", ["gateway", "service"])
def test_requests_of_many_parts(mesh: Mesh, which: str) -> None:
    proc = mesh.gateway if which == "gateway" else mesh.services[0]
    metadata = (("x-api-key", OTHER_KEY),) if which == "gateway" else ()
    rounds = 4 if LONG else 1

    def attack() -> Observation:
        codes: list[str] = []
        options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
        with grpc.insecure_channel(proc.grpc, options=options) as channel:
            infer = channel.unary_unary(INFER)
            for _ in range(rounds):
                for parts in SIZES:
                    for kind, part in KINDS.items():
                        try:
                            infer(part * parts + NAME, metadata=metadata, timeout=60)
                            codes.append(f"{parts} {kind}: OK")
                        except grpc.RpcError as exc:
                            codes.append(f"{parts} {kind}: {exc.code().name} {exc.details()[:80]}")
        refused = all(": INVALID_ARGUMENT" in c for c in codes)
        return Observation("; ".join(codes), refused)

    verdict = under_attack(mesh, proc, f"requests of many parts on {which}", attack)
    print(verdict.summary())
    verdict.judge().check()


# ---- the other requests with maps: model control, trace and log settings, shared memory ----------
# A model load's parameters, a trace or log settings update's settings: a million entries (~10 MB)
# held a gateway's loop 1.3-1.7 s over gRPC (the parse, then a walk of every entry before any check)
# and 0.3-1.0 s over HTTP (the JSON read in the body worker, but the million-key result sent back
# and read on the loop; a shared-memory register's body read in place, 0.5 s). Now at most
# MAX_PARAMETERS entries per map or list (infer_checks.check_message_counts, the codecs' counts),
# and a gRPC message over body_worker.OFFLOAD_BYTES is read by the body worker
# (grpc_frontend._reader, http_codec.parse_grpc_message), as a large JSON body is.
ENTRIES = 300_000


def _control_payloads() -> list[tuple[str, str, bytes]]:
    """(what, where: a gRPC method or an HTTP path, the message or body)."""
    import json

    from meshserve._proto import grpc_service_pb2 as pb

    load = pb.RepositoryModelLoadRequest(model_name="identity_fp32")
    trace = pb.TraceSettingRequest()
    logs = pb.LogSettingsRequest()
    for i in range(ENTRIES):
        load.parameters[f"k{i}"].string_param = "x"
        trace.settings[f"k{i}"].value.append("x")
        logs.settings[f"k{i}"].bool_param = True
    keys = {f"k{i}": True for i in range(ENTRIES)}
    return [("load (gRPC)", "RepositoryModelLoad", load.SerializeToString()),
            ("trace settings (gRPC)", "TraceSetting", trace.SerializeToString()),
            ("log settings (gRPC)", "LogSettings", logs.SerializeToString()),
            ("load (HTTP)", "/v2/repository/models/identity_fp32/load", json.dumps({"parameters": keys}).encode()),
            ("log settings (HTTP)", "/v2/logging", json.dumps(keys).encode()),
            ("shm register (HTTP)", "/v2/systemsharedmemory/region/x/register", json.dumps(keys).encode())]


def test_control_requests_of_many_entries(mesh: Mesh) -> None:
    import urllib.error
    import urllib.request

    from tests.adversarial.harness import ADMIN_KEY

    payloads = _control_payloads()  # (built before the good client's baseline)
    gateway = mesh.gateway

    def attack() -> Observation:
        codes: list[str] = []
        options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
        with grpc.insecure_channel(gateway.grpc, options=options) as channel:
            for what, where, body in payloads:
                if where.startswith("/"):
                    req = urllib.request.Request(f"http://{gateway.http}{where}", data=body, method="POST",
                                                 headers={"x-api-key": ADMIN_KEY})
                    try:
                        urllib.request.urlopen(req, timeout=60).close()
                        codes.append(f"{what}: 200")
                    except urllib.error.HTTPError as exc:
                        codes.append(f"{what}: {exc.code} {exc.read()[:80]!r}")
                    continue
                try:
                    channel.unary_unary(f"/inference.GRPCInferenceService/{where}")(
                        body, metadata=(("x-api-key", ADMIN_KEY),), timeout=60)
                    codes.append(f"{what}: OK")
                except grpc.RpcError as exc:
                    codes.append(f"{what}: {exc.code().name} {exc.details()[:80]}")
        refused = all(": INVALID_ARGUMENT" in c or ": 400" in c for c in codes)
        return Observation("; ".join(codes), refused)

    verdict = under_attack(mesh, gateway, "control requests of many entries", attack)
    print(verdict.summary())
    verdict.judge().check()
