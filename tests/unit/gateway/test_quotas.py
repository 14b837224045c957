"""Token-bucket maths (fake clock, no sleeping), the in-process store, and tenants.yaml."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from gateway.auth import Admission, TenantDirectory, hash_key, parse_tenants
from gateway.quotas.bucket import Limits, take
from gateway.quotas.memory import MemoryQuotaStore
from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol.errors import Code, InferError
from meshserve.server.access import Op
from meshserve.server.core import RequestContext


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_bucket_starts_full_then_refills_at_rate() -> None:
    limits = Limits(rate=2.0, burst=3.0)
    b = None
    allowed = 0
    for _ in range(5):
        b, d = take(b, limits, now=0.0)
        allowed += d.allowed
    assert allowed == 3
    assert not d.allowed and d.reason == "rate" and d.retry_after_s == pytest.approx(0.5)
    b, d = take(b, limits, now=0.5)
    assert d.allowed
    b, d = take(b, limits, now=0.5)
    assert not d.allowed
    # a long idle period refills only up to burst
    b, _ = take(b, limits, now=100.0)
    assert b.tokens == pytest.approx(2.0)


def test_bucket_long_run_rate_and_backwards_clock() -> None:
    limits = Limits(rate=10.0, burst=5.0)
    b = None
    allowed = 0
    for i in range(3000):  # 30 requests/s for 10 s
        b, d = take(b, limits, now=i / 300)
        allowed += d.allowed
    assert abs(allowed - (10.0 * 10 + 5)) <= 2
    assert b is not None
    before = b.tokens
    b, _ = take(b, limits, now=0.0)  # clock skew never refills
    assert b.tokens <= before


async def test_memory_store_rate_and_concurrency() -> None:
    clock = Clock()
    store = MemoryQuotaStore(clock)
    limits = Limits(rate=1.0, burst=2.0, max_concurrency=2)
    d1, t1 = await store.acquire("a", limits)
    d2, t2 = await store.acquire("a", limits)
    assert d1.allowed and d2.allowed
    d3, _ = await store.acquire("a", limits)
    assert not d3.allowed and d3.reason == "concurrency"
    await store.release("a", t1)
    d4, _ = await store.acquire("a", limits)
    assert not d4.allowed and d4.reason == "rate" and d4.retry_after_s == pytest.approx(1.0)
    clock.t += 1.0
    d5, _ = await store.acquire("a", limits)
    assert d5.allowed
    other, _ = await store.acquire("b", limits)  # tenants do not share buckets
    assert other.allowed


TENANTS = """
tenants:
  - name: acme
    keys_sha256: [{acme}]
    rate: 1
    burst: 1
    models: ["add_sub", "scale*"]
    priority: 3
  - name: ops
    keys_sha256: [{ops}]
    rate: 100
    burst: 100
    admin: true
