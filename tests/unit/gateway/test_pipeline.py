"""The gateway's infer path as stages (gateway/pipeline.py): the order ``assemble`` builds, a
flag that is off leaves its stage out, and every request that passed the name check is counted
exactly once, whichever stage ends it, on the unary and the streamed path."""
from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncGenerator
from types import SimpleNamespace
from typing import Any

import pytest
from google.protobuf import text_format

from gateway import pipeline
from gateway.core import GatewayCore
from gateway.ensemble.catalog import EnsembleCatalog
from meshserve import native
from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol.errors import Code, InferError
from meshserve.server.core import UNARY_DECOUPLED_GRPC, UNARY_DECOUPLED_HTTP, InferResult, RequestContext


def _chain(head: pipeline.Names) -> list[str]:
    out: list[str] = []
    stage: Any = head
    while stage is not None:
        out.append(type(stage).__name__)
        stage = getattr(stage, "next", None)
    return out


def test_the_chain_has_a_stage_only_for_the_policies_that_are_on() -> None:
    core = GatewayCore(["127.0.0.1:1"])
    assert _chain(core.pipeline) == ["Names", "Outcomes", "Turns", "Forward"]
    every = pipeline.assemble(core.request_counts, core.turns, core.forward, core.is_decoupled, core.is_decoupled,
                              admission=object(), routes=object(), ensembles=object())  # type: ignore[arg-type]
    assert _chain(every) == ["Names", "Outcomes", "Turns", "Admit", "ABRoutes", "Ensembles", "Forward"]


class _Router:
    """An ABRouter with one route, ``r``, whose one arm ``a`` points at model ``m``."""

    def __init__(self) -> None:
        self.route = SimpleNamespace(name="r", targets=[SimpleNamespace(name="a", model="m", version="")])
        self.arm_counts: Counter[tuple[str, str, str]] = Counter()

    def lookup(self, name: str) -> Any:
        return self.route if name == "r" else None

    def choose(self, route: Any, request: pb.ModelInferRequest, ctx: RequestContext, sequence: Any) -> Any:
        request.model_name = "m"
        return route.targets[0]

    def failed(self, route: Any, target: Any, exc: InferError) -> None:
        self.arm_counts[(route.name, target.name, exc.code.value)] += 1

    def answered(self, route: Any, target: Any, result: InferResult) -> InferResult:
        return result

    @staticmethod
    def marked(target: Any, response: pb.ModelInferResponse) -> pb.ModelInferResponse:
        return response


def _routed_core(fail: bool) -> GatewayCore:
    core = GatewayCore(["127.0.0.1:1"])

    async def forward(request: pb.ModelInferRequest, ctx: RequestContext, sequence: Any) -> InferResult:
        if fail:
            raise InferError.unavailable("no replica")
        return InferResult(message=pb.ModelInferResponse(model_name=request.model_name))

    core.forward.infer = forward  # type: ignore[method-assign]  # the service is not under test here
    router: Any = _Router()
    core.pipeline = pipeline.assemble(core.request_counts, core.turns, core.forward, lambda n, v: n == "r",
                                      lambda n, v: False, routes=router)
    return core


@pytest.mark.parametrize("fail", [False, True])
async def test_a_request_is_counted_once_under_the_model_it_went_to(fail: bool) -> None:
    core = _routed_core(fail)
    ctx = RequestContext("grpc", {})
    outcome = "UNAVAILABLE" if fail else "OK"
    for _ in range(2):  # unary, then a streaming call (the route has a decoupled target: the streamed path)
        core.request_counts.clear()
        try:
            if _ == 0:
                await core.infer(pb.ModelInferRequest(model_name="r"), ctx)
            else:
                answers: AsyncGenerator[Any, None] = core.infer_stream(pb.ModelInferRequest(model_name="r"), ctx)
                assert [final async for _, final in answers] == [True]
        except InferError as exc:
            assert fail and exc.code is Code.UNAVAILABLE
        assert dict(core.request_counts) == {("m", outcome): 1}


