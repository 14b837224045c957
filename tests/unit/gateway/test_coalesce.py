"""Gateway request coalescing: merge/split are exact, and only valid requests ever merge."""
from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
from google.protobuf import text_format

from gateway.upstream import coalesce, merging
from gateway.upstream.coalesce import Coalescer
from gateway.upstream.merging import (
    ModelShape,
    Unmergeable,
    merge,
    merge_key,
    split,
)
from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol import hop
from meshserve.protocol.errors import Code, InferError
from tests.support import loop_passes
from tests.support.slow import work_for_async

CONFIG = text_format.Parse("""
name: "add_sub" max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] }, { name: "INPUT1" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] }, { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 16 ] } ]
dynamic_batching { }
""", mc.ModelConfig())
SHAPE = ModelShape.of(CONFIG)
SHAPE2 = dataclasses.replace(SHAPE, instances=2)  # two model instances


def request(a: np.ndarray, b: np.ndarray, rid: str = "", order: tuple[str, str] = ("INPUT0", "INPUT1")
            ) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="add_sub", id=rid)
    data = {"INPUT0": a, "INPUT1": b}
    for name in order:
        r.inputs.add(name=name, datatype="FP32", shape=list(data[name].shape))
        r.raw_input_contents.append(data[name].astype(np.float32).tobytes())
    return r


def fake_service(req: pb.ModelInferRequest) -> pb.ModelInferResponse:
    arrays = {t.name: np.frombuffer(raw, np.float32).reshape(t.shape)
              for t, raw in zip(req.inputs, req.raw_input_contents, strict=True)}
    a, b = arrays["INPUT0"], arrays["INPUT1"]
    resp = pb.ModelInferResponse(model_name=req.model_name, model_version="1", id=req.id)
    for name, value in (("OUTPUT0", a + b), ("OUTPUT1", a - b)):
        resp.outputs.add(name=name, datatype="FP32", shape=list(value.shape))
        resp.raw_output_contents.append(value.tobytes())
    return resp


def test_merge_then_split_is_exact() -> None:
    rng = np.random.default_rng(0)
    reqs, rows = [], [1, 3, 2]
    for i, n in enumerate(rows):
        order = ("INPUT1", "INPUT0") if i == 1 else ("INPUT0", "INPUT1")  # input order may differ
        reqs.append(request(rng.standard_normal((n, 16)), rng.standard_normal((n, 16)), f"id{i}", order))
    merged = merge(reqs, rows)
    assert merged.parameters[hop.MERGED].int64_param == 3
    assert [list(t.shape) for t in merged.inputs] == [[6, 16], [6, 16]]
    outs = split(fake_service(merged), reqs, rows)
    for req, raw in zip(reqs, outs, strict=True):
        want = fake_service(req)
        assert raw == want.SerializeToString()  # byte for byte what the service would answer it alone
        out = pb.ModelInferResponse.FromString(raw)
        assert out.id == req.id and out.model_version == "1"
        assert [list(o.shape) for o in out.outputs] == [list(o.shape) for o in want.outputs]
        assert list(out.raw_output_contents) == list(want.raw_output_contents)


def test_split_of_large_and_unnamed_members() -> None:
    """Multi-byte lengths and dims, an empty id, one output requested."""
    config = mc.ModelConfig()
    config.CopyFrom(CONFIG)
    config.max_batch_size = 300
    for t in (*config.input, *config.output):
        t.dims[0] = 200
    rows = [130, 1, 169]
    reqs = [request(np.full((n, 200), i), np.ones((n, 200)), "" if i == 1 else f"m{i}") for i, n in enumerate(rows)]
    merged = merge(reqs, rows, ModelShape.of(config))
    answer = fake_service(merged)
    del answer.outputs[0]
    del answer.raw_output_contents[0]
    for req, n, raw in zip(reqs, rows, split(answer, reqs, rows), strict=True):
        want = fake_service(req)
        del want.outputs[0]
        del want.raw_output_contents[0]
        assert raw == want.SerializeToString()
        assert pb.ModelInferResponse.FromString(raw).outputs[0].shape == [n, 200]


MUTATIONS = [
    lambda r: r.inputs[1].__setattr__("datatype", "INT32"),         # wrong dtype
    lambda r: r.inputs[1].shape.__setitem__(1, 8),                  # wrong shape
    lambda r: r.inputs[1].__setattr__("name", "BOGUS"),             # unknown input
    lambda r: r.parameters["priority"].__setattr__("uint64_param", 1),  # semantics-changing parameter
    lambda r: r.outputs.add(name="NOPE"),                           # unknown output
    lambda r: r.outputs.add(name="OUTPUT0").parameters["classification"].__setattr__("int64_param", 2),
    lambda r: r.outputs.add(name="OUTPUT0").parameters["shared_memory_region"].__setattr__("string_param", "x"),
    lambda r: r.inputs[0].parameters["shared_memory_region"].__setattr__("string_param", "x"),
    lambda r: r.inputs[1].__setattr__("name", "INPUT0"),            # an input named twice
    lambda r: r.inputs[1].contents.fp32_contents.append(1.0),      # typed contents (refused by the service)
    lambda r: r.inputs[1].shape.__setitem__(0, 2),                  # batch sizes differ between inputs
]


