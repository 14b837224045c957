"""What a python model with ``sequence_batching`` gets beyond its request's inputs, as Triton's
sequence batcher gives it: the configured control tensors (START, END, READY, CORRID) as inputs
of each request, and implicit state (``state``): the sequence's last state, or its initial one on
START, as the input ``input_name``; the tensor named ``output_name`` in the model's response is the
sequence's next state (not returned to the client unless it asked for that output by name; a
response without it leaves the state as it was).

Control tensors are shaped [1] ([1, 1] when the model batches: each request is one row, as python
models get requests one by one); a state is shaped as configured, with the batch dimension when the
model batches. Triton's python backend passes control tensors the same way; implicit state is
meshserve's (Triton's python backend has no state API): the model reads and returns it as tensors.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol import datatypes
from meshserve.protocol.errors import InferError
from services.base.runtime import RuntimeLoadError
from services.base.scheduling.sequence import BatchRow
from services.base.validation import InputData, Pending, TensorSpec
from services.sequence.model import ControlSpec, StateSpec, parse_controls, parse_states

_Kind = mc.ModelSequenceBatching.Control


def _wire(dtype: Any) -> str:
    return "BYTES" if dtype is np.object_ else datatypes.from_numpy(np.dtype(dtype))


class SequenceIO:
    """The control and state tensors of one python model's sequence batches."""

    def __init__(self, config: mc.ModelConfig, model_dir: Path) -> None:
        sb = config.sequence_batching
        name = config.name
        try:
            self.controls: list[ControlSpec] = parse_controls(sb)
            self.states: list[StateSpec] = parse_states(sb, model_dir, name)
        except InferError as exc:
            raise RuntimeLoadError(exc.message) from None
        clash = ({c.name for c in self.controls} | {s.input_name for s in self.states}) & {t.name for t in config.input}
        if clash:
            raise RuntimeLoadError(f"model '{name}': {sorted(clash)} are control or state inputs of "
                                   "sequence_batching and must not be listed as model inputs")
        self.batched = config.max_batch_size > 0
        self._specs = {c.name: self._spec(c.name, c.dtype, (1,)) for c in self.controls}
        for s in self.states:
            self._specs[s.input_name] = self._spec(s.input_name, s.dtype, tuple(s.initial.shape))

    @property
    def active(self) -> bool:
        return bool(self.controls or self.states)

    @staticmethod
    def _spec(name: str, dtype: Any, dims: tuple[int, ...]) -> TensorSpec:
        wire = _wire(dtype)
        return TensorSpec(name, wire, dims, None, datatypes.element_size(wire))

    def _input(self, name: str, value: np.ndarray) -> InputData:
        spec = self._specs[name]
        arr = value.reshape((1, *value.shape)) if self.batched else value
        data = datatypes.serialize_bytes(arr.reshape(-1)) if spec.datatype == "BYTES" else arr.tobytes()
        return InputData(spec, tuple(arr.shape), data)

    def add_inputs(self, rows: Sequence[BatchRow]) -> None:
        """Give each real row's request its control and state inputs (and ask for its state outputs)."""
        for row in rows:
            q = row.request
            if q is None:
                continue
            pending: Pending = q.payload
            control = row.control
            for c in self.controls:
                pending.inputs[c.name] = self._input(c.name, self._control_value(c, control))
            if not self.states:
                continue
            record = row.sequence
            prior = record.state if record is not None and not (control is not None and control.start) else None
            wanted = {n for n, _ in pending.outputs}
            extra = []
            for s in self.states:
                value = prior.get(s.input_name) if isinstance(prior, dict) else None
                pending.inputs[s.input_name] = self._input(s.input_name, s.initial if value is None else value)
                if s.output_name not in wanted:
                    extra.append((s.output_name, 0))
            if extra:
                pending.outputs = [*pending.outputs, *extra]  # (a copy: a request naming none shares the config's list)

    @staticmethod
    def _control_value(c: ControlSpec, control: Any) -> np.ndarray:
        if c.kind == _Kind.CONTROL_SEQUENCE_CORRID:
            corrid = control.corrid if control is not None else 0
            if c.dtype is np.object_:
                return np.array([str(corrid).encode()], dtype=np.object_)
            return np.array([int(corrid) if isinstance(corrid, int) else 0], dtype=c.dtype)
        if c.kind == _Kind.CONTROL_SEQUENCE_START:
            on = control is not None and control.start
        elif c.kind == _Kind.CONTROL_SEQUENCE_END:
            on = control is not None and control.end
        else:
            on = c.kind == _Kind.CONTROL_SEQUENCE_READY  # (a python model gets real requests only)
        return np.array([c.false_true[1 if on else 0]], dtype=c.dtype)

    def keep_states(self, rows: Sequence[BatchRow], out: list[Any]) -> None:
        """Take each answered request's next state out of its response (``out``, in the real
        rows' order; answers are rewritten without the state outputs the client did not ask for)."""
        if not self.states:
            return
        real = [r for r in rows if r.request is not None]
        for i, (row, body) in enumerate(zip(real, out, strict=True)):
            if not isinstance(body, bytes) or row.sequence is None or row.request is None:
                continue
            response = pb.ModelInferResponse.FromString(body)
            asked = {o.name for o in row.request.payload.request.outputs}
            state = dict(row.sequence.state) if isinstance(row.sequence.state, dict) else {}
            kept_outputs, kept_raw = [], []
            for output, raw in zip(response.outputs, response.raw_output_contents, strict=True):
                spec = next((s for s in self.states if s.output_name == output.name), None)
                if spec is not None:
                    value = np.frombuffer(raw, dtype=spec.dtype) if spec.dtype is not np.object_ else \
                        np.array(datatypes.deserialize_bytes(raw), dtype=np.object_)
                    state[spec.input_name] = value.reshape(tuple(output.shape)[1:] if self.batched
                                                           else tuple(output.shape)).copy()
                    if output.name not in asked:
                        continue
                kept_outputs.append(output)
                kept_raw.append(raw)
            row.sequence.state = state
            if len(kept_outputs) != len(response.outputs):
                del response.outputs[:]
                del response.raw_output_contents[:]
                response.outputs.extend(kept_outputs)
                response.raw_output_contents.extend(kept_raw)
                out[i] = response.SerializeToString()
