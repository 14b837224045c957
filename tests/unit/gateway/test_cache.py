"""gateway/cache.py's pure parts: the key (typed and raw tensors alike, what changes it and what
does not), the LRU within its byte budget, invalidation, Triton's --cache-config syntax, and the
front door's hits (FrontDoor, with a stub for the rest of the chain)."""
from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import numpy as np
import pytest

from gateway.cache import (
    ENTRY_OVERHEAD,
    ENTRY_SHARE,
    CacheConfig,
    CacheStage,
    FrontDoor,
    LocalCache,
    request_key,
)
from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol.errors import Code, InferError
from meshserve.server.core import InferResult, RequestContext


def _request(values: list[int], typed: bool = False, datatype: str = "INT32") -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="m")
    tensor = req.inputs.add(name="X", datatype=datatype, shape=[1, len(values)])
    if typed:
        if datatype == "BYTES":
            tensor.contents.bytes_contents.extend(str(v).encode() for v in values)
        else:
            tensor.contents.int_contents.extend(values)
    elif datatype == "BYTES":
        req.raw_input_contents.append(b"".join(len(s).to_bytes(4, "little") + s
                                               for s in (str(v).encode() for v in values)))
    else:
        req.raw_input_contents.append(np.array(values, np.int32).tobytes())
    return req


@pytest.mark.parametrize("datatype", ["INT32", "BYTES"])
def test_typed_and_raw_contents_share_a_key(datatype: str) -> None:
    assert request_key(_request([1, 2, 3], True, datatype), "1") == request_key(_request([1, 2, 3], False, datatype), "1")


def test_what_changes_the_key_and_what_does_not() -> None:
    base = _request([1, 2, 3])
    key = request_key(base, "1")
    assert key is not None and len(key) == 16
    assert request_key(_request([1, 2, 4]), "1") != key
    assert request_key(base, "2") != key
    other = pb.ModelInferRequest()
    other.CopyFrom(base)
    other.id = "another id"
    other.parameters["binary_data_output"].bool_param = True
    other.parameters["timeout"].int64_param = 5
    assert request_key(other, "1") == key  # how it is rendered or scheduled: the same answer
    other.parameters["custom"].int64_param = 1
    assert request_key(other, "1") != key  # a model may read it
    wanted = pb.ModelInferRequest()
    wanted.CopyFrom(base)
    wanted.outputs.add(name="Y")
    assert request_key(wanted, "1") != key
    binary = pb.ModelInferRequest()
    binary.CopyFrom(wanted)
    binary.outputs[0].parameters["binary_data"].bool_param = True
    assert request_key(binary, "1") == request_key(wanted, "1")
    shaped = _request([1, 2, 3])
    shaped.inputs[0].shape[:] = [3, 1]
    assert request_key(shaped, "1") != key


def test_never_cached_requests() -> None:
    shm = _request([1])
    shm.inputs[0].parameters["shared_memory_region"].string_param = "r"
    assert request_key(shm, "1") is None
    out = _request([1])
    out.outputs.add(name="Y").parameters["shared_memory_region"].string_param = "r"
    assert request_key(out, "1") is None
    short = _request([1, 2], typed=True)
    short.inputs[0].shape[:] = [1, 3]  # two values for three elements: the service words it
    assert request_key(short, "1") is None


def test_lru_within_its_bytes_and_the_entry_share() -> None:
    config = mc.ModelConfig()
    answer = b"x" * 100
    per_entry = 16 + len(answer) + ENTRY_OVERHEAD
    cache = LocalCache(per_entry * 3 + 10)
    keys = [bytes([i]) * 16 for i in range(4)]
    for k in keys[:3]:
        assert cache.put(k, "m", answer, config, 0) is False  # over 1/ENTRY_SHARE of the size
    cache = LocalCache(per_entry * ENTRY_SHARE)
    for k in keys:
        assert cache.put(k, "m", answer, config, 0)
    assert cache.used == 4 * per_entry
    small = LocalCache(per_entry * ENTRY_SHARE)
    for k in keys[:3]:
        small.put(k, "m", answer, config, 0)
    small.size = per_entry * 3  # full: the next put evicts the least recently used
    assert small.get(keys[0], config) == answer  # keys[0] is now the most recent
    small.put(keys[3], "m", answer, config, 0)
    assert small.get(keys[1], config) is None and small.get(keys[0], config) == answer
    assert small.used <= small.size and small.evictions == 1


