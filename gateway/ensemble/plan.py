"""Compile Triton's `ensemble_scheduling` once into an immutable, validated DAG. Pure: no I/O.

Load errors name the ensemble and the step (index and model): unknown model, an input the step
model does not have, a tensor nobody produces (or two steps produce), a cycle, a datatype or
shape mismatch between producer and consumer.

Decoupled steps (Triton's rules, core's ensemble_utils.cc): each response of a decoupled step
feeds the steps after it once more, so every tensor has a lineage (0: the ensemble's inputs; a
decoupled step's outputs start a new one, a step that is not decoupled passes its inputs' on). A
step whose inputs come from different lineages is refused with Triton's text; so (meshserve's rule:
Triton would never answer it) are outputs from different lineages. An ensemble with a decoupled
step is decoupled itself.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol.datatypes import config_to_wire
from meshserve.repository.names import NAME_RULE, is_valid_model_name


class EnsembleError(ValueError):
    """The ensemble cannot be compiled; the message names the ensemble and the step."""


@dataclass(frozen=True)
class TensorSpec:
    datatype: str  # wire name, e.g. "FP32"
    shape: tuple[int, ...]  # full shape including the batch dimension (-1) where batched

    def compatible(self, other: TensorSpec) -> bool:
        if self.datatype != other.datatype or len(self.shape) != len(other.shape):
            return False
        return all(a == b or a < 0 or b < 0 for a, b in zip(self.shape, other.shape, strict=True))

    def __str__(self) -> str:
        return f"{self.datatype}{list(self.shape)}"


@dataclass(frozen=True)
class Step:
    index: int
    model: str
    version: str  # "" = highest ready
    inputs: tuple[tuple[str, str], ...]  # (model input name, ensemble tensor)
    outputs: tuple[tuple[str, str], ...]  # (model output name, ensemble tensor)

    @property
    def label(self) -> str:
        return f"step {self.index} (model '{self.model}')"


@dataclass(frozen=True)
class Plan:
    name: str
    max_batch_size: int
    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]
    steps: tuple[Step, ...]
    order: tuple[int, ...]  # a topological order of step indices
    config: mc.ModelConfig
    step_decoupled: tuple[bool, ...] = ()  # by step index: the step's model is decoupled
    step_lineage: tuple[int, ...] = ()  # by step index: the lineage of its inputs (see the module docstring)
    step_out_lineage: tuple[int, ...] = ()  # by step index: the lineage of its outputs (a decoupled step's own)
    output_lineage: int = 0  # the lineage of the ensemble's outputs
    # the ensemble's own classification labels (its outputs' label_filename, read at load:
    # meshserve/repository/labels.py:read_labels), by output; an output without them is classified with the labels
    # of the step model that makes it (executor.py:_classification)
    labels: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def decoupled(self) -> bool:
        """Whether a request may get zero or many responses (a decoupled step is in it)."""
        return any(self.step_decoupled)

    def consumers(self, tensor: str) -> list[Step]:
        return [s for s in self.steps if any(t == tensor for _, t in s.inputs)]


ConfigLookup = Callable[[str, str], "mc.ModelConfig | None"]


def _specs(entries: Iterable[mc.ModelInput] | Iterable[mc.ModelOutput], max_batch_size: int
           ) -> dict[str, TensorSpec]:
    out = {}
    for t in entries:
        dims = tuple(int(d) for d in t.dims)
        out[t.name] = TensorSpec(config_to_wire(t.data_type), ((-1,) + dims) if max_batch_size > 0 else dims)
    return out


def compile_plan(config: mc.ModelConfig, lookup: ConfigLookup,
                 labels: Mapping[str, tuple[str, ...]] | None = None) -> Plan:
    """`lookup(model, version)` gives a step model's config (None = unknown / not served);
    ``labels``: the ensemble's own classification labels by output (``Plan.labels``)."""
    name = config.name
    if not config.HasField("ensemble_scheduling") or not config.ensemble_scheduling.step:
        raise EnsembleError(f"ensemble '{name}': ensemble_scheduling has no steps")

    def fail(step: Step | None, message: str) -> EnsembleError:
        where = f"ensemble '{name}' {step.label}" if step is not None else f"ensemble '{name}'"
        return EnsembleError(f"{where}: {message}")

    inputs = _specs(config.input, config.max_batch_size)
    outputs = _specs(config.output, config.max_batch_size)
    tensors: dict[str, TensorSpec] = dict(inputs)
    producer: dict[str, Step] = {}
    steps: list[Step] = []
    step_specs: list[tuple[dict[str, TensorSpec], dict[str, TensorSpec]]] = []
    decoupled: list[bool] = []
    for i, s in enumerate(config.ensemble_scheduling.step):
        version = "" if s.model_version < 0 else str(s.model_version)
        step = Step(i, s.model_name, version, tuple(sorted(s.input_map.items())),
                    tuple(sorted(s.output_map.items())))
        if not is_valid_model_name(step.model):
            raise fail(step, f"invalid model_name {step.model!r}: {NAME_RULE}")
        cfg = lookup(step.model, version)
        if cfg is None:
            raise fail(step, f"unknown model '{step.model}'" + (f" version {version}" if version else "")
                       + " (not served by any upstream)")
        if cfg.platform == "ensemble":
            raise fail(step, "nested ensembles are not supported")
        m_in, m_out = _specs(cfg.input, cfg.max_batch_size), _specs(cfg.output, cfg.max_batch_size)
        for model_input, _ in step.inputs:
            if model_input not in m_in:
                raise fail(step, f"model '{step.model}' has no input '{model_input}' (has {sorted(m_in)})")
        mapped = {k for k, _ in step.inputs}
        for t in cfg.input:
            if t.name not in mapped and not t.optional:
                raise fail(step, f"input '{t.name}' of model '{step.model}' is not mapped")
        for model_output, tensor in step.outputs:
            if model_output not in m_out:
                raise fail(step, f"model '{step.model}' has no output '{model_output}' (has {sorted(m_out)})")
            if tensor in inputs:
                raise fail(step, f"tensor '{tensor}' is an ensemble input; a step cannot also produce it")
            if tensor in producer:
                raise fail(step, f"tensor '{tensor}' is also produced by {producer[tensor].label}")
            producer[tensor] = step
            tensors[tensor] = m_out[model_output]
        steps.append(step)
        step_specs.append((m_in, m_out))
        decoupled.append(cfg.model_transaction_policy.decoupled)

    for step, (m_in, _) in zip(steps, step_specs, strict=True):
        for model_input, tensor in step.inputs:
            if tensor not in tensors:
                raise fail(step, f"input '{model_input}' reads tensor '{tensor}', which is neither an "
                                 "ensemble input nor any step's output")
            have, want = tensors[tensor], m_in[model_input]
            if not have.compatible(want):
                raise fail(step, f"input '{model_input}' of model '{step.model}' expects {want} but tensor "
                                 f"'{tensor}' is {have}")
    for out_name, spec in outputs.items():
        if out_name not in producer:
            raise fail(None, f"output '{out_name}' is not produced by any step")
        if not tensors[out_name].compatible(spec):
            raise fail(producer[out_name], f"ensemble output '{out_name}' is declared {spec} but the step "
                                           f"produces {tensors[out_name]}")

    order = _topological(steps, producer, fail)
    lineages, output_lineage = _lineages(name, steps, order, decoupled, producer, list(outputs), fail)
    return Plan(name, config.max_batch_size, inputs, outputs, tuple(steps), order, config,
                tuple(decoupled), tuple(i for i, _ in lineages), tuple(o for _, o in lineages), output_lineage,
                dict(labels or {}))


