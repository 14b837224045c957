"""Closed-loop and open-loop drivers and the per-request record.

Closed loop: `concurrency` workers, each sends its next request when the previous one answers.
Open loop: arrival times drawn in advance from a Poisson process at `rate`; every request's
latency is measured from its *scheduled* send time, so time a request waits because the client
or the server fell behind counts (no coordinated omission).
"""
from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import grpc.aio
import numpy as np

from load.inputs import ModelInfo, Payload, build_payloads, model_info
from load.rawhttp import HttpPool
from load.scenario import Scenario, Target
from load.transport import OK, GrpcSender, H2GrpcSender, HttpSender, RawHttpSender, StreamSender
from meshserve.server import h2


class Sender(Protocol):
    async def send(self, p: Payload) -> str: ...


@dataclass
class Record:
    """Columnar per-request results (lists: cheap appends on the hot path)."""

    sched: list[float] = field(default_factory=list)  # scheduled (open) / actual (closed) send, s from start
    latency: list[float] = field(default_factory=list)  # s, from `sched` to the answer
    lag: list[float] = field(default_factory=list)  # s, actual send - scheduled send (open loop)
    target: list[int] = field(default_factory=list)
    status: list[str] = field(default_factory=list)
    warm: list[bool] = field(default_factory=list)  # sent during warm-up: excluded from figures
    rows: list[int] = field(default_factory=list)

    def add(self, sched: float, latency: float, lag: float, target: int, status: str, warm: bool,
            rows: int) -> None:
        self.sched.append(sched)
        self.latency.append(latency)
        self.lag.append(lag)
        self.target.append(target)
        self.status.append(status)
        self.warm.append(warm)
        self.rows.append(rows)


@dataclass
class RunState:
    record: Record
    start: float = 0.0  # perf_counter at t=0
    warmup_end: float = 0.0  # s from start
    end: float = float("inf")  # s from start; sending stops
    budget: int | None = None  # measured requests still to send (request-count mode)
    inflight: int = 0
    done: bool = False


def _auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class HttpStatusError(RuntimeError):
    """A GET answered with a status other than 200."""

    def __init__(self, url: str, status: int, text: str):
        super().__init__(f"GET {url}: HTTP {status}: {text[:300]}")
        self.status = status


class ModelNotReady(RuntimeError):
    """A target's model still answered 503 at the end of the setup wait: the run stops."""


async def http_get_json(session: aiohttp.ClientSession, url: str, api_key: str | None = None) -> Any:
    async with session.get(url, headers=_auth(api_key)) as r:
        if r.status != 200:
            raise HttpStatusError(url, r.status, await r.text())
        return await r.json(content_type=None)


async def fetch_model_info(session: aiohttp.ClientSession, http: str, model: str, version: str = "",
                           api_key: str | None = None) -> ModelInfo:
    """Metadata + config (with the target's key: a gateway with tenants lets only them read a model)."""
    v = f"/versions/{version}" if version else ""
    md = await http_get_json(session, f"http://{http}/v2/models/{model}{v}", api_key)
    cfg = await http_get_json(session, f"http://{http}/v2/models/{model}{v}/config", api_key)
    return model_info(md, cfg)


async def fetch_model_info_when_ready(session: aiohttp.ClientSession, http: str, model: str, version: str,
                                      api_key: str | None, wait_s: float) -> ModelInfo:
    """fetch_model_info, read again while the server answers 503 (a gateway whose replicas are all
    ejected for a while, a model still loading) for up to ``wait_s`` seconds; still 503 then is an
    error that stops the run (ModelNotReady): requests built without the model's inputs would
    measure error answers, not the model."""
    until = time.monotonic() + wait_s
    while True:
        try:
            return await fetch_model_info(session, http, model, version, api_key)
        except HttpStatusError as exc:
            if exc.status != 503:
                raise
            if time.monotonic() >= until:
                raise ModelNotReady(f"model {model!r} not ready after {wait_s:g} s: {exc}") from None
        await asyncio.sleep(0.2)


async def fetch_stats(session: aiohttp.ClientSession, http: str, model: str,
                      api_key: str | None = None) -> dict[str, Any] | None:
    try:
        return await http_get_json(session, f"http://{http}/v2/models/{model}/stats", api_key)  # type: ignore[no-any-return]
    except Exception:  # a server without the statistics extension
        return None


def _uses_grpc(t: Target) -> bool:
    return t.protocol.startswith("grpc")


