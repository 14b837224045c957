"""Triton's response cache, in the gateway (``--cache-config local,size=BYTES``).

A model whose config says ``response_cache { enable: true }`` answers a repeated request from
the gateway's memory: no hop, no service. The pieces:

- ``CacheConfig.parse``: Triton's ``--cache-config <cache>,<key>=<value>`` syntax (``local``
  with ``size`` in bytes; ``redis`` is refused at start: not built yet).
- ``request_key``: a 16-byte BLAKE2b digest of the resolved version and the request in a
  canonical form, deterministically serialized: no id, no version, every input as raw bytes
  (typed ``contents`` become the raw bytes they stand for, so a gRPC client's typed tensors and
  the same values as ``raw_input_contents`` or HTTP JSON share an entry), the requested outputs
  (names and parameters, but not ``binary_data``: the front door renders binary or JSON per
  request) and every request parameter but those that cannot change the answer
  (``_IGNORED_PARAMETERS``). None: never cached (shared memory, a typed tensor that does not
  convert: the service words the error).
- ``LocalCache``: LRU within the byte budget; an entry over ``ENTRY_SHARE`` of it is not kept;
  ``invalidate`` drops a model's entries and bumps its generation (an answer computed before
  is not stored after). With ``--workers N``: gateway/shared_cache.py's ``SharedCache``.
- ``CacheStage`` (in gateway/pipeline.py's chain, after ``Admit``, before ``ABRoutes``; and
  ``step`` for an ensemble's steps): which requests may be cached, single-flight per key
  (``flights``), the hit/miss counts and durations (statistics and ``nv_cache_*``).
- ``FrontDoor``: a repeat answered by the gRPC and HTTP front doors before the pipeline (the
  same rules: admission first with tenants, the served config, routes, counts), from an index
  the stage fills on a request's first hit.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from gateway.auth import CALLER
from gateway.quotas.memory import MemoryQuotaStore
from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol import datatypes, hop, wire
from meshserve.protocol.errors import Code, InferError
from meshserve.protocol.http_codec import _CONTENTS_FIELD, BINARY_DATA, BINARY_DATA_OUTPUT
from meshserve.server.core import InferResult, RequestContext
from meshserve.telemetry import metrics, tracing

if TYPE_CHECKING:
    from gateway.shared_cache import SharedCache

_request_log = logging.getLogger("meshserve.request")  # (meshserve/server/observe.py's: DEBUG logs every request)
ENTRY_SHARE = 8  # an answer larger than 1/ENTRY_SHARE of the cache's size is not cached
CONFIGS_KEPT = 1024  # configs whose "is it cached" answer is remembered (all dropped when full)
ENTRY_OVERHEAD = 128  # bytes counted per entry beyond its key and answer (the dict slot, the node)
# request parameters that cannot change the answer: how it is rendered or scheduled
_IGNORED_PARAMETERS = frozenset({BINARY_DATA_OUTPUT, "timeout", "priority",
                                 wire.EMPTY_FINAL_REQUEST_PARAMETER})
_SEQUENCE_PARAMETERS = frozenset({"sequence_id", "sequence_start", "sequence_end"})


def tenant_scope(tenant: str) -> bytes:
    """What a key of ``tenant``'s begins with, with tenants (``CacheStage.scoped``): one tenant's
    answers are never another's hit, so a tenant cannot learn from a hit's speed what another sent
    (docs/security.md, "Session 23: the response cache by tenant"). "" is the anonymous callers'."""
    return b"\x01" + tenant.encode() + b"\x00"


def _owner(key: bytes) -> bytes | None:
    """The scope of the tenant whose key this is (None: a gateway without tenants)."""
    if key[:1] != b"\x01":
        return None
    end = key.find(b"\x00", 1)
    return key[:end + 1] if end > 0 else None


def caller_scope() -> bytes:
    """``tenant_scope`` of the request being served (``gateway/auth.py:CALLER``, which ``Admit``
    sets before this stage runs)."""
    who = CALLER.get()
    return tenant_scope("" if who is None else who[0])
_SHM = wire.SHM_REGION
_clock = time.perf_counter_ns  # (Triton's lookup and insertion durations)
# CacheStage.named's facts: (served config, (model, version), the key's prefix, cached, counts row,
# the prefix again where a request may take the lead path as it comes (else None), the longest
# request bytes whose key is their material)
NamedFacts = tuple[mc.ModelConfig, tuple[str, str], bytes, bool, "list[int] | None", "bytes | None", int]
_HOP_HEADER = hop.HEADER  # (a call without it is no gateway's hop: hop.from_gateway without its call)

FAMILIES = {
    "cache_hits": metrics.Family("nv_cache_num_hits_per_model", "counter",
                                 "Number of cache hits per model"),
    "cache_misses": metrics.Family("nv_cache_num_misses_per_model", "counter",
                                   "Number of cache misses per model"),
    "cache_hit_duration": metrics.Family("nv_cache_hit_duration_per_model", "counter",
                                         "Total cache hit duration per model, in microseconds"),
    "cache_miss_duration": metrics.Family("nv_cache_miss_duration_per_model", "counter",
                                          "Total cache miss (lookup and insertion) duration per model, "
                                          "in microseconds"),
}


REDIS_SETTINGS = frozenset({"host", "port", "username", "password"})


@dataclass(frozen=True)
class CacheConfig:
    kind: str
    size: int = 0  # local: the byte budget
    settings: tuple[tuple[str, str], ...] = ()  # redis: host, port, username, password

    @classmethod
    def parse(cls, values: list[str]) -> CacheConfig | None:
        """Triton's ``--cache-config <cache>,<key>=<value>`` (repeatable, one cache); None: off."""
        if not values:
            return None
        kind = ""
        settings: dict[str, str] = {}
        for value in values:
            name, sep, setting = value.partition(",")
            key, eq, val = setting.partition("=")
            if not name or not sep or not key or not eq:
                raise ValueError(f"'{value}': expected <cache>,<key>=<value> (e.g. local,size=1048576)")
            if kind and name != kind:
                raise ValueError(f"one cache at a time: '{kind}' and '{name}' given")
            kind = name
            settings[key] = val
        if kind == "redis":
            unknown = sorted(set(settings) - REDIS_SETTINGS)
            if unknown:
                raise ValueError(f"redis cache: unknown setting '{unknown[0]}' (known: {', '.join(sorted(REDIS_SETTINGS))})")
            if not settings.get("port", "6379").isdigit():
                raise ValueError(f"redis cache: port must be a number, got '{settings['port']}'")
            return cls(kind, settings=tuple(sorted(settings.items())))
        if kind != "local":
            raise ValueError(f"unknown cache '{kind}': expected local or redis")
        unknown = sorted(set(settings) - {"size"})
        if unknown:
            raise ValueError(f"local cache: unknown setting '{unknown[0]}' (known: size)")
        size = settings.get("size", "")
        if not size.isdigit() or int(size) <= 0:
            raise ValueError(f"local cache: size must be a positive number of bytes, got '{size}'")
        return cls(kind, int(size))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """--cache-config: a flag of `meshserve gateway` and `meshserve up`."""
    ap.add_argument("--cache-config", action="append", default=[], metavar="CACHE,KEY=VALUE",
                    help="Triton's response cache, in the gateway: local,size=BYTES, or redis,host=H plus "
                         "redis,port=P (and redis,username= / redis,password=: shared by gateway replicas) "
                         "(repeatable, Triton's syntax); models whose config says response_cache { enable: true } "
                         f"answer repeated requests from it (an answer over 1/{ENTRY_SHARE} of the local size, "
                         "or over 4 MiB in Redis, is not kept). Default: off")


