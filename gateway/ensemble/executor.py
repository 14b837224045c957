"""Run a compiled ensemble plan: a step fires the moment its inputs exist, so independent
branches run concurrently; tensors stay bytes between steps; the first failing step fails the
request with that step's model and status; StepSlots bounds step calls in flight (with tenants,
one tenant's at most its share). A run
reports when its first step left and how long its steps took (StepTimes: the ensemble's
statistics).

A plan with decoupled steps runs by ``run_stream`` (Triton's ensemble semantics): each response of
a decoupled step is a new round of the steps after it, with that response's outputs (plan.py:
lineages), and each round that completes the ensemble's outputs is one response of the ensemble.
The request ends when every step call of every round has ended."""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from gateway.auth import CALLER
from gateway.ensemble.plan import Plan, Step
from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol.datatypes import deserialize_bytes, serialize_bytes
from meshserve.protocol.errors import Code, InferError
from meshserve.protocol.infer_checks import datatype_mismatch, missing_inputs, unexpected_input
from meshserve.repository.labels import label_of
from meshserve.server.admission import tenant_cap
from meshserve.server.slots import Slots
from meshserve.telemetry import tracing

if TYPE_CHECKING:
    from gateway.cache import CacheStage
    from gateway.placement import Placement
    from gateway.upstream.upstream import Upstream


DEFAULT_MAX_INFLIGHT_STEPS = 256
# step results of one streamed run waiting for it (its client reads slower than the steps answer):
# beyond this the steps wait, and so (through the hop's bounded answers) do the decoupled models
STREAM_EVENTS = 64
RELABEL_SLICE = 8192  # classified entries relabelled between two turns of the loop (_relabelled: ~10-25 ms)


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


@dataclass(eq=False)
class _Round:
    """The tensors of one lineage's round (run_stream): the ensemble's inputs (lineage 0), or
    one response of a decoupled step and what the steps after it made of it."""

    lineage: int
    tensors: dict[str, _Tensor]
    started: set[int] = field(default_factory=set)
    answered: bool = False


class StepSlots:
    """At most ``cap`` step calls at once, all ensembles together (--ensemble-max-inflight-steps);
    with tenants, one tenant's steps (the admitted request's: gateway/auth.py:CALLER) at most
    max(1, cap x its share): its further steps wait in a line of its own, served round-robin with
    the other tenants' (``meshserve/server/slots.py:Slots``), so that another tenant's steps find
    the rest of the slots (a tenant's share of --max-inflight times an ensemble's parallel steps
    can be every slot). Without tenants one line, as before."""

    __slots__ = ("cap", "slots")

    def __init__(self, cap: int):
        self.cap = cap
        self.slots = Slots(cap)

    async def take(self) -> tuple[int, Hashable]:
        """A slot (waiting for one), to give back: its index and the tenant it is held for."""
        who = CALLER.get()  # (tenant, share), or None
        cap = self.cap if who is None else tenant_cap(self.cap, who[1])
        return await self.slots.take(who, cap), who

    def give(self, held: tuple[int, Hashable]) -> None:
        self.slots.give(*held)