""".format(acme=hash_key("acme-key"), ops=hash_key("ops-key"))


def test_tenants_validation_names_the_problem() -> None:
    with pytest.raises(ValueError, match="sha256"):
        parse_tenants("tenants: [{name: a, keys_sha256: [nothex], rate: 1, burst: 1}]")
    with pytest.raises(ValueError, match="rate"):
        parse_tenants(f"tenants: [{{name: a, keys_sha256: [{hash_key('k')}], rate: 0, burst: 1}}]")
    with pytest.raises(ValueError, match="listed twice"):
        parse_tenants(f"tenants: [{{name: a, keys_sha256: [{hash_key('k')}], rate: 1, burst: 1}},"
                      f" {{name: a, keys_sha256: [{hash_key('j')}], rate: 1, burst: 1}}]")
    with pytest.raises(ValueError, match="extra"):
        parse_tenants("tenants: []\nbogus: 1")
    assert parse_tenants("").anonymous_allowed
    assert not parse_tenants(TENANTS).anonymous_allowed
    assert parse_tenants("anonymous: true\n" + TENANTS).anonymous_allowed


async def test_admission_keys_models_quota_priority(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANTS)
    clock = Clock()
    adm = Admission(TenantDirectory(path, clock), MemoryQuotaStore(clock))

    async def admit(model: str, headers: dict[str, str]) -> tuple[pb.ModelInferRequest, RequestContext]:
        req, ctx = pb.ModelInferRequest(model_name=model), RequestContext("grpc", headers, raw=b"x")
        await adm.admit(req, ctx)
        return req, ctx

    for headers, code in (({}, Code.UNAUTHENTICATED), ({"x-api-key": "nope"}, Code.UNAUTHENTICATED),
                          ({"authorization": "Bearer acme-key"}, None)):
        if code is None:
            req, ctx = await admit("scale", headers)
            assert req.parameters["priority"].uint64_param == 3 and ctx.raw is None
        else:
            with pytest.raises(InferError) as e:
                await admit("scale", headers)
            assert e.value.code == code
    with pytest.raises(InferError) as e:
        await admit("small_mlp", {"x-api-key": "acme-key"})
    assert e.value.code == Code.PERMISSION_DENIED and "small_mlp" in e.value.message
    with pytest.raises(InferError) as e:
        await admit("add_sub", {"x-api-key": "acme-key"})
    assert e.value.code == Code.RESOURCE_EXHAUSTED and e.value.retry_after_s == pytest.approx(1.0)
    # a client-set priority is kept
    clock.t += 1
    req = pb.ModelInferRequest(model_name="add_sub")
    req.parameters["priority"].uint64_param = 7
    await adm.admit(req, RequestContext("http", {"x-api-key": "acme-key"}))
    assert req.parameters["priority"].uint64_param == 7
    # admin
    with pytest.raises(InferError) as e:
        adm.authorize(Op.REPOSITORY_LOAD, "x", RequestContext("http", {"x-api-key": "acme-key"}))
    assert e.value.code == Code.PERMISSION_DENIED and "admin" in e.value.message
    adm.authorize(Op.REPOSITORY_LOAD, "x", RequestContext("http", {"x-api-key": "ops-key"}))

    # reload on change without restart; an invalid edit keeps the previous tenants
    path.write_text(TENANTS.replace('models: ["add_sub", "scale*"]', 'models: ["*"]'))
    os.utime(path, ns=(1, 10**18))
    clock.t += 2
    await admit("small_mlp", {"x-api-key": "acme-key"})
    path.write_text("tenants: [")
    os.utime(path, ns=(1, 2 * 10**18))
    clock.t += 2
    assert adm.directory.get().by_key  # still the previous, valid file


# two tenants and anonymous callers: big (the file's share, 0.5) and small (its own, 0.25)
SHARES = f"""
share: 0.5
anonymous: true
tenants:
  - {{name: big, keys_sha256: ["{hash_key('big-key')}"], rate: 1000, burst: 1000}}
  - {{name: small, keys_sha256: ["{hash_key('small-key')}"], rate: 1000, burst: 1000, share: 0.25}}
"""


async def test_each_tenant_holds_at_most_its_share_of_the_process_caps(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests and bytes in flight: max(1, cap * share) per tenant (the file's share, or the
    tenant's own); 429 naming the limit past it; given back when the request ends."""
    from meshserve.server import admission as gate_module

    path = tmp_path / "tenants.yaml"
    path.write_text(SHARES)
    monkeypatch.setattr(gate_module, "gate", gate_module.Gate(max_requests=8, max_bytes=1000))
    adm = Admission(TenantDirectory(path), MemoryQuotaStore())
    req = pb.ModelInferRequest(model_name="m")

    def ctx(key: str, size: int = 10) -> RequestContext:
        return RequestContext("grpc", {"x-api-key": key} if key else {}, raw=b"x" * size)

    async def refused(key: str, *fragments: str, size: int = 10) -> None:
        with pytest.raises(InferError) as err:
            await adm.admit(req, ctx(key, size))
        assert err.value.code is Code.RESOURCE_EXHAUSTED and err.value.retry_after_ms is not None
        for fragment in fragments:
            assert fragment in err.value.message, err.value.message

    held = [await adm.admit(req, ctx("big-key")) for _ in range(4)]
    await refused("big-key", "tenant 'big' has 4 inference requests in flight", "0.5 of --max-inflight 8: 4")
    small = [await adm.admit(req, ctx("small-key")) for _ in range(2)]
    await refused("small-key", "0.25 of --max-inflight 8: 2")
    anon = await adm.admit(req, ctx(""))  # anonymous callers: one share between them
    assert anon.tenant == ""
    await adm.release(held.pop())
    await refused("big-key", "this one's 600 would pass its share", "--max-inflight-bytes 1000: 500", size=600)
    held.append(await adm.admit(req, ctx("big-key", 400)))  # 3 x 10 + 400 <= 500
    for a in [*held, *small, anon]:
        await adm.release(a)
    assert adm.inflight == {} and adm.rejections[("big", "share")] == 2
    first = await adm.admit(req, ctx("big-key", 5000))  # nothing in flight: any size, as the gate
    await adm.release(first)