@pytest.mark.parametrize("mutate", MUTATIONS)
def test_anything_unusual_is_never_merged(mutate) -> None:
    r = request(np.zeros((1, 16)), np.zeros((1, 16)))
    assert merge_key(r, SHAPE) is not None
    mutate(r)
    assert merge_key(r, SHAPE) is None


@pytest.mark.parametrize("mutate", MUTATIONS)
def test_the_remembered_answer_is_the_message_s_answer(mutate) -> None:
    """With the client's bytes, merge_key remembers its answer by all but the id and the tensor
    contents: a mergeable request remembered first never lends its answer to an unusual one."""
    shape = ModelShape.of(CONFIG)
    good = request(np.zeros((1, 16)), np.zeros((1, 16)), rid="a")
    assert merge_key(good, shape, good.SerializeToString()) == merge_key(good, SHAPE) is not None
    bad = request(np.ones((1, 16)), np.ones((1, 16)), rid="b")
    mutate(bad)
    assert merge_key(bad, shape, bad.SerializeToString()) is None
    assert merge_key(bad, shape, bad.SerializeToString()) is None  # remembered too
    assert merge_key(good, shape, good.SerializeToString()) is not None


def test_requests_differing_in_id_and_contents_share_one_answer() -> None:
    shape = ModelShape.of(CONFIG)
    rng = np.random.default_rng(1)
    for i in range(20):
        r = request(rng.standard_normal((2, 16)), rng.standard_normal((2, 16)), rid=str(i) if i % 2 else "")
        assert merge_key(r, shape, r.SerializeToString()) == merge_key(r, SHAPE)
    assert len(shape.keys) == 1
    three = request(np.zeros((3, 16)), np.zeros((3, 16)))  # the rows are in the shape: another answer
    assert merge_key(three, shape, three.SerializeToString())[1] == 3
    assert len(shape.keys) == 2


def test_the_remembered_layout_answers_only_requests_laid_out_as_it() -> None:
    """merge_key's fast path (merging._known): a request laid out as the last one remembered
    (the same bytes but its id and tensor contents) gets its answer without the walk; any other
    layout (no id, a long id, a mutation, a field after the tensors, cut bytes) is walked or read
    from the message, and gets the message's own answer."""
    shape = ModelShape.of(CONFIG)
    first = request(np.zeros((1, 16)), np.zeros((1, 16)), rid="7")
    want = merge_key(first, SHAPE)
    assert merge_key(first, shape, first.SerializeToString()) == want is not None
    layout = shape.layout[0]
    same = request(np.ones((1, 16)), np.full((1, 16), 2.0), rid="a-longer-id")
    assert merging._known(same.SerializeToString(), layout) == want
    assert merge_key(same, shape, same.SerializeToString()) == want
    others = [request(np.zeros((1, 16)), np.zeros((1, 16))),  # no id
              request(np.zeros((1, 16)), np.zeros((1, 16)), rid="x" * 200),  # a two-byte length
              request(np.zeros((2, 16)), np.zeros((2, 16)), rid="7")]  # other rows: other bytes
    for r in others:
        assert merging._known(r.SerializeToString(), layout) is merging._UNKNOWN
        assert merge_key(r, shape, r.SerializeToString()) == merge_key(r, SHAPE)
    raw = same.SerializeToString()
    for odd in (raw + b"\x22\x00", raw + b"\x1a\x01x", raw[:-1], raw + b"\x3a\x05ab"):
        assert merging._known(odd, layout) is merging._UNKNOWN
    for mutate in MUTATIONS:
        bad = request(np.zeros((1, 16)), np.zeros((1, 16)), rid="8")
        mutate(bad)
        assert merging._known(bad.SerializeToString(), shape.layout[0]) is merging._UNKNOWN
        assert merge_key(bad, shape, bad.SerializeToString()) is None
        assert merge_key(first, shape, first.SerializeToString()) == want  # (the good layout back)


def test_the_layout_s_answer_is_only_given_to_bytes_with_the_same_metadata() -> None:
    """Exactness of the fast path: any bytes that merging._known answers have the _metadata of
    the request the layout came from (so the message's own answer); random flips, inserts and
    cuts of a request's bytes."""
    rng = np.random.default_rng(3)
    for rid in ("7", ""):
        r = request(np.zeros((1, 16)), np.zeros((1, 16)), rid=rid)
        r.outputs.add(name="OUTPUT0")
        raw = r.SerializeToString()
        head, mid = merging._layout(raw)
        answer = merge_key(r, SHAPE)  # (the layout's answer: typed as the fast path keeps it)
        assert answer is not None
        layout = (head, mid, answer)
        meta = merging._metadata(raw)
        answered = 0
        for _ in range(3000):
            b = bytearray(raw)
            for _ in range(int(rng.integers(1, 3))):
                at = int(rng.integers(0, len(b)))
                kind = rng.integers(0, 3)
                if kind == 0:
                    b[at] = int(rng.integers(0, 256))
                elif kind == 1:
                    b.insert(at, int(rng.integers(0, 256)))
                else:
                    del b[at]
            if merging._known(bytes(b), layout) is not merging._UNKNOWN:
                answered += 1
                assert merging._metadata(bytes(b)) == meta
        assert answered  # (flips inside the id or the tensors' contents keep the layout)


