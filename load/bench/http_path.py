"""The HTTP front door's own cost per infer request, in one process: no socket, no model.

    python -m load.bench.http_path [--what front-door|codec] [-m add_sub|mlp]
        [--body binary|json|json-pa] [-n 2000] [--rounds 5] [--profile] [--instructions]

- ``front-door``: a request's bytes into the httptools ``Connection`` (meshserve/server/http1)
  with a transport that only counts writes, through ``HttpFrontend``, ``http_codec`` and
  ``observe.infer`` to a core that answers at once (outputs = inputs), until its answer is
  written. 200 warm-up requests, then ``--rounds`` rounds of ``-n``; prints µs per request (the
  best round).
- ``codec``: ``http_codec.parse_infer`` + ``render_infer_response`` alone, 8 bodies of the
  model with different numbers and answers of the same shape, 20 warm-up, then ``-n`` per round.

Bodies: ``binary`` (tensors after the JSON header), ``json`` (tritonclient's all-JSON form) and
``json-pa`` (perf_analyzer's: JSON with ``Inference-Header-Content-Length`` = its length). Models:
``add_sub`` (two FP32 inputs of 16) and ``mlp`` (one FP32 input of 512), as the bench models.

``--instructions``: the same work in one process under callgrind, counted in two windows after
its warm-up, one of ``rounds × n`` requests and one of none; the difference over ``rounds × n`` is
the path's user-space instructions per request (a count that repeats on a busy machine; start-up
objects are frozen out of the collector so that a full collection does not fall in one window and
not the other). ``--profile``: cProfile of one round.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from load import inputs
from load.bench import callgrind
from load.rawhttp import build_request
from meshserve._proto import grpc_service_pb2 as pb

MODELS = {"add_sub": ([("INPUT0", [16]), ("INPUT1", [16])], ["OUTPUT0", "OUTPUT1"]),
          "mlp": ([("INPUT0", [512])], ["OUTPUT0"])}
ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m load.bench.http_path", description=__doc__.splitlines()[0])
    ap.add_argument("--what", choices=("front-door", "codec"), default="front-door")
    ap.add_argument("-m", "--model", choices=sorted(MODELS), default="add_sub")
    ap.add_argument("--body", choices=("binary", "json", "json-pa"), default="binary")
    ap.add_argument("-n", "--requests", type=int, default=2000, help="requests per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="cProfile one round instead of timing")
    ap.add_argument("--instructions", action="store_true", help="count instructions under callgrind")
    ap.add_argument("--counted-windows", action="store_true", help=argparse.SUPPRESS)  # (instructions' child)
    return ap.parse_args(argv)


def _model(model: str) -> tuple[inputs.ModelInfo, list[tuple[str, list[int]]], list[str]]:
    specs, outs = MODELS[model]
    info = inputs.ModelInfo(model, 64, [inputs.TensorSpec(name, "FP32", shape) for name, shape in specs], outs)
    return info, specs, outs


def request_bytes(model: str, body: str) -> bytes:
    """One whole HTTP request (head and body) of ``model`` in the ``body`` form."""
    info, specs, _ = _model(model)
    rng = np.random.default_rng(0)
    p = inputs.encode(model, "", {name: rng.random((1, *shape), dtype=np.float32) for name, shape in specs}, info)
    path = f"/v2/models/{model}/infer"
    if body == "binary":
        return build_request("127.0.0.1:1", path, p.http_binary,
                             {"Inference-Header-Content-Length": str(p.http_binary_header_len),
                              "Content-Type": "application/octet-stream"})
    headers = {"Content-Type": "application/json"}
    if body == "json-pa":
        headers["Inference-Header-Content-Length"] = str(len(p.http_json))
    return build_request("127.0.0.1:1", path, p.http_json, headers)


class EchoCore:
    """Answers every infer with its inputs as outputs (the model's work left out)."""

    def __init__(self, outputs: list[str]) -> None:
        self.outputs = outputs

    def authorize(self, op: Any, model: str, ctx: Any) -> Any:
        from meshserve.server.access import Grant

        return Grant()

    async def infer(self, request: pb.ModelInferRequest, ctx: Any) -> Any:
        from meshserve.server.core import InferResult

        out = pb.ModelInferResponse(model_name=request.model_name, model_version="1", id=request.id)
        for i, (t, name) in enumerate(zip(request.inputs, self.outputs, strict=True)):
            out.outputs.add(name=name, datatype=t.datatype, shape=t.shape)
            out.raw_output_contents.append(request.raw_input_contents[i])
        return InferResult(out)


class CountingTransport:
    """A transport that counts writes, keeps the last, and wakes whoever waits for the next one."""

    def __init__(self) -> None:
        self.done: asyncio.Future[None] | None = None
        self.writes = 0
        self.last: bytes | list[bytes] = b""

    def write(self, data: bytes) -> None:
        self.writes += 1
        self.last = data
        if self.done is not None and not self.done.done():
            self.done.set_result(None)

    def writelines(self, data: list[bytes]) -> None:
        self.write(data)  # type: ignore[arg-type]

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 1) if name == "peername" else default

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...
    def can_write_eof(self) -> bool: return True
    def write_eof(self) -> None: ...
    def close(self) -> None: ...


