"""meshserve command line: `up`, `gateway`, `service KIND`, `hop-key`, `placement`, `build-trt`, `check-repo`.

The gateway, the services and load/ are packages of their own that this module imports only
inside the function of the subcommand that runs them (never at module level: each pulls in
its runtime). tests/unit/test_import_rules.py lists exactly which of their modules it may import;
a service's entry module is the one its kind's row names (meshserve/repository/kinds.py).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from meshserve.repository import kinds
from meshserve.server.core import add_server_name_argument
from meshserve.server.process import parse_ready_line
from meshserve.server.workers import DEFAULT_WORKERS, die_with_parent

_LOAD_COMMANDS = ("load", "tune")  # load/ package, imported on use
_COMMANDS = ("up", "gateway", "service", "hop-key", "build-trt", "placement", "check-repo", "tritonserver",
             *_LOAD_COMMANDS)
DEFAULT_REPOSITORY = Path(__file__).resolve().parent.parent / "examples" / "model_repository"
UP_MODES = ("explicit", "none", "poll", "lazy")  # the services' three (Triton's) and the gateway's lazy


def _service_main(kind: str) -> Callable[[argparse.Namespace], None] | None:
    """The `main` of the service of `kind` (imported now, with its runtime), or None.

    The one import by a name string: the module the kind's registry row names
    (meshserve/repository/kinds.py, `Kind.entry`; docs/architecture.md, "Layers")."""
    row = kinds.by_name(kind)
    if row is None or not row.entry:
        return None
    run: Callable[[argparse.Namespace], None] = importlib.import_module(row.entry).main
    return run


def _service_kinds() -> list[str]:
    """The kinds that have a service process, in the registry's order."""
    return [k.name for k in kinds.KINDS if k.entry]


def _cmd_service(args: argparse.Namespace) -> None:
    run = _service_main(args.kind)
    if run is None:
        raise SystemExit(f"meshserve service: kind '{args.kind}' is not available in this build "
                         f"(available: {', '.join(_service_kinds())})")
    run(args)


def _missing_runtime(kind: str) -> str | None:
    """Why the service of `kind` cannot start here (a module its runtime needs is not installed), or None."""
    row = kinds.by_name(kind)
    missing = next((m for m in row.requires if importlib.util.find_spec(m) is None), None) if row else None
    if row is None or missing is None:
        return None
    return f"`{missing}` is not installed" + (f" (pip install 'meshserve[{row.extra}]')" if row.extra else "")


def _cmd_gateway(args: argparse.Namespace) -> None:
    from gateway.main import main as gateway_main

    gateway_main(args)


def _cmd_build_trt(args: argparse.Namespace) -> None:
    from services.tensorrt.build import main as build_main

    build_main(args)


def _run_load_command(command: str, argv: list[str]) -> None:
    """`meshserve load` / `meshserve tune`: load/'s own argument parsers read the rest."""
    if command == "tune":
        from load.tune import main as tune_main

        tune_main(argv)
    else:
        from load.cli import main as load_main

        load_main(argv)


def _cmd_placement(args: argparse.Namespace) -> None:
    """`meshserve placement`: where each model lives, from a gateway's GET /v2/placement."""
    import json
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"{args.url.rstrip('/')}/v2/placement",
                                     headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as r:
            view = json.load(r)
    except urllib.error.HTTPError as exc:
        raise SystemExit(f"meshserve placement: {exc.code}: {exc.read().decode(errors='replace')[:500]}") from None
    except (OSError, ValueError) as exc:
        raise SystemExit(f"meshserve placement: {args.url}: {exc}") from None
    if args.json:
        print(json.dumps(view, indent=2))
        return
    print(placement_table(view))


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}Mi"


