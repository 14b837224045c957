"""Start and stop meshserve processes for the benchmark suite (ports from the ready line).

Every process ``Server`` starts gets a hop key (``hop_key_file``: one per bench process, as
`meshserve up` gives its gateway and services a throwaway one), so a gateway and a service
started here authenticate their hop and keep its extras (docs/security.md, "The authenticated
hop"): the benches measure the production path. ``stop_process`` waits for the whole process
group of a process that leads one (``spawn``: a gateway's workers, a service's children), not
only for the process itself.

No bench leaves a server behind, however it ends (``spawn`` and ``clean_exit``): every bench's
``__main__`` calls ``clean_exit()``, so SIGTERM and SIGHUP unwind it like Ctrl-C does (its
``finally`` blocks and ``running`` blocks stop what they started) and at its exit whatever it
started and did not stop is stopped; a process ``spawn`` started from the main thread gets
SIGTERM from the kernel when the bench dies, even by SIGKILL (PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HOP_KEY_ENV = "MESHSERVE_HOP_KEY_FILE"  # --hop-key-file's default (meshserve/server/tls.py:HOP_KEY_ENV)
POLL_S = 0.02  # how often the waits below look again
_hop_key: list[Path] = []


def hop_key_file() -> Path:
    """This process's hop key: one per process (0600, in a directory removed at exit), written as
    `meshserve hop-key` does (meshserve/cli.py:write_hop_key). Given (``HOP_KEY_ENV``) to every
    process ``Server`` starts, and by tests/conftest.py:start to every test's process."""
    if not _hop_key:
        from meshserve.cli import write_hop_key

        d = Path(tempfile.mkdtemp(prefix="meshserve-hop-"))
        atexit.register(shutil.rmtree, d, True)
        write_hop_key(d / "hop.key")
        _hop_key.append(d / "hop.key")
    return _hop_key[0]


def follow_ready(proc: subprocess.Popen[str], ports: dict[str, int],
                 each_line: Callable[[str], object]) -> threading.Event:
    """Read ``proc``'s stdout to its end on a daemon thread: every line goes to ``each_line``,
    the ports of its ready line (meshserve.server.process.READY_MARKER) into ``ports``. The
    event is set at that line, or at the end of the output (``ports`` empty then: the process
    ended before it was ready)."""
    from meshserve.server.process import parse_ready_line  # (here: importing this module stays cheap)

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
    it; where it leads a process group of its own, wait out the rest of that group too
    (``stop_group``). Returns its exit code."""
    return stop_group(proc, sig, timeout)[0]


# Run before ``argv`` by ``spawn`` (python -I -S -c DEATH_GUARD BENCH_PID ARGV...): SIGTERM to
# this process when the thread that started it ends (PR_SET_PDEATHSIG, kept across the exec of
# ARGV), exit at once if the bench has already gone, then exec ARGV (same pid, same group).
DEATH_GUARD = ("import ctypes, os, sys\n"
               "ctypes.CDLL(None, use_errno=True).prctl(1, 15)\n"  # PR_SET_PDEATHSIG, SIGTERM
               "os.getppid() == int(sys.argv[1]) or sys.exit(143)\n"
               "os.execvp(sys.argv[2], sys.argv[2:])\n")
_live: dict[int, subprocess.Popen[Any]] = {}  # pid -> what ``spawn`` started and no stop has ended


def spawn(argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen(argv, **kwargs)`` as the leader of a process group of its own, so that
    ``stop_process`` waits out everything it started too (a gateway's workers, tritonserver's
    python stubs, drive.sh's perf_analyzer), and a terminal's Ctrl-C reaches only the bench, whose
    ``running`` blocks then stop each in turn.

    A process group, not a session (``start_new_session``): with the kernel's autogroup
    scheduling on (``/proc/sys/kernel/sched_autogroup_enabled``, the default of most
    distributions) every session is a CPU group of its own, shared fairly with the others, so a
    server in a session of its own got half the two cores against perf_analyzer's many threads
    where Triton, adopted from ``start_triton.sh`` in the bench's session, competed thread by
    thread. Measured (add_sub HTTP c32 through the gateway, 3 repeats): 15,666/s and 27.6 rows per
    run in the bench's session, 13,778/s and 11.1 in a session of its own, the code unchanged.

    Never left behind: until a stop (``stop_process``, ``running``) ends it, it is stopped at this
    process's exit (``stop_spawned``, atexit); started from the main thread, it runs under
    ``DEATH_GUARD``, so the kernel sends it SIGTERM when this process dies, even by SIGKILL (from
    another thread it does not: PR_SET_PDEATHSIG fires when the starting *thread* ends)."""
    if threading.current_thread() is threading.main_thread():
        argv = [sys.executable, "-I", "-S", "-c", DEATH_GUARD, str(os.getpid()), *argv]
    proc = subprocess.Popen(argv, process_group=0, **kwargs)
    _live[proc.pid] = proc
    return proc


def stop_spawned() -> None:
    """Stop (``stop_process``, the latest first) every process ``spawn`` started that is still
    running: at exit (atexit), so that no exit path of a bench leaves one behind."""
    while _live:
        pid = next(reversed(_live))
        try:
            stop_process(_live[pid], timeout=10)
        except OSError:  # (already reaped elsewhere)
            _live.pop(pid, None)


atexit.register(stop_spawned)