def test_a_tenant_holds_at_most_its_share_of_the_cache() -> None:
    """With tenants (keys scoped by tenant) a tenant past its share of the bytes makes room with
    its own oldest entries: another tenant's are kept. Before, one tenant's distinct requests
    evicted every other tenant's answers (one LRU for all)."""
    from gateway.auth import CALLER
    from gateway.cache import tenant_scope

    config = mc.ModelConfig()
    answer = b"x" * 100
    per_entry = len(tenant_scope("mallory")) + 16 + len(answer) + ENTRY_OVERHEAD
    cache = LocalCache(per_entry * 40)
    cache.scoped = True

    def put(tenant: str, i: int) -> bytes:
        key = tenant_scope(tenant) + bytes([i]) * 16
        token = CALLER.set((tenant, 0.5))
        try:
            assert cache.put(key, "m", answer, config, 0)
        finally:
            CALLER.reset(token)
        return key

    acme = [put("acme", i) for i in range(5)]
    mallory = [put("mallory", i) for i in range(200)]  # far past its half
    assert all(cache.get(k, config) == answer for k in acme)  # acme's kept
    assert cache.owned[tenant_scope("mallory")] <= cache.size // 2
    assert cache.get(mallory[-1], config) == answer and cache.get(mallory[0], config) is None
    assert cache.used == sum(cache.owned.values()) <= cache.size
    for k in acme:  # dropped entries leave no rows behind
        cache._drop(k)
    assert tenant_scope("acme") not in cache.owned and tenant_scope("acme") not in cache.owners


def test_invalidate_and_a_new_config() -> None:
    config = mc.ModelConfig()
    cache = LocalCache(1 << 20)
    cache.put(b"a" * 16, "m", b"1", config, 0)
    cache.put(b"b" * 16, "n", b"2", config, 0)
    generation = cache.generation("m")
    cache.invalidate("m")
    assert cache.get(b"a" * 16, config) is None and cache.get(b"b" * 16, config) == b"2"
    assert cache.put(b"a" * 16, "m", b"1", config, generation) is False  # asked before the reload
    assert cache.get(b"b" * 16, mc.ModelConfig()) is None  # another config object: a miss, dropped
    assert cache.used == 0 and not cache.entries


def test_cache_config_syntax() -> None:
    assert CacheConfig.parse([]) is None
    assert CacheConfig.parse(["local,size=1048576"]) == CacheConfig("local", 1048576)
    assert CacheConfig.parse(["redis,host=h", "redis,port=7"]) == CacheConfig("redis", settings=(("host", "h"),
                                                                                              ("port", "7")))
    for bad in (["local"], ["local,size=0"], ["local,size=-1"], ["local,size=1k"], ["local,sise=5"],
                ["memcached,size=5"], ["redis,port=x"], ["redis,size=5"], ["local,size=5", "redis,host=h"]):
        with pytest.raises(ValueError):
            CacheConfig.parse(bad)


def test_meshserve_up_passes_the_cache_config_to_its_gateway() -> None:
    from meshserve.cli import _up_gateway_flags, build_parser

    args = build_parser().parse_args(["up", "--cache-config", "redis,host=h", "--cache-config", "redis,port=7"])
    flags = _up_gateway_flags(args)
    assert flags[flags.index("--cache-config") + 1] == "redis,host=h"
    assert "redis,port=7" in flags
    assert "--cache-config" not in _up_gateway_flags(build_parser().parse_args(["up"]))