def _tensor_bytes(tensor: pb.ModelInferRequest.InferInputTensor) -> bytes | None:
    """A typed input's bytes as ``raw_input_contents`` would carry them (None: no conversion)."""
    field = _CONTENTS_FIELD.get(tensor.datatype)
    if field is None:
        return None
    values = getattr(tensor.contents, field)
    if len(values) != datatypes.element_count(tensor.shape):
        return None
    if tensor.datatype == "BYTES":
        return datatypes.serialize_bytes(values)
    try:
        return np.array(values, dtype=datatypes.numpy_dtype(tensor.datatype)).tobytes()
    except (OverflowError, ValueError, TypeError):
        return None


_TENSOR_SKIP = (BINARY_DATA, "binary_data_size")
# bytes whose presence in a serialized request sends it to the canonical copy: a parameter that
# is not part of the key, or shared memory (never cached); data that merely contains them only
# costs that request the slower path
_NOT_CANONICAL = (BINARY_DATA.encode(), _SHM.encode())


EXACT_KEY_MAX = 4096  # LocalCache: a key material up to this many bytes is the key itself (no hash)


def material_key(material: bytes, exact: bool) -> bytes:
    """The key of ``version + b"\\0" + <the request's canonical serialization>``: with ``exact``
    (this process's ``LocalCache``) and up to ``EXACT_KEY_MAX`` bytes, the material itself (a
    dict hashes it; equal keys are equal requests, byte for byte, and a hash costs ~6,000
    instructions for a call of hashlib); else its 16-byte BLAKE2b digest (the workers' store
    and Redis hold 16-byte keys). A material is longer than 16 bytes (a version, a separator
    and a model name field at least), so the two kinds never meet."""
    if exact and 16 < len(material) <= EXACT_KEY_MAX:
        return material
    return hashlib.blake2b(material, digest_size=16).digest()


def request_key(request: pb.ModelInferRequest, version: str, exact: bool = False) -> bytes | None:
    """The cache key of a request, or None where it is never cached (module docstring).

    The key hashes the version and the request's deterministic serialization without its id and
    version, when the request is already in the canonical form: every input as raw bytes, no
    ``binary_data`` / ``binary_data_size`` / shared-memory parameter, no top-level parameter
    that cannot change the answer (a gRPC client's usual request: one C serialization and one
    hash, where reading the fields one by one costs a protobuf attribute read each). Any other
    request is first copied into that form (``_canonical``): typed contents become the raw bytes
    they stand for, those parameters go, so the same request in any form has one key."""
    params = request.parameters
    raws = request.raw_input_contents
    canonical = bool(raws) and not (params and not _IGNORED_PARAMETERS.isdisjoint(params))
    body = b""
    if canonical:
        rid, version_asked = request.id, request.model_version
        if rid:
            request.id = ""
        if version_asked:
            request.model_version = ""
        try:
            body = request.SerializeToString(deterministic=True)
        finally:
            if rid:
                request.id = rid
            if version_asked:
                request.model_version = version_asked
        canonical = _NOT_CANONICAL[0] not in body and _NOT_CANONICAL[1] not in body
    if not canonical:
        copy = _canonical(request)
        if copy is None:
            return None
        body = copy.SerializeToString(deterministic=True)
    return material_key(version.encode() + b"\x00" + body, exact)


def _canonical(request: pb.ModelInferRequest) -> pb.ModelInferRequest | None:
    """The request in the key's canonical form (``request_key``), or None: never cached."""
    copy = pb.ModelInferRequest()
    copy.CopyFrom(request)
    copy.ClearField("id")
    copy.ClearField("model_version")
    raws = copy.raw_input_contents
    typed = not raws
    if not typed and len(raws) != len(copy.inputs):
        return None  # the service words the mistake
    for tensor in copy.inputs:
        params = tensor.parameters
        if _SHM in params:
            return None
        for key in _TENSOR_SKIP:
            if key in params:
                del params[key]
        if typed or tensor.HasField("contents"):
            data = _tensor_bytes(tensor) if typed else None
            if data is None:
                return None  # no conversion, or raw and typed contents mixed: the service words it
            tensor.ClearField("contents")
            raws.append(data)
    for out in copy.outputs:
        params = out.parameters
        if _SHM in params:
            return None
        if BINARY_DATA in params:
            del params[BINARY_DATA]
    params = copy.parameters
    for key in _IGNORED_PARAMETERS:
        if key in params:
            del params[key]
    return copy


RAW_FORMS_KEPT = 1024  # raw_key's canonical metadata remembered (all dropped when full) ...
RAW_FORM_MAX = 4096  # ... each at most this long (a client's larger parameters or inputs: request_key)
_raw_forms: dict[bytes, bytes | None] = {}


def raw_key(raw: bytes, version: str, exact: bool = False) -> bytes | None:
    """``request_key`` of the request the front door parsed from ``raw`` (its wire bytes), without
    a protobuf serialization or field reads: the same key (one hash domain) where ``raw`` is a
    standard serialization, else another key for the same request (a miss, never a wrong hit).
    None: ask ``request_key`` (no raw inputs, fields out of field-number order, shared memory, a
    typed input; anything this scan does not read).

    The top-level fields are walked once (tag and length only): ``model_name`` (1) is hashed as
    sent; ``model_version`` (2) and ``id`` (3) are left out (the resolved version is hashed
    instead); the ``parameters``, ``inputs`` and ``outputs`` (4-6: small, and the same from one
    request of a client to the next) are turned into their canonical form once
    (``_canonical_metadata``) and remembered by their bytes; the ``raw_input_contents`` (7) are
    hashed as sent. What is hashed is a valid serialization of the request in canonical form
    (fields 1, 4-6 and 7 hold disjoint field numbers, so parsing the parts is parsing the
    whole), so two requests share a key only when they are the same request but for id,
    version asked and the parameters that cannot change the answer."""
    n = len(raw)
    i = prev = 0
    name_end = meta_start = meta_end = raws = -1
    for _ in wire.SCAN_STEPS:
        if i >= n:
            break
        tag = raw[i]
        field = tag >> 3
        if tag & 7 != 2 or field < prev or field > 7 or not field or i + 1 >= n:
            return None
        prev = field
        length, j = wire.varint_at(raw, i + 1, n)
        if length < 0 or (end := j + length) > n:
            return None
        if field == 7:
            if raws < 0:
                raws = i
        elif field == 1:
            name_end = end
        elif field >= 4:
            if meta_start < 0:
                meta_start = i
            meta_end = end
        i = end
    else:
        return None  # (more fields than SCAN_FIELDS_MAX: request_key reads the message)
    if raws < 0 or name_end < 0:
        return None
    meta = raw[meta_start:meta_end] if meta_start >= 0 else b""
    form = _raw_forms.get(meta, b"?")  # (b"?": unseen; no serialization of fields 4-6 is that byte)
    if form == b"?":
        if len(meta) > RAW_FORM_MAX:  # (kept, 1,024 of them could hold a GiB of one client's parameters)
            return None
        form = _canonical_metadata(meta)
        if len(_raw_forms) >= RAW_FORMS_KEPT:
            _raw_forms.clear()
        _raw_forms[meta] = form
    if form is None:
        return None
    return material_key(b"".join((version.encode(), b"\x00", raw[:name_end], form, raw[raws:])), exact)