def placement_table(view: dict) -> str:
    """The placement endpoint's answer as two plain tables (replicas, models)."""
    lines = [f"{'REPLICA':<24} {'KIND':<12} {'HEALTHY':<8} {'USED':>10} {'BUDGET':>10} {'BASE':>10} "
             f"{'PENDING':>8} "
             f"{'LOADS':>6} {'EVICTIONS':>9}"]
    for r in view.get("replicas", []):
        lines.append(f"{r['endpoint']:<24} {r.get('kind') or '-':<12} {str(r['healthy']).lower():<8} "
                     f"{_mib(r.get('used_bytes')):>10} {_mib(r.get('budget_bytes')):>10} "
                     f"{_mib(r.get('base_bytes')):>10} "
                     f"{r.get('pending') if r.get('pending') is not None else '-':>8} "
                     f"{r.get('loads') if r.get('loads') is not None else '-':>6} "
                     f"{r.get('evictions') if r.get('evictions') is not None else '-':>9}")
    lines += ["", f"{'MODEL':<28} {'COPIES':>6} {'MIN':>4} {'SIZE':>9} {'LAST USE':>9} {'COLD':>5} "
                  f"{'COLD LAST':>9}  REPLICAS"]
    now = time.time()
    for m in view.get("models", []):
        last = "-" if not m.get("last_used") else f"{now - m['last_used']:.0f}s ago"
        cold = "-" if m.get("cold_start_last_s") is None else f"{m['cold_start_last_s']:.3f}s"
        flags = " (pinned)" if m.get("pinned") else (" (loading)" if m.get("loading") else "")
        lines.append(f"{m['name'] + flags:<28} {m['copies']:>6} {m['min_copies']:>4} {_mib(m.get('size_bytes')):>9} "
                     f"{last:>9} {m.get('cold_starts', 0):>5} {cold:>9}  {', '.join(m['replicas']) or '-'}")
    return "\n".join(lines)


def _cmd_check_repo(args: argparse.Namespace) -> None:
    from meshserve.repository.check import check_repository

    report, ok = check_repository(args.path)
    print(report)
    raise SystemExit(0 if ok else 1)


# ---- meshserve up ---------------------------------------------------------------------

class Child:
    def __init__(self, name: str, argv: list[str]):
        self.name = name
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, bufsize=1,
                                     preexec_fn=die_with_parent)  # none is orphaned if `up` dies
        self.ports: dict[str, int] = {}
        self._ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    PUMP_CHUNK = 64 * 1024  # the child's output is read (and a line without its newline passed on) in pieces of this

    def _pump(self) -> None:
        """Pass the child's output on, reading at most PUMP_CHUNK bytes at a time: a child that
        prints without a newline holds at most one chunk here (a line longer than that is passed
        on in pieces, never gathered); whole lines are checked for the ready marker."""
        import codecs

        assert self.proc.stdout is not None
        raw = self.proc.stdout.buffer  # type: ignore[attr-defined]  # (bytes: a text readline would gather a whole line, any length)
        decode = codecs.getincrementaldecoder("utf-8")("replace").decode
        partial = b""
        while chunk := raw.read1(self.PUMP_CHUNK):
            lines = (partial + chunk).split(b"\n")
            partial = lines.pop()
            for line in lines:
                text = decode(line + b"\n")
                ports = parse_ready_line(text)
                if ports is not None:
                    self.ports.update(ports)
                    self._ready.set()
                else:
                    sys.stdout.write(text)
            if len(partial) >= self.PUMP_CHUNK:  # a long line: passed on as it comes
                sys.stdout.write(decode(partial))
                partial = b""
        if partial:
            sys.stdout.write(decode(partial, True))
        self._ready.set()

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.2):
            if time.monotonic() > deadline:
                raise SystemExit(f"meshserve up: {self.name} did not become ready within {timeout:.0f}s")
        if not self.ports:
            raise SystemExit(f"meshserve up: {self.name} exited with code {self.proc.wait()} before it was ready")


def _stop_all(children: list[Child], timeout: float = 20.0) -> None:
    for c in children:  # gateway first (listed first), then services
        if c.proc.poll() is None:
            c.proc.send_signal(signal.SIGTERM)
        try:
            c.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()


def _reserve_port(host: str) -> socket.socket:
    """A port on ``host`` held for the gateway until it is listening: bound with SO_REUSEADDR and
    never listening, so the gateway (which binds with SO_REUSEADDR too) can bind and listen on it,
    while neither an outgoing connection's local port nor another bind of port 0 can take it in
    the seconds the services take to start. (Picking a port and closing the socket left it free
    to be taken: a test run lost a gateway's gRPC port that way, `address already in use`.)"""
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
    except BaseException:
        s.close()
        raise
    return s