def test_the_canonical_form_is_one_key_for_every_form_of_a_request() -> None:
    """Two typed inputs, the same as raw bytes, with an id, an explicit version, binary_data
    parameters (HTTP's binary extension) and ignored parameters: one key; shared memory: none;
    raw and typed contents mixed (a request the service refuses): not the valid request's key."""
    def two(typed: bool) -> pb.ModelInferRequest:
        req = pb.ModelInferRequest(model_name="m")
        for name, values in (("A", [1, 2]), ("B", [3, 4, 5])):
            tensor = req.inputs.add(name=name, datatype="INT32", shape=[1, len(values)])
            if typed:
                tensor.contents.int_contents.extend(values)
            else:
                req.raw_input_contents.append(np.array(values, np.int32).tobytes())
        req.outputs.add(name="Y")
        return req

    key = request_key(two(False), "1")
    other = two(True)
    other.id, other.model_version = "someone", "1"
    other.inputs[0].parameters["binary_data_size"].int64_param = 8
    other.outputs[0].parameters["binary_data"].bool_param = True
    other.parameters["timeout"].int64_param = 5
    assert request_key(other, "1") == key
    assert (other.id, other.model_version) == ("someone", "1")  # (restored after the key)
    raw = two(False)
    raw.id = "x"
    raw.parameters["priority"].int64_param = 1
    assert request_key(raw, "1") == key and raw.id == "x"
    raw.parameters["custom"].int64_param = 1
    assert request_key(raw, "1") != key
    mixed = two(False)
    mixed.inputs[1].contents.int_contents.extend([3, 4, 5])
    assert request_key(mixed, "1") not in (key, None)  # refused by the service: it never reaches the raw one's entry
    shm = two(False)
    shm.outputs[0].parameters["shared_memory_region"].string_param = "r"
    assert request_key(shm, "1") is None


# ---- the key from the bytes the front door holds (raw_key, the stage's gRPC fast path) ------------

def _two_inputs(**changes: object) -> pb.ModelInferRequest:
    """add_sub's request (two FP32 [1,4] inputs), with one thing changed: name, datatype, shape,
    byte (index into INPUT1's bytes), parameter, model, id, version."""
    req = pb.ModelInferRequest(model_name=str(changes.get("model", "add_sub")), id=str(changes.get("id", "")),
                               model_version=str(changes.get("version", "")))
    for i in range(2):
        t = req.inputs.add(name=f"INPUT{i}", datatype="FP32", shape=[1, 4])
        data = bytearray(np.arange(4, dtype=np.float32).tobytes())
        if i == 1:
            if "name" in changes:
                t.name = str(changes["name"])
            if "datatype" in changes:
                t.datatype = str(changes["datatype"])
            if "shape" in changes:
                t.shape[:] = [4, 1]
            if "byte" in changes:
                data[int(changes["byte"])] ^= 1  # type: ignore[call-overload]
        req.raw_input_contents.append(bytes(data))
    if "parameter" in changes:
        req.parameters["custom"].int64_param = int(changes["parameter"])  # type: ignore[call-overload]
    return req


class _Next:
    def __init__(self) -> None:
        self.calls = 0

    async def infer(self, request: pb.ModelInferRequest, ctx: object, sequence: str | None) -> object:
        from meshserve.server.core import InferResult
        self.calls += 1
        return InferResult(message=pb.ModelInferResponse(model_name=request.model_name, id=request.id))


def _stage_keys(requests: list[tuple[pb.ModelInferRequest, bytes | None, str]], exact: bool = True) -> list[bytes]:
    """The key the stage stored for each request, sent as (message, ctx.raw, protocol)."""
    import asyncio

    from gateway.cache import CacheStage
    from gateway.shared_cache import SharedCache
    from meshserve.server.core import RequestContext
    config = mc.ModelConfig(name="add_sub")
    config.response_cache.enable = True
    keys: list[bytes] = []

    async def run() -> None:
        for request, raw, protocol in requests:
            cache: LocalCache | SharedCache = LocalCache(1 << 20)
            if not exact:
                import tempfile
                cache = SharedCache(tempfile.mktemp(), 1 << 20)
            stage = CacheStage(cache, lambda m, v: config, lambda m: "1", lambda m: False)
            stage.next = _Next()
            await stage.infer(request, RequestContext(protocol=protocol, raw=raw), None)
            if isinstance(cache, LocalCache):
                keys.extend(cache.entries)
            else:
                before = stage.next.calls
                await stage.infer(request, RequestContext(protocol=protocol, raw=raw), None)
                assert stage.next.calls == before  # a hit: the same key
                keys.append(request_key(request, "1") or b"")
                cache.close()
    asyncio.run(run())
    return keys