def _canonical_metadata(meta: bytes) -> bytes | None:
    """The parameters, inputs and outputs of a request (their serialized fields) in the key's
    canonical form (``_canonical``), deterministically serialized; None: not a plain raw request
    (shared memory, a typed input, bytes that do not parse)."""
    try:
        partial = pb.ModelInferRequest.FromString(meta)
    except Exception:  # (the front door parsed the whole; a part that does not parse: ask request_key)
        return None
    if partial.model_name or partial.model_version or partial.id or partial.raw_input_contents:
        return None
    for tensor in partial.inputs:
        if tensor.HasField("contents"):
            return None
    partial.raw_input_contents.extend(b"" for _ in partial.inputs)  # (so _canonical takes them as raw)
    copy = _canonical(partial)
    if copy is None:
        return None
    del copy.raw_input_contents[:]
    return copy.SerializeToString(deterministic=True)


def _without_id(answer: bytes) -> bytes:
    """A serialized ModelInferResponse as the cache keeps it: without its id (cut at the wire
    level where protobuf's layout allows, meshserve/protocol/wire.py:without_response_id, else
    parsed and serialized again)."""
    cut = wire.without_response_id(answer)
    if cut is not None:
        return cut
    message = pb.ModelInferResponse.FromString(answer)
    message.ClearField("id")
    return message.SerializeToString()


class LocalCache:
    """LRU over serialized answers within ``size`` bytes (keys, answers and ``ENTRY_OVERHEAD``
    per entry); one process's. An entry is a tuple (model, answer: the serialized
    ModelInferResponse with its id cleared, the config it was computed under: another one, a
    reload, is a miss, its size): a tuple costs a tenth of an object's ``__init__`` per miss.

    With tenants (keys that begin with their tenant's ``tenant_scope``) a tenant holds at most its
    share of ``size`` (the tenants file's ``share``, from ``CALLER``): past it, its own oldest
    entries make room, not another tenant's (``owned``, ``owners``: its bytes and its keys in the
    order they were kept)."""

    def __init__(self, size: int):
        self.size = size
        self.max_entry = size // ENTRY_SHARE
        self.used = 0
        self.entries: OrderedDict[bytes, tuple[str, bytes, mc.ModelConfig, int]] = OrderedDict()
        self.generations: dict[str, int] = {}  # a model's, once invalidated (0 before)
        self.invalidations = 0  # every model's (a lead that saw none since it began stores without a look-up)
        self.evictions = 0
        self.scoped = False  # (gateway/core.py: with tenants, as CacheStage.scoped)
        self.owned: dict[bytes, int] = {}  # a tenant's bytes (its scope: tenant_scope)
        self.owners: dict[bytes, dict[bytes, None]] = {}  # a tenant's keys, oldest kept first

    def get(self, key: bytes, config: mc.ModelConfig, model: str = "") -> bytes | None:
        entry = self.entries.get(key)
        if entry is None:
            return None
        if entry[2] is not config:
            self._drop(key)
            return None
        self.entries.move_to_end(key)
        return entry[1]

    def put(self, key: bytes, model: str, answer: bytes, config: mc.ModelConfig, generation: int) -> bool:
        """Keep an answer (False: too large, or the model was invalidated since it was asked)."""
        size = len(key) + len(answer) + ENTRY_OVERHEAD
        if size > self.max_entry or generation != self.generations.get(model, 0):
            return False
        entries = self.entries
        if key in entries:
            self._drop(key)
        owner = _owner(key) if self.scoped else None
        if owner is not None:  # (a tenant's: its own oldest make room past its share)
            who = CALLER.get()
            cap = int(self.size * (who[1] if who is not None else 1.0))
            if size > cap:
                return False
            keys = self.owners.setdefault(owner, {})
            while self.owned.get(owner, 0) + size > cap and keys:
                self._drop(next(iter(keys)))
                self.evictions += 1
        if self.used + size > self.size:
            while self.used + size > self.size and entries:
                self._drop(next(iter(entries)))
                self.evictions += 1
        entries[key] = (model, answer, config, size)
        self.used += size
        if owner is not None:
            self.owned[owner] = self.owned.get(owner, 0) + size
            self.owners.setdefault(owner, {})[key] = None
        return True

    def _drop(self, key: bytes) -> None:
        size = self.entries.pop(key)[3]
        self.used -= size
        owner = _owner(key) if self.scoped else None
        if owner is not None:
            left = self.owned[owner] - size
            keys = self.owners[owner]
            del keys[key]
            if keys:
                self.owned[owner] = left
            else:  # (a tenant with nothing kept holds no row)
                del self.owned[owner], self.owners[owner]

    def generation(self, model: str) -> int:
        """The model's generation (``put`` keeps an answer only if it has not changed since)."""
        return self.generations.get(model, 0)

    def invalidate(self, model: str) -> None:
        """Drop a model's entries; answers computed before now are not stored after. (A scan of
        every entry: a load or unload is rare, where a per-model key set cost every miss its
        upkeep.)"""
        self.generations[model] = self.generations.get(model, 0) + 1
        self.invalidations += 1
        for key in [key for key, entry in self.entries.items() if entry[0] == model]:
            self._drop(key)


