"""Entry point shared by every backend service: `meshserve service KIND ...`."""
from __future__ import annotations

import argparse
from pathlib import Path

from meshserve.repository import kinds
from meshserve.repository.kinds import add_backend_directory
from meshserve.server import limits as server_limits
from meshserve.server import repository_control, tls
from meshserve.server.core import add_server_name_argument
from meshserve.server.process import configure_tracing, run, serve, setup_logging
from services.base import load_threads, memory
from services.base.control import MODES, ModelControl
from services.base.core import ServiceCore
from services.base.runtime import RuntimeAdapter

# --max-model-load-bytes: what loading a model uploaded in a load request may allocate (a 310-byte
# ONNX file of two ConstantOfShape nodes made onnxruntime's constant folding take 1.9 GiB)
DEFAULT_MAX_MODEL_LOAD_BYTES = 512 << 20


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--repository", required=True, type=Path, help="Triton-layout model repository")
    add_backend_directory(ap)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--grpc-port", type=int, default=8101, help="gRPC port (0 = pick a free one)")
    ap.add_argument("--http-port", type=int, default=None, help="also serve v2 REST on this port")
    ap.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    ap.add_argument("--log-level", default="INFO")
    ap.add_argument("--model-control-mode", choices=MODES, default="none",
                    help="none: load all, API refused (Triton's default); explicit: load --load-model "
                         "names, then load/unload through the API; poll: reload changed models")
    ap.add_argument("--load-model", action="append", default=[], metavar="NAME",
                    help="explicit mode: a model to load at start ('*' = all); repeatable")
    ap.add_argument("--repository-poll-secs", type=float, default=15.0, metavar="SECONDS")
    ap.add_argument("--exit-on-error", action="store_true",
                    help="exit (code 1, before the ready line) when a model of the start fails to load "
                         "(Triton's --exit-on-error; default: report it in the index and serve the rest)")
    add_load_thread_argument(ap, load_threads.DEFAULT_LOAD_THREADS)
    ap.add_argument("--log-format", choices=("text", "json"), default="text",
                    help="json: one JSON object per log line (request id and trace id as keys)")
    py = ap.add_argument_group("python service")
    py.add_argument("--bls-target", default="", metavar="HOST:PORT",
                    help="python models' BLS calls (InferenceRequest.exec) go to this gRPC address: the gateway's "
                         "(`meshserve up` passes it)")
    add_bls_key_argument(py)
    add_bls_tls_arguments(py)
    py.add_argument("--python-execute-timeout", type=float, default=60.0, metavar="SECONDS",
                    help="an execute() running longer gets its worker killed and restarted, its requests "
                         "UNAVAILABLE (0 = no limit; a model's parameter execute_timeout_seconds overrides it)")
    ap.add_argument("--max-model-load-bytes", type=int, default=DEFAULT_MAX_MODEL_LOAD_BYTES, metavar="BYTES",
                    help="memory an uploaded model's load may take (onnx: measured in a child process under "
                         "this bound before the service loads it; more is a 400); 0 = no bound "
                         f"(default {DEFAULT_MAX_MODEL_LOAD_BYTES >> 20} MiB)")
    mem = ap.add_argument_group("memory budget (docs/model-mesh.md, Service side)")
    mem.add_argument("--memory-budget", type=_budget, default=None, metavar="BYTES",
                     help="bytes this service's loaded models may hold (512Mi, 2G, 80%% of the base); with "
                          "--model-control-mode explicit a load that would pass it first unloads the least recently "
                          "used idle unpinned model versions, else it is refused (RESOURCE_EXHAUSTED); default "
                          f"{memory.DEFAULT_BUDGET_SHARE * 100:.0f}%% of the cgroup memory limit, or of physical memory")
    mem.add_argument("--pin", action="append", default=[], metavar="NAME",
                     help="a model that is never evicted (repeatable)")
    add_eviction_arguments(mem)
    add_server_name_argument(ap)
    repository_control.add_arguments(ap)
    server_limits.add_arguments(ap)


def add_load_thread_argument(ap: argparse.ArgumentParser | argparse._ArgumentGroup, default: int | None) -> None:
    """--model-load-thread-count: a service's (``default``: Triton's 4), and `meshserve up`'s
    (None: not passed on, the services' own default; meshserve/cli.py:_up_mesh_service_flags)."""
    ap.add_argument(load_threads.FLAG, type=load_threads.thread_count_argument, default=default, metavar="N",
                    help="models loaded at once (each on a thread of its own; a python model's "
                         "auto_complete_config runs too), pinned models first (Triton's flag; default "
                         f"{load_threads.DEFAULT_LOAD_THREADS}; docs/model-control.md)")