def _loopback(host: str) -> str:
    """The address a local process reaches a server listening on ``host`` by."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def _up_refusal(args: argparse.Namespace) -> str | None:
    """Why `meshserve up` will not start with these flags: uploads (code from clients) on a
    gateway that others can reach, with no tenants to say who may upload."""
    from meshserve.server.repository_control import UPLOADS_FLAG, is_loopback

    if args.allow_model_uploads and args.tenants is None and not (args.host == "localhost" or is_loopback(args.host)):
        return (f"meshserve up: {UPLOADS_FLAG} on a non-loopback --host ({args.host}) needs --tenants (only an "
                "admin key may then upload); without tenants anyone who reaches the port could run code here")
    if args.load_model is not None and args.model_control_mode != "explicit":
        return "meshserve up: Use of '--load-model' requires setting '--model-control-mode=explicit' as well."
    return None


def _up_gateway_flags(args: argparse.Namespace) -> list[str]:
    """`meshserve up`'s tenant, quota, model-control and response-cache flags, passed on to its gateway."""
    flags = ["--quota-store", args.quota_store]
    if args.tenants is not None:
        flags += ["--tenants", str(args.tenants)]
    if args.metrics_auth:
        flags.append("--metrics-auth")
    if args.allow_remote_model_control:
        flags.append("--allow-remote-model-control")
    for value in args.cache_config:
        flags += ["--cache-config", value]
    from gateway.main import front_door_flags
    from meshserve.server import limits, tls

    return (flags + _up_upload_flags(args) + tls.flags(tls.from_args(args)) + limits.passed_on(args)
            + front_door_flags(args))


def _up_mesh_service_flags(args: argparse.Namespace) -> list[str]:
    """A service's model-control and memory flags: in explicit mode the --load-model models at start
    (every model without it), in lazy mode none (the gateway loads each on its first request;
    docs/model-mesh.md); none and poll are the services' own (Triton's) modes."""
    mode = args.model_control_mode
    if mode in ("explicit", "lazy"):
        startup = [] if mode == "lazy" else (args.load_model if args.load_model is not None else ["*"])
        flags = ["--model-control-mode", "explicit"] + [f for name in startup for f in ("--load-model", name)]
    else:
        flags = ["--model-control-mode", mode]
        if mode == "poll" and args.repository_poll_secs is not None:
            flags += ["--repository-poll-secs", str(args.repository_poll_secs)]
    if args.exit_on_error:
        flags.append("--exit-on-error")
    if args.memory_budget is not None:
        flags += ["--memory-budget", args.memory_budget]
    from services.base.main import eviction_flags

    if args.model_load_thread_count is not None:
        flags += ["--model-load-thread-count", str(args.model_load_thread_count)]
    return flags + eviction_flags(args) + [f for name in args.pin for f in ("--pin", name)]


def _up_mesh_gateway_flags(args: argparse.Namespace) -> list[str]:
    """The gateway's placement flags (`meshserve up --model-control-mode lazy`)."""
    mode = "lazy" if args.model_control_mode == "lazy" else "explicit"  # (the gateway's: placement or not)
    flags = ["--model-control-mode", mode, "--min-copies", str(args.min_copies)]
    return flags + [f for name in args.pin for f in ("--pin", name)]


def _up_upload_flags(args: argparse.Namespace) -> list[str]:
    """--allow-model-uploads for the gateway and every service (each checks it)."""
    return ["--allow-model-uploads"] if args.allow_model_uploads else []


def _up_python_flags(args: argparse.Namespace, gateway_grpc: int) -> list[str]:
    """The python service's BLS flags: the gateway's gRPC address and the service's key file
    (its path: the key itself never goes on a command line)."""
    flags = ["--bls-target", f"{_loopback(args.host)}:{gateway_grpc}"]
    if args.bls_api_key_file is not None:
        flags += ["--bls-api-key-file", str(args.bls_api_key_file)]
    if args.tls_grpc_use_ssl or args.tls_grpc_mutual or args.bls_use_ssl:  # the gateway's gRPC port serves TLS
        root = args.bls_root_cert or args.tls_grpc_root  # (default: the CA of the gateway's clients)
        flags += ["--bls-use-ssl", *(["--bls-root-cert", str(root)] if root else [])]
        if args.bls_client_cert:
            flags += ["--bls-client-cert", str(args.bls_client_cert), "--bls-client-key", str(args.bls_client_key)]
    return flags


