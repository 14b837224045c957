"""model_warmup: run the configured warmup requests on every instance before it serves.

Triton semantics: each `model_warmup` entry names inputs with `zero_data`, `random_data` or
`input_data_file` (raw little-endian bytes, or length-prefixed BYTES, in `<model>/warmup/`),
a `batch_size` (1 when the model has no batch dimension) and a `count` (default 1). A
warmup that fails fails the load, naming the warmup and the input.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol import datatypes
from services.base.runtime import RuntimeInstance


class WarmupError(Exception):
    """A warmup request could not be built or failed to run."""


def warmup_inputs(config: mc.ModelConfig, warmup: mc.ModelWarmup, model_dir: Path) -> dict[str, np.ndarray]:
    batch = max(1, warmup.batch_size) if config.max_batch_size > 0 else 0
    rng = np.random.default_rng(0)
    feeds: dict[str, np.ndarray] = {}
    for name, spec in warmup.inputs.items():
        where = f"model '{config.name}' warmup '{warmup.name}' input '{name}'"
        dt = datatypes.config_to_wire(spec.data_type)
        shape = ((batch,) if batch else ()) + tuple(int(d) for d in spec.dims)
        if any(d < 0 for d in shape):
            raise WarmupError(f"{where}: dims {list(spec.dims)} must be fixed (no -1)")
        count = datatypes.element_count(shape)
        choice = spec.WhichOneof("input_data_type")
        if dt == "BYTES":
            if choice == "input_data_file":
                values = datatypes.deserialize_bytes(_read(model_dir, spec.input_data_file, where), count)
            elif choice == "random_data":
                values = [bytes(rng.integers(97, 123, size=8, dtype=np.uint8)) for _ in range(count)]
            else:
                values = [b""] * count
            feeds[name] = np.array(values, dtype=np.object_).reshape(shape)
            continue
        dtype = datatypes.carrier_dtype(dt)  # (BF16: its raw bits as uint16)
        if choice == "input_data_file":
            raw = _read(model_dir, spec.input_data_file, where)
            if len(raw) != count * dtype.itemsize:
                raise WarmupError(f"{where}: {spec.input_data_file} holds {len(raw)} bytes, shape {list(shape)} "
                                  f"of {dt} needs {count * dtype.itemsize}")
            feeds[name] = np.frombuffer(raw, dtype=dtype).reshape(shape)
        elif choice == "random_data":
            if dtype.kind == "f":
                feeds[name] = rng.standard_normal(shape).astype(dtype)
            elif dtype.kind == "b":
                feeds[name] = rng.integers(0, 2, size=shape).astype(dtype)
            else:
                feeds[name] = rng.integers(0, 8, size=shape).astype(dtype)
        else:
            feeds[name] = np.zeros(shape, dtype=dtype)
    return feeds


def _read(model_dir: Path, name: str, where: str) -> bytes:
    path = model_dir / "warmup" / name
    try:
        return path.read_bytes()
    except OSError as exc:
        raise WarmupError(f"{where}: cannot read {path}: {exc.strerror}") from None


def run_warmup(config: mc.ModelConfig, instances: list[RuntimeInstance], model_dir: Path) -> None:
    outputs = [o.name for o in config.output]
    for warmup in config.model_warmup:
        feeds = warmup_inputs(config, warmup, model_dir)
        for instance in instances:
            for _ in range(max(1, warmup.count)):
                try:
                    instance.run(dict(feeds), outputs)
                except Exception as exc:
                    raise WarmupError(f"model '{config.name}' warmup '{warmup.name}' failed: {exc}") from None