def front_door(model: str, body: str,
               transport: CountingTransport | None = None) -> Callable[[], Coroutine[Any, Any, None]]:
    """One request through the httptools connection and the HTTP front end, answered by an
    ``EchoCore``: the only place that knows how the front door is put together."""
    from meshserve.server import http1
    from meshserve.server.http_frontend import HttpFrontend
    from meshserve.server.limits import ServerLimits

    raw = request_bytes(model, body)
    limits = ServerLimits()
    frontend = HttpFrontend(EchoCore(MODELS[model][1]))  # type: ignore[arg-type]
    conn = http1.Http1Server(frontend.answer, limits).connection()
    transport = transport or CountingTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]

    async def one() -> None:
        transport.done = asyncio.get_running_loop().create_future()
        conn.data_received(raw)
        await transport.done

    return one


def codec(model: str, body: str) -> Callable[[int], None]:
    """``i`` -> parse the i-th of 8 bodies and render an answer of the same shape."""
    from meshserve.protocol import http_codec

    info, specs, outs = _model(model)
    rng = np.random.default_rng(0)
    bodies, answers = [], []
    for _ in range(8):
        arrays = {name: rng.random((1, *shape), dtype=np.float32) for name, shape in specs}
        p = inputs.encode(model, "", arrays, info)
        bodies.append((p.http_binary, p.http_binary_header_len) if body == "binary" else
                      (p.http_json, len(p.http_json) if body == "json-pa" else None))
        answer = pb.ModelInferResponse(model_name=model, model_version="1")
        for (name, shape), out in zip(specs, outs, strict=True):
            answer.outputs.add(name=out, datatype="FP32", shape=[1, *shape])
            answer.raw_output_contents.append(arrays[name].tobytes())
        answers.append(answer)

    def one(i: int) -> None:
        data, header_len = bodies[i % 8]
        request, plan, _raw = http_codec.parse_infer(data, header_len, model, "")
        http_codec.render_infer_response(answers[i % 8], request, plan)

    return one


async def _run_front_door(a: argparse.Namespace, windows: Iterable[int]) -> list[float]:
    one = front_door(a.model, a.body)
    for _ in range(200):
        await one()
    gc.freeze()
    rounds = []
    for k in windows:
        for _ in range(a.rounds):
            t0 = time.perf_counter()
            for _ in range(k):
                await one()
            rounds.append(time.perf_counter() - t0)
    return rounds


