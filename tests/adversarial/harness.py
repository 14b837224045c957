"""The adversarial suite's measuring harness: the mesh (a gateway with tenants in front of two
ONNX replicas, real processes), the good client's record, RSS sampling, and `under_attack`,
which runs one attack and judges it by the issue's three rules:

1. the good client's p99 during the attack stays under max(250 ms, 5x its p99 measured just
   before), with 0 failures;
2. the attacked process's RSS (VmRSS) grows by less than 100 MiB and comes back near its
   baseline after the attacker leaves (polled, bounded);
3. the offending connection is closed or its streams refused (the attack reports what its own
   socket saw).
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from gateway.auth import hash_key
from tests.conftest import ROOT, Proc, _wait_http_ready, start
from tests.support.waiting import eventually

MiB = 1 << 20
LONG = os.environ.get("MESHSERVE_ADVERSARIAL_LONG") == "1"  # bigger counts, longer soaks
KEY = "acme-key"  # the good client's tenant
OTHER_KEY = "mallory-key"  # the attacker's tenant (a valid key: attacks get past auth)
ADMIN_KEY = "ops-key"

P99_FLOOR_S = 0.250
P99_FACTOR = 5.0
RSS_GROWTH_MAX = 100 * MiB
RSS_RETURN_SLACK = 40 * MiB  # "near baseline": allocator arenas and caches keep some
RSS_RETURN_WAIT_S = 20.0
BASELINE_S = 1.0  # 100 requests of the good client: the limit is max(250 ms, 5x their p99)
TAIL_S = 0.5  # the good client is judged this long after the attacker leaves too


def tenant(name: str, key: str, models: list[str] | None = None, admin: bool = False) -> str:
    """One entry of a tenants.yaml: the key's hash, a rate no test reaches, what it may use."""
    entry = f'  - name: {name}\n    keys_sha256: ["{hash_key(key)}"]\n    rate: 100000\n    burst: 100000\n'
    if models is not None:
        entry += f"    models: {json.dumps(models)}\n"
    return entry + ("    admin: true\n" if admin else "")


TENANTS = ("\ntenants:\n" + tenant("acme", KEY, ["add_sub", "identity_fp32"])
           + tenant("mallory", OTHER_KEY, ["add_sub", "identity_fp32"]) + tenant("ops", ADMIN_KEY, admin=True))

# Small timeouts so the slow-client attacks end within the suite's time (ServerLimits flags).
BODY_TIMEOUT_S = 3.0
LIMIT_FLAGS = ["--header-timeout-s", "2", "--read-timeout-s", "3", "--body-timeout-s", str(BODY_TIMEOUT_S)]


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class GoodClient:
    """tests.adversarial.good_client in its own process; its lines collected here."""

    def __init__(self, gateway: Proc, rate: float = 100.0, extra: tuple[str, ...] = ()):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.adversarial.good_client", "--grpc", gateway.grpc, "--http", gateway.http,
             "--key", KEY, "--rate", str(rate), *extra], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True, bufsize=1, start_new_session=True)
        self.records: list[tuple[float, float, str]] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            t, lat, status = line.rstrip("\n").split(" ", 2)
            with self.lock:
                self.records.append((float(t), float(lat), status))

    def window(self, t0: float, t1: float) -> list[tuple[float, float, str]]:
        with self.lock:
            return [r for r in self.records if t0 <= r[0] < t1]

    def wait_past(self, t: float, timeout: float) -> bool:
        """Poll (bounded) until the client has answered a request sent at or after t."""
        def answered_or_gone() -> str | None:
            with self.lock:
                if self.records and self.records[-1][0] >= t:
                    return "answered"
            return "exited" if self.proc.poll() is not None else None

        try:
            return eventually(answered_or_gone, timeout, "the good client's answers") == "answered"
        except AssertionError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(10)
            except (subprocess.TimeoutExpired, OSError):
                self.proc.kill()
                self.proc.wait()


