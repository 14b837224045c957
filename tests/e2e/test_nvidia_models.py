"""What NVIDIA's example clients found (docs/nvidia-examples.md), without the examples: `meshserve
up` on tests/support/nvidia_models.py's repository, driven with tritonclient.

- classification (``class_count``) of an ensemble's output: Triton classifies it with the labels of
  the composing model that made it; the gateway asks that step for it (ensemble_image_client.py);
- a model version that is not a number: Triton's text "failed to get model version from specified
  version string '...'" (grpc_explicit_int8_content_client.py looks for it);
- the generated models answer as Triton's example models do (simple_int8, the sequence models)."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.support import nvidia_models
from tests.support.net import free_port
from tests.support.up import Up, meshserve_up


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Up, Path]]:
    folder = tmp_path_factory.mktemp("nvidia")
    repo = nvidia_models.build(folder / "models")
    image = nvidia_models.write_image(folder / "image.ppm")
    with meshserve_up("--repository", str(repo), "--http-port", str(free_port()), "--grpc-port", str(free_port()),
                      "--metrics-port", "-1") as up:
        yield up, image


@pytest.mark.parametrize("client", [httpclient, grpcclient], ids=["http", "grpc"])
def test_ensemble_output_classified_with_the_step_models_labels(client: object, mesh: tuple[Up, Path]) -> None:
    up, image = mesh
    mod = client  # tritonclient.http or .grpc: the same calls
    data = np.array([[image.read_bytes()]], dtype=np.object_)
    url = up.http if mod is httpclient else up.grpc
    with mod.InferenceServerClient(url) as c:  # type: ignore[attr-defined]
        inp = mod.InferInput("INPUT", [1, 1], "BYTES")  # type: ignore[attr-defined]
        inp.set_data_from_numpy(data)
        scores = c.infer("preprocess_inception_ensemble", [inp]).as_numpy("OUTPUT")
        assert scores.dtype == np.float32 and scores.shape == (1, 1001)
        top = np.argsort(-scores[0], kind="stable")[:3]
        out = mod.InferRequestedOutput("OUTPUT", class_count=3)  # type: ignore[attr-defined]
        classes = c.infer("preprocess_inception_ensemble", [inp], outputs=[out]).as_numpy("OUTPUT")
    assert classes.shape == (1, 3), classes
    got = [entry.decode().split(":") for entry in classes[0]]
    labels = nvidia_models.labels(1001, "inception").splitlines()  # inception_onnx's label file
    assert [int(i) for _, i, _ in got] == list(top)
    assert [name for _, _, name in got] == [labels[i] for i in top]
    np.testing.assert_allclose([float(v) for v, _, _ in got], scores[0][top], rtol=1e-5)


def test_a_version_that_is_not_a_number_gets_tritons_text(mesh: tuple[Up, Path]) -> None:
    up, _ = mesh
    x = np.arange(16, dtype=np.int8).reshape(1, 16)
    with grpcclient.InferenceServerClient(up.grpc) as c:
        ins = [grpcclient.InferInput(f"INPUT{i}", [1, 16], "INT8") for i in (0, 1)]
        for i in ins:
            i.set_data_from_numpy(x)
        res = c.infer("simple_int8", ins)
        np.testing.assert_array_equal(res.as_numpy("OUTPUT0"), x + x)
        np.testing.assert_array_equal(res.as_numpy("OUTPUT1"), x - x)
        with pytest.raises(InferenceServerException) as err:
            c.infer("simple_int8", ins, model_version="wrong_specification")
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "failed to get model version from specified version string 'wrong_specification'" in err.value.message()


def test_sequence_models_answer_as_tritons(mesh: tuple[Up, Path]) -> None:
    """simple_dyna_sequence: READY * (INPUT + START + END * CORRID); simple_string_dyna_sequence:
    the running sum, plus the (numeric string) id at the end."""
    up, _ = mesh
    with httpclient.InferenceServerClient(up.http) as c:
        def send(model: str, seq: int | str, value: int, start: bool, end: bool) -> int:
            inp = httpclient.InferInput("INPUT", [1, 1], "INT32")
            inp.set_data_from_numpy(np.array([[value]], np.int32))
            res = c.infer(model, [inp], sequence_id=seq, sequence_start=start, sequence_end=end)
            return int(res.as_numpy("OUTPUT")[0][0])

        assert [send("simple_dyna_sequence", 77, v, i == 0, i == 2) for i, v in enumerate([5, 6, 7])] == [6, 6, 84]
        assert [send("simple_string_dyna_sequence", "40", v, i == 0, i == 2)
                for i, v in enumerate([5, 6, 7])] == [5, 11, 58]
