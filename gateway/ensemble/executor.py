"""Run a compiled ensemble plan: a step fires the moment its inputs exist, so independent
branches run concurrently; tensors stay bytes between steps; the first failing step fails the
request with that step's model and status; a semaphore bounds step calls in flight. A run
reports when its first step left and how long its steps took (StepTimes: the ensemble's
statistics)."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.ensemble.plan import Plan, Step
from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol.errors import Code, InferError
from meshserve.telemetry import tracing

if TYPE_CHECKING:
    from gateway.upstream.upstream import Upstream


DEFAULT_MAX_INFLIGHT_STEPS = 256


@dataclass(slots=True)
class StepTimes:
    """One run's timings: when its first step was sent (ns, monotonic; 0 = none was) and the sum
    of its steps' round trips (ns), which the ensemble reports as its compute time."""

    first_ns: int = 0
    steps_ns: int = 0


@dataclass(frozen=True)
class _Tensor:
    datatype: str
    shape: tuple[int, ...]
    data: bytes


class EnsembleExecutor:
    def __init__(self, upstream: Upstream, max_inflight_steps: int = DEFAULT_MAX_INFLIGHT_STEPS):
        self._upstream = upstream
        self._slots = asyncio.Semaphore(max_inflight_steps)
        self.max_inflight_steps = max_inflight_steps

    async def run(self, plan: Plan, request: pb.ModelInferRequest, timeout: float | None,
                  times: StepTimes | None = None, affinity: str | None = None) -> pb.ModelInferResponse:
        """``affinity``: the request's sequence key (its steps carry its parameters)."""
        tensors = _inputs(plan, request)
        wanted = [o.name for o in request.outputs] or list(plan.outputs)
        for name in wanted:
            if name not in plan.outputs:
                raise InferError.invalid(f"ensemble '{plan.name}' has no output '{name}' "
                                         f"(outputs: {sorted(plan.outputs)})")
        with tracing.child_span("gateway.ensemble", {"meshserve.ensemble": plan.name,
                                                     "meshserve.ensemble.steps": len(plan.steps)}):
            return await self._run(plan, request, timeout, tensors, wanted, times or StepTimes(), affinity)

    async def _run(self, plan: Plan, request: pb.ModelInferRequest, timeout: float | None,
                   tensors: dict[str, _Tensor], wanted: list[str], times: StepTimes,
                   affinity: str | None) -> pb.ModelInferResponse:
        deadline = None if timeout is None else time.monotonic() + timeout
        needs = {s.index: {t for _, t in s.inputs} for s in plan.steps}
        started: set[int] = set()
        running: dict[asyncio.Task[dict[str, _Tensor]], Step] = {}

        def launch_ready() -> None:
            for i in plan.order:
                if i not in started and needs[i] <= tensors.keys():
                    started.add(i)
                    step = plan.steps[i]
                    running[asyncio.ensure_future(self._step(plan, step, tensors, request, deadline, times,
                                                                       affinity))] = step

        launch_ready()
        try:
            while running:
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    running.pop(task)
                    tensors.update(task.result())  # a failed step raises here and fails the request
                launch_ready()
        finally:
            for task in running:
                task.cancel()
        response = pb.ModelInferResponse(model_name=plan.name, model_version="1", id=request.id)
        for name in wanted:
            t = tensors[name]
            response.outputs.add(name=name, datatype=t.datatype, shape=list(t.shape))
            response.raw_output_contents.append(t.data)
        return response

    async def _step(self, plan: Plan, step: Step, tensors: dict[str, _Tensor], request: pb.ModelInferRequest,
                    deadline: float | None, times: StepTimes, affinity: str | None) -> dict[str, _Tensor]:
        req = pb.ModelInferRequest(model_name=step.model, model_version=step.version, id=request.id)
        for key, value in request.parameters.items():
            req.parameters[key].CopyFrom(value)
        for model_input, tensor in step.inputs:
            t = tensors[tensor]
            req.inputs.add(name=model_input, datatype=t.datatype, shape=list(t.shape))
            req.raw_input_contents.append(t.data)
        for model_output, _ in step.outputs:
            req.outputs.add(name=model_output)
        async with self._slots:
            timeout = None if deadline is None else deadline - time.monotonic()
            if timeout is not None and timeout <= 0:
                raise InferError(Code.DEADLINE_EXCEEDED, f"ensemble '{plan.name}' {step.label}: deadline exceeded")
            sent = time.monotonic_ns()
            if not times.first_ns:
                times.first_ns = sent
            try:
                with tracing.child_span("gateway.ensemble.step", {"meshserve.ensemble": plan.name,
                                                                  "meshserve.step": step.index,
                                                                  "meshserve.model": step.model}):
                    resp = await self._upstream.send(req, None, timeout, affinity)
            except InferError as exc:
                raise InferError(exc.code, f"ensemble '{plan.name}' {step.label}: {exc.message}",
                                 retry_after_s=exc.retry_after_s) from None
            finally:
                times.steps_ns += time.monotonic_ns() - sent
        if len(resp.raw_output_contents) != len(resp.outputs):
            raise InferError.internal(f"ensemble '{plan.name}' {step.label}: the response carries no raw "
                                      "output contents")
        got = {o.name: _Tensor(o.datatype, tuple(o.shape), raw)
               for o, raw in zip(resp.outputs, resp.raw_output_contents, strict=True)}
        out = {}
        for model_output, tensor in step.outputs:
            if model_output not in got:
                raise InferError.internal(f"ensemble '{plan.name}' {step.label}: output '{model_output}' missing "
                                          "from the response")
            out[tensor] = got[model_output]
        return out


def _inputs(plan: Plan, request: pb.ModelInferRequest) -> dict[str, _Tensor]:
    if len(request.raw_input_contents) != len(request.inputs):
        raise InferError.invalid(f"ensemble '{plan.name}': send every input as raw bytes "
                                 "(raw_input_contents / the binary tensor extension or JSON over HTTP)")
    tensors: dict[str, _Tensor] = {}
    for t, raw in zip(request.inputs, request.raw_input_contents, strict=True):
        spec = plan.inputs.get(t.name)
        if spec is None:
            raise InferError.invalid(f"ensemble '{plan.name}' has no input '{t.name}' (inputs: {sorted(plan.inputs)})")
        if t.datatype != spec.datatype:
            raise InferError.invalid(f"ensemble '{plan.name}' input '{t.name}': expects '{spec.datatype}', "
                                     f"got '{t.datatype}'")
        tensors[t.name] = _Tensor(t.datatype, tuple(t.shape), raw)
    missing = sorted(set(plan.inputs) - tensors.keys())
    if missing:
        raise InferError.invalid(f"ensemble '{plan.name}': missing input(s) {missing}")
    return tensors