def _hop_auth(args: argparse.Namespace, run_dir: Path) -> tuple[list[str], list[str]]:
    """The gateway -> service hop authenticated out of the box (docs/security.md, "The
    authenticated hop"): with --mesh-tls by the mesh CA's certificates, else by a hop key: the
    one --hop-key-file names, or a throwaway one written to the run directory (0600).
    Returns (the services' flags, the gateway's flags)."""
    if args.mesh_tls:
        return _mesh_tls(run_dir)
    key = args.hop_key_file
    if key is None:
        key = run_dir / "hop.key"
        write_hop_key(key)
    flags = ["--hop-key-file", str(key)]
    return flags, flags


def write_hop_key(path: Path) -> None:
    """A new hop key (32 random bytes as 64 hex digits) in a new file ``path``, readable by its
    owner alone (0600); FileExistsError when ``path`` exists (a key in use is never overwritten)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))


def _cmd_hop_key(args: argparse.Namespace) -> None:
    from meshserve.server.tls import HOP_KEY_ENV

    try:
        write_hop_key(args.path)
    except FileExistsError:
        raise SystemExit(f"meshserve hop-key: {args.path} exists (a key in use is not overwritten: remove it "
                         f"first to make a new one)") from None
    except OSError as exc:
        raise SystemExit(f"meshserve hop-key: cannot write {args.path}: {exc.strerror}") from None
    print(f"meshserve hop-key: wrote a new hop key to {args.path} (0600); give it to the gateway and to every "
          f"service: --hop-key-file {args.path} (or ${HOP_KEY_ENV})")


def _mesh_tls(run_dir: Path) -> tuple[list[str], list[str]]:
    """`meshserve up --mesh-tls`: a throwaway mesh CA in the run directory (0700; removed at
    exit), a certificate for the services (mutual TLS on their gRPC ports) and one for the
    gateway's hop. Returns (the services' flags, the gateway's flags)."""
    try:
        from meshserve.server import certs
    except ImportError:
        raise SystemExit("meshserve up --mesh-tls needs the cryptography package (pip install cryptography)") from None
    ca = certs.authority(run_dir, "mesh-ca")
    service = ca.issue(run_dir, "service", server=True)
    hop = ca.issue(run_dir, "gateway-hop", server=False)
    ca.key.unlink()  # nothing more is signed: the CA's key is not kept
    return (["--grpc-use-ssl-mutual=true", "--grpc-server-cert", str(service.cert), "--grpc-server-key",
             str(service.key), "--grpc-root-cert", str(ca.cert)],
            ["--upstream-root-cert", str(ca.cert), "--upstream-client-cert", str(hop.cert),
             "--upstream-client-key", str(hop.key)])


def _in_gateway(kind: str) -> bool:
    row = kinds.by_name(kind)
    return row is not None and row.in_gateway


def _start_errors(args: argparse.Namespace, entries: list, runnable: list[str]) -> tuple[list[str], list[str]]:
    """What keeps a model named for the start from loading, known before any process starts:
    (--load-model names that are no model of the repository, in Triton's words; the models of the
    start whose kind no service here runs). A failed load itself is the service's to report
    (--exit-on-error)."""
    names = {e.name for e in entries}
    lazy = args.model_control_mode == "lazy"
    wanted = None if lazy or args.load_model is None or "*" in args.load_model else set(args.load_model)
    unknown = [f"failed to load '{name}', failed to poll from model repository (--load-model: no such model in "
               f"{args.repository})" for name in sorted((wanted or set()) - names)]
    skipped = [] if lazy else [e.name for e in entries if (not e.kind or (e.kind not in runnable and not _in_gateway(
        e.kind))) and (wanted is None or e.name in wanted)]
    return unknown, skipped


