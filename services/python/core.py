"""PythonServiceCore: a ServiceCore whose model versions run model.py in worker processes."""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshserve._proto import model_config_pb2 as mc
from meshserve.repository import layout
from services.base.core import ServiceCore
from services.base.model import ModelVersion
from services.base.runtime import RuntimeInstance, RuntimeLoadError, config_parameter, placements
from services.base.validation import ModelTensors
from services.base.warmup import run_warmup
from services.python import execution_env as execution_env_module
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
    instances_are_processes = True
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

    async def log_settings_changed(self, changes: dict[str, Any]) -> None:
        """/v2/logging changed the service's settings (from a client of the service, or pushed by
        the gateway): every worker takes the settings /v2/logging gave, so the models' log lines
        (pb_utils.Logger) follow them as in Triton (its logging QA: verbose lines appear at
        ``log_verbose_level`` 1, none at INFO/WARNING/ERROR once those are off)."""
        for mv in self._all_versions():
            if isinstance(mv, PythonModelVersion):
                for w in mv.workers:
                    w.log_settings()

    def _build_version(self, path: Path, config: mc.ModelConfig, version: int) -> ModelVersion:
        assert self._loop is not None
        name = config.name
        execution_env = None
        if (env_path := (config_parameter(config, execution_env_module.PARAMETER) or "").strip()):
            execution_env = execution_env_module.resolve(env_path, path, name)
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
                                  timeout, self.options.load_timeout_s, self.options.log_level, tensors,
                                  execution_env)
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


def render_custom_metrics(metrics: list[tuple]) -> bytes:
    """Prometheus text of the workers' custom metrics (pb_utils.metrics_snapshot rows), merged
    across instances as Triton's one process would hold them: counters add up, a gauge shows the
    value set last, a histogram's counts and sums add up. Written as Triton's prometheus-cpp
    writes them (a histogram's _count, _sum, then cumulative _bucket lines up to le="+Inf")."""
    families: dict[str, tuple[str, int]] = {}
    merged: dict[tuple[str, tuple[tuple[str, str], ...]], list] = {}
    for row in metrics:
        try:
            name, description, kind, labels, value, updated = row[:6]
            hist: Any = row[6] if len(row) > 6 else None
            description, kind, labels = str(description), int(kind), tuple((str(k), str(v)) for k, v in labels)
            value, updated = float(value), float(updated)
            if kind == 2:
                bounds, counts, count = tuple(float(b) for b in hist[0]), [int(c) for c in hist[1]], int(hist[2])
                if len(bounds) != len(counts):
                    continue
        except (TypeError, ValueError, IndexError):
            continue  # a malformed row (the worker runs the model's code): left out
        if families.setdefault(str(name), (description, kind))[1] != kind:
            continue
        key = (str(name), labels)
        have = merged.get(key)
        if kind == 2:
            if have is None:
                merged[key] = [value, updated, bounds, counts, count]
            else:  # the first bounds hold; another's bucket counts where its bound fits (le stays true)
                have[0] += value
                have[4] += count
                for b, c in zip(bounds, counts, strict=True):
                    at = next((i for i, mine in enumerate(have[2]) if b <= mine), None)
                    if at is not None:
                        have[3][at] += c
        elif have is None:
            merged[key] = [value, updated]
        elif kind == 0:  # counter
            have[0] += value
            have[1] = max(have[1], updated)
        elif updated > have[1]:  # gauge: the latest set
            merged[key] = [value, updated]
    lines: list[str] = []
    for name, (description, kind) in families.items():
        lines.append(f"# HELP {name} {_escape_help(description)}")
        lines.append(f"# TYPE {name} {('counter', 'gauge', 'histogram')[kind] if 0 <= kind <= 2 else 'untyped'}")
        for (fam, labels), m in merged.items():
            if fam != name:
                continue
            if kind != 2:
                lines.append(f"{name}{_labels(labels)} {_number(m[0])}")
                continue
            sum_, bounds, counts, count = m[0], m[2], m[3], m[4]
            lines.append(f"{name}_count{_labels(labels)} {count}")
            lines.append(f"{name}_sum{_labels(labels)} {_number(sum_)}")
            running = 0
            for bound, c in zip(bounds, counts, strict=True):
                running += c
                lines.append(f"{name}_bucket{_labels(labels + (('le', _number(bound)),))} {running}")
            if not bounds or bounds[-1] != math.inf:
                lines.append(f"{name}_bucket{_labels(labels + (('le', '+Inf'),))} {count}")
    return ("\n".join(lines) + "\n").encode() if lines else b""


def _number(value: float) -> str:
    """A sample value as prometheus-cpp writes it (16 significant digits, +Inf, -Inf, Nan)."""
    if math.isnan(value):
        return "Nan"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return format(value, ".16g")


def _labels(labels: tuple[tuple[str, str], ...]) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels) + "}" if labels else ""


def _escape_help(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