def add_eviction_arguments(ap: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--eviction-grace and --gpu-memory-budget: a service's, and `meshserve up`'s, which passes
    them on to its services (meshserve/cli.py:_up_mesh_service_flags)."""
    ap.add_argument("--eviction-grace", type=_grace, default=memory.EVICTION_GRACE_S, metavar="SECONDS",
                    help="a loaded model version that has not served a request yet is not evicted by another load "
                         "for this long after its load (a load that could only evict such versions is refused); "
                         f"0 = none (default {memory.EVICTION_GRACE_S:g}, at most {memory.MAX_EVICTION_GRACE_S:g})")
    ap.add_argument("--gpu-memory-budget", type=_gpu_budget, action="append", default=[],
                    metavar="[GPU=]BYTES",
                    help="device memory the loaded models' KIND_GPU instances may hold on each GPU (512Mi, 8G, "
                         "90%% of the GPU), or on one (0=8G; repeatable); counted and enforced as --memory-budget is; "
                         f"default {memory.DEFAULT_BUDGET_SHARE * 100:.0f}%% of each GPU's memory (none on a host "
                         "without a GPU)")


def eviction_flags(args: argparse.Namespace) -> list[str]:
    """``add_eviction_arguments``' values as flags again (what `meshserve up` gives each service)."""
    flags = ["--eviction-grace", repr(args.eviction_grace)]
    for device, amount in args.gpu_memory_budget:
        flags += ["--gpu-memory-budget", f"{'' if device is None else f'{device}='}{amount}"]
    return flags


def _budget(text: str) -> int:
    try:
        return memory.budget_argument(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _gpu_budget(text: str) -> tuple[int | None, int | str]:
    try:
        return memory.gpu_budget_argument(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _grace(text: str) -> float:
    try:
        return memory.grace_argument(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_bls_key_argument(ap: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--bls-api-key-file, of `meshserve service python` and of `meshserve up` (which passes it on)."""
    ap.add_argument("--bls-api-key-file", type=Path, default=None, metavar="FILE",
                    help="python models' BLS calls carry the API key in FILE (read once at start): the python "
                         "service's own identity at a gateway with --tenants, which the tenants file grants the "
                         "models BLS may reach (default: no key, refused unless the file allows anonymous callers)")


def add_bls_tls_arguments(ap: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """BLS over TLS, flags of `meshserve service python` (and of `meshserve up`, which passes them
    on): the gateway's gRPC port serves TLS (--grpc-use-ssl), mutual TLS too."""
    ap.add_argument("--bls-use-ssl", action="store_true",
                    help="python models' BLS calls reach --bls-target over TLS (default: plaintext)")
    ap.add_argument("--bls-root-cert", type=Path, default=None, metavar="PEM",
                    help="BLS over TLS: the CA the gateway's certificate must chain to (default: the system's; "
                         "giving it implies --bls-use-ssl)")
    ap.add_argument("--bls-client-cert", type=Path, default=None, metavar="PEM",
                    help="BLS over TLS: the service's client certificate, for a gateway with --grpc-use-ssl-mutual")
    ap.add_argument("--bls-client-key", type=Path, default=None, metavar="PEM", help="its private key")


def main(kind: str, adapters: dict[str, RuntimeAdapter], args: argparse.Namespace,
         gpu_available: bool = False, core_cls: type[ServiceCore] = ServiceCore) -> None:
    """Run the service of ``kind`` with its runtime ``adapters`` (config backend -> adapter): the
    backends its registry row serves (meshserve/repository/kinds.py)."""
    row = kinds.by_name(kind)
    if row is None or not set(adapters) <= row.served_backends:
        served = ", ".join(sorted(row.served_backends)) if row else "none: no such kind in meshserve/repository/kinds.py"
        raise SystemExit(f"meshserve service {kind}: adapters for {', '.join(sorted(adapters))}; the kind serves "
                         f"{served}")
    setup_logging(args.log_level, args.log_format)
    limits = server_limits.from_args(args)
    tls.configure_hop(limits.tls, args.host, service=True)  # which hop streams are believed (--hop-key-file)
    configure_tracing(f"meshserve-{kind}", "service")  # OTEL_* environment; off by default
    if not args.repository.is_dir():
        raise SystemExit(f"meshserve service {kind}: model repository {args.repository} does not exist")
    try:
        control = ModelControl(args.model_control_mode, frozenset(args.load_model), args.repository_poll_secs)
    except ValueError as exc:
        raise SystemExit(f"meshserve service {kind}: {exc}") from None

    async def amain() -> None:
        core = core_cls(kind, args.repository, adapters, gpu_available=gpu_available)
        core.control = control
        core.server_name = args.server_name
        core.access = repository_control.ControlPolicy.from_args(args)
        core.max_model_load_bytes = args.max_model_load_bytes
        core.load_threads = args.model_load_thread_count
        budget = args.memory_budget if args.memory_budget is not None else memory.default_budget()
        core.memory = memory.MemoryBook(budget, frozenset(args.pin), enforced=control.mode == "explicit",
                                        grace_s=args.eviction_grace)
        if gpu_available:  # device memory is counted per GPU (docs/model-mesh.md, "GPU memory")
            try:
                core.memory.gpu_budgets = memory.gpu_budgets(args.gpu_memory_budget, memory.gpu_totals())
            except ValueError as exc:
                raise SystemExit(f"meshserve service {kind}: {exc}") from None
        await core.start()
        failed = core.startup_failures()
        if failed and args.exit_on_error:
            await core.stop(drain=False)
            raise SystemExit(f"meshserve service {kind}: failed to load all models (--exit-on-error): "
                             + ", ".join(f"'{name}'" for name, _ in failed) + " (the reasons: above)")
        await serve(core, name=f"{kind}-service", host=args.host, grpc_port=args.grpc_port,
                    http_port=args.http_port, metrics_port=args.metrics_port, limits=limits)

    run(amain())