class EnsembleExecutor:
    def __init__(self, upstream: Upstream, max_inflight_steps: int = DEFAULT_MAX_INFLIGHT_STEPS):
        self._upstream = upstream
        self._slots = StepSlots(max_inflight_steps)
        self.max_inflight_steps = max_inflight_steps
        # the gateway's response cache (--cache-config): a step whose model's config enables it
        # is answered from it (gateway/cache.py:CacheStage.step); None: every step is sent
        self.step_cache: CacheStage | None = None
        # the model mesh (gateway/placement.py): a step whose model the policy manages is placed
        # (loaded where no healthy replica serves it) as a direct request's model is; None: none is
        self.placement: Placement | None = None

    async def run(self, plan: Plan, request: pb.ModelInferRequest, timeout: float | None,
                  times: StepTimes | None = None, affinity: str | None = None) -> pb.ModelInferResponse:
        """``affinity``: the request's sequence key (its steps carry its parameters)."""
        tensors = _inputs(plan, request)
        wanted = _wanted(plan, request)
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
            # (a failed step's task holds its error, whose traceback holds this frame: no local
            # keeps it, docs/security.md, "Session 11: error cycles")
            done = task = None  # type: ignore[assignment]
        return await _response(plan, request, tensors, wanted)

    async def run_stream(self, plan: Plan, request: pb.ModelInferRequest, timeout: float | None,
                         times: StepTimes | None = None, affinity: str | None = None
                         ) -> AsyncIterator[pb.ModelInferResponse]:
        """Every response of a plan with decoupled steps (see the module docstring), as its
        rounds complete the outputs; the first failing step call fails the request. Leaving early
        stops every step call (a decoupled step's service is told to stop it)."""
        wanted = _wanted(plan, request)
        root = _Round(0, _inputs(plan, request))
        times = times or StepTimes()
        deadline = None if timeout is None else time.monotonic() + timeout
        needs = {s.index: {t for _, t in s.inputs} for s in plan.steps}
        # (round, step, its outputs) for a unary step's answer or a decoupled step's response;
        # (round, step, None) when a step call ended; an exception fails the run
        events: asyncio.Queue[tuple[_Round, Step, dict[str, _Tensor] | None] | BaseException] = \
            asyncio.Queue(STREAM_EVENTS)
        tasks: set[asyncio.Task[None]] = set()

        async def call(rnd: _Round, step: Step) -> None:
            try:
                if plan.step_decoupled[step.index]:
                    await self._stream_step(plan, step, rnd, request, deadline, times, affinity, events)
                else:
                    out = await self._step(plan, step, rnd.tensors, request, deadline, times, affinity)
                    await events.put((rnd, step, out))
                await events.put((rnd, step, None))
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                await events.put(exc)

        def launch(rnd: _Round) -> None:
            for i in plan.order:
                if plan.step_lineage[i] == rnd.lineage and i not in rnd.started and needs[i] <= rnd.tensors.keys():
                    rnd.started.add(i)
                    task = asyncio.ensure_future(call(rnd, plan.steps[i]))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)

        calls = 0  # step calls started and not ended
        with tracing.child_span("gateway.ensemble", {"meshserve.ensemble": plan.name,
                                                     "meshserve.ensemble.steps": len(plan.steps)}):
            try:
                rounds = [root]
                while True:
                    for rnd in rounds:
                        before = len(rnd.started)
                        launch(rnd)
                        calls += len(rnd.started) - before
                        if (not rnd.answered and rnd.lineage == plan.output_lineage
                                and all(w in rnd.tensors for w in wanted)):
                            rnd.answered = True
                            yield await _response(plan, request, rnd.tensors, wanted)
                    if not calls:
                        return
                    event = await events.get()
                    if isinstance(event, BaseException):
                        raise event
                    rnd, step, out = event
                    if out is None:
                        calls -= 1
                        rounds = []
                    elif plan.step_decoupled[step.index]:  # a response: a round of its own
                        rounds = [_Round(plan.step_out_lineage[step.index], out)]
                    else:
                        rnd.tensors.update(out)
                        rounds = [rnd]
            finally:
                for task in list(tasks):
                    task.cancel()
                if tasks:
                    await asyncio.gather(*tasks, return_exceptions=True)
                event = None  # type: ignore[assignment]  # (as _run's: the raised error's traceback holds this frame)

    async def _stream_step(self, plan: Plan, step: Step, rnd: _Round, request: pb.ModelInferRequest,
                           deadline: float | None, times: StepTimes, affinity: str | None,
                           events: asyncio.Queue[tuple[_Round, Step, dict[str, _Tensor] | None] | BaseException]
                           ) -> None:
        """A decoupled step's call: each of its responses' outputs to ``events``."""
        req = _step_request(plan, step, rnd.tensors, request)
        if self.placement is not None:
            await self._ready(plan, step, deadline)
        timeout = self._remaining(plan, step, deadline)
        with _StepCall(plan, step, times):
            answers = cast(AsyncGenerator[tuple[pb.ModelInferResponse | None, bool], None],
                           self._upstream.stream(req, None, timeout, affinity))
            async with contextlib.aclosing(answers):
                own = await self._slots.take()  # (held until its first response: the call is open then)
                try:
                    first = await anext(answers, None)
                finally:
                    self._slots.give(own)
                response: tuple[pb.ModelInferResponse | None, bool] | None = first
                while response is not None:
                    if response[0] is not None:
                        await events.put((rnd, step, _outputs(plan, step, response[0])))
                    if response[1]:
                        break
                    response = await anext(answers, None)

    @staticmethod
    def _remaining(plan: Plan, step: Step, deadline: float | None) -> float | None:
        timeout = None if deadline is None else deadline - time.monotonic()
        if timeout is not None and timeout <= 0:
            raise InferError(Code.DEADLINE_EXCEEDED, f"ensemble '{plan.name}' {step.label}: deadline exceeded")
        return timeout

    async def _step(self, plan: Plan, step: Step, tensors: dict[str, _Tensor], request: pb.ModelInferRequest,
                    deadline: float | None, times: StepTimes, affinity: str | None) -> dict[str, _Tensor]:
        req = _step_request(plan, step, tensors, request)
        placed = None if self.placement is None else await self._ready(plan, step, deadline)

        def send(r: pb.ModelInferRequest, t: float | None) -> Awaitable[pb.ModelInferResponse]:
            if placed is None:
                return self._upstream.send(r, None, t, affinity)
            return placed.resend(step.model, step.version, lambda: _left(deadline),
                                 lambda: self._upstream.send(r, None, t, affinity))

        own = await self._slots.take()
        try:
            timeout = self._remaining(plan, step, deadline)
            with _StepCall(plan, step, times):
                if self.step_cache is None:
                    resp = await send(req, timeout)
                else:
                    resp = await self.step_cache.step(req, timeout, affinity, send)
        finally:
            self._slots.give(own)
        return _outputs(plan, step, resp)

    async def _ready(self, plan: Plan, step: Step, deadline: float | None) -> Placement | None:
        """A step whose model the mesh manages: placed first when no healthy replica serves it
        (``Placement.ready``: the load a direct request would start or join, waited for within
        the ensemble's deadline, before the step takes a slot); the Placement, to send it
        again if its model is evicted before it runs. None: an unmanaged step."""
        placement = self.placement
        if placement is None or not placement.manages(step.model):
            return None
        timeout = self._remaining(plan, step, deadline)
        try:
            await placement.ready(step.model, step.version, timeout)
        except InferError as exc:
            raise named(plan.name, step.label, exc) from None
        return placement