def test_unusual_bytes_are_read_from_the_message_and_memory_stays_bounded() -> None:
    """Bytes not laid out as usual (a field number above 15, a truncated varint, trailing bytes)
    or metadata larger than _METADATA_MAX are not remembered; at most _KEYS_MAX answers are."""
    shape = ModelShape.of(CONFIG)
    r = request(np.zeros((1, 16)), np.zeros((1, 16)))
    raw = r.SerializeToString()
    want = merge_key(r, SHAPE)
    assert merging._metadata(raw) is not None
    for odd in (raw + b"\x82\x01\x00", raw + b"\x0a", raw + b"\x0a\x05ab", raw[:-3], b"\x08\x01" + raw):
        assert merging._metadata(odd) is None
        assert merge_key(r, shape, odd) == want
    assert not shape.keys
    big = request(np.zeros((1, 16)), np.zeros((1, 16)))
    big.parameters["binary_data_output"].bool_param = True
    big.model_version = "9" * (merging._METADATA_MAX + 1)
    assert merging._metadata(big.SerializeToString()) is None
    assert merge_key(big, shape, big.SerializeToString()) == merge_key(big, SHAPE)
    assert not shape.keys
    for i in range(merging._KEYS_MAX + 10):
        r.model_version = str(i)
        assert merge_key(r, shape, r.SerializeToString())[0][1] == str(i)
        assert len(shape.keys) <= merging._KEYS_MAX


def test_a_one_input_model_merges_exactly_and_finds_wrong_members() -> None:
    """A model with one input (the mlp): merged by its own path, byte for byte what the general
    one builds; a member with the wrong byte size or a second raw entry is named."""
    config = text_format.Parse("""
    name: "mlp" max_batch_size: 64
    input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
    output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
    dynamic_batching { }
    """, mc.ModelConfig())
    shape = ModelShape.of(config)
    rng = np.random.default_rng(2)
    reqs, rows = [], [1, 3, 2]
    for n in rows:
        r = pb.ModelInferRequest(model_name="mlp")
        r.inputs.add(name="INPUT0", datatype="FP32", shape=[n, 4])
        r.outputs.add(name="OUTPUT0")
        r.raw_input_contents.append(rng.standard_normal((n, 4)).astype(np.float32).tobytes())
        reqs.append(r)
    merged = merge(reqs, rows, shape)
    assert merged.SerializeToString() == merge(reqs, rows).SerializeToString()
    assert merged.raw_input_contents[0] == b"".join(r.raw_input_contents[0] for r in reqs)
    assert list(merged.inputs[0].shape) == [6, 4]
    reqs[1].raw_input_contents[0] = reqs[1].raw_input_contents[0][:-4]
    reqs[2].raw_input_contents.append(b"\0" * 32)
    with pytest.raises(Unmergeable) as err:
        merge(reqs, rows, shape)
    assert err.value.members == [1, 2]


def test_http_rendering_parameters_do_not_stop_a_merge() -> None:
    """Every HTTP client asks for its outputs as binary or JSON (`binary_data`,
    `binary_data_output`): the gateway renders each answer from the client's own request, so
    they do not change what the service computes, and such requests merge with gRPC ones."""
    plain = request(np.zeros((1, 16)), np.zeros((1, 16)))
    http = request(np.zeros((1, 16)), np.zeros((1, 16)))
    http.parameters["binary_data_output"].bool_param = True
    for name, binary in (("OUTPUT1", True), ("OUTPUT0", False)):
        http.outputs.add(name=name).parameters["binary_data"].bool_param = binary
    named = request(np.zeros((1, 16)), np.zeros((1, 16)))
    named.outputs.add(name="OUTPUT0")
    named.outputs.add(name="OUTPUT1")
    assert merge_key(http, SHAPE) == merge_key(named, SHAPE) == ((
        "add_sub", "", (("INPUT0", (16,)), ("INPUT1", (16,))), ("OUTPUT0", "OUTPUT1")), 1)
    assert merge_key(plain, SHAPE)[0] != merge_key(named, SHAPE)[0]  # all outputs vs the named ones


def test_variable_dims_are_part_of_the_key() -> None:
    config = mc.ModelConfig()
    config.CopyFrom(CONFIG)
    config.input[0].dims[0] = -1
    config.input[1].dims[0] = -1
    shape = ModelShape.of(config)
    k16, k8 = merge_key(request(np.zeros((2, 16)), np.zeros((2, 16))), shape), \
        merge_key(request(np.zeros((1, 8)), np.zeros((1, 8))), shape)
    assert k16 == (("add_sub", "", (("INPUT0", (16,)), ("INPUT1", (16,))), ()), 2)
    assert k8 is not None and k8[0] != k16[0]
    assert merge_key(request(np.zeros((1, 8)), np.zeros((1, 16))), shape)[0] not in (k8[0], k16[0])