def _lineages(name: str, steps: list[Step], order: tuple[int, ...], decoupled: list[bool], producer: dict[str, Step],
              outputs: list[str], fail: Callable[[Step | None, str], EnsembleError]
              ) -> tuple[list[tuple[int, int]], int]:
    """(each step's (input, output) lineages, the outputs' lineage); EnsembleError where inputs
    mix lineages."""
    of_tensor: dict[str, int] = {}  # produced tensors (the ensemble's inputs are lineage 0)
    step_lineage = [(0, 0)] * len(steps)
    fresh = 0
    for i in order:
        step = steps[i]
        found = {of_tensor.get(t, 0) for _, t in step.inputs}
        if len(found) > 1:
            raise EnsembleError(f"in ensemble {name}, step of model '{step.model}' receives inputs originated "
                                "from different decoupled models")  # (Triton's text)
        lineage = given = found.pop() if found else 0
        if decoupled[i]:
            fresh += 1
            lineage = fresh
        step_lineage[i] = (given, lineage)
        for _, tensor in step.outputs:
            of_tensor[tensor] = lineage
    found = {of_tensor[o] for o in outputs if o in producer}
    if len(found) > 1:
        raise fail(None, "its outputs originate from different decoupled models (each response of a "
                         "decoupled step makes its own outputs: they never meet)")
    return step_lineage, found.pop() if found else 0


def _topological(steps: list[Step], producer: dict[str, Step],
                 fail: Callable[[Step | None, str], EnsembleError]) -> tuple[int, ...]:
    deps = {s.index: {producer[t].index for _, t in s.inputs if t in producer} for s in steps}
    order: list[int] = []
    ready = sorted(i for i, d in deps.items() if not d)
    remaining = {i: set(d) for i, d in deps.items() if d}
    while ready:
        i = ready.pop(0)
        order.append(i)
        for j in list(remaining):
            remaining[j].discard(i)
            if not remaining[j]:
                del remaining[j]
                ready.append(j)
    if remaining:
        first = steps[min(remaining)]
        cycle = sorted(remaining)
        raise fail(first, f"the steps {cycle} form a cycle (each waits for another's output)")
    return tuple(order)