class _StepCall:
    """Around one step's call: its span, its time in the run's StepTimes, and its error named
    after the step."""

    __slots__ = ("plan", "step", "times", "sent", "span")

    def __init__(self, plan: Plan, step: Step, times: StepTimes) -> None:
        self.plan, self.step, self.times = plan, step, times
        self.sent = 0
        self.span: Any = None

    def __enter__(self) -> None:
        self.sent = sent = time.monotonic_ns()
        if not self.times.first_ns:
            self.times.first_ns = sent
        step = self.step
        self.span = tracing.child_span("gateway.ensemble.step", {"meshserve.ensemble": self.plan.name,
                                                                 "meshserve.step": step.index,
                                                                 "meshserve.model": step.model})
        self.span.__enter__()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self.times.steps_ns += time.monotonic_ns() - self.sent
        self.span.__exit__(kind, exc, tb)
        if isinstance(exc, InferError):
            raise named(self.plan.name, self.step.label, exc) from None


def named(ensemble: str, label: str, exc: InferError) -> InferError:
    """A step's error, named after the ensemble and the step (``Step.label``)."""
    return InferError(exc.code, f"ensemble '{ensemble}' {label}: {exc.message}", retry_after_s=exc.retry_after_s)


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


def _step_request(plan: Plan, step: Step, tensors: dict[str, _Tensor],
                  request: pb.ModelInferRequest) -> pb.ModelInferRequest:
    """A step's request: its inputs from ``tensors``, the ensemble request's id and parameters."""
    req = pb.ModelInferRequest(model_name=step.model, model_version=step.version, id=request.id)
    for key, value in request.parameters.items():
        req.parameters[key].CopyFrom(value)
    for model_input, tensor in step.inputs:
        t = tensors[tensor]
        req.inputs.add(name=model_input, datatype=t.datatype, shape=list(t.shape))
        req.raw_input_contents.append(t.data)
    for model_output, tensor in step.outputs:
        wanted = req.outputs.add(name=model_output)
        if request.outputs:
            _classification(plan, request, tensor, wanted)
    return req