def _banner(args: argparse.Namespace, ports: dict[str, int], n_services: int, servable: list[str]) -> str:
    """What `meshserve up` prints once every process is ready: the gateway's endpoints (the HTTP
    and metrics lines only where they are served: --allow-http, --allow-metrics) and a request to try."""
    host = "localhost" if args.host in ("0.0.0.0", "127.0.0.1") else args.host
    http = ports.get("http")
    scheme = "https" if args.tls_http_use_ssl or args.tls_http_mutual else "http"  # (--http-use-ssl)
    metrics_at = f"{host}:{ports['metrics']}" if "metrics" in ports else f"{host}:{http}"
    model = next(iter(servable), "add_sub")
    lines = [f"meshserve is up ({n_services} service process(es) + gateway"
             + ("; models load on first use: `meshserve placement` shows where" if args.model_control_mode == "lazy"
                else "") + ")."]
    if http is not None:
        lines.append(f"  HTTP/REST  {scheme}://{host}:{http}/v2          (health: /v2/health/ready)")
    lines.append(f"  gRPC       {host}:{ports['grpc']}                 (inference.GRPCInferenceService)")
    if args.allow_metrics and ("metrics" in ports or http is not None):
        lines.append(f"  Metrics    http://{metrics_at}/metrics     (Prometheus: Triton's nv_inference_* of every model, "
                     "by replica)")
    if http is not None:
        lines += ["Try:", f"  curl -s {scheme}://{host}:{http}/v2/models/{model}"]
        if "add_sub" in servable:  # an infer to try where the repository has the example's add_sub (inputs known)
            data = ",".join(["1"] * 16), ",".join(["2"] * 16)
            lines.append(f"  curl -s -X POST {scheme}://{host}:{http}/v2/models/add_sub/infer -d "
                         f"""'{{"inputs":[{{"name":"INPUT0","shape":[1,16],"datatype":"FP32","data":[{data[0]}]}},"""
                         f"""{{"name":"INPUT1","shape":[1,16],"datatype":"FP32","data":[{data[1]}]}}]}}'""")
    return "\n" + "\n".join(lines) + "\nPress Ctrl-C to stop."