@dataclass
class Mesh:
    gateway: Proc
    services: list[Proc]
    good: GoodClient
    tmp: Path

    def procs(self) -> list[Proc]:
        return [self.gateway, *self.services]

    def healthy(self) -> bool:
        if any(p.proc.poll() is not None for p in self.procs()):
            return False
        try:
            for p in self.procs():
                _wait_http_ready(p.http, timeout=10)
        except Exception:
            return False
        return self.good.proc.poll() is None

    def stop(self) -> None:
        self.good.stop()
        for p in self.procs():
            p.stop()


def start_mesh(model_repo: Path, tmp: Path) -> Mesh:
    tenants = tmp / "tenants.yaml"
    tenants.write_text(TENANTS)
    services: list[Proc] = []
    gateway = None
    try:
        for _ in range(2):
            services.append(start(["service", "onnx", "--repository", str(model_repo), "--grpc-port", "0",
                                   "--http-port", "0", "--model-control-mode", "explicit",
                                   "--load-model", "add_sub", "--load-model", "identity_fp32", *LIMIT_FLAGS]))
        gateway = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--tenants", str(tenants),
                         *[a for s in services for a in ("--upstream", s.grpc)], *LIMIT_FLAGS])
        for p in (gateway, *services):
            _wait_http_ready(p.http)
        good = GoodClient(gateway)
        if not good.wait_past(time.monotonic(), 30):
            raise RuntimeError("the good client did not start")
        return Mesh(gateway, services, good, tmp)
    except Exception:
        for p in ([gateway] if gateway else []) + services:
            p.stop()
        raise


@contextlib.contextmanager
def one_service_mesh(model_repo: Path, tmp: Path, gateway_argv: Callable[[Proc, Path], list[str]],
                     module: str = "meshserve") -> Iterator[Mesh]:
    """A mesh of one onnx service (add_sub) behind a gateway with the tenants file, started by
    ``gateway_argv(service, tenants_file)`` (``module``: the server module it runs), with the good
    client running; everything stopped after."""
    (tmp / "tenants.yaml").write_text(TENANTS)
    service = start(["service", "onnx", "--repository", str(model_repo), "--grpc-port", "0", "--http-port", "0",
                     "--model-control-mode", "explicit", "--load-model", "add_sub", *LIMIT_FLAGS])
    gateway = good = None
    try:
        gateway = start(gateway_argv(service, tmp / "tenants.yaml"), module=module)
        _wait_http_ready(gateway.http)
        good = GoodClient(gateway)
        assert good.wait_past(time.monotonic(), 30), "the good client did not start"
        yield Mesh(gateway, [service], good, tmp)
    finally:
        if good is not None:
            good.stop()
        if gateway is not None:
            gateway.stop()
        service.stop()


def p99(latencies: list[float]) -> float:
    if not latencies:
        return float("inf")
    s = sorted(latencies)
    return s[min(len(s) - 1, int(len(s) * 0.99))]


class RssSampler:
    """Peak VmRSS of one process, sampled every 20 ms on a thread while the attack runs."""

    def __init__(self, pid: int):
        self.pid = pid
        self.peak = rss(pid)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            try:
                self.peak = max(self.peak, rss(self.pid))
            except (OSError, RuntimeError):
                return  # the process is gone: the health check after the test says so

    def stop(self) -> int:
        self._stop.set()
        self._t.join(2)
        return self.peak