CHANGES = [{"name": "INPUTX"}, {"datatype": "INT32"}, {"shape": 1}, {"byte": 0}, {"byte": 15},
           {"parameter": 1}, {"model": "add_subx"}]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_key_from_the_wire_bytes_tells_every_change_apart(protocol: str) -> None:
    """One input byte, shape, datatype, name, a parameter or the model changed: another key, from
    the gRPC fast path (the bytes), raw_key (the scan) and request_key alike; the id alone or the
    version asked (resolved to the same): the same key."""
    from gateway.cache import raw_key
    base = _two_inputs()
    sent = [base] + [_two_inputs(**c) for c in CHANGES]
    keys = _stage_keys([(r, r.SerializeToString(), protocol) for r in sent])
    assert len(set(keys)) == len(keys)
    assert keys == [request_key(r, "1", True) for r in sent]  # one key domain: the fields' key
    assert [raw_key(r.SerializeToString(), "1", True) for r in sent] == keys
    assert len({raw_key(r.SerializeToString(), "1") for r in sent}) == len(sent)  # digests too
    same = [_two_inputs(id="x"), _two_inputs(id="y"), _two_inputs(version="1")]
    assert _stage_keys([(r, r.SerializeToString(), protocol) for r in same]) == [keys[0]] * 3
    assert _stage_keys([(base, None, protocol)]) == [keys[0]]  # no bytes: the fields' key


def test_raw_key_canonical_form_and_what_it_leaves_to_request_key() -> None:
    from gateway.cache import raw_key
    base = _two_inputs(id="a")
    key = raw_key(base.SerializeToString(), "1", True)
    assert key == request_key(base, "1", True)
    # an HTTP binary request's bytes: binary_data_size on inputs, binary_data on outputs, an
    # ignorable parameter: the same key as the plain request
    plain = _two_inputs()
    plain.outputs.add(name="OUTPUT0")
    http = pb.ModelInferRequest()
    http.CopyFrom(plain)
    http.id = "7"
    for t in http.inputs:
        t.parameters["binary_data_size"].int64_param = 16
    http.outputs[0].parameters["binary_data"].bool_param = True
    http.parameters["binary_data_output"].bool_param = True
    assert raw_key(http.SerializeToString(), "1", True) == request_key(plain, "1", True) is not None
    # shared memory, a typed input, no raw inputs, fields out of order: request_key decides
    shm = pb.ModelInferRequest()
    shm.CopyFrom(plain)
    shm.outputs[0].parameters["shared_memory_region"].string_param = "r"
    assert raw_key(shm.SerializeToString(), "1") is None and request_key(shm, "1") is None
    typed = _request([1, 2, 3], typed=True)
    assert raw_key(typed.SerializeToString(), "1") is None
    out_of_order = plain.SerializeToString() + pb.ModelInferRequest(model_name="add_sub").SerializeToString()
    assert raw_key(out_of_order, "1") is None
    assert raw_key(b"\x0a\x05add", "1") is None  # truncated
    # a key of the workers' store is always a 16-byte digest; this process's may be its material
    assert key is not None and len(key) > 16 and len(raw_key(base.SerializeToString(), "1") or b"") == 16


def test_the_workers_store_keys_the_fast_path_as_request_key() -> None:
    base = _two_inputs()
    assert _stage_keys([(base, base.SerializeToString(), "grpc")], exact=False) == [request_key(base, "1")]


def _front_door(size: int = 1 << 20) -> tuple[Any, Any, mc.ModelConfig, list[int], Counter[tuple[str, str]]]:
    """A CacheStage over a LocalCache with its FrontDoor; the rest of the chain answers Y = X and
    counts its calls."""
    config = mc.ModelConfig(name="m")
    config.response_cache.enable = True
    configs = {"config": config}
    stage = CacheStage(LocalCache(size), lambda name, version: configs["config"], lambda name: "1",
                       lambda name: name == "route")
    calls = [0]

    class Rest:
        async def infer(self, request: pb.ModelInferRequest, ctx: RequestContext, sequence: str | None) -> InferResult:
            calls[0] += 1
            answer = pb.ModelInferResponse(model_name=request.model_name, model_version="1", id=request.id)
            answer.outputs.add(name="Y", datatype="INT32", shape=[1, 3])
            answer.raw_output_contents.append(request.raw_input_contents[0])
            return InferResult(message=answer)

    stage.next = Rest()
    counts: Counter[tuple[str, str]] = Counter()
    assert isinstance(stage.local, LocalCache)
    stage.front = FrontDoor(stage, stage.local, counts)
    return stage, configs, config, calls, counts