def _run_codec(a: argparse.Namespace, windows: Iterable[int]) -> list[float]:
    one = codec(a.model, a.body)
    for i in range(20):
        one(i)
    gc.freeze()
    rounds = []
    for k in windows:
        for _ in range(a.rounds):
            t0 = time.perf_counter()
            for i in range(k):
                one(i)
            rounds.append(time.perf_counter() - t0)
    return rounds


def timed(a: argparse.Namespace, windows: Iterable[int] | None = None) -> list[float]:
    """Seconds of each round: after the warm-up, ``--rounds`` rounds of ``k`` requests for each
    ``k`` of ``windows`` (default: one window of ``-n``)."""
    windows = [a.requests] if windows is None else windows
    if a.what == "codec":
        return _run_codec(a, windows)
    import uvloop

    return uvloop.run(_run_front_door(a, windows))


def _windows() -> Iterator[int]:
    """``--instructions``' measured process (run under callgrind, instrumentation off until
    ``instructions`` turns it on), after its warm-up: says "ready" and reads how many requests per
    round the next window runs, until its stdin closes."""
    while True:
        print("ready", flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        yield int(line)


def instructions(a: argparse.Namespace) -> int:
    """Instructions per request: one process under callgrind with its instrumentation off while
    it starts and warms up; then two windows counted with ``callgrind_control`` (zeroed and turned
    on, then off and dumped), one of no requests and one of ``rounds × n``: the difference over
    ``rounds × n``. The start-up is never counted, so nothing it does once (importing, writing
    bytecode caches: a fresh clone's first run once counted ~58M instructions more) enters the
    count, and the windows' own hand-over (a line each way on a pipe) cancels out. (Until
    2026-11-30 two whole runs were counted, with none and with ``n``, each start-up instrumented:
    ~40 s for the suite's test on this 2-core machine; docs/perf/suite-time.md.)"""
    if not callgrind.available():
        raise SystemExit("--instructions needs valgrind, which is not installed")
    argv = [sys.executable, "-m", "load.bench.http_path", "--what", a.what, "-m", a.model, "--body", a.body,
            "--rounds", str(a.rounds), "--counted-windows"]
    env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": str(ROOT)}
    totals = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cg"
        proc = subprocess.Popen([*callgrind.command(out, instr_at_start=False), *argv], cwd=ROOT, env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        stdout = proc.stdout
        assert proc.stdin is not None and stdout is not None

        def ready() -> None:  # (after its warm-up, and after each window)
            if stdout.readline() != "ready\n":
                raise RuntimeError(f"the measured process stopped (exit code {proc.poll()})")

        try:
            ready()
            for requests in (0, a.requests):
                before = set(out.parent.glob(out.name + "*"))
                callgrind.control(proc.pid, "--zero")
                callgrind.control(proc.pid, "--instr=on")
                proc.stdin.write(f"{requests}\n")
                proc.stdin.flush()
                ready()
                callgrind.control(proc.pid, "--instr=off")
                callgrind.control(proc.pid, "--dump")
                totals.append(callgrind.program_total(callgrind.wait_dump(out, before)))
        finally:
            proc.stdin.close()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return (totals[1] - totals[0]) // (a.rounds * a.requests)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    cell = f"{a.what} {a.model} {a.body}"
    if a.counted_windows:
        timed(a, _windows())
    elif a.instructions:
        print(f"{cell}: {instructions(a)} instructions per request ({a.rounds} x {a.requests}, callgrind)")
    elif a.profile:
        import cProfile
        import pstats

        a.rounds = 1
        with cProfile.Profile() as pr:
            timed(a)
        pstats.Stats(pr).sort_stats("tottime").print_stats(30)
    else:
        rounds = timed(a)
        if a.requests:
            print(f"{cell}: {min(rounds) / a.requests * 1e6:.1f} µs per request (best of {a.rounds} x {a.requests})")


if __name__ == "__main__":
    from load.bench.procs import clean_exit

    clean_exit()
    main()