async def test_each_tenant_holds_at_most_its_share_of_a_models_queue(tmp_path: Path) -> None:
    """A model whose config bounds its queue (max_queue_size): a tenant holds at most
    max(1, room * share) of the requests its replicas queue and run at once (queue + max_batch_size
    x instances, per replica), 429 naming the share past it, given back when a request ends or
    fails to be admitted; a model without the bound, another model and another tenant are not
    counted against it."""
    from google.protobuf import text_format

    from gateway.auth import QueueRooms, queue_room
    from meshserve._proto import model_config_pb2 as mc

    def config(text: str) -> mc.ModelConfig:
        return text_format.Parse(text, mc.ModelConfig())

    bounded = config('name: "q" max_batch_size: 2 dynamic_batching { default_queue_policy { max_queue_size: 4 } } '
                     'instance_group [ { count: 2 } ]')
    assert queue_room(bounded, 1) == QueueRooms(1, (4 + 2 * 2,)) and queue_room(bounded, 3) == QueueRooms(1, (3 * 8,))
    assert queue_room(config('name: "b" max_batch_size: 8 dynamic_batching { }'), 2) is None
    assert queue_room(config('name: "p" max_batch_size: 0'), 1) is None
    path = tmp_path / "tenants.yaml"
    path.write_text(f"""
tenants:
  - {{name: acme, keys_sha256: ["{hash_key('acme-key')}"], rate: 1000, burst: 1000}}
  - {{name: mallory, keys_sha256: ["{hash_key('mallory-key')}"], rate: 1000, burst: 1000}}
""")
    adm = Admission(TenantDirectory(path), MemoryQuotaStore())
    adm.queue_room = lambda model, version: queue_room(bounded, 1) if model == "q" else None  # 8: a share of 4

    def ctx(key: str) -> RequestContext:
        return RequestContext("grpc", {"x-api-key": key}, raw=b"x")

    q, other = pb.ModelInferRequest(model_name="q"), pb.ModelInferRequest(model_name="other")
    held = [await adm.admit(q, ctx("mallory-key")) for _ in range(4)]
    with pytest.raises(InferError) as err:
        await adm.admit(q, ctx("mallory-key"))
    assert err.value.code is Code.RESOURCE_EXHAUSTED and err.value.retry_after_ms is not None
    assert "tenant 'mallory' has 4 requests for model 'q' in flight, its share (0.5 of the 8" in err.value.message
    held += [await adm.admit(other, ctx("mallory-key")), await adm.admit(q, ctx("acme-key"))]
    await adm.release(held.pop(0))
    held.append(await adm.admit(q, ctx("mallory-key")))
    assert adm.queued == {("mallory", "q", 1): 4, ("acme", "q", 1): 1}
    for a in held:
        await adm.release(a)
    assert adm.queued == {} and adm.inflight == {}