def _through(stage: Any, raw: bytes) -> pb.ModelInferResponse:
    """The gRPC front door's order: FrontDoor.grpc, else the stage with the request's bytes."""
    hit = stage.front.grpc(raw, None, None)
    if hit is not None:
        return pb.ModelInferResponse.FromString(hit)
    ctx = RequestContext(protocol="grpc", raw=raw)
    return asyncio.run(stage.infer(pb.ModelInferRequest.FromString(raw), ctx, None)).message()


def test_the_front_door_answers_a_repeat_with_its_own_id() -> None:
    stage, configs, config, calls, counts = _front_door()
    base = _request([1, 2, 3])
    first = pb.ModelInferRequest()
    first.CopyFrom(base)
    first.id = "first"
    assert stage.front.grpc(first.SerializeToString(), None, None) is None  # not indexed yet
    assert _through(stage, first.SerializeToString()).id == "first"
    assert calls[0] == 1
    assert not stage.front.entries  # a miss is not indexed at the door
    assert _through(stage, first.SerializeToString()).id == "first"  # a hit in the stage: indexed
    assert len(stage.front.entries) == 1
    for rid in ("second", ""):
        again = pb.ModelInferRequest()
        again.CopyFrom(base)
        again.id = rid
        hit = stage.front.grpc(again.SerializeToString(), None, None)  # answered at the door
        assert hit is not None
        answer = pb.ModelInferResponse.FromString(hit)
        assert answer.id == rid and answer.raw_output_contents[0] == base.raw_input_contents[0]
    assert calls[0] == 1
    assert stage.counts.table()[("m", "1")][:2] == (3, 1)
    assert counts[("m", "OK")] == 2  # (the door's; the stage's hit is counted by Outcomes, not here)
    # another version asked: its own key (through the pipeline once, then at the door)
    versioned = pb.ModelInferRequest()
    versioned.CopyFrom(base)
    versioned.model_version = "1"
    for _ in range(2):
        assert _through(stage, versioned.SerializeToString()).raw_output_contents[0] == base.raw_input_contents[0]
    assert stage.front.grpc(versioned.SerializeToString(), None, None) is not None
    # a reload (another served config) or an invalidation: the pipeline's path, never a stale answer
    configs["config"] = mc.ModelConfig(name="m", response_cache=config.response_cache)
    assert stage.front.grpc(base.SerializeToString(), None, None) is None
    configs["config"] = config
    stage.local.invalidate("m")
    assert stage.front.grpc(base.SerializeToString(), None, None) is None
    assert _through(stage, base.SerializeToString()).id == ""
    assert calls[0] == 2


def test_an_invalidation_during_a_lead_keeps_nothing_and_the_waiter_asks_again() -> None:
    """A miss led as it comes (``named``, a request without id or version) while a model is
    invalidated (a load or unload through the gateway): its answer goes to its own client but is not
    kept, and an identical request waiting on it runs the model again (it may be the old model's)."""
    from gateway import pipeline
    from gateway.turns import SequenceTurns

    config = mc.ModelConfig(name="m")
    config.response_cache.enable = True
    gate = asyncio.Event()
    calls: list[int] = []

    class Forward:
        async def named(self, request: pb.ModelInferRequest, ctx: RequestContext, sequence: str | None,
                        name: str, version: str, outcomes: Any = None, known: Any = None) -> InferResult:
            calls.append(1)
            await gate.wait()
            if outcomes is not None:
                outcomes.counts[(name, "OK")] += 1
            return InferResult(pb.ModelInferResponse(model_name=name, model_version="1", id=request.id))

        def infer(self, request: pb.ModelInferRequest, ctx: RequestContext, sequence: str | None) -> Any:
            return self.named(request, ctx, sequence, request.model_name, request.model_version)

    stage = CacheStage(LocalCache(1 << 20), lambda name, version: config, lambda name: "1", None)
    counts: Counter[tuple[str, str]] = Counter()
    head = pipeline.assemble(counts, SequenceTurns(), Forward(), lambda n, v: False, lambda n, v: False,  # type: ignore[arg-type]
                             cache=stage)
    raw = _request([5, 6, 7]).SerializeToString()

    def send() -> Any:
        return head.infer(pb.ModelInferRequest.FromString(raw), RequestContext("grpc", {}, None, raw))

    async def run() -> None:
        lead = asyncio.ensure_future(send())
        waiter = asyncio.ensure_future(send())
        for _ in range(5):
            await asyncio.sleep(0)
        assert calls == [1] and len(stage.flights) == 1
        await stage.invalidate("other")  # any model's invalidation: the lead cannot tell it from its own
        gate.set()
        await asyncio.gather(lead, waiter)
        assert calls == [1, 1] and not stage.flights  # the waiter ran the model itself
        assert len(stage.local.entries) == 1  # (the waiter's lead began after the invalidation: kept)
        await send()
        assert calls == [1, 1]  # a hit

    asyncio.run(run())
    assert stage.counts.table()[("m", "1")][:2] == (1, 2) and dict(counts) == {("m", "OK"): 3}