class Driver:
    """Builds payloads and senders for a scenario and runs it once."""

    def __init__(self, sc: Scenario, on_tick: Callable[[RunState, float], None] | None = None,
                 tick_s: float = 1.0):
        self.sc = sc
        self.on_tick = on_tick
        self.tick_s = tick_s
        self.payloads: list[list[Payload]] = []
        self.senders: list[Sender] = []
        self.infos: dict[str, ModelInfo] = {}
        self.stats_before: dict[str, Any] = {}
        self.stats_after: dict[str, Any] = {}
        self.read_keys: dict[str, str | None] = {}  # model -> the key its reads are made with
        self.cpu: dict[str, float] = {}
        self.wall_s = 0.0
        self.setup_errors: list[str] = []
        self.pool: HttpPool | None = None
        self.h2: h2.Channel | None = None

    async def _prepare(self, session: aiohttp.ClientSession, channel: grpc.aio.Channel | None) -> None:
        sc = self.sc
        for i, t in enumerate(sc.targets):
            key = f"{t.model}/{t.version}"
            key_ = sc.tenants[t.tenant].api_key if t.tenant else None
            self.read_keys.setdefault(t.model, key_)
            try:
                if key not in self.infos:
                    self.infos[key] = await fetch_model_info_when_ready(session, sc.http, t.model, t.version, key_,
                                                                        sc.timeout_s)
                info = self.infos[key]
                pl = build_payloads(t.model, t.version, info, t.batch, input_file=t.input_file, seed=sc.seed + i)
            except ModelNotReady:
                raise
            except Exception as exc:  # an unknown model is a target whose requests fail
                self.setup_errors.append(f"{t.label}: {exc}")
                info = ModelInfo(t.model, 0, [], [])
                pl = build_payloads(t.model, t.version, info, 1, variants=1)
            self.payloads.append(pl)
            if t.protocol.startswith("http") and sc.http_client == "raw":
                if self.pool is None:
                    host, _, port = sc.http.rpartition(":")
                    self.pool = HttpPool(host, int(port))
                self.senders.append(RawHttpSender(self.pool, sc.http, t, key_, sc.timeout_s))
            elif t.protocol.startswith("http"):
                self.senders.append(HttpSender(session, sc.http, t, key_, sc.timeout_s))
            elif t.protocol == "grpc" and sc.grpc_client == "h2":
                if self.h2 is None:
                    self.h2 = h2.Channel(sc.grpc)
                self.senders.append(H2GrpcSender(self.h2, t, key_, sc.timeout_s))
            elif t.protocol == "grpc":
                assert channel is not None
                self.senders.append(GrpcSender(channel, t, key_, sc.timeout_s))
            else:
                assert channel is not None
                self.senders.append(StreamSender(channel, t, key_, sc.timeout_s))

    def _close_transports(self) -> None:
        if self.pool is not None:
            self.pool.close()
        if self.h2 is not None:
            self.h2.close()

    async def run(self) -> RunState:
        sc = self.sc
        conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        channel = None
        if any(_uses_grpc(t) for t in sc.targets):
            channel = grpc.aio.insecure_channel(sc.grpc, options=[
                ("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)])
        async with aiohttp.ClientSession(connector=conn) as session:
            try:
                await self._prepare(session, channel)
            except ModelNotReady:
                self._close_transports()
                if channel is not None:
                    await channel.close()
                raise
            models = sorted({t.model for t in sc.targets})
            for m in models:
                snap = await fetch_stats(session, sc.http, m, self.read_keys.get(m))
                if snap is not None:
                    self.stats_before[m] = snap
            st = RunState(Record())
            st.warmup_end = sc.warmup_s
            if sc.requests is None:
                assert sc.duration_s is not None
                st.end = sc.warmup_s + sc.duration_s
            else:
                st.budget = sc.requests
            t0 = os.times()
            st.start = time.perf_counter()
            ticker = asyncio.create_task(self._tick(st)) if self.on_tick else None
            try:
                if sc.mode == "closed":
                    await self._closed(st)
                else:
                    await self._open(st)
            finally:
                st.done = True
                if ticker:
                    ticker.cancel()
            self.wall_s = time.perf_counter() - st.start
            t1 = os.times()
            self.cpu = {"user_s": t1.user - t0.user, "sys_s": t1.system - t0.system}
            for s in self.senders:
                if isinstance(s, StreamSender):
                    await s.close()
            self._close_transports()
            for m in models:
                if m in self.stats_before:
                    self.stats_after[m] = await fetch_stats(session, sc.http, m, self.read_keys.get(m))
        if channel is not None:
            await channel.close()
        if self.on_tick:
            self.on_tick(st, time.perf_counter() - st.start)
        return st

    async def _tick(self, st: RunState) -> None:
        assert self.on_tick is not None
        while True:
            await asyncio.sleep(self.tick_s)
            self.on_tick(st, time.perf_counter() - st.start)

    def _target_picker(self) -> Callable[[], int]:
        weights = [t.weight for t in self.sc.targets]
        if len(weights) == 1:
            return lambda: 0
        rng = random.Random(self.sc.seed)
        idx = list(range(len(weights)))
        return lambda: rng.choices(idx, weights)[0]

    def _claim(self, st: RunState, now: float) -> bool:
        """May another request be sent at `now` (s from start)? Counts the request budget."""
        if now >= st.end:
            return False
        if st.budget is not None and now >= st.warmup_end:
            if st.budget <= 0:
                return False
            st.budget -= 1
        return True

    async def _closed(self, st: RunState) -> None:
        pick = self._target_picker()
        rec, payloads, senders, clock, start = st.record, self.payloads, self.senders, time.perf_counter, st.start

        async def worker(w: int) -> None:
            n = w
            while True:
                t_send = clock() - start
                if not self._claim(st, t_send):
                    return
                i = pick()
                pl = payloads[i]
                p = pl[n % len(pl)]
                n += 1
                status = await senders[i].send(p)
                rec.add(t_send, clock() - start - t_send, 0.0, i, status, t_send < st.warmup_end, p.rows)

        await asyncio.gather(*(worker(w) for w in range(self.sc.concurrency)))

    def _arrivals(self, st: RunState, rng: np.random.Generator) -> Iterator[float]:
        """Poisson arrivals at `rate`. With a fixed window (warm-up, measurement) the process is drawn
        conditioned on its expected count: N = rate x window arrivals placed uniformly at random in the
        window (the inter-arrival gaps are still exponential-like), so the offered rate is exact and
        only the client or server falling behind makes the achieved rate differ."""
        rate = self.sc.rate
        assert rate is not None
        windows = [(0.0, st.warmup_end)]
        if self.sc.duration_s is not None:
            windows.append((st.warmup_end, st.warmup_end + self.sc.duration_s))
        else:
            assert self.sc.requests is not None
            windows.append((st.warmup_end, st.warmup_end + self.sc.requests / rate))
        for a, b in windows:
            n = int(round(rate * (b - a)))
            yield from np.sort(rng.uniform(a, b, n)).tolist()
        if self.sc.requests is not None:  # budget not used up (cannot happen unless rounding): keep going
            t = windows[-1][1]
            while True:
                t += float(rng.exponential(1.0 / rate))
                yield t

    async def _open(self, st: RunState) -> None:
        sc = self.sc
        assert sc.rate is not None
        pick = self._target_picker()
        rng = np.random.default_rng(sc.seed)
        rec, payloads, senders, clock, start = st.record, self.payloads, self.senders, time.perf_counter, st.start
        tasks: set[asyncio.Task[None]] = set()

        async def one(t_sched: float, i: int, p: Payload) -> None:
            t_send = clock() - start
            status = await senders[i].send(p)
            rec.add(t_sched, clock() - start - t_sched, t_send - t_sched, i, status, t_sched < st.warmup_end, p.rows)
            st.inflight -= 1

        n = 0
        for t_next in self._arrivals(st, rng):
            if not self._claim(st, t_next):
                break
            delay = t_next - (clock() - start)
            if delay > 0.0005:
                await asyncio.sleep(delay)
            elif n % 16 == 0:
                await asyncio.sleep(0)  # behind schedule: still let responses be read
            i = pick()
            pl = payloads[i]
            p = pl[n % len(pl)]
            n += 1
            if st.inflight >= sc.max_inflight:
                # the client cannot hold more outstanding requests: count it, do not hide it
                rec.add(t_next, 0.0, 0.0, i, "client max_inflight", t_next < st.warmup_end, p.rows)
                continue
            st.inflight += 1
            task = asyncio.create_task(one(t_next, i, p))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*list(tasks))


def is_ok(status: str) -> bool:
    return status == OK