async def test_each_tenant_holds_at_most_its_share_of_each_priority_levels_queue(tmp_path: Path) -> None:
    """With priority levels, each level's queue is its own (the level's priority_queue_policy,
    else the default policy, as the service reads them): a tenant holds at most its share of the
    room of the level its requests queue at (the request's `priority`, else the tenant's, else the
    model's default level); an unbounded level is not counted; a level's share does not count
    against another level's."""
    from google.protobuf import text_format

    from gateway.auth import QueueRooms, queue_room
    from meshserve._proto import model_config_pb2 as mc

    levels = text_format.Parse(
        'name: "q" max_batch_size: 1 dynamic_batching { priority_levels: 3 default_priority_level: 2 '
        'priority_queue_policy { key: 1 value { max_queue_size: 0 } } '
        'priority_queue_policy { key: 3 value { max_queue_size: 7 } } '
        'default_queue_policy { max_queue_size: 3 } }', mc.ModelConfig())
    assert queue_room(levels, 1) == QueueRooms(2, (0, 3 + 1, 7 + 1))
    only_one = text_format.Parse('name: "o" dynamic_batching { priority_levels: 2 '
                                 'priority_queue_policy { key: 2 value { max_queue_size: 4 } } }', mc.ModelConfig())
    assert queue_room(only_one, 2) == QueueRooms(1, (0, 2 * 5))  # (the default level 1 is unbounded)
    no_levels = text_format.Parse('name: "n" dynamic_batching { priority_queue_policy { key: 1 value '
                                  '{ max_queue_size: 4 } } }', mc.ModelConfig())
    assert queue_room(no_levels, 1) is None  # (without priority_levels the service reads the default policy)
    path = tmp_path / "tenants.yaml"
    path.write_text(f"""
tenants:
  - {{name: mallory, keys_sha256: ["{hash_key('mallory-key')}"], rate: 1000, burst: 1000}}
  - {{name: urgent, keys_sha256: ["{hash_key('urgent-key')}"], rate: 1000, burst: 1000, priority: 3}}
""")
    adm = Admission(TenantDirectory(path), MemoryQuotaStore())
    adm.queue_room = lambda model, version: queue_room(levels, 1)  # shares: level 1 none, 2: 2, 3: 4

    def req(priority: int | None) -> pb.ModelInferRequest:
        r = pb.ModelInferRequest(model_name="q")
        if priority is not None:
            r.parameters["priority"].uint64_param = priority
        return r

    def ctx(key: str) -> RequestContext:
        return RequestContext("grpc", {"x-api-key": key}, raw=b"x")

    held = [await adm.admit(req(3), ctx("mallory-key")) for _ in range(4)]
    with pytest.raises(InferError) as err:
        await adm.admit(req(3), ctx("mallory-key"))
    assert err.value.code is Code.RESOURCE_EXHAUSTED and err.value.retry_after_ms is not None
    assert ("tenant 'mallory' has 4 requests for model 'q' in flight at priority level 3, its share (0.5 of the 8 "
            "its replicas queue and run at once at priority level 3 (max_queue_size): 4)") in err.value.message
    held += [await adm.admit(req(None), ctx("mallory-key")) for _ in range(2)]  # the default level, 2
    with pytest.raises(InferError):
        await adm.admit(req(0), ctx("mallory-key"))  # (0: the default level too)
    held += [await adm.admit(req(1), ctx("mallory-key")) for _ in range(5)]  # level 1: unbounded, not counted
    held += [await adm.admit(req(None), ctx("urgent-key")) for _ in range(4)]  # its own priority: level 3
    with pytest.raises(InferError):
        await adm.admit(req(None), ctx("urgent-key"))
    held.append(await adm.admit(req(2), ctx("urgent-key")))
    assert adm.queued == {("mallory", "q", 3): 4, ("mallory", "q", 2): 2, ("urgent", "q", 3): 4, ("urgent", "q", 2): 1}
    await adm.release(held.pop(0))
    held.append(await adm.admit(req(3), ctx("mallory-key")))
    for a in held:
        await adm.release(a)
    assert adm.queued == {} and adm.inflight == {}


