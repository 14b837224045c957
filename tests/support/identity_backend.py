"""A throwaway backend kind, "identity", for tests/integration/test_backend_kinds.py: what a new
backend is (docs/architecture.md, "Where to add a backend"), its runtime and its service entry in
one module, registered by the one registry row ``ROW`` (passed in MESHSERVE_EXTRA_KINDS).

Its models are ``model.identity`` files holding the word ``identity``; output i is a copy of input i.
Pure numpy: no asyncio, no protocol, as every adapter.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from meshserve._proto import model_config_pb2 as mc
from meshserve.repository.kinds import EXTRA_KINDS_ENV
from services.base import main as base_main
from services.base.runtime import InstancePlacement, RuntimeLoadError

ROW = {"name": "identity", "backends": {"identity": ["model.identity"]}, "platforms": {"identity_numpy": "identity"},
       "entry": "tests.support.identity_backend", "deploy": "identity"}
ENV = {EXTRA_KINDS_ENV: json.dumps([ROW])}
MAGIC = "identity\n"


class IdentityInstance:
    def __init__(self, config: mc.ModelConfig) -> None:
        self.pairs = list(zip([i.name for i in config.input], [o.name for o in config.output], strict=True))

    def run(self, inputs: dict[str, np.ndarray], output_names: list[str]) -> dict[str, np.ndarray]:
        out = {o: np.array(inputs[i], copy=True) for i, o in self.pairs}
        return {name: out[name] for name in output_names}

    def close(self) -> None:
        self.pairs = []


class IdentityAdapter:
    name = "identity"

    def load(self, model_file: Path, config: mc.ModelConfig, placement: InstancePlacement) -> IdentityInstance:
        if model_file.read_text() != MAGIC or len(config.input) != len(config.output):
            raise RuntimeLoadError(f"model '{config.name}': {model_file.name} is no identity model for this config")
        return IdentityInstance(config)


def main(args: argparse.Namespace) -> None:
    base_main.main("identity", {"identity": IdentityAdapter()}, args)