async def test_a_member_with_the_wrong_byte_size_travels_alone() -> None:
    """merge_key does not read the tensors' bytes; the merge does, and a member whose bytes do
    not match its shape is sent alone (its own error from the service), the rest merged."""
    sent: list[int] = []
    gate = asyncio.Event()
    c = Coalescer(upstream(counting_send(sent, gate)), 1)
    reqs = [request(np.full((1, 16), i), np.ones((1, 16)), f"r{i}") for i in range(5)]
    reqs[2].raw_input_contents[1] = b"\0" * 10

    async def one(r: pb.ModelInferRequest) -> pb.ModelInferResponse:
        key, rows = merge_key(r, SHAPE)  # the wrong size is not seen here
        return (await c.submit(key, r, None, rows, SHAPE, None)).message()

    tasks = [asyncio.ensure_future(one(r)) for r in reqs]
    for _ in range(100):
        if len(sent) == 3:
            break
        await asyncio.sleep(0)
    assert sorted(sent) == [1, 1, 3]  # r0 at once; then r2 alone and r1, r3, r4 merged
    gate.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[2], ValueError)  # the stand-in service's error for r2's bytes, r2's alone
    for i in (0, 1, 3, 4):
        np.testing.assert_array_equal(np.frombuffer(results[i].raw_output_contents[0], np.float32),
                                      np.full(16, i + 1.0))


def test_merge_checks_byte_sizes_and_input_counts() -> None:
    reqs = [request(np.zeros((1, 16)), np.zeros((1, 16))) for _ in range(4)]
    reqs[1].raw_input_contents[0] = b"\0" * 60
    del reqs[3].raw_input_contents[1]
    with pytest.raises(Unmergeable) as err:
        merge(reqs, [1, 1, 1, 1], SHAPE)
    assert err.value.members == [1, 3]
    assert merge([reqs[0], reqs[2]], [1, 1], SHAPE).inputs[0].shape == [2, 16]


def test_batch_over_max_and_unbatchable_models() -> None:
    assert merge_key(request(np.zeros((9, 16)), np.zeros((9, 16))), SHAPE) is None
    nobatch = mc.ModelConfig()
    nobatch.CopyFrom(CONFIG)
    nobatch.max_batch_size = 0
    assert ModelShape.of(nobatch) is None
    strings = mc.ModelConfig()
    strings.CopyFrom(CONFIG)
    strings.input[0].data_type = mc.TYPE_STRING
    assert ModelShape.of(strings) is None


def upstream(send):
    """A stand-in for upstream.Upstream: one healthy replica; ``send`` the test's own."""
    return SimpleNamespace(send=send, start=lambda request, body, timeout: None,  # (the flush cannot write at once)
                           replicas=[SimpleNamespace(healthy=True)])


async def submit(c: Coalescer, r: pb.ModelInferRequest) -> pb.ModelInferResponse:
    key, rows = merge_key(r, SHAPE)
    return (await c.submit(key, r, None, rows, SHAPE, None)).message()


def counting_send(sent: list[int], gate: asyncio.Event, waited: list[int | None] | None = None):
    async def send(req: pb.ModelInferRequest, raw: bytes | None, timeout: float | None) -> pb.ModelInferResponse:
        if raw is not None:  # forwarded as the client's bytes (plus appended parameters)
            req = pb.ModelInferRequest.FromString(raw)
        sent.append(req.parameters[hop.MERGED].int64_param if hop.MERGED in req.parameters else 1)
        if waited is not None:
            waited.append(req.parameters[hop.QUEUED].int64_param
                          if hop.QUEUED in req.parameters else None)
        await gate.wait()
        return fake_service(req)
    return send


async def test_requests_pending_in_one_pass_travel_as_one_and_nothing_waits() -> None:
    """The first request of an idle model goes at once; the others of the same event-loop pass are
    merged and sent at the end of it, while the first is still out: nothing waits for an answer
    (the service, not the gateway, decides what runs together)."""
    sent: list[int] = []
    waited: list[int | None] = []
    gate = asyncio.Event()
    c = Coalescer(upstream(counting_send(sent, gate, waited)), 1)
    reqs = [request(np.full((1, 16), i), np.ones((1, 16)), f"r{i}") for i in range(6)]
    tasks = [asyncio.ensure_future(submit(c, r)) for r in reqs]
    for _ in range(100):  # no clock involved: a few loop passes
        if len(sent) == 2:
            break
        await asyncio.sleep(0)
    assert sent == [1, 5]  # before any answer came back
    assert waited == [None, None]  # passing through in one loop pass is not queueing: no queued time
    gate.set()
    outs = await asyncio.gather(*tasks)
    for i, out in enumerate(outs):
        assert out.id == f"r{i}"
        np.testing.assert_array_equal(np.frombuffer(out.raw_output_contents[0], np.float32), np.full(16, i + 1.0))
    assert not c._groups  # an idle model leaves nothing behind


async def test_the_flush_writes_the_merge_in_its_own_loop_pass() -> None:
    """The requests of a pass leave at its end, written by the flush itself (Upstream.start), not
    by a task a loop pass later; a request that cannot be written at once (start: None) is sent
    by the task as before."""
    sent: list[int] = []
    written: list[int] = []
    gate = asyncio.Event()

    async def answer(req: pb.ModelInferRequest) -> pb.ModelInferResponse:
        await gate.wait()
        return fake_service(req)

    def start(req: pb.ModelInferRequest, body: bytes, timeout: float | None):
        req = pb.ModelInferRequest.FromString(body)
        if hop.MERGED not in req.parameters:
            return None  # a lone request: the task sends it
        written.append(req.parameters[hop.MERGED].int64_param)
        return answer(req)

    c = Coalescer(SimpleNamespace(send=counting_send(sent, gate), start=start,
                                  replicas=[SimpleNamespace(healthy=True)]), 2)
    reqs = [request(np.full((1, 16), i), np.ones((1, 16)), f"r{i}") for i in range(13)]
    tasks = [asyncio.ensure_future(submit(c, r)) for r in reqs]
    await asyncio.sleep(0)  # the requests' first steps: r0 goes at once, the others wait for the flush
    assert sent == [1] and written == []
    await asyncio.sleep(0)  # the flush ran before this step: the merges are written, nothing is answered
    assert written == [8, 4] and sent == [1]
    gate.set()
    outs = await asyncio.gather(*tasks)
    assert [o.id for o in outs] == [f"r{i}" for i in range(13)]
    np.testing.assert_array_equal(np.frombuffer(outs[12].raw_output_contents[1], np.float32), np.full(16, 11.0))