async def test_a_refused_name_is_neither_routed_nor_counted() -> None:
    core = _routed_core(False)
    with pytest.raises(InferError) as caught:
        await core.infer(pb.ModelInferRequest(model_name="../etc"), RequestContext("grpc", {}))
    assert caught.value.code is Code.INVALID_ARG
    request = pb.ModelInferRequest(model_name="r")
    request.parameters["meshserve_merged_requests"].int64_param = 4
    with pytest.raises(InferError):
        await core.infer(request, RequestContext("grpc", {}))
    assert not core.request_counts


_ADD = """name: "add_sub" max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
dynamic_batching { }
"""


def _add(rows: int, rid: str) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="add_sub", id=rid)
    r.inputs.add(name="INPUT0", datatype="FP32", shape=[rows, 4])
    r.raw_input_contents.append(bytes(16 * rows))
    return r


@pytest.mark.parametrize("protocol", ["grpc", "http"])
async def test_without_policies_each_way_forward_sends_counts_a_request_once(protocol: str) -> None:
    """No policy configured: the coroutine ``Forward`` returns counts the request (no ``Outcomes``
    coroutine). Each way counts it exactly once by its outcome: the idle model's lone send, a
    merge, a request that cannot merge (sent alone), a refusal before it leaves (a decoupled
    model), and the service's words for a unary call on a decoupled model reach an HTTP client
    in HTTP's."""
    core = GatewayCore(["127.0.0.1:1"])
    assert core.pipeline.next.forward is core.forward  # (the path under test)
    config = text_format.Parse(_ADD, mc.ModelConfig())
    core.forward._config_for = lambda name, version: config  # type: ignore[method-assign]
    answer: list[Any] = ["ok"]
    gate = asyncio.Event()
    sent: list[int] = []

    async def send(request: pb.ModelInferRequest, raw: bytes | None, timeout: float | None,
                   affinity: str | None = None, client_stream: str | None = None) -> pb.ModelInferResponse:
        sent.append(request.inputs[0].shape[0])
        await gate.wait()
        if isinstance(answer[0], InferError):
            raise answer[0]
        out = pb.ModelInferResponse(model_name="add_sub", id=request.id)
        out.outputs.add(name="OUTPUT0", datatype="FP32", shape=list(request.inputs[0].shape))
        out.raw_output_contents.append(request.raw_input_contents[0])
        return out

    core.upstream.send = send  # type: ignore[method-assign]  # the service is not under test here
    core.upstream.start = lambda request, body, timeout: None  # type: ignore[method-assign]
    ctx = RequestContext(protocol, {})

    async def call(request: pb.ModelInferRequest) -> InferResult:  # (as a front door: awaited at once)
        return await core.infer(request, ctx)

    async def wave(*requests: pb.ModelInferRequest) -> list[Any]:
        sent.clear()
        gate.clear()
        calls = [asyncio.ensure_future(call(r)) for r in requests]
        for _ in range(50):
            await asyncio.sleep(0)
        gate.set()
        return await asyncio.gather(*calls, return_exceptions=True)

    # the first alone (the model was idle), the next two merged, one of 9 rows (cannot merge) alone
    out = await wave(_add(1, "a"), _add(1, "b"), _add(1, "c"), _add(9, "d"))
    assert sorted(sent) == [1, 2, 9] and [o.message().id for o in out] == ["a", "b", "c", "d"]
    assert dict(core.request_counts) == {("add_sub", "OK"): 4}
    core.request_counts.clear()
    # that wave merged: the next wave's first request waits for the pass's flush with the rest
    # (one message of 3 rows), and each request is still counted once
    assert core.forward.coalescer.crowded == {"add_sub"}
    out = await wave(_add(1, "a"), _add(1, "b"), _add(1, "c"), _add(9, "d"))
    assert sorted(sent) == [3, 9] and [o.message().id for o in out] == ["a", "b", "c", "d"]
    assert dict(core.request_counts) == {("add_sub", "OK"): 4}
    core.request_counts.clear()
    # a wave of one (waited for its flush: queued) forgets the mark; the next lone request goes
    # at once, in no group (not queued)
    queued = core.forward.coalescer.queued
    assert [o.message().id for o in await wave(_add(1, "e"))] == ["e"] and sent == [1]
    assert core.forward.coalescer.queued == queued + 1 and not core.forward.coalescer.crowded
    assert [o.message().id for o in await wave(_add(1, "f"))] == ["f"] and sent == [1]
    assert core.forward.coalescer.queued == queued + 1
    assert dict(core.request_counts) == {("add_sub", "OK"): 2}
    core.request_counts.clear()
    core.forward.coalescer.crowded.clear()  # (as after a wave of one: the first goes alone again)
    answer[0] = InferError.unavailable("no replica")
    out = await wave(_add(1, "a"), _add(1, "b"), _add(1, "c"), _add(9, "d"))
    assert sorted(sent) == [1, 2, 9] and all(isinstance(o, InferError) and o.code is Code.UNAVAILABLE for o in out)
    assert dict(core.request_counts) == {("add_sub", "UNAVAILABLE"): 4}
    core.request_counts.clear()
    core.forward.coalescer.crowded.clear()
    answer[0] = InferError.invalid(UNARY_DECOUPLED_GRPC)  # the service knew the model decoupled
    out = await wave(_add(1, "a"), _add(1, "b"))
    words = UNARY_DECOUPLED_HTTP if protocol == "http" else UNARY_DECOUPLED_GRPC
    assert all(isinstance(o, InferError) and o.message == words for o in out)
    assert dict(core.request_counts) == {("add_sub", "INVALID_ARG"): 2}
    core.request_counts.clear()
    config = text_format.Parse(_ADD + "model_transaction_policy { decoupled: true }", mc.ModelConfig())  # (a new config)
    out = await wave(_add(1, "a"))
    assert sent == [] and isinstance(out[0], InferError) and out[0].message == words
    assert dict(core.request_counts) == {("add_sub", "INVALID_ARG"): 1}