def _classification(plan: Plan, request: pb.ModelInferRequest, tensor: str,
                    wanted: pb.ModelInferRequest.InferRequestedOutputTensor) -> None:
    """Triton's classification of an ensemble output the client asks it of (``class_count``): asked
    of the step that makes the output, when no other step takes it, so it comes classified with
    the labels of the model that made it (Triton's ensembles inherit those labels), or, where the
    ensemble's config names the output's own ``label_filename``, relabelled with the ensemble's
    (``_relabelled``)."""
    for asked in request.outputs:
        if asked.name == tensor and "classification" in asked.parameters and not plan.consumers(tensor):
            wanted.parameters["classification"].CopyFrom(asked.parameters["classification"])


def _own_labelled(plan: Plan, request: pb.ModelInferRequest) -> set[str]:
    """The outputs the request's step asked classified (``_classification``) that the ensemble
    has labels of its own for."""
    return {o.name for o in request.outputs if o.name in plan.labels and "classification" in o.parameters
            and not plan.consumers(o.name)}


async def _relabelled(plan: Plan, name: str, data: bytes) -> bytes:
    """A classified output's "score:index[:label]" entries (the step's, with its model's labels,
    if any) with the ensemble's own labels instead. Triton's rule (core's
    model_lifecycle.cc: an ensemble's output takes the producing step's labels only when its
    config names none of its own; which index gets a label: meshserve/repository/labels.py:label_of).
    A Python step per entry (a response holds up to services/base/classification.py:MAX_CLASSIFIED
    of them: 0.3-0.75 s of this loop), so the loop's other work runs every ``RELABEL_SLICE``."""
    labels = plan.labels[name]
    out = []
    try:
        entries = deserialize_bytes(data)
    except InferError:
        entries = [b""]  # (refused below: not what a step answers)
    for n, entry in enumerate(entries):
        if n and not n % RELABEL_SLICE:
            await asyncio.sleep(0)
        score, _, rest = entry.partition(b":")
        index = rest.split(b":", 1)[0]
        if not score or not index.isdigit():
            raise InferError.internal(f"ensemble '{plan.name}' output '{name}': the step's classification "
                                      f"{entry[:64]!r} is not 'score:index[:label]'")
        label = label_of(labels, int(index))
        out.append(score + b":" + index + (b":" + label.encode() if label else b""))
    return serialize_bytes(out)


def _outputs(plan: Plan, step: Step, resp: pb.ModelInferResponse) -> dict[str, _Tensor]:
    """A step's response as the ensemble tensors it produces."""
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


def _wanted(plan: Plan, request: pb.ModelInferRequest) -> list[str]:
    """The outputs the request asks for (all by default)."""
    wanted = [o.name for o in request.outputs] or list(plan.outputs)
    for name in wanted:
        if name not in plan.outputs:
            raise InferError.invalid(f"ensemble '{plan.name}' has no output '{name}' "
                                     f"(outputs: {sorted(plan.outputs)})")
    return wanted


async def _response(plan: Plan, request: pb.ModelInferRequest, tensors: dict[str, _Tensor],
                    wanted: list[str]) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(model_name=plan.name, model_version="1", id=request.id)
    own = _own_labelled(plan, request) if plan.labels else ()
    for name in wanted:
        t = tensors[name]
        response.outputs.add(name=name, datatype=t.datatype, shape=list(t.shape))
        response.raw_output_contents.append(await _relabelled(plan, name, t.data) if name in own else t.data)
    return response


def _inputs(plan: Plan, request: pb.ModelInferRequest) -> dict[str, _Tensor]:
    if len(request.raw_input_contents) != len(request.inputs):
        raise InferError.invalid(f"ensemble '{plan.name}': send every input as raw bytes "
                                 "(raw_input_contents / the binary tensor extension or JSON over HTTP)")
    tensors: dict[str, _Tensor] = {}
    for t, raw in zip(request.inputs, request.raw_input_contents, strict=True):
        spec = plan.inputs.get(t.name)
        if spec is None:  # (Triton's words, as a service's)
            raise unexpected_input(t.name, plan.name, plan.inputs)
        if t.datatype != spec.datatype:
            raise datatype_mismatch(t.name, t.datatype, plan.name, spec.datatype)
        tensors[t.name] = _Tensor(t.datatype, tuple(t.shape), raw)
    if len(tensors) < len(plan.inputs):  # (an ensemble's inputs are all required)
        missing = [n for n in plan.inputs if n not in tensors]
        raise missing_inputs(plan.name, len(plan.inputs), len(plan.inputs), list(tensors), missing)
    return tensors