async def test_an_idle_model_sends_alone_and_is_busy_meanwhile() -> None:
    """``send_alone`` (the gateway's path for a model with nothing here, no merge check) marks the
    model busy while it is out, so requests arriving meanwhile take the merging path."""
    sent: list[int] = []
    gate = asyncio.Event()
    c = Coalescer(SimpleNamespace(send=lambda req, raw, timeout, affinity=None: counting_send(sent, gate)(
        req, raw, timeout), start=lambda request, body, timeout: None, replicas=[SimpleNamespace(healthy=True)]), 1)
    assert c.idle("add_sub")
    first = asyncio.ensure_future(c.send_alone(request(np.zeros((1, 16)), np.zeros((1, 16)), "a"), None, None))
    await asyncio.sleep(0)
    assert not c.idle("add_sub") and c.idle("other")
    reqs = [request(np.full((1, 16), i), np.ones((1, 16)), f"r{i}") for i in range(4)]
    tasks = [asyncio.ensure_future(submit(c, r)) for r in reqs]
    for _ in range(100):
        if len(sent) == 2:
            break
        await asyncio.sleep(0)
    await loop_passes()  # (nothing more leaves)
    # the model's first request is out (alone, in no group): the whole pass waits for the flush and
    # travels merged, one message (the group's first was sent alone too before: 1, 1, 3)
    assert sent == [1, 4]
    gate.set()
    assert [o.id for o in await asyncio.gather(first, *tasks)] == ["a", "r0", "r1", "r2", "r3"]
    assert c.idle("add_sub") and not c._groups


async def test_requests_wait_only_while_full_batches_are_in_flight() -> None:
    """With one full batch per replica allowed (``1``): a request of max_batch_size rows fills it, so
    the next ones wait in the gateway, and leave as one merged request when its rows come back,
    telling the service how long they already waited (its max_queue_delay counts from there)."""
    sent: list[int] = []
    waited: list[int | None] = []
    gate = asyncio.Event()
    c = Coalescer(upstream(counting_send(sent, gate, waited)), 1)
    full = request(np.zeros((8, 16)), np.zeros((8, 16)), "full")
    reqs = [request(np.full((1, 16), i), np.ones((1, 16)), f"r{i}") for i in range(3)]
    first = asyncio.ensure_future(submit(c, full))
    await asyncio.sleep(0)
    tasks = [asyncio.ensure_future(submit(c, r)) for r in reqs]
    await loop_passes()
    await asyncio.sleep(0.012)  # the three wait 10 ms at least, which the merge reports (the real clock:
    # compiled, the coalescer reads the time module it imported, not a stand-in put on the module)
    assert sent == [1]  # 8 rows in flight: the bound (1 batch of 8 rows x 1 instance x 1 replica)
    gate.set()
    outs = await asyncio.gather(first, *tasks)
    assert sent == [1, 3]
    assert waited[1] is not None and waited[1] >= 10_000
    assert [o.id for o in outs] == ["full", "r0", "r1", "r2"]


async def test_the_bound_counts_instances() -> None:
    """Two instances take two batches at once: two full requests go out before anything waits."""
    sent: list[int] = []
    gate = asyncio.Event()
    c = Coalescer(upstream(counting_send(sent, gate)), 1)
    reqs = [request(np.zeros((8, 16)), np.zeros((8, 16)), f"f{i}") for i in range(3)]
    key, rows = merge_key(reqs[0], SHAPE)
    tasks = [asyncio.ensure_future(c.submit(key, r, None, rows, SHAPE2, None)) for r in reqs]
    await loop_passes()
    assert sent == [1, 1]
    gate.set()
    await asyncio.gather(*tasks)
    assert sent == [1, 1, 1]


async def test_a_merge_stops_at_the_byte_limit() -> None:
    """A merged message must stay within the services' --max-request-bytes: the merge stops
    growing there (the rest go in the next one), even when max_batch_size would allow more."""
    sent: list[tuple[int, int]] = []
    gate = asyncio.Event()

    async def send(req: pb.ModelInferRequest, raw: bytes | None, timeout: float | None) -> pb.ModelInferResponse:
        sent.append((req.parameters[hop.MERGED].int64_param if hop.MERGED in req.parameters else 1,
                     req.ByteSize()))
        await gate.wait()
        return fake_service(req)

    reqs = [request(np.full((1, 16), i), np.ones((1, 16)), f"r{i}") for i in range(6)]
    per_request = reqs[0].ByteSize() + 4096  # a member's message + what the merge assumes it adds
    limit = 2 * per_request + 100
    c = Coalescer(upstream(send), 1, max_bytes=limit)
    tasks = [asyncio.ensure_future(submit(c, r)) for r in reqs]
    for _ in range(1000):  # until all six are out (no clock involved)
        if len(sent) == 4:
            break
        await asyncio.sleep(0)
    gate.set()
    outs = await asyncio.gather(*tasks)
    assert [n for n, _ in sent] == [1, 2, 2, 1]  # without the limit: [1, 5]
    assert all(size <= limit for _, size in sent)
    assert [o.id for o in outs] == [f"r{i}" for i in range(6)]