def _answering(answer: list[Any]) -> Any:
    """An ``Upstream.send`` that raises ``answer[0]`` when it is an InferError, else answers."""
    async def send(request: pb.ModelInferRequest, raw: bytes | None, timeout: float | None,
                   affinity: str | None = None, client_stream: str | None = None) -> pb.ModelInferResponse:
        if isinstance(answer[0], InferError):
            raise answer[0]
        return pb.ModelInferResponse(model_name="add_sub", id=request.id)
    return send


def _spy_counted(outcomes: Any) -> list[str]:
    """The ids of the requests that take ``Outcomes._counted`` from now on."""
    counted: list[str] = []
    by_turns = outcomes._counted

    def spy(request: pb.ModelInferRequest, *args: Any) -> Any:
        counted.append(request.id)
        return by_turns(request, *args)

    outcomes._counted = spy
    return counted


async def test_parameters_without_a_sequence_id_take_forward_s_way_and_count_once() -> None:
    """perf_analyzer sends ``triton_enable_empty_final_response`` with every request: parameters
    without a sequence id have nothing for ``Turns``, so (no policy configured) the request takes
    ``Forward``'s own coroutine, not ``Outcomes._counted``'s, and is counted once by its outcome;
    a request with a sequence id still goes by ``Turns`` (``_counted``)."""
    core = GatewayCore(["127.0.0.1:1"])
    outcomes = core.pipeline.next
    assert outcomes.forward is core.forward
    config = text_format.Parse(_ADD, mc.ModelConfig())
    core.forward._config_for = lambda name, version: config  # type: ignore[method-assign]
    answer: list[Any] = ["ok"]
    send = _answering(answer)

    core.upstream.send = send  # type: ignore[method-assign]
    counted = _spy_counted(outcomes)
    ctx = RequestContext("grpc", {})
    flagged = _add(1, "a")
    flagged.parameters["triton_enable_empty_final_response"].bool_param = True
    assert (await core.infer(flagged, ctx)).message().id == "a"
    assert counted == [] and dict(core.request_counts) == {("add_sub", "OK"): 1}
    answer[0] = InferError.unavailable("no replica")
    with pytest.raises(InferError) as failed:
        await core.infer(flagged, ctx)
    assert failed.value.code is Code.UNAVAILABLE and counted == []
    assert dict(core.request_counts) == {("add_sub", "OK"): 1, ("add_sub", "UNAVAILABLE"): 1}
    answer[0] = "ok"
    sequenced = _add(1, "s")
    sequenced.parameters["sequence_id"].int64_param = 7
    assert (await core.infer(sequenced, ctx)).message().id == "s"
    assert counted == ["s"] and core.request_counts[("add_sub", "OK")] == 2


