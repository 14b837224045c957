"""PythonServiceCore: a ServiceCore whose model versions run model.py in worker processes."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from meshserve._proto import model_config_pb2 as mc
from meshserve.repository import layout
from services.base.core import ServiceCore
from services.base.model import ModelVersion
from services.base.runtime import RuntimeLoadError, config_parameter, placements
from services.python.autocomplete import config_json
from services.python.instance import ModelWorker, WorkerSpec
from services.python.model import PythonModelVersion

# model config parameter: seconds one execute() may take before its worker is killed and restarted
EXECUTE_TIMEOUT_PARAMETER = "execute_timeout_seconds"


@dataclass(frozen=True)
class PythonOptions:
    """The python service's flags."""

    bls_target: str = ""  # the gateway's gRPC address, for BLS (--bls-target)
    execute_timeout_s: float = 60.0  # --python-execute-timeout; the model parameter overrides it
    load_timeout_s: float = 120.0  # initialize() limit
    log_level: str = "INFO"


class PythonServiceCore(ServiceCore):
    """Hosts the repository's python-backend models."""

    options = PythonOptions()
    _loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await super().start()

    async def stop(self, drain: bool = True) -> None:
        for mv in self._all_versions():
            if isinstance(mv, PythonModelVersion):
                mv.stop_restarts()  # a worker that exits while the service drains stays down
        await super().stop(drain)

    def _build_version(self, path: Path, config: mc.ModelConfig, version: int) -> ModelVersion:
        assert self._loop is not None
        name = config.name
        if "EXECUTION_ENV_PATH" in config.parameters:
            raise RuntimeLoadError(
                f"model '{name}': parameter EXECUTION_ENV_PATH (a packed conda environment) is not supported by "
                "meshserve's python service; install the model's packages into the service's Python environment")
        timeout = self.options.execute_timeout_s
        raw = config_parameter(config, EXECUTE_TIMEOUT_PARAMETER)
        if raw is not None and raw.strip():
            try:
                timeout = float(raw)
            except ValueError:
                raise RuntimeLoadError(f"model '{name}': parameter '{EXECUTE_TIMEOUT_PARAMETER}' must be a number of "
                                       f"seconds, got '{raw}'") from None
            if timeout < 0:
                raise RuntimeLoadError(f"model '{name}': parameter '{EXECUTE_TIMEOUT_PARAMETER}' must be >= 0")
        if config.model_warmup:
            raise RuntimeLoadError(f"model '{name}': model_warmup is not supported for python models yet")
        model_file = layout.model_file(path, config, version)
        if not model_file.is_file():
            raise RuntimeLoadError(f"model '{name}': {model_file} not found")
        model_config = config_json(config)
        per_group: dict[str, int] = {}
        workers: list[ModelWorker] = []
        try:
            for p in placements(config, self.gpu_available):
                index = per_group.get(p.group, 0)
                per_group[p.group] = index + 1
                kind = "GPU" if p.kind == "gpu" else "CPU"
                args = {"model_config": model_config, "model_instance_kind": kind,
                        "model_instance_name": f"{p.group}_{index}",
                        "model_instance_device_id": str(p.device_id), "model_repository": str(path),
                        "model_version": str(version), "model_name": name}
                spec = WorkerSpec(model_file, args, f"{p.group}_{index}", name, str(version),
                                  config.model_transaction_policy.decoupled, self.options.bls_target,
                                  timeout, self.options.load_timeout_s, self.options.log_level)
                worker = ModelWorker(spec, self._loop)
                worker.spawn()  # the instances initialize side by side
                workers.append(worker)
            for worker in workers:
                worker.wait_initialized()
        except BaseException:
            for w in workers:
                w.close()
            raise
        return PythonModelVersion(config, version, path, workers)
