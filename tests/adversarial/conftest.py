"""One mesh for the adversarial suite (a gateway with tenants in front of two ONNX replicas and
a good client), checked before every test and started afresh if an attack broke it, so one
failure does not cascade into the tests after it."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.adversarial.harness import Mesh, start_mesh


class _Holder:
    mesh: Mesh | None = None


@pytest.fixture(scope="session")
def _mesh_holder(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Holder]:
    holder = _Holder()
    yield holder
    if holder.mesh is not None:
        holder.mesh.stop()


@pytest.fixture
def mesh(_mesh_holder: _Holder, model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Mesh:
    m = _mesh_holder.mesh
    if m is not None and not m.healthy():
        m.stop()
        m = None
    if m is None:
        m = _mesh_holder.mesh = start_mesh(model_repo, tmp_path_factory.mktemp("mesh"))
    return m