async def test_with_ensembles_a_model_that_is_not_one_takes_forward_s_way(tmp_path: Any) -> None:
    """``--repository`` puts ``Ensembles`` past ``Turns`` (the usual deployment): a name that is not
    an ensemble takes ``Forward``'s own coroutine (not ``Outcomes._counted``'s), with or without
    parameters, and is counted once by its outcome; an ensemble's name goes by ``_counted`` to the
    ``Ensembles`` stage, which runs it."""
    (tmp_path / "ens").mkdir()
    (tmp_path / "ens" / "config.pbtxt").write_text(
        'name: "ens" platform: "ensemble" max_batch_size: 8 input [{name: "INPUT0" data_type: TYPE_FP32 dims: [4]}] '
        'output [{name: "OUTPUT0" data_type: TYPE_FP32 dims: [4]}] ensemble_scheduling { step [{model_name: "add_sub" '
        'model_version: -1 input_map {key: "INPUT0" value: "INPUT0"} output_map {key: "OUTPUT0" value: "OUTPUT0"}}] }')
    catalog = EnsembleCatalog(tmp_path)
    core = GatewayCore(["127.0.0.1:1"], ensembles=catalog)
    assert _chain(core.pipeline) == ["Names", "Outcomes", "Turns", "Ensembles", "Forward"]
    outcomes = core.pipeline.next
    assert outcomes.forward is core.forward and outcomes.ensembles is catalog
    config = text_format.Parse(_ADD, mc.ModelConfig())
    core.forward._config_for = lambda name, version: config  # type: ignore[method-assign]
    answer: list[Any] = ["ok"]
    send = _answering(answer)

    async def run(request: pb.ModelInferRequest, *args: Any) -> pb.ModelInferResponse:
        return pb.ModelInferResponse(model_name="ens", id=request.id)

    core.upstream.send = send  # type: ignore[method-assign]
    catalog.infer = run  # type: ignore[method-assign]  # (the ensemble's steps are not under test here)
    counted = _spy_counted(outcomes)
    ctx = RequestContext("grpc", {})
    flagged = _add(1, "a")
    flagged.parameters["triton_enable_empty_final_response"].bool_param = True
    assert (await core.infer(flagged, ctx)).message().id == "a"
    assert (await core.infer(_add(1, "b"), ctx)).message().id == "b"
    assert counted == [] and dict(core.request_counts) == {("add_sub", "OK"): 2}
    answer[0] = InferError.unavailable("no replica")
    with pytest.raises(InferError) as failed:
        await core.infer(_add(1, "c"), ctx)
    assert failed.value.code is Code.UNAVAILABLE and counted == []
    assert core.request_counts[("add_sub", "UNAVAILABLE")] == 1
    whole = _add(1, "e")
    whole.model_name = "ens"
    assert (await core.infer(whole, ctx)).message().model_name == "ens"
    assert counted == ["e"] and core.request_counts[("ens", "OK")] == 1
    assert sum(core.request_counts.values()) == 4


def _valued(value: int, rid: str = "") -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="add_sub", id=rid)
    r.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4])
    r.raw_input_contents.append(bytes([value]) * 16)
    return r