def _cmd_up(args: argparse.Namespace) -> None:
    from meshserve.repository import layout

    refusal = _up_refusal(args)
    if refusal:
        raise SystemExit(refusal)
    if args.replicas < 1:
        raise SystemExit("meshserve up: --replicas must be at least 1")
    repo: Path = args.repository
    if repo.resolve() == DEFAULT_REPOSITORY.resolve():
        from meshserve import examples

        examples.ensure(repo, progress=lambda msg: print(f"meshserve up: {msg}", flush=True))
    if not repo.is_dir():
        raise SystemExit(f"meshserve up: model repository {repo} does not exist")
    entries = layout.scan(repo)
    # Ensembles run in the gateway (it gets the repository), not in a service of their own.
    needed = sorted({e.kind for e in entries if e.kind and not _in_gateway(e.kind)})
    for e in entries:
        if e.error:
            print(f"meshserve up: model '{e.name}' has a problem and will not load: {e.error}", flush=True)
    services_here = _service_kinds()
    if not needed:
        # An empty repository (or ensembles only): Triton starts on it, and models copied in later
        # are loaded through the repository API. A service of every kind this build can run, so
        # that any of them can be (a model of a kind not started here could not be).
        needed = [k for k in services_here if _missing_runtime(k) is None]
        print(f"meshserve up: {repo} holds no model yet: starting a service of every kind this build runs "
              f"({', '.join(needed)}), so that models copied in later can be loaded", flush=True)
    runnable = [k for k in needed if k in services_here and _missing_runtime(k) is None]
    for k in needed:
        if k not in runnable:
            names = ", ".join(e.name for e in entries if e.kind == k)
            why = f"no {k} service in this build" if k not in services_here else _missing_runtime(k)
            print(f"meshserve up: {k} models ({names}) are skipped: {why}", flush=True)
    if not runnable:
        raise SystemExit(f"meshserve up: no servable model in {repo} (run `meshserve check-repo {repo}`)")
    unknown, skipped = _start_errors(args, entries, runnable)
    for why in unknown:
        print(f"meshserve up: {why}", flush=True)
    if (unknown or skipped) and args.exit_on_error:
        raise SystemExit("meshserve up: failed to load all models (--exit-on-error)"
                         + (f": {', '.join(skipped)} will not load here" if skipped else ""))

    py = [sys.executable, "-m", "meshserve"]
    children: list[Child] = []
    stopping = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stopping.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    services: list[Child] = []
    if args.tenants is not None and args.bls_api_key_file is None and "python" in runnable:
        print("meshserve up: warning: --tenants without --bls-api-key-file: python models' BLS calls carry no "
              "API key and will be refused unless the tenants file allows anonymous callers "
              "(docs/python-backend.md)", flush=True)
    if args.tls_grpc_mutual and not args.bls_client_cert and "python" in runnable:
        print("meshserve up: warning: --grpc-use-ssl-mutual without --bls-client-cert: python models' BLS calls "
              "reach the gateway's gRPC port without a client certificate and will be refused (docs/security.md)",
              flush=True)
    # the run directory (0700, removed at exit): the hop's throwaway key or mesh CA
    mesh_dir = Path(tempfile.mkdtemp(prefix="meshserve-up-"))
    try:
        service_tls, gateway_hop = _hop_auth(args, mesh_dir)
    except BaseException:
        shutil.rmtree(mesh_dir, ignore_errors=True)
        raise
    reserved: socket.socket | None = None
    try:
        # python models call other models (BLS) through the gateway: its gRPC port must be known
        # before the services start, so a port of 0 is picked here and held until the gateway listens
        if not args.grpc_port:
            reserved = _reserve_port(args.host)
        gateway_grpc = int(reserved.getsockname()[1]) if reserved is not None else args.grpc_port
        for kind in runnable:
            print(f"meshserve up: starting the {kind} service"
                  + (f" ({args.replicas} replicas)…" if args.replicas > 1 else "…"), flush=True)
            extra = _up_python_flags(args, gateway_grpc) if kind == "python" else []
            for n in range(args.replicas):
                name = f"{kind} service" + (f" {n + 1}" if args.replicas > 1 else "")
                child = Child(name, [*py, "service", kind, "--repository", str(repo),
                                     "--host", "127.0.0.1", "--grpc-port", "0", *_up_mesh_service_flags(args),
                                     "--server-name", args.server_name, "--log-level", args.log_level,
                                     *_up_upload_flags(args), *service_tls, *extra])
                services.append(child)
        for child in services:
            child.wait_ready(args.timeout)
        upstreams = [f"127.0.0.1:{c.ports['grpc']}" for c in services]
        print("meshserve up: starting the gateway…", flush=True)
        gateway = Child("gateway", [*py, "gateway", "--host", args.host, "--http-port", str(args.http_port),
                                    "--grpc-port", str(gateway_grpc), "--log-level", args.log_level,
                                    "--repository", str(repo), "--federate-metrics", "--server-name", args.server_name,
                                    "--workers", str(args.gateway_workers),
                                    *(["--metrics-port", str(args.metrics_port)] if args.metrics_port >= 0 else []),
                                    *_up_gateway_flags(args), *_up_mesh_gateway_flags(args), *gateway_hop,
                                    *sum((["--upstream", u] for u in upstreams), [])])
        children = [gateway, *services]
        gateway.wait_ready(args.timeout)
        if reserved is not None:
            reserved.close()  # the gateway listens on it now
        print(_banner(args, gateway.ports, len(services),
                      [e.name for e in entries if e.kind in runnable and not e.error]), flush=True)
        while not stopping.is_set():
            for c in children:
                if c.proc.poll() is not None:
                    print(f"meshserve up: {c.name} exited with code {c.proc.returncode}; stopping", flush=True)
                    stopping.set()
            stopping.wait(0.5)
    finally:
        print("meshserve up: stopping…", flush=True)
        _stop_all(children or services)
        if reserved is not None:
            reserved.close()
        shutil.rmtree(mesh_dir, ignore_errors=True)
        print("meshserve up: stopped", flush=True)


