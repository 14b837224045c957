"""SequenceServiceCore: a ServiceCore whose model versions run through the sequence batcher."""
from __future__ import annotations

from pathlib import Path

from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol.errors import InferError
from meshserve.repository import layout
from services.base.core import ServiceCore
from services.base.model import ModelVersion
from services.base.runtime import placements
from services.base.warmup import run_warmup
from services.sequence.model import SequenceModelVersion


class SequenceServiceCore(ServiceCore):
    """Hosts the repository's models of kind "sequence" (any backend with an adapter here)."""

    def _build_version(self, path: Path, config: mc.ModelConfig, version: int) -> ModelVersion:
        backend = config.backend
        adapter = self.adapters.get(backend)
        if adapter is None:
            raise InferError.unavailable(
                f"model '{config.name}': backend '{backend}' is not served by the {self.kind} service "
                f"(available here: {', '.join(sorted(self.adapters))})")
        if not config.HasField("sequence_batching"):
            raise InferError.invalid(f"model '{config.name}' has no sequence_batching")
        model_file = layout.model_file(path, config, version)
        runtime_config = with_hidden_tensors(config)
        self._guard_upload(adapter, path, model_file, runtime_config)
        instances = [adapter.load(model_file, runtime_config, p) for p in placements(config, self.gpu_available)]
        run_warmup(runtime_config, instances, path)  # warmup entries name control/state inputs explicitly
        return SequenceModelVersion(config, version, path, instances, config.platform or backend)


def with_hidden_tensors(config: mc.ModelConfig) -> mc.ModelConfig:
    """The config a runtime adapter sees: control and state inputs (and state outputs) listed
    as ordinary tensors, so adapters that map config inputs to model arguments (TorchScript)
    feed them too. Clients and metadata keep seeing the original config."""
    out = mc.ModelConfig()
    out.CopyFrom(config)
    listed_in = {t.name for t in out.input}
    listed_out = {t.name for t in out.output}
    Kind = mc.ModelSequenceBatching.Control
    for ci in config.sequence_batching.control_input:
        if ci.name in listed_in or not ci.control:
            continue
        ctl = ci.control[0]
        if ctl.kind == Kind.CONTROL_SEQUENCE_CORRID:
            data_type = ctl.data_type
        elif ctl.int32_false_true:
            data_type = mc.TYPE_INT32
        elif ctl.fp32_false_true:
            data_type = mc.TYPE_FP32
        else:
            data_type = mc.TYPE_BOOL
        out.input.add(name=ci.name, data_type=data_type, dims=[1])
        listed_in.add(ci.name)
    for st in config.sequence_batching.state:
        if st.input_name not in listed_in:
            out.input.add(name=st.input_name, data_type=st.data_type, dims=list(st.dims))
            listed_in.add(st.input_name)
        if st.output_name not in listed_out:
            out.output.add(name=st.output_name, data_type=st.data_type, dims=list(st.dims))
            listed_out.add(st.output_name)
    return out