async def test_a_failing_merged_send_fails_only_its_members() -> None:
    calls = 0

    async def send(req: pb.ModelInferRequest, raw: bytes | None, timeout: float | None) -> pb.ModelInferResponse:
        nonlocal calls
        calls += 1
        await loop_passes()  # in flight while the others queue up and merge
        if hop.MERGED in req.parameters:
            raise RuntimeError("backend failed")
        return fake_service(req)

    c = Coalescer(upstream(send), 1)
    reqs = [request(np.zeros((1, 16)), np.zeros((1, 16)), f"r{i}") for i in range(3)]
    results = await asyncio.gather(*(c.submit(merge_key(r, SHAPE)[0], r, None, 1, SHAPE, None) for r in reqs),
                                   return_exceptions=True)
    assert not isinstance(results[0], Exception)
    assert all(isinstance(r, RuntimeError) for r in results[1:])
    # the coalescer keeps serving afterwards
    assert (await c.submit(merge_key(reqs[0], SHAPE)[0], reqs[0], None, 1, SHAPE, None)).message().id == "r0"


@pytest.mark.parametrize("extra", [
    'priority_levels: 2 default_priority_level: 1',
    'default_queue_policy { max_queue_size: 4 }',
    'default_queue_policy { default_timeout_microseconds: 1000 }',
    'priority_queue_policy { key: 1 value { max_queue_size: 1 } }',
])
def test_models_with_queue_policies_are_never_coalesced(extra: str) -> None:
    config = mc.ModelConfig()
    config.CopyFrom(CONFIG)
    text_format.Parse(extra, config.dynamic_batching)
    assert ModelShape.of(config) is None


def test_models_without_dynamic_batching_are_never_coalesced() -> None:
    config = mc.ModelConfig()
    config.CopyFrom(CONFIG)
    config.ClearField("dynamic_batching")
    assert ModelShape.of(config) is None


def test_python_models_are_never_coalesced() -> None:
    """A python model's execute() gets one InferenceRequest per client request, each with its own
    parameters (Triton's contract): the gateway must not merge them into one."""
    config = mc.ModelConfig()
    config.CopyFrom(CONFIG)
    config.backend = "python"
    assert SHAPE is not None and ModelShape.of(config) is None


async def test_requests_merge_only_with_deadlines_each_can_keep() -> None:
    """No deadline never rides with a deadline; deadlines merge only when close (DEADLINE_SPREAD_NS),
    and a merged request carries what is left of its earliest member's."""
    sent: list[tuple[int, float | None]] = []
    gate = asyncio.Event()

    async def send(req: pb.ModelInferRequest, raw: bytes | None, timeout: float | None) -> pb.ModelInferResponse:
        req = pb.ModelInferRequest.FromString(raw) if raw is not None else req
        sent.append((req.parameters[hop.MERGED].int64_param if hop.MERGED in req.parameters else 1,
                     timeout))
        await gate.wait()
        return fake_service(req)

    c = Coalescer(upstream(send), 1)
    timeouts = [None, None, 5.0, 5.0, None, 5.0 + 10 * coalesce.DEADLINE_SPREAD_NS / 1e9, None]
    reqs = [request(np.full((1, 16), i), np.ones((1, 16)), f"r{i}") for i in range(len(timeouts))]

    async def one(r: pb.ModelInferRequest, timeout: float | None) -> pb.ModelInferResponse:
        key, rows = merge_key(r, SHAPE)
        return (await c.submit(key, r, None, rows, SHAPE, timeout)).message()

    tasks = [asyncio.ensure_future(one(r, t)) for r, t in zip(reqs, timeouts, strict=True)]
    for _ in range(100):
        if len(sent) == 5:
            break
        await asyncio.sleep(0)
    # r0 alone at once; then, in order: [r1] (the next has a deadline), [r2 r3], [r4], [r5] (too far), [r6]
    assert [m for m, _ in sent] == [1, 1, 2, 1, 1, 1], sent
    assert [t is None for _, t in sent] == [True, True, False, True, False, True]
    assert 4.9 < sent[2][1] <= 5.0  # type: ignore[operator]
    gate.set()
    outs = await asyncio.gather(*tasks)
    assert [o.id for o in outs] == [r.id for r in reqs]


