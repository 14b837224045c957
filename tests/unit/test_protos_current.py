"""The generated protobuf modules match protos/*.proto (regenerate with protos/generate.py)."""
from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT


def test_generated_code_is_current() -> None:
    proc = subprocess.run([sys.executable, "protos/generate.py", "--check"], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_wire_compatible_with_tritonclient_descriptors() -> None:
    """Every message, field name, number, type and oneof matches tritonclient's compiled protos."""
    import tritonclient.grpc.model_config_pb2 as tcfg
    import tritonclient.grpc.service_pb2 as tsvc

    from meshserve._proto import grpc_service_pb2, model_config_pb2

    def fields(mod) -> set:
        out, seen = set(), set()

        def walk(d) -> None:
            if d.full_name in seen:
                return
            seen.add(d.full_name)
            for f in d.fields:
                out.add((d.full_name, f.name, f.number, f.type, f.is_repeated,
                         f.containing_oneof.name if f.containing_oneof else None))
                if f.message_type:
                    walk(f.message_type)
            for n in d.nested_types:
                walk(n)

        for m in mod.DESCRIPTOR.message_types_by_name.values():
            walk(m)
        return out

    assert fields(grpc_service_pb2) | fields(model_config_pb2) == fields(tsvc) | fields(tcfg)
    ours = grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    theirs = tsvc.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    sig = lambda s: [(m.name, m.input_type.full_name, m.output_type.full_name,  # noqa: E731
                      m.client_streaming, m.server_streaming) for m in s.methods]
    assert sig(ours) == sig(theirs)
