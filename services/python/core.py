"""PythonServiceCore: a ServiceCore whose model versions run model.py in worker processes."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from meshserve._proto import model_config_pb2 as mc
from meshserve.repository import layout
from services.base.core import ServiceCore
from services.base.model import ModelVersion
from services.base.runtime import RuntimeInstance, RuntimeLoadError, config_parameter, placements
from services.base.validation import ModelTensors
from services.base.warmup import run_warmup
from services.python.autocomplete import config_json
from services.python.instance import ModelWorker, WorkerSpec, become_subreaper
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
        become_subreaper()  # what a model leaves behind is reaped, not left to init (instance.py:reap_session)
        await super().start()

    async def stop(self, drain: bool = True) -> None:
        for mv in self._all_versions():
            if isinstance(mv, PythonModelVersion):
                mv.stop_restarts()  # a worker that exits while the service drains stays down
        await super().stop(drain)

    async def metrics_text(self) -> tuple[bytes, str]:
        """Triton's model metrics, then the python models' custom metrics (MetricFamily): the same
        family and labels in several instances are one metric, as in Triton's single process:
        counters add up, a gauge shows the value set last."""
        body, content_type = await super().metrics_text()
        workers = [w for mv in self._all_versions() if isinstance(mv, PythonModelVersion) for w in mv.workers]
        snapshots = await asyncio.gather(*(w.metrics() for w in workers))
        return body + render_custom_metrics([m for snap in snapshots for m in snap]), content_type

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
        model_file = layout.model_file(path, config, version)
        if not model_file.is_file():
            raise RuntimeLoadError(f"model '{name}': {model_file} not found")
        model_config = config_json(config)
        tensors = ModelTensors.from_config(config)
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
                                  timeout, self.options.load_timeout_s, self.options.log_level, tensors)
                worker = ModelWorker(spec, self._loop)
                worker.spawn()  # the instances initialize side by side
                workers.append(worker)
            for worker in workers:
                worker.wait_initialized()
            run_warmup(config, list[RuntimeInstance](workers), path)  # through ModelWorker.run, before it serves
        except BaseException:
            for w in workers:
                w.close()
            raise
        return PythonModelVersion(config, version, path, workers)


def render_custom_metrics(metrics: list[tuple[str, str, int, tuple[tuple[str, str], ...], float, float]]) -> bytes:
    """Prometheus text of the workers' custom metrics, merged across instances."""
    families: dict[str, tuple[str, int]] = {}
    merged: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[float, float]] = {}
    for name, description, kind, labels, value, updated in metrics:
        families.setdefault(name, (description, kind))
        key = (name, labels)
        if key in merged:
            total, at = merged[key]
            if kind == 0:  # counter
                value, updated = total + value, max(at, updated)
            elif at > updated:  # gauge: the latest set
                value, updated = total, at
        merged[key] = (value, updated)
    lines: list[str] = []
    for name, (description, kind) in families.items():
        lines.append(f"# HELP {name} {description}")
        lines.append(f"# TYPE {name} {'counter' if kind == 0 else 'gauge'}")
        for (fam, labels), (value, _) in merged.items():
            if fam == name:
                lab = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
                lines.append(f"{name}{{{lab}}} {value:g}")
    return ("\n".join(lines) + "\n").encode() if lines else b""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