def clean_exit() -> None:
    """Called first by every bench's ``__main__`` (tests/load/test_bench_procs.py checks that
    each calls it): SIGTERM and SIGHUP raise SystemExit(128 + signal) in the main thread, so the
    bench unwinds as on Ctrl-C (every ``finally`` and ``running`` block stops what it started)
    where Python's default would end it on the spot; a second one ends it the default way. At
    exit, after ``stop_spawned``, any child it started another way (a bare ``subprocess.Popen``:
    a load client, a profiler) and left running is stopped too (``stop_children``)."""
    def unwind(signum: int, _frame: object) -> None:
        for s in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_DFL)  # (the next one is not caught: the unwinding is not cut)
        raise SystemExit(128 + signum)

    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, unwind)
    atexit.register(stop_children)  # (registered after stop_spawned: runs before it, and calls it first)


def stop_children(timeout: float = 10.0) -> dict[int, str]:
    """``stop_spawned``, then SIGTERM to every child of this process still running, SIGKILL to
    those still there after ``timeout`` s, and what is left of the group of one that leads one
    (``end_group``). Returns what it found, pid -> command line (empty: nothing was left)."""
    stop_spawned()
    me = os.getpid()
    found = {pid: cmdline(pid) for pid in _children(me)}
    for pid in found:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while (left := [p for p in found if _alive_child(p, me)]) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    for pid in found:
        end_group(pid, grace=0.5)  # (nothing is sent to a pid that leads no group)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    return found


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name (state, ppid, pgrp, ...); [] when gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _children(ppid: int) -> list[int]:
    """The live (not zombie) children of ``ppid``."""
    return [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit() and _alive_child(int(e.name), ppid)]


def _alive_child(pid: int, ppid: int) -> bool:
    f = _stat(pid)
    return len(f) > 1 and f[0] != "Z" and int(f[1]) == ppid


@contextlib.contextmanager
def running(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM, timeout: float = 20) -> Iterator[Any]:
    """``proc`` (from ``spawn``) stopped with its whole group (``stop_process``) when the block
    ends, however it ends: normally, by an exception or by Ctrl-C's KeyboardInterrupt."""
    try:
        yield proc
    finally:
        stop_process(proc, sig, timeout)


def stop_group(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM, timeout: float = 20,
               grace: float = 2.0, leader: bool | None = None) -> tuple[int, dict[int, str]]:
    """``stop_process``, and what of its group had to be killed (pid -> command line; empty when
    the stop was clean). A process started by ``spawn`` leads its group: after it
    exited, what is left of the group gets ``grace`` s to follow (a child that sees its parent's
    pipe close), then SIGKILL (``end_group``). The process is reaped only after that, so its pid,
    the group's id, cannot be taken by another process meanwhile. ``leader``: whether it was
    started as one (None: asked of the system, which can tell only while it is not yet reaped)."""
    if leader is None:
        leader = proc.returncode is None and _pgid(proc.pid) == proc.pid
    if not _exited(proc, 0):
        os.kill(proc.pid, sig)  # (not proc.send_signal: that reaps an exited process)
        if not _exited(proc, timeout):
            os.kill(proc.pid, signal.SIGKILL)
            _exited(proc, 60)
    left = end_group(proc.pid, grace) if leader else {}
    proc.wait()
    _live.pop(proc.pid, None)  # (only now: a stop cut short by a signal is done again at exit)
    return proc.returncode, left


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _exited(proc: subprocess.Popen[Any], timeout: float) -> bool:
    """Has ``proc`` exited (within ``timeout`` s)? Waits without reaping it (WNOWAIT)."""
    deadline = time.monotonic() + timeout
    while proc.returncode is None:
        try:
            if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:  # reaped elsewhere (a Popen.poll meanwhile)
            proc.poll()
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and len(f := _stat(int(entry.name))) > 2 and int(f[2]) == pgid and f[0] != "Z":
            found.append(int(entry.name))
    return found


def end_group(pgid: int, grace: float = 2.0, timeout: float = 10.0) -> dict[int, str]:
    """After a process that led its group (``spawn``) has been stopped: give what is left of its
    group ``grace`` s to exit on its own, then SIGKILL the rest and wait, at most ``timeout`` s,
    until none is left. Returns what had to be killed, pid -> command line (empty when the stop
    was clean). A pid that was no group's leader matches no process: nothing is sent."""
    deadline = time.monotonic() + grace
    while (left := group_members(pgid)) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    if not left:
        return {}
    killed = {pid: cmdline(pid) for pid in left}
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:  # gone meanwhile
        pass
    deadline = time.monotonic() + timeout
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    return killed


def cmdline(pid: int) -> str:
    """The command line of ``pid`` ("" when it is gone or a zombie)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


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
        """``python -m meshserve ARGS``, run under ``prefix`` (e.g. valgrind's command) if given;
        with this process's hop key (``hop_key_file``) unless ``env`` names another (or "": none)."""
        self.argv = [*(prefix or []), sys.executable, "-m", "meshserve", *args]
        self.logf = open(log, "a")  # closed in stop()
        self.proc = spawn(self.argv, stdout=subprocess.PIPE, stderr=self.logf, text=True, bufsize=1, cwd=ROOT,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", HOP_KEY_ENV: str(hop_key_file()), **(env or {})})
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
        """SIGTERM, then wait for it and its process group (its workers): nothing it started runs on."""
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
