"""services/python/bls.py: BLS calls carry the service's key (x-api-key metadata, from the
environment the service sets), and the gateway's refusals of that identity reach the model as
Triton's BLS error with a non-5xx code and a message saying what the operator must change; the
key file rules of services/python/main.py:read_api_key."""
from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import grpc_service_pb2_grpc as pb_grpc
from services.python import bls, pb_utils
from services.python.main import read_api_key


class _Gateway(pb_grpc.GRPCInferenceServiceServicer):
    """Admits the key "good"; model "busy" is over the identity's quota."""

    def ModelInfer(self, request: pb.ModelInferRequest, context: grpc.ServicerContext) -> pb.ModelInferResponse:
        key = dict(context.invocation_metadata()).get("x-api-key")
        if key is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "an API key is required")
        if key != "good":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "unknown API key")
        if request.model_name == "busy":
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "tenant 'bls' is over its rate limit")
        if request.model_name == "secret":
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "tenant 'bls' may not call model 'secret'")
        return pb.ModelInferResponse(model_name=request.model_name)


@pytest.fixture(scope="module")
def target() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(_Gateway(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


def _call(client: bls.BlsClient, model: str = "m") -> pb_utils.InferenceResponse:
    return client.infer(pb_utils.InferenceRequest(model_name=model, requested_output_names=[], inputs=[]))


def test_the_key_comes_from_the_services_environment(target: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(bls.BLS_API_KEY_ENV, "good")
    assert not _call(bls.BlsClient(target)).has_error()
    monkeypatch.delenv(bls.BLS_API_KEY_ENV)
    refused = _call(bls.BlsClient(target)).error()
    assert refused.code() == pb_utils.TritonError.INVALID_ARG
    assert "started without --bls-api-key-file" in refused.message()


@pytest.mark.parametrize(("key", "model", "code", "says"), [
    ("wrong", "m", pb_utils.TritonError.INVALID_ARG, "unknown API key (refused BLS call of the python service: its key, "
                                                      "--bls-api-key-file, is not a key of the gateway's tenants file)"),
    ("good", "secret", pb_utils.TritonError.INVALID_ARG, "may not call model 'secret' (refused BLS call of the python "
                                                          "service: its identity, --bls-api-key-file, may not use"),
    ("good", "busy", pb_utils.TritonError.UNAVAILABLE, "tenant 'bls' is over its rate limit"),
])
def test_refusals_of_the_identity_are_not_internal_errors(target: str, key: str, model: str, code: int,
                                                         says: str) -> None:
    error = _call(bls.BlsClient(target, api_key=key), model).error()
    assert error is not None and error.code() == code
    assert error.message().startswith(f"Model {model} - Error when running inference: ")
    assert says in error.message()


def test_the_key_file(tmp_path: Path) -> None:
    path = tmp_path / "k"
    path.write_text("  s3cret-key\n")
    assert read_api_key(path) == "s3cret-key"
    for bad, why in [("", "is empty"), ("a\nb", "one line of printable ASCII"), ("x" * 5000, "larger than 4096")]:
        path.write_text(bad)
        with pytest.raises(SystemExit, match=f"--bls-api-key-file {path}: .*{why}"):
            read_api_key(path)