def test_the_front_door_never_answers_what_it_cannot_key() -> None:
    stage, _, _, calls, _ = _front_door()
    base = _request([4, 5, 6]).SerializeToString()
    late_id = base + b"\x1a\x01z"  # an id after the inputs (not where serializers put it): never indexed
    for _ in range(2):  # a miss, then a hit in the stage
        assert _through(stage, late_id).id == "z"
    assert stage.front.grpc(late_id, None, None) is None
    assert not stage.front.entries
    stage.front.entries[b"\x0a\x01m"] = ("m", "", mc.ModelConfig(), b"", [0] * 4, ("m", "OK"))
    for tiny in (b"", b"\x0a", b"\x0a\x01", b"\x0a\x01m", b"\x0a\x01mZ"):  # (a door with entries: no IndexError)
        stage.front.grpc(tiny, None, None)
    stage.front.entries.clear()
    routed = _request([4, 5, 6])
    routed.model_name = "route"  # an A/B route: never cached
    assert _through(stage, routed.SerializeToString()).id == ""
    assert stage.front.grpc(routed.SerializeToString(), None, None) is None
    assert calls[0] == 2


def test_the_front_door_index_is_bounded() -> None:
    stage, _, _, _, _ = _front_door(size=64 * 1024)  # the index: at most 8 KiB of keys
    for i in range(200):
        for _ in range(2):  # a miss, then a hit (indexed)
            _through(stage, _request([i] * 64).SerializeToString())
        assert stage.front.bytes <= stage.front.max_bytes
    assert 0 < len(stage.front.entries) < 200
    large = _request(list(range(2000))).SerializeToString()  # over 4 KiB: never indexed nor looked up
    for _ in range(3):
        _through(stage, large)
    assert stage.front.grpc(large, None, None) is None
    assert all(len(key) <= 4096 for key in stage.front.entries)


class _WaitingStore:
    """A quota store whose admission waits (as Redis's does)."""

    async def acquire(self, tenant: str, limits: Any, lease_s: float = 0.0) -> Any:
        await asyncio.sleep(0)
        raise AssertionError("never driven here")

    async def release(self, tenant: str, ticket: str) -> None:
        await asyncio.sleep(0)

    async def close(self) -> None:
        pass