def test_the_transport_names_the_caller_and_its_share_from_the_headers_alone(tmp_path: Path) -> None:
    """Admission.caller: what a compressed body's inflated bytes are counted against before the
    request is parsed (meshserve/server/inflate.py): the key's tenant and share, the anonymous
    callers' share, 401 for a key that is no tenant's (and for none, when anonymous is off)."""
    path = tmp_path / "tenants.yaml"
    tenants = f"""
share: 0.5
tenants:
  - {{name: big, keys_sha256: ["{hash_key('big-key')}"], rate: 1000, burst: 1000}}
  - {{name: small, keys_sha256: ["{hash_key('small-key')}"], rate: 1000, burst: 1000, share: 0.25}}
"""
    path.write_text(tenants)
    adm = Admission(TenantDirectory(path), MemoryQuotaStore())
    assert adm.caller({"x-api-key": "big-key"}) == ("big", 0.5)
    assert adm.caller({"authorization": "Bearer small-key"}) == ("small", 0.25)
    for headers, text in (({"x-api-key": "nobody"}, "unknown API key"), ({}, "an API key is required")):
        with pytest.raises(InferError) as err:
            adm.caller(headers)
        assert err.value.code is Code.UNAUTHENTICATED and text in err.value.message
    path.write_text("anonymous: true\nshare: 0.125\n" + tenants.replace("share: 0.5\n", ""))
    assert Admission(TenantDirectory(path), MemoryQuotaStore()).caller({}) == ("", 0.125)


@pytest.mark.parametrize("text", ["share: 0", "share: 1.5", "tenants: [{name: a, keys_sha256: ['"
                                  + "a" * 64 + "'], rate: 1, burst: 1, share: 0}]"])
def test_a_share_is_a_fraction_of_a_cap(text: str) -> None:
    with pytest.raises(ValueError, match="share"):
        parse_tenants(text)


async def test_a_sequence_is_its_first_tenant_s_while_it_lives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another tenant naming a live sequence is refused (403); the owner keeps it alive; it is
    free after its end, or once its binding lapses; the table is bounded per tenant."""
    from gateway import auth

    path = tmp_path / "tenants.yaml"
    path.write_text(f"""
tenants:
  - {{name: a, keys_sha256: ["{hash_key('a-key')}"], rate: 1000, burst: 1000}}
  - {{name: b, keys_sha256: ["{hash_key('b-key')}"], rate: 1000, burst: 1000, share: 0.001}}
""")
    clock = Clock()
    adm = Admission(TenantDirectory(path, clock=clock), MemoryQuotaStore(clock=clock), clock=clock)

    def req(end: bool = False) -> pb.ModelInferRequest:
        r = pb.ModelInferRequest(model_name="seq")
        r.parameters["sequence_id"].int64_param = 42
        if end:
            r.parameters["sequence_end"].bool_param = True
        return r

    async def call(key: str, end: bool = False, seq: str = "i:42", idle: float = 0.0) -> None:
        await adm.release(await adm.admit(req(end), RequestContext("grpc", {"x-api-key": key}), seq, idle))

    await call("a-key")
    with pytest.raises(InferError) as err:
        await call("b-key")
    assert err.value.code is Code.PERMISSION_DENIED and "another tenant's sequence" in err.value.message
    await call("b-key", seq="i:43")  # another id is b's own
    clock.t += auth.SEQUENCE_BINDING_MIN_S - 1
    await call("a-key")  # a's request keeps it alive
    clock.t += auth.SEQUENCE_BINDING_MIN_S - 1
    with pytest.raises(InferError):
        await call("b-key", end=True)  # not even its end
    await call("a-key", end=True)
    await call("b-key")  # ended: free, now b's
    clock.t += 200 * 2 + 1  # past a model idle timeout of 200 s, twice over
    await call("a-key", idle=200)  # lapsed: a's again
    monkeypatch.setattr(auth, "MAX_SEQUENCES", 2000)  # b's share: max(1, 2000 * 0.001) = 2
    await call("b-key", seq="i:1")
    await call("b-key", seq="i:2")  # (its lapsed i:43 is swept to make room)
    with pytest.raises(InferError) as err:
        await call("b-key", seq="i:3")
    assert err.value.code is Code.RESOURCE_EXHAUSTED and "sequences in progress" in err.value.message
    assert len(adm.sequences) <= 4 and adm.inflight == {}


async def test_each_tenant_holds_at_most_its_share_of_a_models_sequence_slots(tmp_path: Path) -> None:
    """A sequence model whose services hold 4 live sequences (sequence_room): a tenant's new
    sequences take at most max(1, 4 x 0.5) = 2 of them (429 naming the share past it); its own go
    on; an ended one, or one unused for twice the model's idle timeout (the service has let it
    go), gives its slot back; another tenant's and another model's are not counted."""
    from google.protobuf import text_format

    from gateway.auth import sequence_room
    from meshserve._proto import model_config_pb2 as mc

    direct = text_format.Parse('name: "s" max_batch_size: 2 sequence_batching { direct { } }', mc.ModelConfig())
    oldest = text_format.Parse('name: "o" max_batch_size: 8 sequence_batching { oldest { max_candidate_sequences: 3 } }',
                               mc.ModelConfig())
    # Triton's rule: per instance (max_candidate_sequences 3 x 4 instances x 2 replicas)
    assert sequence_room(direct, 2, 1) == 4 and sequence_room(direct, 1, 3) == 6 and sequence_room(oldest, 4, 2) == 24
    # oldest without max_candidate_sequences: Triton's default, the direct strategy's slots
    unset = text_format.Parse('name: "u" max_batch_size: 4 sequence_batching { oldest { } }', mc.ModelConfig())
    assert sequence_room(unset, 2, 3) == 24
    assert sequence_room(text_format.Parse('name: "u" sequence_batching { oldest { } }', mc.ModelConfig()), 1, 1) == 1
    assert sequence_room(mc.ModelConfig(name="plain"), 1, 1) == 0
    path = tmp_path / "tenants.yaml"
    path.write_text(f"""