@pytest.mark.parametrize("protocol", ["grpc", "http"])
async def test_with_the_cache_past_turns_each_path_counts_a_request_once(protocol: str) -> None:
    """The cache is the stage past ``Turns`` (no policy before it): ``Outcomes`` returns
    ``CacheStage.named``'s coroutine (no ``Outcomes`` coroutine), and each path counts the
    request exactly once by its outcome: a miss's lead (answered, failed), a single-flight
    waiter, a hit in the stage, a model that is not cached (``Forward``'s coroutine), a refusal
    before anything is awaited (a decoupled model), leads called before either is awaited, and
    (HTTP) the stage's ``infer``."""
    from gateway.cache import CacheConfig

    core = GatewayCore(["127.0.0.1:1"], cache=CacheConfig.parse(["local,size=1048576"]))
    assert core.cache is not None and core.pipeline.next.cache is core.cache and core.pipeline.next.forward is None
    configs = [text_format.Parse(_ADD + "response_cache { enable: true }", mc.ModelConfig())]
    core.forward._config_for = lambda name, version: configs[0]  # type: ignore[method-assign]
    core.cache._config_for = lambda name, version: configs[0]
    core.cache._versions = lambda name: "1"
    answer: list[Any] = ["ok"]
    gate = asyncio.Event()
    sent: list[int] = []

    async def send(request: pb.ModelInferRequest, raw: bytes | None, timeout: float | None,
                   affinity: str | None = None, client_stream: str | None = None) -> pb.ModelInferResponse:
        if raw is not None:  # (a merged request's contents are in its body)
            request = pb.ModelInferRequest.FromString(raw)
        sent.append(request.inputs[0].shape[0])
        await gate.wait()
        if isinstance(answer[0], InferError):
            raise answer[0]
        out = pb.ModelInferResponse(model_name="add_sub", model_version="1", id=request.id)
        out.outputs.add(name="OUTPUT0", datatype="FP32", shape=list(request.inputs[0].shape))
        out.raw_output_contents.append(request.raw_input_contents[0])
        return out

    def infer(name: str, version: str, rid: str, raw: bytes, timeout: float | None,
              affinity: str | None = None, client_stream: str | None = None) -> Any:  # (a client's bytes, sent alone)
        return send(pb.ModelInferRequest.FromString(raw), raw, timeout, affinity)

    core.upstream.send = send  # type: ignore[method-assign]  # the service is not under test here
    core.upstream.infer = infer  # type: ignore[method-assign]
    core.upstream.start = lambda request, body, timeout: None  # type: ignore[method-assign]

    def ctx(request: pb.ModelInferRequest) -> RequestContext:
        return RequestContext(protocol, {}, None, request.SerializeToString() if protocol == "grpc" else None)

    async def call(request: pb.ModelInferRequest) -> InferResult:  # (as a front door: awaited at once)
        return await core.infer(request, ctx(request))

    async def wave(*requests: pb.ModelInferRequest, at_once: bool = True) -> list[Any]:
        sent.clear()
        gate.clear()
        core.request_counts.clear()
        if at_once:
            calls = [asyncio.ensure_future(call(r)) for r in requests]
        else:  # each infer called before any is awaited
            calls = [asyncio.ensure_future(core.infer(r, ctx(r))) for r in requests]
        for _ in range(50):
            await asyncio.sleep(0)
        gate.set()
        return await asyncio.gather(*calls, return_exceptions=True)

    rows = core.cache.counts.row(("add_sub", "1"))
    # three misses led (the first alone, the next two merged) and a waiter on the third's flight
    out = await wave(_valued(1, "a"), _valued(2, "b"), _valued(3, "c"), _valued(3, "d"))
    assert sum(sent) == 3 and [o.message().id for o in out] == ["a", "b", "c", "d"]
    assert dict(core.request_counts) == {("add_sub", "OK"): 4} and rows[:2] == [1, 3]
    out = await wave(_valued(1, "e"), _valued(2))  # hits in the stage
    assert sent == [] and [o.message().id for o in out] == ["e", ""]
    assert dict(core.request_counts) == {("add_sub", "OK"): 2} and rows[:2] == [3, 3]
    out = await wave(_valued(4), _valued(4), at_once=False)  # the second sees no flight yet: led, then waits
    assert sent == [1] and dict(core.request_counts) == {("add_sub", "OK"): 2} and rows[:2] == [4, 4]
    answer[0] = InferError.unavailable("no replica")
    out = await wave(_valued(5, "a"), _valued(6, "b"), _valued(6, "c"))  # failed leads, a waiter that leads again
    assert all(isinstance(o, InferError) and o.code is Code.UNAVAILABLE for o in out)
    assert dict(core.request_counts) == {("add_sub", "UNAVAILABLE"): 3}
    out = await wave(_valued(9), _valued(10), _valued(10))  # the same without ids (named's lead as they come)
    assert all(isinstance(o, InferError) and o.code is Code.UNAVAILABLE for o in out)
    assert dict(core.request_counts) == {("add_sub", "UNAVAILABLE"): 3}
    configs[0] = text_format.Parse(_ADD, mc.ModelConfig())  # not cached: Forward's coroutine counts it
    out = await wave(_valued(7), _valued(7))
    assert len(sent) == 2 and dict(core.request_counts) == {("add_sub", "UNAVAILABLE"): 2}
    answer[0] = "ok"
    out = await wave(_valued(7), _valued(7))
    assert dict(core.request_counts) == {("add_sub", "OK"): 2}
    configs[0] = text_format.Parse(_ADD + "model_transaction_policy { decoupled: true }", mc.ModelConfig())
    out = await wave(_valued(8))  # refused before it left
    words = UNARY_DECOUPLED_HTTP if protocol == "http" else UNARY_DECOUPLED_GRPC
    assert sent == [] and isinstance(out[0], InferError) and out[0].message == words
    assert dict(core.request_counts) == {("add_sub", "INVALID_ARG"): 1}