def _up_arguments(up: argparse.ArgumentParser) -> None:
    """`meshserve up`'s arguments (with the gateway's and the services' definitions it passes on)."""
    up.add_argument("--repository", type=Path, default=DEFAULT_REPOSITORY)
    kinds.add_backend_directory(up)
    up.add_argument("--host", default="127.0.0.1", help="address the gateway listens on")
    up.add_argument("--http-port", type=int, default=8000)
    up.add_argument("--grpc-port", type=int, default=8001)
    up.add_argument("--metrics-port", type=int, default=8002,
                    help="the gateway's /metrics alone on this port, as Triton's :8002 (0: a free one, -1: none; "
                         "/metrics is on the HTTP port too)")
    up.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for each process")
    up.add_argument("--log-level", default="WARNING")
    up.add_argument("--gateway-workers", type=int, default=DEFAULT_WORKERS, metavar="N",
                    help="gateway processes sharing its ports (`meshserve gateway --workers`)")
    add_server_name_argument(up)
    from gateway.main import add_tenant_arguments
    from meshserve.server import repository_control

    add_tenant_arguments(up)  # the gateway's own definitions: tenants, quotas, /metrics auth
    from gateway.main import add_front_door_arguments

    add_front_door_arguments(up)  # --allow-http, --allow-metrics: passed on to the gateway
    from gateway.main import add_cache_arguments

    add_cache_arguments(up)  # --cache-config, passed on to the gateway
    repository_control.add_arguments(up)
    from services.base.main import add_bls_key_argument, add_bls_tls_arguments

    add_bls_key_argument(up)
    add_bls_tls_arguments(up)
    from meshserve.server import tls

    tls.add_arguments(up)  # the gateway's ports
    from meshserve.server import limits

    limits.add_arguments(up, with_tls=False)  # the gateway's limits (--max-request-bytes, ...), passed on to it
    up.add_argument("--mesh-tls", action="store_true",
                    help="the gateway-to-service hop on mutual TLS with a throwaway CA made in a run directory "
                         "(needs the cryptography package; default off: plaintext on loopback, each hop stream "
                         "signed with a throwaway --hop-key-file)")
    up.add_argument("--model-control-mode", type=str.lower, choices=UP_MODES, default="explicit",
                    help="explicit (default): the --load-model models loaded at start (without it, every model), "
                         "then load / unload through the repository API; none: every model loaded, the API "
                         "refused (Triton's default); poll: every model loaded, changes in the repository loaded "
                         "every --repository-poll-secs; lazy: the services start with no model loaded and the "
                         "gateway loads each on its first request on a replica it picks, evicting the least "
                         "recently used under --memory-budget (docs/model-mesh.md)")
    up.add_argument("--load-model", action="append", default=None, metavar="NAME",
                    help="explicit mode: a model loaded at start (repeatable; '*' = every model; without it "
                         "every model: Triton's explicit mode loads none then, as `meshserve tritonserver` does)")
    up.add_argument("--repository-poll-secs", type=float, default=None, metavar="SECONDS",
                    help="poll mode: seconds between the services' reads of the repository (their default 15)")
    up.add_argument("--exit-on-error", action="store_true",
                    help="stop the start when a model fails to load, a --load-model name is no model of the "
                         "repository, or a model's kind has no service here (Triton's --exit-on-error, its "
                         "default; `meshserve up`'s default: report them and serve the rest)")
    up.add_argument("--memory-budget", default=None, metavar="BYTES",
                    help="each service replica's memory budget for its models (512Mi, 2G, 80%%; the service's "
                         "default: a share of the cgroup limit or physical memory)")
    from services.base.main import add_eviction_arguments

    add_eviction_arguments(up)  # --eviction-grace, --gpu-memory-budget: passed on to every service
    up.add_argument("--replicas", type=int, default=1, metavar="N", help="service processes per kind")
    from services.base.main import add_load_thread_argument

    add_load_thread_argument(up, None)  # passed on to every service
    up.add_argument("--pin", action="append", default=[], metavar="NAME",
                    help="a model placed at start and never evicted (repeatable)")
    up.add_argument("--min-copies", type=int, default=1, metavar="N",
                    help="replicas each lazily loaded model is placed on")
    up.set_defaults(func=_cmd_up)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line's parser; with ``command`` (the subcommand a command line names,
    ``command_of``), only that subcommand's arguments are defined, the others' left empty: `up`'s
    and `gateway`'s definitions import the gateway's package, `up`'s and `service`'s the services',
    so a `service` process would import the whole gateway (pydantic, yaml, its stages) and a
    `gateway` the services' core for nothing (docs/perf/suite-time.md). The chosen subcommand's
    parser, and so its parsing, help and errors, is the same either way."""
    ap = argparse.ArgumentParser(prog="meshserve", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)

    def full(name: str) -> bool:
        return command is None or command == name

    up = sub.add_parser("up", help="run the services and the gateway locally on one repository")
    if full("up"):
        _up_arguments(up)

    gw = sub.add_parser("gateway", help="run the gateway")
    if full("gateway"):
        from gateway.main import add_arguments as gateway_arguments

        gateway_arguments(gw)
    gw.set_defaults(func=_cmd_gateway)

    svc = sub.add_parser("service", help="run one backend service")
    if full("service"):
        from services.base.main import add_arguments as service_arguments

        svc.add_argument("kind", choices=sorted(k.name for k in kinds.KINDS))
        service_arguments(svc)
    svc.set_defaults(func=_cmd_service)

    hk = sub.add_parser("hop-key", help="write a new hop key for `gateway` and `service` --hop-key-file "
                                         "(docs/security.md, \"The authenticated hop\")")
    hk.add_argument("path", type=Path, metavar="FILE", help="the key file to create (0600; never overwritten)")
    hk.set_defaults(func=_cmd_hop_key)

    trt = sub.add_parser("build-trt", help="build a TensorRT plan (model.plan) from an ONNX model")
    trt.add_argument("onnx", type=Path, metavar="MODEL.onnx")
    trt.add_argument("-o", "--output", type=Path, default=Path("model.plan"), help="plan file to write")
    trt.add_argument("--fp16", action="store_true", help="allow FP16 kernels")
    trt.add_argument("--min-batch", type=int, default=1, help="optimization profile: smallest batch")
    trt.add_argument("--opt-batch", type=int, default=None, help="batch to tune for (default: max)")
    trt.add_argument("--max-batch", type=int, default=8, help="optimization profile: largest batch")
    trt.add_argument("--workspace-mib", type=int, default=None, help="builder workspace limit")
    trt.set_defaults(func=_cmd_build_trt)

    pl = sub.add_parser("placement", help="where each model lives (a lazy gateway's GET /v2/placement)")
    pl.add_argument("--url", default="http://localhost:8000", help="the gateway's HTTP address")
    pl.add_argument("--api-key", default=os.environ.get("MESHSERVE_API_KEY"),
                    help="an admin key, with --tenants (default: $MESHSERVE_API_KEY)")
    pl.add_argument("--json", action="store_true", help="the endpoint's JSON as it is")
    pl.add_argument("--timeout", type=float, default=10.0)
    pl.set_defaults(func=_cmd_placement)

    chk = sub.add_parser("check-repo", help="validate a model repository and report each model")
    chk.add_argument("path", type=Path)
    kinds.add_backend_directory(chk)
    chk.set_defaults(func=_cmd_check_repo)

    from meshserve import tritonserver

    tritonserver.add_parser(sub)  # Triton's command line, run as `up`
    # load generator and tuning (load/): imported only when the subcommand runs
    lg = sub.add_parser("load", help="load generator (see `meshserve load --help`)", add_help=False)
    lg.add_argument("rest", nargs=argparse.REMAINDER)
    lg.set_defaults(func=lambda a: _run_load_command("load", a.rest))
    tn = sub.add_parser("tune", help="sweep batching settings for a p99 target (see `meshserve tune --help`)",
                        add_help=False)
    tn.add_argument("rest", nargs=argparse.REMAINDER)
    tn.set_defaults(func=lambda a: _run_load_command("tune", a.rest))
    return ap


def command_of(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names (its first word, where that is one), or None (no word, an
    option such as --help, or a word that is none: the parser then says so, over all of them)."""
    return argv[0] if argv and argv[0] in _COMMANDS else None


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in _LOAD_COMMANDS:  # own argument parsers (argparse REMAINDER drops leading flags)
        _run_load_command(argv[0], argv[1:])
        return
    if argv and argv[0] == "tritonserver":  # Triton's own command line (meshserve/tritonserver.py)
        from meshserve import tritonserver

        tritonserver.main(argv[1:])
        return
    run_parsed(build_parser(command_of(argv)).parse_args(argv), argv)


def run_parsed(args: argparse.Namespace, argv: list[str]) -> None:
    """Run the subcommand ``args`` (parsed from ``argv``) names."""
    args.raw_argv = argv  # `meshserve gateway --workers N` starts its workers with these
    if getattr(args, "backend_directory", None) is not None:
        if not args.backend_directory.is_dir():
            raise SystemExit(f"meshserve {args.command}: --backend-directory {args.backend_directory}: not a directory")
        os.environ[kinds.BACKEND_DIR_ENV] = str(args.backend_directory.resolve())
    args.func(args)


if __name__ == "__main__":
    main()
