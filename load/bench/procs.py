"""Start and stop meshserve processes for the benchmark suite (ports from the ready line)."""
from __future__ import annotations

import os
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshserve.server.process import parse_ready_line

ROOT = Path(__file__).resolve().parents[2]


def follow_ready(proc: subprocess.Popen[str], ports: dict[str, int],
                 each_line: Callable[[str], object]) -> threading.Event:
    """Read ``proc``'s stdout to its end on a daemon thread: every line goes to ``each_line``,
    the ports of its ready line (meshserve.server.process.READY_MARKER) into ``ports``. The
    event is set at that line, or at the end of the output (``ports`` empty then: the process
    ended before it was ready)."""
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            each_line(line)
            found = parse_ready_line(line)
            if found is not None:
                ports.update(found)
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    return ready


def stop_process(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM, timeout: float = 20) -> int:
    """Send ``sig`` to ``proc`` if it still runs, give it ``timeout`` seconds to exit, then kill
    it. Returns its exit code."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class Endpoints:
    """The loopback endpoints of a started process, from the ``ports`` of its ready line."""

    ports: dict[str, int]

    @property
    def http(self) -> str:
        return f"127.0.0.1:{self.ports['http']}"

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.ports['grpc']}"


class Server(Endpoints):
    def __init__(self, args: list[str], log: Path, timeout: float = 120, env: dict[str, str] | None = None,
                 prefix: list[str] | None = None):
        """``python -m meshserve ARGS``, run under ``prefix`` (e.g. valgrind's command) if given."""
        self.argv = [*(prefix or []), sys.executable, "-m", "meshserve", *args]
        self.logf = open(log, "a")  # closed in stop()
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=self.logf, text=True, bufsize=1,
                                     cwd=ROOT, start_new_session=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.ports: dict[str, int] = {}
        ready = follow_ready(self.proc, self.ports, self.logf.write)
        if not ready.wait(timeout) or not self.ports:
            self.stop()
            raise RuntimeError(f"{' '.join(args)} did not become ready (log: {log})")
        wait_ready(self.http, timeout)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        stop_process(self.proc)
        self.logf.close()


def wait_ready(hostport: str, timeout: float = 60, proc: subprocess.Popen[Any] | None = None,
               context: ssl.SSLContext | None = None) -> None:
    """Poll GET /v2/health/ready (over HTTPS with ``context``) until it answers 200; RuntimeError
    after ``timeout`` s, or at once when ``proc`` (the server's process, if given) has exited."""
    url = f"{'https' if context else 'http'}://{hostport}/v2/health/ready"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{hostport}: its process exited (rc {proc.returncode})")
        try:
            with urllib.request.urlopen(url, timeout=2, context=context) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{hostport}: not ready in {timeout:.0f} s")


def explicit_control_args() -> list[str]:
    """Flags that let the repository extension reload models (tune, the batching section), where the
    service has model control modes; none otherwise."""
    out = subprocess.run([sys.executable, "-m", "meshserve", "service", "onnx", "--help"], capture_output=True,
                         text=True, cwd=ROOT).stdout
    return ["--model-control-mode", "explicit", "--load-model", "*"] if "--model-control-mode" in out else []


def service(repo: Path, log: Path, control: list[str] | None = None, env: dict[str, str] | None = None,
            ports: tuple[int, int] = (0, 0), prefix: list[str] | None = None, timeout: float = 120) -> Server:
    """An ONNX service on ``repo``; ``ports``: (HTTP, gRPC), 0 = free ones."""
    return Server(["service", "onnx", "--repository", str(repo), "--http-port", str(ports[0]),
                   "--grpc-port", str(ports[1]), "--log-level", "WARNING", *(control or [])], log, timeout, env,
                  prefix)


def gateway(upstreams: list[str], log: Path, extra: list[str] | None = None,
            env: dict[str, str] | None = None, ports: tuple[int, int] = (0, 0),
            prefix: list[str] | None = None, timeout: float = 120) -> Server:
    """A gateway in front of ``upstreams``; ``ports``: (HTTP, gRPC), 0 = free ones."""
    ups = sum((["--upstream", u] for u in upstreams), [])
    return Server(["gateway", "--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--log-level", "WARNING",
                   *ups, *(extra or [])], log, timeout, env, prefix)


class OtlpSink:
    """A bare OTLP/gRPC trace receiver (TraceService/Export, answers an empty response): what a
    collector costs the sender, without a collector's own CPU on these cores. It runs as its own
    process, so it never takes the GIL from the load generator in the bench process."""

    def __init__(self) -> None:
        self.spans_bytes = 0
        self.proc = subprocess.Popen([sys.executable, "-m", "load.bench.procs", "otlp-sink"], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("port "):
            self.proc.kill()
            raise RuntimeError(f"the OTLP sink did not start: {line!r}")
        self.port = int(line.split()[1])

    def stop(self) -> None:
        """Stops the sink; ``spans_bytes`` then holds the request bytes it received."""
        out, _ = self.proc.communicate("stop\n", timeout=10)
        self.spans_bytes = int(out.split()[-1]) if out.split() else 0


def _otlp_sink_main() -> None:
    from concurrent import futures

    import grpc

    received = [0]

    def export(request: bytes, context: object) -> bytes:
        received[0] += len(request)
        return b""

    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "opentelemetry.proto.collector.trace.v1.TraceService",
        {"Export": grpc.unary_unary_rpc_method_handler(export)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"port {port}", flush=True)
    sys.stdin.readline()  # "stop", or EOF when the bench process dies
    server.stop(0)
    print(received[0], flush=True)


def cpu_seconds(pid: int) -> float:
    """user+sys seconds of one process, all its threads (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_tree_cpu_s(pid: int) -> float:
    """user+sys seconds of a process and its descendants (from /proc)."""
    total = 0.0
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            total += cpu_seconds(p)
            for t in Path(f"/proc/{p}/task").iterdir():
                todo.extend(int(k) for k in (t / "children").read_text().split())
        except (OSError, IndexError, ValueError):
            continue
    return total

if __name__ == "__main__" and sys.argv[1:] == ["otlp-sink"]:
    _otlp_sink_main()