@pytest.mark.skipif(native.running(pipeline) == "compiled",
                    reason="stands in for the next stage and the check (a compiled Names takes an Outcomes only)")
async def test_a_request_laid_out_as_the_last_checked_one_is_not_read_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Names`` keeps the last layout of request bytes that passed its check (all but the id's
    and the tensors' contents): a request with that layout is handed on with the name, version
    and parameters read from the first (parameters as ``PLAIN``: some, no sequence id), without
    ``check``; any other layout is checked (a refused name or a hop's private parameter is still
    refused), parameters with a sequence id are never kept, and misses in a row take a new layout
    once in 64. ``Outcomes`` gives a path that reads the parameters the request's own."""
    names = GatewayCore(["127.0.0.1:1"]).pipeline
    handed: list[tuple[str, str, Any]] = []
    names.next = SimpleNamespace(infer=lambda request, ctx, name, version, params, *laid: handed.append(
        (name, version, params)))  # type: ignore[assignment]
    checked: list[str] = []
    check = names.check

    def spy(request: pb.ModelInferRequest) -> Any:
        checked.append(request.id)
        return check(request)

    names.check = spy  # type: ignore[method-assign]
    walks: list[int] = []
    layout = pipeline._layout
    monkeypatch.setattr(pipeline, "_layout", lambda raw: walks.append(1) or layout(raw))

    def call(r: pb.ModelInferRequest) -> Any:
        names.infer(r, RequestContext("grpc", {}, None, r.SerializeToString()))
        return handed[-1]

    flagged = [_add(1, rid) for rid in ("a", "bb", "ccc")]
    for r in flagged:
        r.model_version = "2"
        r.parameters["triton_enable_empty_final_response"].bool_param = True
        r.raw_input_contents[0] = bytes(range(16))  # (other contents than the first's: the same layout)
    first = call(flagged[0])
    assert first[:2] == ("add_sub", "2") and first[2] is not pipeline.PLAIN and first[2]
    assert call(flagged[1]) == ("add_sub", "2", pipeline.PLAIN) and call(flagged[2]) == ("add_sub", "2", pipeline.PLAIN)
    assert checked == ["a"] and walks == [1]
    assert call(_add(1, "c")) == ("add_sub", "", None) and checked == ["a", "c"]  # (another layout: read)
    assert call(_add(1, "d")) == ("add_sub", "", None) and checked == ["a", "c"]  # (its layout kept)
    bad = _add(1, "e")
    bad.model_name = "../x"
    with pytest.raises(InferError):
        call(bad)
    private = _add(1, "f")
    private.parameters["meshserve_merged"].int64_param = 2
    with pytest.raises(InferError):
        call(private)
    sequenced = [_add(1, rid) for rid in ("s", "t")]
    for r in sequenced:
        r.parameters["sequence_id"].int64_param = 7
    assert [call(r)[2] is not pipeline.PLAIN for r in sequenced] == [True, True]
    assert checked[-2:] == ["s", "t"] and call(_add(1, "g"))[2] is None
    # misses in a row (each request another layout): a walk for the first, then one in 64
    walks.clear()
    for i in range(130):
        odd = _add(1, "x" * (128 + i))  # (an id of 128 bytes or more: a layout merge_key never keeps)
        call(odd)
    assert 2 <= len(walks) <= 4
    # a path that reads the parameters gets the request's own, not PLAIN
    outcomes = GatewayCore(["127.0.0.1:1"]).pipeline.next
    got: list[Any] = []
    outcomes.forward = None
    outcomes._counted = lambda request, ctx, name, version, params: got.append(params)  # type: ignore[method-assign]
    outcomes.infer(flagged[1], RequestContext("grpc", {}), "add_sub", "2", pipeline.PLAIN)
    assert got[0] is not pipeline.PLAIN and "triton_enable_empty_final_response" in got[0]


@pytest.mark.skipif(native.running(pipeline) == "compiled", reason="watches a module function (pure Python)")
async def test_forward_takes_the_merge_key_of_the_layout_names_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Forward.named`` given the layout ``Names`` found the request's bytes in (``laid``) takes
    the answer its model's merge key remembers for the same layout, without walking the bytes
    again (``merge_key``); another layout, or none, goes by ``merge_key``."""
    core = GatewayCore(["127.0.0.1:1"])
    forward = core.forward
    config = text_format.Parse(_ADD, mc.ModelConfig())
    forward._config_for = lambda name, version: config  # type: ignore[method-assign]
    shape = forward.facts(config)[1]
    assert shape is not None
    first = _add(1, "a")
    raw = first.SerializeToString()
    assert pipeline.merge_key(first, shape, raw) is not None and shape.layout  # (the layout remembered)
    keys: list[str] = []
    merge_key = pipeline.merge_key
    monkeypatch.setattr(pipeline, "merge_key", lambda request, shape, raw: keys.append(request.id) or merge_key(
        request, shape, raw))
    forward.coalescer.busy["add_sub"] = 1  # (busy: the merge check runs)
    laid = pipeline._layout(raw)
    assert laid is not None

    def named(r: pb.ModelInferRequest, seen: Any) -> str:
        coro = forward.named(r, RequestContext("grpc", {}, None, r.SerializeToString()), None, "add_sub", "",
                             None, None, seen)
        coro.close()
        return str(coro.__qualname__)

    assert named(_add(1, "b"), (laid[0], laid[1], None)) == "Coalescer.submit" and keys == []
    assert named(_add(1, "c"), None) == "Coalescer.submit" and keys == ["c"]
    two = _add(2, "d")  # (another layout: its rows are in its bytes)
    other = pipeline._layout(two.SerializeToString())
    assert other is not None and other[:2] != laid[:2]
    assert named(two, (other[0], other[1], None)) == "Coalescer.submit" and keys == ["c", "d"]