async def test_a_merge_that_misses_one_member_s_deadline_fails_no_other_member(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The merged request times out at its earliest member's deadline: that member fails with
    DEADLINE_EXCEEDED; the others, whose deadlines have not passed, are sent again alone and
    answered. (The spread is widened so that the loose deadlines merge with the tight one.)"""
    monkeypatch.setattr(coalesce, "DEADLINE_SPREAD_NS", 10 * 10**9)
    calls: list[int] = []
    release = asyncio.Event()

    async def send(req: pb.ModelInferRequest, raw: bytes | None, timeout: float | None) -> pb.ModelInferResponse:
        req = pb.ModelInferRequest.FromString(raw) if raw is not None else req
        members = req.parameters[hop.MERGED].int64_param if hop.MERGED in req.parameters else 1
        calls.append(members)
        if members > 1:  # the merge: held past its deadline, as a slow service would
            await work_for_async(timeout or 0)  # a service slower than the deadline
            raise InferError(Code.DEADLINE_EXCEEDED, "deadline exceeded waiting for service x")
        if len(calls) == 1:
            await release.wait()  # the first request keeps the model busy: the next ones merge
        return fake_service(req)

    c = Coalescer(upstream(send), 1)
    reqs = [request(np.full((1, 16), i), np.ones((1, 16)), f"r{i}") for i in range(4)]

    async def one(r: pb.ModelInferRequest, timeout: float | None) -> pb.ModelInferResponse:
        key, rows = merge_key(r, SHAPE)
        return (await c.submit(key, r, None, rows, SHAPE, timeout)).message()

    first = asyncio.ensure_future(one(reqs[0], None))
    await asyncio.sleep(0)
    tight = asyncio.ensure_future(one(reqs[1], 0.01))
    loose = [asyncio.ensure_future(one(r, 5.0)) for r in reqs[2:]]  # within the spread: merged with it
    results = await asyncio.gather(tight, *loose, return_exceptions=True)
    release.set()
    await first
    assert isinstance(results[0], InferError) and results[0].code is Code.DEADLINE_EXCEEDED
    assert [o.id for o in results[1:]] == ["r2", "r3"]  # type: ignore[union-attr]
    assert calls[:2] == [1, 3] and sorted(calls[2:]) == [1, 1] and c.deadline_resends == 2


def _laid_out(reqs: list[pb.ModelInferRequest], shape: ModelShape) -> list[bytes]:
    """The requests' bytes, the first one's layout remembered by merge_key (as a busy model's)."""
    raws = [r.SerializeToString() for r in reqs]
    for r, raw in zip(reqs, raws, strict=True):
        assert merge_key(r, shape, raw) is not None
    return raws


@pytest.mark.parametrize("ids", [False, True])
def test_a_merge_from_the_members_bytes_is_the_merge_byte_for_byte(ids: bool) -> None:
    """merging.merge_laid_out (the coalescer's merge of members with the remembered layout):
    the merged request without contents plus the contents' fields it returns are exactly
    merge's message serialized, for members with or without ids (of different lengths),
    several rows, requested outputs, and the one-input model's path. (A member's rows are in
    its metadata: a member with other rows than the layout's has another layout.)"""
    rng = np.random.default_rng(7)
    rows = [2, 2, 2, 2]
    reqs = [request(rng.standard_normal((n, 16)), rng.standard_normal((n, 16)), f"id-{'x' * (i * 9)}" if ids else "")
            for i, n in enumerate(rows)]
    for r in reqs:
        r.outputs.add(name="OUTPUT1")
    shape = ModelShape.of(CONFIG)
    raws = _laid_out(reqs, shape)
    laid = merging.merge_laid_out(reqs, raws, rows, shape)
    assert laid is not None
    assert laid[0].SerializeToString() + laid[1] == merge(reqs, rows, shape).SerializeToString()
    assert not laid[0].raw_input_contents  # (the contents travel in laid[1] only)
    three = request(rng.standard_normal((3, 16)), rng.standard_normal((3, 16)), "id-" if ids else "")
    three.outputs.add(name="OUTPUT1")
    assert merging.merge_laid_out([*reqs, three], [*raws, three.SerializeToString()], [*rows, 3], shape) is None
    shape = ModelShape(64, {"INPUT0": ("FP32", (64,), 4)}, frozenset({"OUTPUT0"}))  # (the mlp's, 64 wide)
    one = []
    for n in rows:  # (2 KiB and more per member: contents' lengths of two-byte varints)
        r = pb.ModelInferRequest(model_name="mlp", id="q" if ids else "")
        r.inputs.add(name="INPUT0", datatype="FP32", shape=[n, 64])
        r.raw_input_contents.append(rng.standard_normal((n, 64)).astype(np.float32).tobytes())
        one.append(r)
    laid = merging.merge_laid_out(one, _laid_out(one, shape), rows, shape)
    assert laid is not None
    assert laid[0].SerializeToString() + laid[1] == merge(one, rows, shape).SerializeToString()


@pytest.mark.parametrize("ids", [False, True])
def test_the_id_fields_a_merge_cuts_from_the_bytes_split_as_the_messages_ids(ids: bool) -> None:
    """merging.merge_laid_out also gives each member's id field as cut from its bytes (nothing
    for an empty id, as protobuf writes none); split with those gives byte for byte what split
    reading each member's id from its message gives, and each member's answer carries its id."""
    rng = np.random.default_rng(11)
    rows = [2, 2, 2, 2]  # (a member's rows are in its layout)
    rid = (lambda i: f"id-{'x' * (i * 30)}") if ids else (lambda i: "")  # (up to a 93-byte id)
    reqs = [request(rng.standard_normal((n, 16)), rng.standard_normal((n, 16)), rid(i)) for i, n in enumerate(rows)]
    shape = ModelShape.of(CONFIG)
    raws = _laid_out(reqs, shape)
    laid = merging.merge_laid_out(reqs, raws, rows, shape)
    assert laid is not None
    assert laid[2] == [(b"\x1a" + bytes((len(r.id),)) + r.id.encode()) if r.id else b"" for r in reqs]
    merged = merge(reqs, rows, shape)
    answer = fake_service(merged)
    by_bytes = split(answer, reqs, rows, laid[2])
    assert by_bytes == split(answer, reqs, rows)
    assert [pb.ModelInferResponse.FromString(b).id for b in by_bytes] == [r.id for r in reqs]
    with pytest.raises(ValueError):
        split(answer, reqs, rows, laid[2][1:])


def test_a_merge_from_bytes_reads_the_messages_for_any_other_layout() -> None:
    """A member whose bytes are not laid out as the remembered layout (inputs in another order,
    another requested output, a field after the contents, no bytes at all): None, and the
    coalescer merges the messages (merge), which reorders and checks them."""
    rows = [1, 1]
    base = [request(np.zeros((1, 16)), np.ones((1, 16)), "a"), request(np.ones((1, 16)), np.zeros((1, 16)), "b")]
    shape = ModelShape.of(CONFIG)
    raws = _laid_out(base, shape)
    assert merging.merge_laid_out(base, raws, rows, shape) is not None
    swapped = request(np.ones((1, 16)), np.zeros((1, 16)), "b", order=("INPUT1", "INPUT0"))
    assert merging.merge_laid_out([base[0], swapped], [raws[0], swapped.SerializeToString()], rows, shape) is None
    named = request(np.ones((1, 16)), np.zeros((1, 16)), "b")
    named.outputs.add(name="OUTPUT0")
    assert merging.merge_laid_out([base[0], named], [raws[0], named.SerializeToString()], rows, shape) is None
    after = raws[1] + b"\x0a\x07add_sub"  # (a model name again, after the contents)
    assert merging.merge_laid_out(base, [raws[0], after], rows, shape) is None
    assert merging.merge_laid_out(base, [raws[0], None], rows, shape) is None
    assert merging.merge_laid_out(base, raws, rows, ModelShape.of(CONFIG)) is None  # (no layout yet)


def test_a_merge_from_bytes_keeps_what_its_layout_and_counts_fix() -> None:
    """merging.merge_laid_out keeps, by the remembered layout, the inputs' specs (once every member,
    the first too, had the layout) and the merged request's bytes by (members, rows): a later merge
    of other members with the same layout and counts is still merge's message byte for byte (its
    own ids and contents), other counts build their own, and a first member of another layout
    (None: merge reads the messages) leaves nothing kept that a later merge could take."""
    merging._LAID.clear()
    shape = ModelShape.of(CONFIG)
    assert shape is not None
    base = [request(np.zeros((1, 16)), np.ones((1, 16)), "a"), request(np.ones((1, 16)), np.zeros((1, 16)), "b")]
    raws = _laid_out(base, shape)
    swapped = request(np.ones((1, 16)), np.zeros((1, 16)), "b", order=("INPUT1", "INPUT0"))
    assert merging.merge_laid_out([swapped, base[0]], [swapped.SerializeToString(), raws[0]], [1, 1], shape) is None
    assert not merging._LAID
    rng = np.random.default_rng(5)
    for members, rid in ((2, "c"), (2, "dd"), (3, "e"), (2, "f")):
        reqs = [request(rng.standard_normal((1, 16)), rng.standard_normal((1, 16)), f"{rid}{i}")
                for i in range(members)]
        rows = [1] * members
        laid = merging.merge_laid_out(reqs, [r.SerializeToString() for r in reqs], rows, shape)
        assert laid is not None and laid[3] == laid[0].SerializeToString()
        assert laid[3] + laid[1] == merge(reqs, rows, shape).SerializeToString()
        assert laid[0].model_name == "add_sub" and hop.merged_count(laid[0]) == members
    (lay, _, by_counts), = merging._LAID.values()
    assert lay == shape.layout[0] and sorted(by_counts) == [(2, 2), (3, 3)]  # (by value: the compiled build boxes a new tuple)


def test_a_merge_from_bytes_names_the_members_with_wrong_contents() -> None:
    """As merge: a member whose contents are of the wrong byte size, too few or too many is
    named (Unmergeable), and travels alone; the layout check still holds for it."""
    rows = [1, 1, 1, 1, 1]
    reqs = [request(np.full((n, 16), i), np.ones((n, 16)), f"r{i}") for i, n in enumerate(rows)]
    shape = ModelShape.of(CONFIG)
    raws = _laid_out(reqs[:1], shape)
    reqs[1].raw_input_contents[1] = b"\0" * 10  # wrong size
    del reqs[2].raw_input_contents[1]  # too few
    reqs[3].raw_input_contents.append(b"\0" * 64)  # too many
    raws += [r.SerializeToString() for r in reqs[1:]]
    for raw in raws:
        assert merging._known(raw, shape.layout[0]) is not merging._UNKNOWN  # (merge_key's fast path took each)
    with pytest.raises(Unmergeable) as err:
        merging.merge_laid_out(reqs, raws, rows, shape)
    assert err.value.members == [1, 2, 3]
    with pytest.raises(Unmergeable) as err:
        merge(reqs, rows, shape)
    assert err.value.members == [1, 2, 3]