@dataclass
class Verdict:
    """One attack's outcome against the three rules."""

    name: str
    observed: str  # what the attacker's socket saw
    closed_or_refused: bool
    baseline_p99_s: float
    attack_p99_s: float
    good_requests: int
    failures: list[str]
    rss_base: int
    rss_peak: int
    rss_after: int
    problems: list[str] = field(default_factory=list)

    def judge(self, expect_refusal: bool = True, allow: Callable[[str], bool] | None = None) -> Verdict:
        limit = max(P99_FLOOR_S, P99_FACTOR * self.baseline_p99_s)
        failures = [f for f in self.failures if allow is None or not allow(f)]
        if failures:
            self.problems.append(f"good client: {len(failures)} failures, e.g. {failures[:3]}")
        if self.attack_p99_s > limit:
            self.problems.append(f"good client p99 {self.attack_p99_s * 1000:.1f} ms > limit {limit * 1000:.1f} ms "
                                 f"(baseline p99 {self.baseline_p99_s * 1000:.1f} ms)")
        if self.rss_peak - self.rss_base >= RSS_GROWTH_MAX:
            self.problems.append(f"RSS grew {(self.rss_peak - self.rss_base) / MiB:.0f} MiB (limit "
                                 f"{RSS_GROWTH_MAX // MiB})")
        if self.rss_after - self.rss_base > RSS_RETURN_SLACK:
            self.problems.append(f"RSS still {(self.rss_after - self.rss_base) / MiB:.0f} MiB above baseline "
                                 f"{RSS_RETURN_WAIT_S:.0f} s after the attack")
        if expect_refusal and not self.closed_or_refused:
            self.problems.append(f"the offending connection was neither closed nor refused: {self.observed}")
        return self

    def summary(self) -> str:
        return (f"{self.name}: observed [{self.observed}]; good p99 {self.baseline_p99_s * 1000:.1f} -> "
                f"{self.attack_p99_s * 1000:.1f} ms over {self.good_requests} requests, "
                f"{len(self.failures)} failures; RSS {self.rss_base / MiB:.0f} -> peak {self.rss_peak / MiB:.0f} "
                f"-> {self.rss_after / MiB:.0f} MiB")

    def check(self) -> None:
        assert not self.problems, self.summary() + "\n  " + "\n  ".join(self.problems)


@dataclass
class Observation:
    """What an attack returns: a description and whether its connection was closed/refused."""

    text: str
    closed_or_refused: bool


def under_attack(mesh: Mesh, target: Proc, name: str, attack: Callable[[], Observation]) -> Verdict:
    """Measure the good client just before, run `attack` (bounded by itself), measure during
    and just after, and poll the target's RSS back toward its baseline."""
    good = mesh.good
    pid = target.proc.pid
    rss_base = rss(pid)
    t0 = time.monotonic()
    assert good.wait_past(t0 + BASELINE_S, BASELINE_S + 10), "the good client stopped answering before the attack"
    t1 = time.monotonic()
    baseline = [lat for _, lat, st in good.window(t0, t1) if st == "ok"]
    sampler = RssSampler(pid)
    try:
        obs = attack()
    finally:
        t2 = time.monotonic()
        good.wait_past(t2 + TAIL_S, TAIL_S + 15)  # bounded: a stalled server shows as late records
        peak = sampler.stop()
    during = good.window(t1, t2 + TAIL_S)
    # a request sent during the attack but still unanswered has no record yet: wait for it (bounded)
    samples = [rss(pid) if target.proc.poll() is None else 0]

    def settled() -> bool:
        if samples[-1] - rss_base > RSS_RETURN_SLACK and target.proc.poll() is None:
            samples.append(rss(pid))
        return samples[-1] - rss_base <= RSS_RETURN_SLACK or target.proc.poll() is not None

    with contextlib.suppress(AssertionError):  # bounded: what it reached is the verdict's "after"
        eventually(settled, RSS_RETURN_WAIT_S, "RSS back near its baseline", interval=0.2)
    after = samples[-1]
    failures = [st for _, _, st in during if st != "ok"]
    if target.proc.poll() is not None:
        failures.append(f"the attacked process exited with {target.proc.returncode}")
    return Verdict(name, obs.text, obs.closed_or_refused, p99(baseline),
                   p99([lat for _, lat, _ in during]), len(during), failures, rss_base, peak, after)