def test_the_front_door_answers_at_once_only_where_admission_never_waits(tmp_path: Any) -> None:
    """No tenants, or the in-process quota store: ``at_once`` (a gRPC hit before the call's Task,
    a tenant's admission run to its end without a loop: its 403 and 429 raised at once, its share
    given back); a store that waits (Redis): the awaitable, in the Task. The index's first entry
    tells the front end once (``on_first_entry``: its hook is installed then)."""
    from gateway.auth import Admission, TenantDirectory
    from gateway.cache import _now, tenant_scope
    from gateway.quotas.memory import MemoryQuotaStore
    from tests.integration.test_gateway_tenants import tenants_yaml

    stage, _, _, calls, counts = _front_door()
    assert stage.front.at_once
    told: list[int] = []
    stage.front.on_first_entry = lambda: told.append(1)
    raw = _request([7, 8, 9]).SerializeToString()
    for _ in range(3):
        _through(stage, raw)  # a miss, a hit in the stage (indexed: told), a hit at the door
    assert told == [1] and calls[0] == 1
    (tmp_path / "tenants.yaml").write_text(tenants_yaml(rate=0.001, burst=2, models='["m"]'))
    directory = TenantDirectory(tmp_path / "tenants.yaml")
    admission = Admission(directory, MemoryQuotaStore())
    door = FrontDoor(stage, stage.local, counts, admission)
    # (with tenants the index is by tenant: the stage's entries, as acme's and ops's stage would index them)
    door.entries = {tenant_scope(t) + k: v for k, v in stage.front.entries.items() for t in ("acme", "ops")}
    assert door.at_once

    def context(key: str) -> Any:
        return lambda call, data: RequestContext(protocol="grpc", headers={"x-api-key": key}, raw=data)

    for _ in range(2):  # acme's burst: two hits, each an answer at once (bytes, not an awaitable)
        hit = door.grpc(raw, None, context("acme-key"))
        assert isinstance(hit, bytes) and pb.ModelInferResponse.FromString(hit).raw_output_contents
    assert admission.inflight == {}  # each hit's share given back
    with pytest.raises(InferError) as over:
        door.grpc(raw, None, context("acme-key"))
    assert over.value.code is Code.RESOURCE_EXHAUSTED
    (tmp_path / "tenants.yaml").write_text(tenants_yaml(models='["other"]'))
    admission.directory = TenantDirectory(tmp_path / "tenants.yaml")
    with pytest.raises(InferError) as denied:
        door.grpc(raw, None, context("acme-key"))
    assert denied.value.code is Code.PERMISSION_DENIED
    assert counts[("m", Code.RESOURCE_EXHAUSTED.value)] == 1 and counts[("m", Code.PERMISSION_DENIED.value)] == 1
    assert admission.inflight == {}

    waiting = FrontDoor(stage, stage.local, counts, Admission(directory, _WaitingStore()))
    assert not waiting.at_once  # its hits: awaitables, in the call's Task
    waiting.entries = door.entries
    pending = waiting.grpc(raw, None, context("ops-key"))
    assert pending is not None and not isinstance(pending, bytes)
    with pytest.raises(RuntimeError):  # a coroutine that would wait is never half run at once
        _now(pending)  # type: ignore[arg-type]
    assert waiting.admission.inflight == {}  # (closed: its share given back)


def test_raw_key_remembers_only_small_metadata() -> None:
    """raw_key's remembered canonical forms (``_raw_forms``: RAW_FORMS_KEPT of them, process-wide)
    are keyed by the request's metadata bytes, which a client chooses: a large parameter made each
    entry as large as the request (1,024 of 1 MiB: a GiB of the gateway's memory). Metadata over
    RAW_FORM_MAX is left to request_key (the same key), never remembered (session 10 review)."""
    from gateway import cache
    from gateway.cache import RAW_FORM_MAX, _raw_forms, raw_key

    big = _two_inputs()
    big.parameters["note"].string_param = "x" * (64 << 10)
    before = dict(_raw_forms)
    try:
        for i in range(8):
            big.parameters["note"].string_param = f"{i}" + "x" * (64 << 10)
            assert raw_key(big.SerializeToString(), "1", True) is None  # request_key's to decide
            assert request_key(big, "1", True) is not None
        assert all(len(meta) <= RAW_FORM_MAX for meta in _raw_forms)
        small = _two_inputs()
        small.parameters["note"].string_param = "y"
        assert raw_key(small.SerializeToString(), "1", True) == request_key(small, "1", True) is not None
    finally:
        cache._raw_forms.clear()
        cache._raw_forms.update(before)


