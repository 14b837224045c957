"""Load generator acceptance tests: short runs (seconds) against real meshserve processes."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from load.cli import run_scenario, summary_text
from load.report import write_report
from load.scenario import Scenario, Target, load_scenario
from tests.conftest import Stack, service_and_gateway, start
from tests.support.waiting import eventually_async


def _scenario(stack: Stack, via: str = "gateway", **kw: object) -> Scenario:
    proc = stack.gateway if via == "gateway" else stack.service
    return Scenario.model_validate({"http": proc.http, "grpc": proc.grpc, "warmup_s": 0.2, **kw})


@pytest.mark.parametrize("protocol", ["http-binary", "http-json", "grpc", "grpc-aio", "grpc-stream"])
async def test_counts_match_server_statistics(stack: Stack, protocol: str) -> None:
    client = {"grpc_client": "aio"} if protocol == "grpc-aio" else {}  # grpc.aio instead of our h2 client
    sc = _scenario(stack, concurrency=4, duration_s=None, requests=300, **client,
                   targets=[{"model": "add_sub", "protocol": protocol.removesuffix("-aio")}])
    res = await run_scenario(sc)
    assert res["failed"] == 0, res["errors"]
    assert res["sent"] == 300 and res["succeeded"] == 300
    # the statistics extension counts every row the server ran, warm-up included
    assert res["server_stats"]["add_sub"]["inference_count"] == res["all_requests"]["succeeded_rows"]
    assert res["all_requests"]["succeeded_rows"] >= 300
    assert res["latency_ms"]["p50"] > 0
    assert res["client_cpu"]["cores"] is not None


async def test_batch_rows_counted(stack: Stack) -> None:
    sc = _scenario(stack, via="service", concurrency=2, duration_s=None, requests=50, warmup_s=0,
                   targets=[{"model": "add_sub", "protocol": "grpc", "batch": 4}])
    res = await run_scenario(sc)
    assert res["succeeded"] == 50
    assert res["server_stats"]["add_sub"]["inference_count"] == 200 == res["all_requests"]["succeeded_rows"]


@pytest.mark.serial  # a latency/rate bound: run alone (scripts/test.sh)
async def test_open_loop_rate_within_5_percent(stack: Stack) -> None:
    sc = _scenario(stack, mode="open", rate=200, duration_s=5, warmup_s=0.5,
                   targets=[{"model": "add_sub", "protocol": "grpc"}])
    res = await run_scenario(sc)
    assert res["failed"] == 0, res["errors"]
    assert abs(res["open_loop"]["achieved_rate"] - 200) / 200 < 0.05, res["open_loop"]
    assert abs(res["goodput_rps"] - 200) / 200 < 0.05
    assert res["server_stats"]["add_sub"]["inference_count"] == res["all_requests"]["succeeded_rows"]
    # latency is measured from the scheduled send time: never below the send lag
    assert res["latency_ms"]["p99"] >= res["open_loop"]["send_lag_ms"]["p50"]


async def test_errors_counted_by_status(stack: Stack, tmp_path: Path) -> None:
    sc = _scenario(stack, concurrency=4, duration_s=None, requests=400, targets=[
        {"model": "add_sub", "protocol": "http-binary", "weight": 2},
        {"model": "no_such_model", "protocol": "http-json"},
        {"model": "no_such_model", "protocol": "grpc"},
        {"model": "add_sub", "protocol": "grpc", "batch": 9},  # max_batch_size is 8
        {"model": "add_sub", "protocol": "http-binary", "batch": 9},
    ])
    res = await run_scenario(sc)
    per = res["per_target"]
    assert per["no_such_model:http-json"]["errors"] == {"http 404": per["no_such_model:http-json"]["sent"]}
    assert per["no_such_model:grpc"]["errors"] == {"grpc NOT_FOUND": per["no_such_model:grpc"]["sent"]}
    assert per["add_sub:grpc:b9"]["errors"] == {"grpc INVALID_ARGUMENT": per["add_sub:grpc:b9"]["sent"]}
    assert per["add_sub:http-binary:b9"]["errors"] == {"http 400": per["add_sub:http-binary:b9"]["sent"]}
    assert per["add_sub:http-binary"]["errors"] == {} and per["add_sub:http-binary"]["succeeded"] > 0
    assert res["failed"] == sum(res["errors"].values()) == res["sent"] - res["succeeded"]
    assert res["succeeded"] > 0 and len(res["setup_errors"]) == 2
    assert "error http 404" in summary_text(res)
    report = write_report([res], tmp_path / "rep")
    assert "http 404" in report.read_text()


def test_scenario_validation(tmp_path: Path) -> None:
    bad = tmp_path / "s.yaml"
    bad.write_text("targets:\n  - {model: m, tenant: ghost}\n")
    with pytest.raises(ValueError, match="tenant 'ghost' is not defined"):
        load_scenario(bad)
    bad.write_text("mode: open\ntargets:\n  - {model: m}\n")
    with pytest.raises(ValueError, match="needs `rate`"):
        load_scenario(bad)
    bad.write_text("targets:\n  - {model: m, protocol: carrier-pigeon}\n")
    with pytest.raises(ValueError):
        load_scenario(bad)
    for f in sorted((Path(__file__).resolve().parents[2] / "load" / "scenarios").glob("*.yaml")):
        load_scenario(f)  # the shipped scenarios stay valid


async def fake_v2_server(infer: Any, not_ready: int = 0) -> tuple[web.AppRunner, int]:
    """A v2 HTTP server for model "m" (one FP32 input, no batching) on a free port; ``infer``
    answers its inference requests; its first ``not_ready`` metadata/config reads are 503, as a
    gateway's while its only replica is ejected. (runner, port): clean the runner up."""
    reads = [0]

    async def meta(request: web.Request) -> web.Response:
        reads[0] += 1
        if reads[0] <= not_ready:
            return web.json_response({"error": "model 'm': no healthy replica"}, status=503)
        if request.path.endswith("/config"):
            return web.json_response({"max_batch_size": 0})
        return web.json_response({"name": "m", "inputs": [{"name": "X", "datatype": "FP32", "shape": [2]}],
                                  "outputs": [{"name": "Y"}]})

    app = web.Application()
    app.router.add_get("/v2/models/m", meta)
    app.router.add_get("/v2/models/m/config", meta)
    app.router.add_post("/v2/models/m/infer", infer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


async def test_tenant_api_key_sent_as_bearer() -> None:
    seen: list[str] = []

    async def infer(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization", ""))
        await request.read()
        return web.json_response({})

    runner, port = await fake_v2_server(infer)
    try:
        sc = Scenario(http=f"127.0.0.1:{port}", warmup_s=0, duration_s=None, requests=10,
                      tenants={"alice": {"api_key": "k-alice"}},  # type: ignore[dict-item]
                      targets=[Target(model="m", tenant="alice", protocol="http-json")])
        res = await run_scenario(sc)
    finally:
        await runner.cleanup()
    assert res["succeeded"] == 10
    assert set(seen) == {"Bearer k-alice"}


async def test_model_not_ready_at_setup_waits_instead_of_sending_empty_requests() -> None:
    """A gateway whose only replica is ejected (a slow health probe) answers the setup reads with
    503 for a while. The load generator waits for the model: before, it built input-less requests
    for the whole run, which the service answered "expected 2 inputs but got 0 inputs" once the
    replica came back (a callgrind run of the gateway: 416 UNAVAILABLE, then 1584 INVALID_ARGUMENT)."""
    bodies: list[Any] = []

    async def infer(request: web.Request) -> web.Response:
        bodies.append(json.loads(await request.read()))
        return web.json_response({"outputs": []})

    runner, port = await fake_v2_server(infer, not_ready=5)
    try:
        sc = Scenario(http=f"127.0.0.1:{port}", warmup_s=0, duration_s=None, requests=10, timeout_s=20,
                      targets=[Target(model="m", protocol="http-json")])
        res = await run_scenario(sc)
    finally:
        await runner.cleanup()
    assert res["setup_errors"] == [] and res["succeeded"] == 10
    assert len(bodies) == 10 and all([i["name"] for i in b["inputs"]] == ["X"] for b in bodies), bodies[:2]


async def test_run_started_while_the_only_replica_is_ejected(model_repo: Path) -> None:
    """Real processes: the service stops answering (SIGSTOP) until the gateway ejects it, a run
    starts while the gateway answers 503 "no healthy replica", the service resumes a second later.
    Every request of the run carries the model's inputs and succeeds: before, the run sent
    input-less requests, UNAVAILABLE while ejected, then INVALID_ARGUMENT "expected 2 inputs but
    got 0 inputs" from the service once the replica was back."""
    with service_and_gateway("onnx", ["--repository", str(model_repo), "--model-control-mode", "explicit",
                                      "--load-model", "*"], ["--discovery-interval", "0.5"]) as (svc, gw):
        os.kill(svc.proc.pid, signal.SIGSTOP)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as session:
                async def ejected() -> bool:
                    try:
                        async with session.get(f"http://{gw.http}/v2/models/add_sub/config") as r:
                            return r.status == 503
                    except (aiohttp.ClientError, TimeoutError):
                        return False  # (the gateway still waits on the stopped service)

                await eventually_async(ejected, timeout=60, what="the gateway ejects the stopped replica")
            asyncio.get_running_loop().call_later(1.0, os.kill, svc.proc.pid, signal.SIGCONT)
            sc = Scenario(http=gw.http, grpc=gw.grpc, warmup_s=0, duration_s=None, requests=200, concurrency=4,
                          timeout_s=60, targets=[Target(model="add_sub", protocol="grpc")])
            res = await run_scenario(sc)
        finally:
            os.kill(svc.proc.pid, signal.SIGCONT)
    assert res["setup_errors"] == [], res["setup_errors"]
    assert res["errors"] == {} and res["succeeded"] == res["sent"] == 200, res["errors"]


async def test_model_never_ready_aborts_the_run() -> None:
    """Still 503 after the setup wait: the run stops with the reason, sending nothing."""
    sent: list[int] = []

    async def infer(request: web.Request) -> web.Response:
        sent.append(1)
        return web.json_response({"outputs": []})

    runner, port = await fake_v2_server(infer, not_ready=1 << 30)
    try:
        sc = Scenario(http=f"127.0.0.1:{port}", warmup_s=0, duration_s=None, requests=10, timeout_s=1,
                      targets=[Target(model="m", protocol="http-json")])
        with pytest.raises(RuntimeError, match="not ready.*HTTP 503"):
            await run_scenario(sc)
    finally:
        await runner.cleanup()
    assert sent == []


def test_tune_produces_snippet(model_repo: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from load.bench.procs import explicit_control_args
    from load.tune import cmd

    svc = start(["service", "onnx", "--repository", str(model_repo), "--grpc-port", "0", "--http-port", "0",
                 *explicit_control_args()])
    try:
        out = tmp_path / "tune.json"
        cmd(argparse.Namespace(model="small_mlp", p99_ms=50.0, url=svc.http, grpc=None, protocol="http-binary",
                               delays="0,1000", concurrency="1,4", step_s=0.6, warmup_s=0.1, input_file=None,
                               json=str(out)))
    finally:
        svc.stop()
    text = capsys.readouterr().out
    assert "dynamic_batching {" in text and "max_queue_delay_microseconds:" in text
    doc = json.loads(out.read_text())
    assert len(doc["cells"]) == 4 and doc["fit"] is not None
    assert doc["recommendation"]["met_target"]
    rec = doc["recommendation"]
    if rec["best_cell"]["concurrency"] == 1:
        assert rec["preferred_batch_size"] is None and rec["max_queue_delay_microseconds"] == 0
    else:
        assert 1 <= rec["preferred_batch_size"] <= 32


def test_cli_entry_points(stack: Stack, tmp_path: Path) -> None:
    import subprocess
    import sys

    out = tmp_path / "r.json"
    cp = subprocess.run([sys.executable, "-m", "meshserve", "load", "--http", stack.gateway.http, "-m", "add_sub",
                         "-n", "50", "--warmup", "0", "-c", "2", "--json", str(out), "--quiet"],
                        capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0, cp.stderr
    assert "sent 50, ok 50" in cp.stdout
    assert json.loads(out.read_text())["succeeded"] == 50


def test_progress_plain_lines(capsys: pytest.CaptureFixture[str]) -> None:
    from load.progress import Progress
    from load.runner import Record, RunState

    st = RunState(Record(), warmup_end=0.0)
    p = Progress(10)
    st.record.add(0.1, 0.002, 0.0, 0, "ok", False, 1)
    st.record.add(0.2, 0.003, 0.0, 0, "http 500", False, 1)
    p(st, 1.0)
    err = capsys.readouterr().err
    assert "rate=" in err and "errors=1" in err


def test_tune_fit_and_recommendation() -> None:
    from load.tune import Cell, fit_linear, recommend, snippet

    # compute ms = 0.1·batch + 0.5, with counts (count, total ns)
    samples = {b: (10, int(10 * (0.1 * b + 0.5) * 1e6)) for b in (1, 2, 4, 8)}
    fit = fit_linear(samples)
    assert fit is not None and abs(fit[0] - 0.1) < 1e-6 and abs(fit[1] - 0.5) < 1e-6
    cells = [Cell(0, 8, 900.0, 2.0, 9.0, 0, 3.0), Cell(1000, 8, 1200.0, 3.0, 9.5, 0, 6.0),
             Cell(4000, 32, 2000.0, 20.0, 40.0, 0, 20.0)]
    rec = recommend(cells, fit, p99_ms=10.0, max_batch=64)
    assert rec["max_queue_delay_microseconds"] == 1000  # best goodput under the target
    assert rec["preferred_batch_size"] == 8  # 0.1·45+0.5 = 5 ms fits half the target, capped at c=8
    assert "preferred_batch_size: [ 8 ]" in snippet(rec)
    assert not recommend(cells, fit, p99_ms=1.0, max_batch=64)["met_target"]


async def test_raw_http_parser_content_length_chunked_and_split_reads() -> None:
    import asyncio as aio

    from load.rawhttp import _Conn

    loop = aio.get_running_loop()
    c = _Conn()
    c.waiter = loop.create_future()
    c.data_received(b"HTTP/1.1 404 Not Found\r\nContent-Length: 5\r\n\r\nab")
    assert not c.waiter.done()
    c.data_received(b"cdeHTTP/1.1 200 OK\r\n")
    assert c.waiter.result() == 404 and bytes(c.buf) == b"HTTP/1.1 200 OK\r\n"
    c.waiter = loop.create_future()
    c.data_received(b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n3\r\nabc\r\n0\r\n\r\n")
    assert c.waiter.result() == 200 and not c.keep_alive and not c.buf


async def test_open_loop_latency_counts_client_stall() -> None:
    """No coordinated omission: a 300 ms stall of the client's event loop shows up in the latency of
    the requests scheduled during it (measured from their scheduled send time)."""
    import time as _time

    import numpy as np

    from load.results import summarize
    from load.runner import Driver, RunState

    async def infer(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({})

    runner, port = await fake_v2_server(infer)
    stalled: list[bool] = []

    def stall(st: RunState, now: float) -> None:
        if not stalled and not st.done:
            stalled.append(True)
            _time.sleep(0.3)  # the client's loop is blocked: nothing is sent or read

    try:
        sc = Scenario(http=f"127.0.0.1:{port}", mode="open", rate=200, duration_s=1.5, warmup_s=0,
                      targets=[Target(model="m", protocol="http-json")])
        drv = Driver(sc, on_tick=stall, tick_s=0.5)
        st = await drv.run()
    finally:
        await runner.cleanup()
    res = summarize(drv, st)
    assert stalled and res["failed"] == 0 and res["sent"] == 300
    lat, lag = np.asarray(st.record.latency), np.asarray(st.record.lag)
    assert lag.max() >= 0.25 and lat.max() >= 0.25  # the stall is in the figures, not hidden
    assert (lat >= lag).all()
    assert res["latency_ms"]["max"] >= 250