tenants:
  - {{name: a, keys_sha256: ["{hash_key('a-key')}"], rate: 1000, burst: 1000}}
  - {{name: b, keys_sha256: ["{hash_key('b-key')}"], rate: 1000, burst: 1000}}
""")
    clock = Clock()
    adm = Admission(TenantDirectory(path, clock=clock), MemoryQuotaStore(clock=clock), clock=clock)
    adm.sequence_room = lambda model, version: 4 if model == "s" else 0

    async def call(key: str, seq: int, model: str = "s", end: bool = False) -> None:
        r = pb.ModelInferRequest(model_name=model)
        if end:
            r.parameters["sequence_end"].bool_param = True
        await adm.release(await adm.admit(r, RequestContext("grpc", {"x-api-key": key}), f"i:{seq}", 1.0))

    await call("b-key", 1)
    await call("b-key", 2)
    with pytest.raises(InferError) as err:
        await call("b-key", 3)
    assert err.value.code is Code.RESOURCE_EXHAUSTED and err.value.retry_after_ms is not None
    assert "tenant 'b' has 2 sequences of model 's' in progress, its share (0.5 of the 4" in err.value.message
    await call("b-key", 2)  # its own go on
    await call("b-key", 3, model="other")  # another model's
    await call("a-key", 4)
    await call("a-key", 5)  # a's own share
    await call("b-key", 1, end=True)
    await call("b-key", 6)  # the ended one's slot
    clock.t += 2.5  # unused for twice the idle timeout of 1 s: let go at the service
    await call("b-key", 7)
    assert set(adm._live[("b", "s")]) == {"i:7"}


async def test_with_several_replicas_a_tenant_holds_its_share_of_each_replicas_sequence_slots(tmp_path: Path) -> None:
    """Sequences are pinned to replicas by their id (rendezvous hashing), so a tenant choosing ids
    could put its whole share of the model's slots on one replica: with several, its new
    sequence also takes at most max(1, one replica's slots x share) of the replica its id is
    pinned to (GatewayCore.sequence_replica); an ended or let-go one gives that back too."""
    path = tmp_path / "tenants.yaml"
    path.write_text(f"""
tenants:
  - {{name: b, keys_sha256: ["{hash_key('b-key')}"], rate: 1000, burst: 1000}}
""")
    clock = Clock()
    adm = Admission(TenantDirectory(path, clock=clock), MemoryQuotaStore(clock=clock), clock=clock)
    adm.sequence_room = lambda model, version: 8  # 2 replicas x 4 slots: b's share 4, of each replica 2
    adm.sequence_replica = lambda model, version, key: ("odd" if int(key[2:]) % 2 else "even", 2)

    async def call(seq: int, end: bool = False) -> None:
        r = pb.ModelInferRequest(model_name="s")
        if end:
            r.parameters["sequence_end"].bool_param = True
        await adm.release(await adm.admit(r, RequestContext("grpc", {"x-api-key": "b-key"}), f"i:{seq}", 1.0))

    await call(1)
    await call(3)
    with pytest.raises(InferError) as err:
        await call(5)
    assert err.value.code is Code.RESOURCE_EXHAUSTED and err.value.retry_after_ms is not None
    assert ("tenant 'b' has 2 sequences of model 's' in progress on the replica sequence 5 is pinned to, its share "
            "(0.5 of the 4 one replica holds at once: 2)") in err.value.message
    await call(3)  # its own go on
    await call(2)
    await call(4)  # the other replica's share
    with pytest.raises(InferError) as err:
        await call(6)
    assert "its share (0.5 of the 8 its replicas hold at once: 4)" in err.value.message
    await call(1, end=True)
    await call(5)  # the ended one's slot on its replica
    assert adm._pinned == {("b", "s", "i:3"): "odd", ("b", "s", "i:5"): "odd", ("b", "s", "i:2"): "even",
                           ("b", "s", "i:4"): "even"}
    clock.t += 2.5  # unused for twice the idle timeout of 1 s: let go at the service
    await call(7)
    assert set(adm._live[("b", "s")]) == {"i:7"} and adm._pinned == {("b", "s", "i:7"): "odd"}


def test_certificate_names_name_a_tenant_only_when_verified() -> None:
    """A tenant's certificate_names (mutual TLS): matched against the names of a certificate the
    handshake verified (tls.CertNames, a type no header from a wire has), the CN first; a key wins."""
    from gateway.auth import Tenants
    from meshserve.server.tls import CLIENT_CERT_HEADER, CertNames, _cert_names

    spec = parse_tenants(f"""
tenants:
  - {{name: acme, certificate_names: ["acme-client", "spiffe://mesh/acme"], rate: 1, burst: 1}}
  - {{name: beta, keys_sha256: ["{hash_key('beta-key')}"], rate: 1, burst: 1}}
""")
    tenants = Tenants(spec)
    names = _cert_names({"subject": ((("organizationName", "x"),), (("commonName", "someone"),)),
                         "subjectAltName": (("DNS", "host"), ("URI", "spiffe://mesh/acme"))})
    assert names == "someone\nspiffe://mesh/acme\nhost" and type(names) is CertNames
    found = tenants.authenticate({CLIENT_CERT_HEADER: names})
    assert found is not None and found.name == "acme"
    found = tenants.authenticate({CLIENT_CERT_HEADER: names, "x-api-key": "beta-key"})
    assert found is not None and found.name == "beta"
    with pytest.raises(InferError) as err:  # the same text from a wire: not a verified certificate
        tenants.authenticate({CLIENT_CERT_HEADER: str(names)})
    assert err.value.code is Code.UNAUTHENTICATED
    assert _cert_names({}) is None
    for bad in ("tenants: [{name: a, rate: 1, burst: 1}]",
                "tenants: [{name: a, certificate_names: [''], rate: 1, burst: 1}]",
                "tenants: [{name: a, certificate_names: [x], rate: 1, burst: 1},"
                " {name: b, certificate_names: [x], rate: 1, burst: 1}]"):
        with pytest.raises(ValueError):
            parse_tenants(bad)


async def test_a_tenant_with_nothing_in_flight_keeps_no_entry_when_its_request_is_not_counted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Admission.inflight holds an entry only for a tenant with requests in flight: a request
    that is not counted (its model's queue-room lookup fails, or it is refused) leaves none for a
    tenant that had nothing in flight, and one that had keeps its counts unchanged."""
    from meshserve.server import admission as gate_module

    path = tmp_path / "tenants.yaml"
    path.write_text(f"""
share: 0.5
tenants:
  - {{name: acme, keys_sha256: ["{hash_key('acme-key')}"], rate: 1000, burst: 1000}}
""")
    monkeypatch.setattr(gate_module, "gate", gate_module.Gate(max_requests=2))  # acme's share: 1
    adm = Admission(TenantDirectory(path), MemoryQuotaStore())
    ctx = RequestContext("grpc", {"x-api-key": "acme-key"}, raw=b"x" * 10)

    def lookup_fails(model: str, version: str) -> None:
        raise InferError.unavailable(f"no config for model '{model}'")

    adm.queue_room = lookup_fails  # type: ignore[assignment]
    with pytest.raises(InferError):
        await adm.admit(pb.ModelInferRequest(model_name="m"), ctx)
    assert adm.inflight == {} and adm.queued == {}
    adm.queue_room = None
    held = await adm.admit(pb.ModelInferRequest(model_name="m"), ctx)
    assert adm.inflight == {"acme": [1, 10]}
    with pytest.raises(InferError) as err:
        await adm.admit(pb.ModelInferRequest(model_name="m"), ctx)
    assert err.value.code is Code.RESOURCE_EXHAUSTED
    assert adm.inflight == {"acme": [1, 10]}
    await adm.release(held)
    assert adm.inflight == {}


async def test_a_caller_at_its_share_is_refused_at_the_door(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Admission.at_door: what ``admit`` would answer a caller that holds its whole share of
    --max-inflight (the same error, counted the same), from its headers and model name alone; None
    for anything ``admit`` answers otherwise (an unknown key: 401; a model the tenant may not call:
    403; an invalid name: 400) or lets in. ``crowded``: only once the process has the smallest
    share's cap in flight."""
    from meshserve.server import admission as gate_module

    path = tmp_path / "tenants.yaml"
    path.write_text(SHARES + f"""  - {{name: narrow, keys_sha256: ["{hash_key('narrow-key')}"], rate: 1000, burst: 1000, models: ["a*"]}}
""")
    gate = gate_module.Gate(max_requests=8)
    monkeypatch.setattr(gate_module, "gate", gate)
    adm = Admission(TenantDirectory(path), MemoryQuotaStore())

    def ctx(key: str) -> RequestContext:
        return RequestContext("grpc", {"x-api-key": key} if key else {}, raw=b"x")

    async def hold(key: str, model: str, n: int) -> list:
        held = [await adm.admit(pb.ModelInferRequest(model_name=model), ctx(key)) for _ in range(n)]
        gate.requests += n  # (observe counts a request in the process's gate before admission)
        return held

    gate.requests = 1
    assert not adm.crowded()  # the smallest share's cap: 0.25 of 8 = 2
    held = await hold("big-key", "m", 4)
    assert adm.crowded()
    refused = adm.at_door("m", {"x-api-key": "big-key"})
    assert refused is not None and refused.code is Code.RESOURCE_EXHAUSTED and refused.retry_after_ms is not None
    with pytest.raises(InferError) as err:
        await adm.admit(pb.ModelInferRequest(model_name="m"), ctx("big-key"))
    assert refused.message == err.value.message and refused.retry_after_ms == err.value.retry_after_ms
    assert "tenant 'big' has 4 inference requests in flight, its share (0.5 of --max-inflight 8: 4)" in refused.message
    assert adm.rejections[("big", "share")] == 2
    assert adm.at_door("m", {"x-api-key": "small-key"}) is None  # nothing in flight
    assert adm.at_door("m", {"x-api-key": "no-such-key"}) is None  # admit: 401
    assert adm.at_door("m", {}) is None  # anonymous callers: nothing in flight yet
    assert adm.at_door("../m", {"x-api-key": "big-key"}) is None  # the name check: 400
    held += await hold("narrow-key", "a1", 4)
    assert adm.at_door("b1", {"x-api-key": "narrow-key"}) is None  # admit: 403
    assert adm.at_door("a2", {"x-api-key": "narrow-key"}) is not None
    held += await hold("", "m", 4)
    anonymous = adm.at_door("m", {})
    assert anonymous is not None and "anonymous callers has 4 inference requests in flight" in anonymous.message
    assert adm.rejections[("big", "share")] == 2 and adm.rejections[("(anonymous)", "share")] == 1
    await adm.release(held.pop(0))  # big: 3 of its 4
    assert adm.at_door("m", {"x-api-key": "big-key"}) is None
    for h in held:
        await adm.release(h)
    assert adm.inflight == {}