class CacheCounts:
    """Per (model, version): hits, misses, and their durations in ns (Triton's statistics and
    ``nv_cache_*``). Counted in ``rows`` (a list of four ints per pair: hits, misses, hit ns,
    miss ns; ``row`` hands one to a caller that counts often, as the front door does: an
    increment of a list item costs a tenth of a ``Counter``'s); the ``Counter``s hold what is
    added from elsewhere (``SharedCounts.totals``: every worker's). Reads sum both."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], list[int]] = {}
        self.hits: Counter[tuple[str, str]] = Counter()
        self.misses: Counter[tuple[str, str]] = Counter()
        self.hit_ns: Counter[tuple[str, str]] = Counter()
        self.miss_ns: Counter[tuple[str, str]] = Counter()

    def row(self, model: tuple[str, str]) -> list[int]:
        row = self.rows.get(model)
        if row is None:
            row = self.rows[model] = [0, 0, 0, 0]
        return row

    def hit(self, model: tuple[str, str], ns: int) -> None:
        row = self.rows.get(model) or self.row(model)
        row[0] += 1
        row[2] += ns

    def miss(self, model: tuple[str, str], ns: int) -> None:
        row = self.rows.get(model) or self.row(model)
        row[1] += 1
        row[3] += ns

    def table(self) -> dict[tuple[str, str], tuple[int, int, int, int]]:
        """(hits, misses, hit ns, miss ns) per pair: the rows and the Counters, summed."""
        out: dict[tuple[str, str], tuple[int, int, int, int]] = {}
        for key in set(self.rows) | set(self.hits) | set(self.misses):
            row = self.rows.get(key, (0, 0, 0, 0))
            out[key] = (row[0] + self.hits[key], row[1] + self.misses[key], row[2] + self.hit_ns[key],
                        row[3] + self.miss_ns[key])
        return out

    def samples(self) -> list[metrics.Sample]:
        out: list[metrics.Sample] = []
        for key, (hits, misses, hit_ns, miss_ns) in sorted(self.table().items()):
            labels = {"model": key[0], "version": key[1]}
            out.append(("cache_hits", labels, hits))
            out.append(("cache_misses", labels, misses))
            out.append(("cache_hit_duration", labels, hit_ns // 1000))
            out.append(("cache_miss_duration", labels, miss_ns // 1000))
        return out

    def add_to(self, stats: pb.ModelStatistics) -> None:
        """Add the gateway's hits and misses of this model version to merged service statistics
        (as Triton counts them: a hit is also a successful request and its inference)."""
        hits, misses, hit_ns, miss_ns = self.table().get((stats.name, stats.version), (0, 0, 0, 0))
        s = stats.inference_stats
        if hits:
            s.cache_hit.count += hits
            s.cache_hit.ns += hit_ns
            s.success.count += hits
            s.success.ns += hit_ns
            stats.inference_count += hits
        if misses:
            s.cache_miss.count += misses
            s.cache_miss.ns += miss_ns


REDIS_ENTRY_MAX = 4 << 20  # an answer over 4 MiB is not kept in Redis
REDIS_TIMEOUT_S = 0.25  # a Redis call slower than this is a miss
REDIS_BACKOFF_S = 1.0  # after a Redis error, lookups are misses (and nothing is stored) this long
REDIS_PREFIX = "meshserve:cache:"


class RedisCache:
    """Answers in Redis, shared by every gateway (and worker) that names the same server.

    An entry is ``REDIS_PREFIX{model}:<digest hex>`` holding ``<generation>|<answer>``; the model's
    generation (``REDIS_PREFIX{model}:gen``) is bumped by a load or unload through any gateway
    and read with the entry in one MGET, so an answer of an older generation is a miss (it is
    overwritten by the next miss's answer). Redis's own memory bound is the operator's
    (``maxmemory`` with ``allkeys-lru``). A Redis error or timeout is a miss, never an error,
    and Redis is left alone for ``REDIS_BACKOFF_S`` after one."""

    def __init__(self, settings: tuple[tuple[str, str], ...]):
        import redis.asyncio as aioredis  # only needed when this cache is configured
        from redis.exceptions import RedisError

        given = dict(settings)
        self._client: Any = aioredis.Redis(
            host=given.get("host", "localhost"), port=int(given.get("port", "6379")),
            username=given.get("username"), password=given.get("password"),
            socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S)
        self._errors: tuple[type[BaseException], ...] = (RedisError, OSError, TimeoutError)
        self._down_until = 0.0
        self.errors = 0

    @staticmethod
    def _keys(model: str, key: bytes) -> tuple[str, str]:
        tag = REDIS_PREFIX + "{" + model + "}:"  # one hash slot per model (Redis Cluster)
        return tag + "gen", tag + key.hex()

    def _failed(self) -> None:
        self.errors += 1
        self._down_until = time.monotonic() + REDIS_BACKOFF_S

    async def get(self, key: bytes, model: str) -> tuple[bytes | None, bytes | None]:
        """(the answer or None, the model's generation: None when Redis did not answer)."""
        if time.monotonic() < self._down_until:
            return None, None
        try:
            generation, value = await self._client.mget(self._keys(model, key))
        except self._errors:
            self._failed()
            return None, None
        generation = generation or b"0"
        if value is not None:
            stored, sep, answer = value.partition(b"|")
            if sep and stored == generation:
                return answer, generation
        return None, generation

    async def put(self, key: bytes, model: str, answer: bytes, generation: bytes) -> None:
        if len(answer) > REDIS_ENTRY_MAX or time.monotonic() < self._down_until:
            return
        try:
            await self._client.set(self._keys(model, key)[1], generation + b"|" + answer)
        except self._errors:
            self._failed()

    async def invalidate(self, model: str) -> None:
        try:
            await self._client.incr(self._keys(model, b"")[0])
        except self._errors:
            self._failed()

    async def close(self) -> None:
        await self._client.aclose()


class CacheStage:
    """The pipeline stage (gateway/pipeline.py:assemble puts it after ``Admit``). A request is
    looked up when its model's config enables the response cache, the model is neither
    decoupled nor a sequence model (nor a sequence request), the name is not an A/B route (routes
    are never cached: the arm is chosen after this stage) and nothing names shared memory.
    Concurrent identical misses run the model once: the first is the leader, the others wait on
    its answer (within their own deadlines); when the leader fails, nothing is kept and each
    waiter tries again (one of them leads), so a leader's own deadline or cancellation never
    becomes another client's error."""

    next: Any  # pipeline.Stage

    def __init__(self, cache: LocalCache | SharedCache | RedisCache,
                 config_for: Callable[[str, str], mc.ModelConfig | None],
                 versions: Callable[[str], str | None], is_route: Callable[[str], bool] | None,
                 counts: CacheCounts | None = None):
        """``cache``: this process's (LocalCache), the workers' (gateway/shared_cache.py) or
        Redis; ``is_route``: whether a name is an A/B route (None: the gateway has no routes);
        ``counts``: where hits and misses are counted (the workers' shared rows)."""
        self.local = None if isinstance(cache, RedisCache) else cache
        self.shared = cache if isinstance(cache, RedisCache) else None
        self.counts = counts if counts is not None else CacheCounts()
        self._config_for = config_for
        self._versions = versions  # the version a request without one is routed to
        self._is_route = is_route
        self.flights: dict[bytes, asyncio.Future[bytes | None] | None] = {}  # None: a lead nobody waits on yet
        self._configs: dict[int, tuple[mc.ModelConfig, bool]] = {}  # _enabled
        self._exact = isinstance(cache, LocalCache)  # keys may be their material (material_key)
        # this process's LocalCache: a miss reads its entries and generations without a call
        self._entries = cache.entries if isinstance(cache, LocalCache) else None
        self._generations = cache.generations if isinstance(cache, LocalCache) else None
        # the front doors' hits (``FrontDoor``): this process's LocalCache only
        self.front: FrontDoor | None = None
        # ``named``'s facts per model name (version asked: (name, version)): the config they were
        # worked out under, (model, resolved version), the key's prefix, whether it is cached, the
        # counts row (this process's CacheCounts only: None otherwise)
        self._named: dict[str | tuple[str, str], NamedFacts] = {}
        self._rows = type(self.counts) is CacheCounts
        # the pipeline's Forward when it is this stage's next (gateway/pipeline.py:assemble): a
        # miss hands it the name and version read already (no upb reads there)
        self.forward: Any = None
        # with tenants (gateway/core.py sets it): every key begins with its caller's tenant
        # (caller_scope), the front door's index keys too
        self.scoped = False

    def _cacheable(self, request: pb.ModelInferRequest, sequence: str | None
                   ) -> tuple[mc.ModelConfig, tuple[str, str], bool] | None:
        """(the config, (model, version), whether the request asks no version and has no
        parameters) of a request that is looked up, else None."""
        if sequence is not None:
            return None
        name = request.model_name
        asked = request.model_version
        version = asked or self._versions(name)  # (then the config by its version: one lookup)
        if version is None:
            return None
        config = self._config_for(name, version)
        if config is None:
            return None
        known = self._configs.get(id(config))  # (_enabled's remembered answer, without its call)
        if not (known[1] if known is not None and known[0] is config else self._enabled(config)):
            return None
        params = request.parameters
        if params and not _SEQUENCE_PARAMETERS.isdisjoint(params):
            return None
        if self._is_route is not None and self._is_route(name):
            return None
        return config, (name, version), not asked and not params

    def _scoped(self, key: bytes) -> bytes:
        """``key`` as the caller's tenant's (``scoped``): its scope first, for this process's
        LocalCache (which reads a tenant's share from it); a 16-byte digest of both for the
        workers' store and Redis, which hold 16-byte keys (a longer one would be cut there)."""
        scoped = caller_scope() + key
        return scoped if self._exact else hashlib.blake2b(scoped, digest_size=16).digest()

    def _enabled(self, config: mc.ModelConfig) -> bool:
        """Whether a config's requests are looked up, worked out once per config (held by its id
        while it is the served one; a protobuf field read costs more than the dict lookup)."""
        known = self._configs.get(id(config))
        if known is None or known[0] is not config:
            if len(self._configs) >= CONFIGS_KEPT:
                self._configs.clear()
            enabled = config.response_cache.enable and not config.model_transaction_policy.decoupled \
                and not config.HasField("sequence_batching")
            known = self._configs[id(config)] = (config, enabled)
        return known[1]

    def infer(self, request: pb.ModelInferRequest, ctx: RequestContext, sequence: str | None) -> Any:
        front = self.front
        key = None
        if front is not None and front.missed is request:  # the HTTP front door's look-up, just made
            found, key = front.missed_found, front.missed_key
            front.missed = None
        else:
            found = self._cacheable(request, sequence)
        if found is None:
            return self.next.infer(request, ctx, sequence)
        config, model, plain = found
        raw = ctx.raw  # the bytes the request was parsed from (None: changed since, or never had them)
        if key is None and raw is not None and not (hop.trusted and hop.from_gateway(ctx.headers)):
            # (ctx.raw is None for a request naming shared memory: the front doors' shm.infer
            # clears it; a gateway's hop is believed to name none, and is keyed from its fields)
            if plain and ctx.protocol == "grpc" and not request.id:
                # a gRPC client's usual request: no id, version or parameter to leave out, so
                # the bytes it sent are the key's material (request_key's, where the client
                # serialized as protobuf does: any other serialization is another key, a miss)
                material = model[1].encode() + b"\x00" + raw
                key = material if self._exact and 16 < len(material) <= EXACT_KEY_MAX \
                    else material_key(material, self._exact)  # (material_key, inline)
            else:
                key = raw_key(raw, model[1], self._exact)
            if key is not None and self.scoped:
                key = self._scoped(key)
        if key is None:
            key = request_key(request, model[1], self._exact)
            if key is None:
                return self.next.infer(request, ctx, sequence)
            if self.scoped:
                key = self._scoped(key)
        return self._found(key, model, config, request, ctx, sequence, raw)

    def named(self, request: pb.ModelInferRequest, ctx: RequestContext, name: str, asked: str,
              outcomes: Any = None) -> Any:
        """``infer`` of a request without parameters (so no sequence) whose model name and version
        asked ``Names`` read already (gateway/pipeline.py:Outcomes): no upb read of them here,
        the facts of ``_cacheable`` remembered per (name, version asked) while the served config
        is the one they were worked out under (a reload, a version change: worked out again),
        and a miss of this process's ``LocalCache`` led by ``_lead`` (no lookup loop, the put
        and the counts inline). A request of another form (HTTP, bytes the front door missed,
        no bytes, a gateway's hop): ``infer``. With ``outcomes`` (gateway/pipeline.py:Outcomes,
        no A/B route behind) the returned coroutine counts the request's outcome under ``name``:
        ``_lead`` (through ``Forward.named``'s coroutine) and ``Forward.named`` their own, any other
        path through ``Outcomes.counting`` (no ``Outcomes`` coroutine on a miss's path).

        The usual request (no version asked, gRPC bytes, no hop marker, the field after the name
        neither a version nor an id: no id to leave out of the key) goes to ``_lead`` at once, its
        key the facts' prefix and its bytes (docs/perf/response-cache.md, section 12); every
        other one takes ``_slow``."""
        raw = ctx.raw
        if raw is not None and not asked and ctx.protocol == "grpc" and _HOP_HEADER not in ctx.headers:
            config = self._config_for(name, "")
            facts = self._named.get(name)
            # a miss's usual request: the served config the facts were worked out under, a model
            # this process's LocalCache keeps, and bytes with neither a version nor an id after the
            # name (the id is left out of the key: such a request takes the scan)
            if facts is not None and facts[0] is config and (prefix := facts[5]) is not None and not self.scoped \
                    and 16 < (n := len(raw)) <= facts[6] and (i := raw[1] + 2) < n and raw[i] > 0x1A:
                return self._lead(prefix + raw, facts, request, ctx, outcomes)
            return self._slow(request, ctx, name, asked, outcomes, config)
        return self._slow(request, ctx, name, asked, outcomes)

    def _slow(self, request: pb.ModelInferRequest, ctx: RequestContext, name: str, asked: str,
              outcomes: Any, config: Any = False) -> Any:
        """``named``'s every other request (``config``: the served config, when ``named`` looked it
        up already)."""
        raw = ctx.raw
        front = self.front
        if raw is None or ctx.protocol != "grpc" or (front is not None and front.missed is request) \
                or (hop.trusted and hop.from_gateway(ctx.headers)):
            return self._other(self.infer(request, ctx, None), name, ctx, outcomes)
        if config is False:
            config = self._config_for(name, asked)
        facts = self._named.get(name if not asked else (name, asked))
        if facts is None or facts[0] is not config:
            facts = self._learn(name, asked, config)
            if facts is None:
                return self._other(self.infer(request, ctx, None), name, ctx, outcomes)
        if not facts[3] or (self._is_route is not None and self._is_route(name)):
            forward = self.forward
            return self._other(self.next.infer(request, ctx, None), name, ctx, outcomes) if forward is None \
                else forward.named(request, ctx, None, name, asked, outcomes, config)
        config, model = facts[0], facts[1]
        rid = request.id
        if asked or rid:  # the version asked and the id are left out of the key: the scan's
            key = raw_key(raw, model[1], self._exact)
            if key is None and (key := request_key(request, model[1], self._exact)) is None:
                return self._other(self.next.infer(request, ctx, None), name, ctx, outcomes)
        else:  # (as infer's plain gRPC request)
            material = facts[2] + raw
            key = material if self._exact and 16 < len(material) <= EXACT_KEY_MAX \
                else material_key(material, self._exact)
        if self.scoped:
            key = self._scoped(key)
        if self._entries is None or facts[4] is None:
            return self._other(self._found(key, model, config, request, ctx, None, raw), name, ctx, outcomes)
        return self._lead(key, facts, request, ctx, outcomes, rid, asked)

    @staticmethod
    def _other(answer: Any, name: str, ctx: RequestContext, outcomes: Any) -> Any:
        """``answer`` counted by ``outcomes`` (None: by the caller)."""
        return answer if outcomes is None else outcomes.counting(answer, name, ctx.protocol)

    def _learn(self, name: str, asked: str, config: mc.ModelConfig | None) -> NamedFacts | None:
        """``named``'s facts of (name, version asked) under the served ``config`` (None: ask
        ``infer``, which works them out per request)."""
        if config is None:
            return None
        version = asked or self._versions(name)
        if version is None or self._config_for(name, version) is not config:
            return None
        if len(self._named) >= CONFIGS_KEPT:
            self._named.clear()
        model = (name, version)
        prefix = version.encode() + b"\x00"
        cached = self._enabled(config)
        row = self.counts.row(model) if self._rows else None
        # named's lead as the request comes: no version asked, no routes, this process's LocalCache
        lead = prefix if cached and not asked and self._is_route is None and self._entries is not None \
            and row is not None else None
        facts = (config, model, prefix, cached, row, lead, EXACT_KEY_MAX - len(prefix))
        self._named[name if not asked else (name, asked)] = facts
        return facts

    def _found(self, key: bytes, model: tuple[str, str], config: mc.ModelConfig, request: pb.ModelInferRequest,
               ctx: RequestContext, sequence: str | None, raw: bytes | None) -> Any:
        """``_cached`` for a request whose key is known: a gRPC request that hits here (an entry
        stored by an earlier miss, or by another form of the request) is indexed at the front
        door from now on. Only a repeat is indexed, so a request that never repeats costs the
        door nothing (what Triton counts is unchanged: this one is a hit already)."""
        front = self.front
        if front is not None and raw is not None and key in front.local.entries and ctx.protocol == "grpc" \
                and len(raw) <= FRONT_RAW_MAX and (keyed := front_key(raw)) is not None:
            fkey = caller_scope() + keyed[0] if self.scoped else keyed[0]
            return self._cached(key, model, config, request, ctx.time_remaining, None,
                                (fkey, keyed[1], request.model_version), ctx, sequence)
        return self._cached(key, model, config, request, ctx.time_remaining, None, None, ctx, sequence)

    async def _lead(self, key: bytes, facts: NamedFacts, request: pb.ModelInferRequest, ctx: RequestContext,
                    outcomes: Any = None, rid: str = "", asked: str = "") -> InferResult:
        """A request of ``named`` whose key is known (``facts``: its model's, a model this process's
        ``LocalCache`` keeps): looked up here, when the coroutine runs (a hit, or an identical
        request in flight: ``_found``'s path); a miss is led: the rest of the chain called at once
        (the coalescer sees the request in the same pass as without the cache), the answer kept as
        ``LocalCache.put`` keeps it, the miss counted in the model's row. The answer is kept
        without an id: the chain answers with the request's own (``rid``; Triton echoes it), so
        only a request with one has it cut out. With ``outcomes`` the request's outcome is counted
        there: by ``Forward.named``'s coroutine when ``Forward`` is the next stage (its config is
        cached, so never decoupled: ``Forward.named`` does not refuse it before its coroutine
        runs), else here."""
        started = _clock()
        entries = self._entries
        flights = self.flights
        if key in entries or key in flights:  # type: ignore[operator]  # (named: a LocalCache)
            return await self._other(self._found(key, facts[1], facts[0], request, ctx, None, ctx.raw),
                                     facts[1][0], ctx, outcomes)
        flights[key] = None
        name = facts[1][0]
        local: LocalCache = self.local  # type: ignore[assignment]  # (named: this process's LocalCache)
        invalidations = local.invalidations  # (a model's generation, for every model at once: one read)
        looked = _clock() - started
        answer = None
        inserted = 0
        try:
            forward = self.forward
            if forward is not None:
                result = await forward.named(request, ctx, None, name, asked, outcomes, facts[0])
            else:
                try:
                    result = await self.next.infer(request, ctx, None)
                except InferError as exc:
                    if outcomes is None:
                        raise
                    raise outcomes.failed(name, exc, ctx.protocol) from None
                if outcomes is not None:
                    outcomes.counts[(name, "OK")] += 1
            inserting = _clock()
            answer = result.serialized()
            if rid:
                answer = _without_id(answer)
            size = len(key) + len(answer) + ENTRY_OVERHEAD
            if invalidations != local.invalidations:
                answer = None  # a model was invalidated meanwhile (perhaps this one): not kept, the waiters ask again
            elif not self.scoped and local.used + size <= local.size and size <= local.max_entry \
                    and key not in entries:  # type: ignore[operator]
                entries[key] = (name, answer, facts[0], size)  # type: ignore[index]  # (LocalCache.put's usual case)
                local.used += size
            else:  # (evictions, an answer too large, a key stored meanwhile)
                local.put(key, name, answer, facts[0], local.generations.get(name, 0))
            inserted = _clock() - inserting
            return result
        finally:
            row: list[int] = facts[4]  # type: ignore[assignment]  # (named: this process's CacheCounts)
            row[1] += 1
            row[3] += looked + inserted
            flight = flights.pop(key)
            if flight is not None:
                flight.set_result(answer)

    async def step(self, request: pb.ModelInferRequest, timeout: float | None, affinity: str | None,
                   send: Callable[[pb.ModelInferRequest, float | None], Awaitable[pb.ModelInferResponse]]
                   ) -> pb.ModelInferResponse:
        """An ensemble step's call (gateway/ensemble/executor.py): answered from the cache when the
        step model's own config enables it (as Triton caches a composing model's answers), with
        the same rules, single-flight and counts as a client's request for that model; ``send``
        otherwise."""
        found = self._cacheable(request, affinity)
        key = None if found is None else request_key(request, found[1][1], self._exact)
        if found is None or key is None:
            return await send(request, timeout)
        if self.scoped:  # (the ensemble's caller: CALLER, copied into the step's task)
            key = self._scoped(key)
        deadline = None if timeout is None else time.monotonic() + timeout

        def remaining() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        async def run() -> InferResult:
            return InferResult(message=await send(request, remaining()))

        return (await self._cached(key, found[1], found[0], request, remaining, run)).message()

    def stream(self, request: pb.ModelInferRequest, ctx: RequestContext, sequence: str | None) -> Any:
        return self.next.stream(request, ctx, sequence)  # streamed (decoupled) answers: never cached

    async def invalidate(self, *models: str) -> None:
        """Drop these models' answers (a load or unload through the gateway)."""
        for model in models:
            if self.local is not None:
                self.local.invalidate(model)
            if self.shared is not None:
                await self.shared.invalidate(model)

    async def close(self) -> None:
        if self.shared is not None:
            await self.shared.close()

    async def _cached(self, key: bytes, model: tuple[str, str], config: mc.ModelConfig,
                      request: pb.ModelInferRequest, remaining: Callable[[], float | None],
                      run: Callable[[], Awaitable[InferResult]] | None,
                      front: tuple[bytes, bytes, str] | None = None, ctx: RequestContext | None = None,
                      sequence: str | None = None) -> InferResult:
        """A hit, a wait on the same miss's flight, or the lead of a miss (``run``: the model).
        One coroutine for all three: a miss's answer resumes through every frame above it.
        ``front``: (the front door's key, the id field it cut out, the version asked) of a gRPC
        request the front door missed that hits here: indexed there. ``run`` None: the rest of the
        chain (``self.next.infer(request, ctx, sequence)``: no closure per request)."""
        started = time.perf_counter_ns()
        local, shared = self.local, self.shared
        shared_generation: bytes | None = None  # the Redis generation looked up under (None: do not store)
        entries = self._entries
        while True:
            if entries is not None and key not in entries:
                answer = None  # (LocalCache.get's miss, without its call)
            elif local is not None:
                answer = local.get(key, config, model[0])
            elif shared is not None:
                answer, shared_generation = await shared.get(key, model[0])
            if answer is not None:
                if front is not None:
                    self._index(front, request, model, config, key)
                return self._hit(model, answer, request, started)
            flights = self.flights
            if key not in flights:
                break
            flight = flights[key]
            if flight is None:  # the first waiter makes the leader's future
                flight = flights[key] = asyncio.get_running_loop().create_future()
            try:
                answer = await asyncio.wait_for(asyncio.shield(flight), remaining())
            except TimeoutError:
                raise InferError(Code.DEADLINE_EXCEEDED,
                                 f"deadline exceeded waiting for model '{request.model_name}'") from None
            if answer is not None:
                return self._hit(model, answer, request, started)
            # the leader failed: nothing was kept; look again (one waiter leads the next try)
        # the lead: run the model; waiters for the same key share its answer (a future only
        # once one waits: most misses have no twin)
        self.flights[key] = None
        generations = self._generations
        if generations is not None:
            generation = generations.get(model[0], 0)  # (LocalCache.generation, inline)
        else:
            generation = local.generation(model[0]) if local is not None else 0
        looked = time.perf_counter_ns() - started
        answer = None
        inserted = 0
        try:
            result = await (self.next.infer(request, ctx, sequence) if run is None else run())
            inserting = time.perf_counter_ns()
            answer = _without_id(result.serialized()) if result.message().id else result.serialized()
            if local is not None:
                if not local.put(key, model[0], answer, config, generation) \
                        and generation != local.generation(model[0]):
                    answer = None  # reloaded meanwhile: the waiters ask the new model
            elif shared is not None and shared_generation is not None:
                await shared.put(key, model[0], answer, shared_generation)
            inserted = time.perf_counter_ns() - inserting
            return result
        finally:
            self.counts.miss(model, looked + inserted)
            flight = self.flights.pop(key)
            if flight is not None:
                flight.set_result(answer)

    def _index(self, front: tuple[bytes, bytes, str], request: pb.ModelInferRequest, model: tuple[str, str],
               config: mc.ModelConfig, key: bytes) -> None:
        """Index an entry under the front door's key: only where the id the front door cut out is
        the request's id (a serialization with its id elsewhere, or twice, is never answered there)."""
        door = self.front
        fkey, rid, asked = front
        if door is not None and rid[2:] == request.id.encode():
            door.index(fkey, (model[0], asked, config, key, self.counts.row(model), (model[0], "OK")))

    def _hit(self, model: tuple[str, str], answer: bytes, request: pb.ModelInferRequest, started: int
             ) -> InferResult:
        self.counts.hit(model, time.perf_counter_ns() - started)
        if tracing.enabled and (span := tracing.current_span()) is not None:
            now = time.time_ns()
            tracing.emit_span("gateway.cache", span, now, now, {"meshserve.cache_hit": True,
                                                                 "meshserve.model": model[0]})
        return InferResult(raw=wire.with_request_id(answer, request.id) if request.id else answer)


# FrontDoor.entries' values: (model, version asked, config, the cache's key, counts row, Outcomes key)
FrontEntry = tuple[str, str, mc.ModelConfig, bytes, list[int], tuple[str, str]]
FRONT_ID_MAX = 127  # the front door reads an id of one length byte (longer: the pipeline's path)
FRONT_RAW_MAX = EXACT_KEY_MAX + FRONT_ID_MAX + 2  # a larger request's key is never indexed: not looked up


def front_key(raw: bytes) -> tuple[bytes, bytes] | None:
    """(the front door's key of a serialized ModelInferRequest: its bytes without the id field,
    the id field cut out, b"" without one), or None: not the layout the door reads (the name, the
    version asked and the id each with a one-byte length, in field order)."""
    n = len(raw)
    if n < 3 or raw[0] != 0x0A or raw[1] > 0x7F:  # model_name = 1
        return None
    i = raw[1] + 2
    if i + 1 < n and raw[i] == 0x12:  # model_version = 2: stays in the key
        if raw[i + 1] > 0x7F:
            return None
        i += raw[i + 1] + 2
    if i + 1 < n and raw[i] == 0x1A:  # id = 3
        end = i + 2 + raw[i + 1]
        if raw[i + 1] > FRONT_ID_MAX or end > n:
            return None
        return raw[:i] + raw[end:], raw[i:end]
    return raw, b""


class FrontDoor:
    """A hit answered in the gRPC front door (``grpc``), before the pipeline's stages: a key
    computation, a dict lookup, the id spliced in, the bytes written.

    The key is the request's wire bytes without its id field (``ModelInferRequest.id`` = 3, after
    the model name and the version asked, where protobuf serializers put it). ``index`` maps it to
    the entry of ``LocalCache`` that the pipeline's stage found for the same request on its first
    hit there (``CacheStage._index``: only when the id cut out is the request's id; a miss is not
    indexed, so a request that never repeats costs the index nothing, and what Triton counts is
    unchanged): (model, version asked, the config the answer was computed under, the cache's key,
    the model's counts row, its ``Outcomes`` key). A hit needs the
    model's served config to be that config still (a reload, a version change: the pipeline's
    path), the name not to have become an A/B route, the entry still in the cache (LRU, byte
    budget and invalidation are the cache's), tracing off (a traced request takes the pipeline,
    which records the span) and the request log below DEBUG. The answer is the stored
    ``ModelInferResponse`` (its id cleared) with the request's id field appended (a singular
    field's last occurrence wins). It counts as the stage counts a hit (statistics, ``nv_cache_*``)
    and as ``Outcomes`` counts an answered request. With tenants the request is admitted first
    (``Admission.admit``: 403 for a model the tenant may not call, its quota and share) and
    released once answered, as ``Admit`` holds a request until its answer.

    The index holds front-door keys of at most ``EXACT_KEY_MAX`` bytes, in all at most
    ``1/ENTRY_SHARE`` of the cache's size (then it is emptied and refills from the pipeline's
    hits): memory beyond the cache's own budget, bounded."""

    def __init__(self, stage: CacheStage, local: LocalCache, request_counts: Counter[tuple[str, str]],
                 admission: Any = None):
        self.stage = stage
        self.local = local
        # front key -> (model, version asked, config, the cache's key, its counts row
        # (CacheCounts.row), its Outcomes key)
        self.entries: dict[bytes, FrontEntry] = {}
        self.bytes = 0
        self.max_bytes = local.size // ENTRY_SHARE
        self.request_counts = request_counts
        self.admission = admission  # gateway/auth.py:Admission, or None (no tenants)
        # every hit answered without waiting (no tenants, or the in-process quota store, whose
        # admission never waits): the gRPC door runs before the call's Task (the HTTP/2 server's
        # at_once hook, grpc_frontend.register), admission driven to its end at once (``_now``);
        # else (Redis quotas: a network round trip) a hit with tenants is an awaitable, in the Task
        self.at_once = admission is None or type(admission.store) is MemoryQuotaStore
        # called when the index gets its first entry (with tenants the gRPC front end installs its
        # at-once hook then: while the index is empty, a call pays no ServerCall for the door;
        # without, the hook is installed at once: grpc_frontend.register)
        self.on_first_entry: Callable[[], object] | None = None
        # the HTTP request ``http`` just missed, its key and ``_cacheable``'s answer: the stage
        # takes them over (by the request's identity, on the same pass of the loop) rather than
        # working them out again
        self.missed: pb.ModelInferRequest | None = None
        self.missed_key = b""
        self.missed_found: tuple[mc.ModelConfig, tuple[str, str], bool] | None = None

    def index(self, key: bytes, entry: FrontEntry) -> None:
        if len(key) > EXACT_KEY_MAX:
            return
        if not self.entries and self.on_first_entry is not None:
            self.on_first_entry()
        if key not in self.entries:
            self.bytes += len(key)
            if self.bytes > self.max_bytes:
                self.entries.clear()
                self.bytes = len(key)
        self.entries[key] = entry

    def grpc(self, raw: bytes, call: Any, context: Callable[[Any, bytes], RequestContext] | None = None
             ) -> bytes | Awaitable[bytes] | None:
        """The answer of a gRPC ModelInfer call from the cache (with tenants: admitted first, the
        admission's error raised; an awaitable of the answer unless ``at_once``), or None: the
        pipeline's path. ``context``: the front door's RequestContext of a call (read only with
        tenants, and then given). With ``at_once`` it runs before the call's Task is made: nothing
        here waits."""
        index = self.entries
        if not index or (n := len(raw)) > FRONT_RAW_MAX or tracing.enabled:
            return None  # (nothing repeated yet, or too large a request to be indexed: not even the scan)
        if n > 2 and raw[0] == 0x0A and raw[1] < 0x80 and (i := raw[1] + 2) < n and raw[i] > 0x1A:
            key, rid = raw, b""  # (front_key's usual case, inline: a name, then neither a version nor an id)
        else:
            keyed = front_key(raw)
            if keyed is None:
                return None
            key, rid = keyed
        if self.admission is not None:  # (with tenants the index is by tenant: CacheStage.scoped)
            assert context is not None  # (the gRPC front end gives it with tenants)
            ctx = context(call, raw)
            scope = self._scope(ctx)
            if scope is None:
                return None
            key = scope + key
        found = index.get(key)
        if found is None:
            return None  # (a miss: the pipeline's path)
        if not rid.isascii():  # (an id that is not UTF-8 is a malformed request: the parse's INVALID_ARGUMENT)
            try:
                rid[2:].decode()
            except UnicodeDecodeError:
                return None
        started = time.perf_counter_ns()
        name, asked, config, lkey, row, ok = found
        stage = self.stage
        is_route = stage._is_route
        if stage._config_for(name, asked) is not config or (is_route is not None and is_route(name)) \
                or _request_log.isEnabledFor(10):
            return None
        entries = self.local.entries
        entry = entries.get(lkey)
        if entry is None or entry[2] is not config:
            del self.entries[key]
            self.bytes -= len(key)
            return None
        answer = entry[1] + rid if rid else entry[1]
        if self.admission is not None:
            admitted = self._admitted(pb.ModelInferRequest.FromString(raw), ctx, row, ok, answer, lkey, started)
            return _now(admitted) if self.at_once else admitted
        entries.move_to_end(lkey)
        self.request_counts[ok] += 1
        row[0] += 1
        row[2] += time.perf_counter_ns() - started
        return answer

    def http(self, request: pb.ModelInferRequest, ctx: RequestContext) -> bytes | Awaitable[bytes] | None:
        """The serialized answer of an HTTP infer request from the cache (with tenants: an
        awaitable of it), or None: the pipeline's path. The key is the stage's (``raw_key`` of
        the bytes the codec made, else ``request_key``), so HTTP binary, HTTP JSON and gRPC share
        entries; the front door renders the answer per the request's outputs and binary/JSON
        choice."""
        if tracing.enabled:
            return None
        started = time.perf_counter_ns()
        stage = self.stage
        found = stage._cacheable(request, None)  # (a sequence request: never, by its parameters)
        if found is None or _request_log.isEnabledFor(10):
            return None
        config, model, _ = found
        raw = ctx.raw
        key = raw_key(raw, model[1], True) if raw is not None else None
        if key is None and (key := request_key(request, model[1], True)) is None:
            return None
        if self.admission is not None:  # (with tenants the keys are by tenant: CacheStage.scoped)
            scope = self._scope(ctx)
            if scope is None:
                return None
            key = scope + key
        entry = self.local.entries.get(key)
        if entry is None or entry[2] is not config:
            self.missed, self.missed_key, self.missed_found = request, key, found
            return None
        answer = wire.with_request_id(entry[1], request.id) if request.id else entry[1]
        row = stage.counts.row(model)
        if self.admission is not None:
            admitted = self._admitted(request, ctx, row, (model[0], "OK"), answer, key, started)
            return _now(admitted) if self.at_once else admitted
        self.local.entries.move_to_end(key)
        self.request_counts[(model[0], "OK")] += 1
        row[0] += 1
        row[2] += time.perf_counter_ns() - started
        return answer

    def _scope(self, ctx: RequestContext) -> bytes | None:
        """``tenant_scope`` of the tenant the request's headers name (None: they name none: the
        pipeline's path refuses it, in its words)."""
        try:
            tenant = self.admission.directory.get().authenticate(ctx.headers)
        except InferError:
            return None
        return tenant_scope("" if tenant is None else tenant.name)

    async def _admitted(self, request: pb.ModelInferRequest, ctx: RequestContext, row: list[int],
                        ok: tuple[str, str], answer: bytes, lkey: bytes, started: int) -> bytes:
        """A hit of a gateway with tenants: admitted as ``Admit`` admits (403, 429 before any
        answer), released at once (a hit holds nothing while it is written). With ``at_once``
        it never waits: ``_now`` runs it to its end."""
        admission = self.admission
        try:
            admitted = await admission.admit(request, ctx)
        except InferError as exc:
            self.request_counts[(ok[0], exc.code.value)] += 1
            raise
        try:
            if lkey in self.local.entries:
                self.local.entries.move_to_end(lkey)
            self.request_counts[ok] += 1
            row[0] += 1
            row[2] += time.perf_counter_ns() - started
            return answer
        finally:
            await admission.release(admitted)


def _now(coroutine: Coroutine[Any, Any, bytes]) -> bytes:
    """The result of a coroutine that finishes without waiting (``FrontDoor._admitted`` on the
    in-process quota store), run to its end here; one that would wait is closed (its cleanup runs:
    the admission gives its share back) and is an error, never left half run."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coroutine.close()
    raise RuntimeError("the front door's admission waited: not a synchronous quota store")