def test_the_front_door_leaves_an_id_that_is_not_utf8_to_the_parse() -> None:
    """A request whose id is not UTF-8 is malformed (protobuf's parse refuses it: the pipeline's
    INVALID_ARGUMENT); the front door, which cuts the id out of the key without parsing, answered
    it from the cache with the bad bytes echoed as the answer's id (session 10 review)."""
    stage, _, _, _, _ = _front_door()
    first = _request([7, 8, 9])
    first.id = "ok"
    for _ in range(2):  # a miss, then a hit in the stage: indexed at the door
        assert _through(stage, first.SerializeToString()).id == "ok"
    again = _request([7, 8, 9])
    again.id = "yz"
    assert stage.front.grpc(again.SerializeToString(), None, None) is not None  # a hit at the door
    bad = again.SerializeToString().replace(b"\x1a\x02yz", b"\x1a\x02\xff\xfe")
    with pytest.raises(Exception, match="Error parsing"):
        pb.ModelInferRequest.FromString(bad)
    assert stage.front.grpc(bad, None, None) is None  # the pipeline's path: its parse says INVALID_ARGUMENT
    accented = _request([7, 8, 9])
    accented.id = "é"
    hit = stage.front.grpc(accented.SerializeToString(), None, None)
    assert hit is not None and pb.ModelInferResponse.FromString(hit).id == "é"  # UTF-8 beyond ASCII: a hit


def test_the_pipelines_miss_path_names_ids_single_flight_and_reload() -> None:
    """Names -> Outcomes -> CacheStage.named -> Forward (a stub): a repeat is a hit, whatever its
    id (the answer is kept without one and answers with the request's own), 32 identical
    concurrent misses run the model once, a reload (another served config) is a miss, and every
    one is counted as Triton counts it."""
    from gateway import pipeline
    from gateway.turns import SequenceTurns

    config = mc.ModelConfig(name="m")
    config.response_cache.enable = True
    configs = {"config": config}
    calls: list[str] = []
    handed: list[bool] = []

    class Forward:
        async def named(self, request: pb.ModelInferRequest, ctx: RequestContext, sequence: str | None,
                        name: str, version: str, outcomes: Any = None, known: Any = None) -> InferResult:
            # (the lead hands on the config it looked up, _cached's lead none; given ``outcomes``,
            # the request's outcome is counted here, as the real Forward.named's coroutine counts it)
            assert known is None or known is configs["config"]
            handed.append(known is not None)
            calls.append(name)
            await asyncio.sleep(0)
            answer = pb.ModelInferResponse(model_name=name, model_version="1", id=request.id)
            answer.raw_output_contents.append(request.raw_input_contents[0])
            if outcomes is not None:
                outcomes.counts[(name, "OK")] += 1
            return InferResult(answer)

        def infer(self, request: pb.ModelInferRequest, ctx: RequestContext, sequence: str | None) -> Any:
            return self.named(request, ctx, sequence, request.model_name, request.model_version)

    stage = CacheStage(LocalCache(1 << 20), lambda name, version: configs["config"], lambda name: "1", None)
    forward: Any = Forward()
    counts: Counter[tuple[str, str]] = Counter()
    head = pipeline.assemble(counts, SequenceTurns(), forward, lambda n, v: False, lambda n, v: False,
                             cache=stage)
    assert stage.forward is forward

    def send(values: list[int], rid: str = "") -> Any:
        request = _request(values)
        request.id = rid
        raw = request.SerializeToString()
        return head.infer(pb.ModelInferRequest.FromString(raw), RequestContext("grpc", {}, None, raw))

    async def run() -> None:
        first = await send([1, 2, 3], "a")
        assert first.message().id == "a" and len(calls) == 1
        assert all(b"\x1a\x01a" not in entry[1] for entry in stage.local.entries.values())  # kept without its id
        again = await send([1, 2, 3], "b")
        assert len(calls) == 1 and again.message().id == "b"
        assert again.message().raw_output_contents == first.message().raw_output_contents
        plain = await send([1, 2, 3])
        assert len(calls) == 1 and plain.message().id == ""
        answers = await asyncio.gather(*(send([7, 8, 9], str(i)) for i in range(32)))
        assert len(calls) == 2 and [a.message().id for a in answers] == [str(i) for i in range(32)]
        reloaded = mc.ModelConfig()
        reloaded.CopyFrom(config)
        configs["config"] = reloaded  # a reload: the stage's facts and entries of the old config are stale
        await send([1, 2, 3])
        assert len(calls) == 3
        await send([1, 2, 3])
        assert len(calls) == 3

    asyncio.run(run())
    hits, misses, hit_ns, miss_ns = stage.counts.table()[("m", "1")]
    assert (hits, misses) == (2 + 31 + 1, 3) and hit_ns > 0 and miss_ns > 0
    assert dict(counts) == {("m", "OK"): 3 + 32 + 2}  # each request once (Outcomes)
    assert any(handed)
