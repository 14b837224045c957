"""`meshserve tritonserver ARGS`: Triton's own command line, run as `meshserve up`.

A deployment that starts ``tritonserver --model-repository=/models --model-control-mode=explicit
--load-model=simple ...`` starts the mesh with the same words: every one of the 91 options of
Triton's ``src/command_line_parser.cc`` (server snapshot e1db8a603) is known here, parsed with its
grammar (getopt_long: ``--name=value`` or ``--name value``, a unique prefix of a name, booleans as
true/on/1 and false/off/0 in any case) and given one of three fates, listed in FLAGS and in
docs/tritonserver-flags.md:

- **mapped**: it means the same here and becomes `meshserve up`'s flag (ports, repository, model
  control, TLS, cache, logging, limits, ...);
- **ignored**: it tunes a part of Triton that meshserve does not have (thread pools, CUDA memory
  pools, Triton's trace files, ...); it is accepted, and a line on stderr names it and says why;
- **refused**: what it asks for cannot be done here and going on without it would change what a
  client gets or may reach (a second repository, restricted APIs, SageMaker, ...): the command
  stops before anything starts, naming the flag.

Triton's defaults where they differ from `meshserve up`'s: model control mode ``none`` (every
model loaded, the load / unload API refused), ``--exit-on-error=true`` (a model that fails to load
at start stops the server), ``--allow-client-shm=false`` (client shared memory refused), the
server's name ``triton`` (``--id``), logging at INFO, and the ports on every address (0.0.0.0), as
Triton listens.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field

PROG = "meshserve tritonserver"


class TritonArgError(Exception):
    """A command line Triton would refuse (its words), or one meshserve cannot run (a refused flag)."""


@dataclass(frozen=True)
class Flag:
    arg: str  # Triton's kind of argument: none, str, int, bool, float, or a pair's format
    fate: str  # mapped, ignored, refused (FATES)
    note: str  # what it becomes here, or why it is ignored or refused


FATES = ("mapped", "ignored", "refused")
NO_PART = "Triton's own {what}: meshserve has no such part"


def _m(arg: str, note: str) -> Flag:
    return Flag(arg, "mapped", note)


def _i(arg: str, note: str) -> Flag:
    return Flag(arg, "ignored", note)


def _r(arg: str, note: str) -> Flag:
    return Flag(arg, "refused", note)


PAIR = "str"  # Triton's "<a>,<b>=<c>"-style options take one string here; each is checked where it is used

# Every option of Triton's command line (src/command_line_parser.cc), in its order.
FLAGS: dict[str, Flag] = {
    "help": _m("none", "this list of options, and what each becomes"),
    "id": _m("str", "the server's name in its metadata (`--server-name`; Triton's default `triton`)"),
    "exit-timeout-secs": _i("int", "meshserve up gives its processes 20 s to stop"),
    "model-store": _m("str", "`--repository` (one repository: a second one is refused)"),
    "model-repository": _m("str", "`--repository` (one repository: a second one is refused)"),
    "exit-on-error": _m("bool", "`--exit-on-error` (Triton's default true): a model that fails to load at start, "
                                "a --load-model name no model has, or a model of a kind no service here runs, "
                                "stops the start"),
    "disable-auto-complete-config": _i("none", "meshserve completes configs as Triton does by default; a complete "
                                               "config is taken as written"),
    "strict-readiness": _i("bool", "the gateway is ready while it has a healthy service replica; each model's "
                                   "readiness is its own (/v2/models/NAME/ready)"),
    "model-control-mode": _m("str", "`--model-control-mode` none, poll or explicit (any case)"),
    "repository-poll-secs": _m("int", "`--repository-poll-secs` (poll mode)"),
    "load-model": _m("str", "`--load-model` (explicit mode; repeatable; `*` = every model; none given: no model "
                            "at start, as Triton)"),
    "model-config-name": _r("str", "custom model configurations (configs/NAME.pbtxt) are not read: the model "
                                   "would run with its config.pbtxt instead"),
    "model-load-thread-count": _m("int", "`--model-load-thread-count`, in every service"),
    "model-load-retry-count": _i("int", "a failed load is not retried (it is reported; load it again through "
                                        "the repository API)"),
    "model-namespacing": _r("bool", "one namespace of model names (true is refused; false is the default)"),
    "enable-peer-access": _i("bool", NO_PART.format(what="CUDA peer access between GPUs")),
    "allow-http": _m("bool", "`--allow-http` (false: the gateway serves gRPC only)"),
    "http-address": _m("str", "`--host` (the HTTP, gRPC and metrics addresses must be the same one)"),
    "http-port": _m("int", "`--http-port`"),
    "reuse-http-port": _i("bool", "the gateway's workers share its ports (`--gateway-workers`); another "
                                  "process cannot join them"),
    "http-header-forward-pattern": _r("str", "HTTP headers are not forwarded to models as request parameters: a "
                                             "model that reads them would not find them"),
    "http-thread-count": _i("int", NO_PART.format(what="HTTP thread pool (the gateway is one event loop per "
                                                       "worker: `--gateway-workers`)")),
    "http-max-input-size": _m("int", "`--max-request-bytes` (the gateway's bound on a request, HTTP body and "
                                     "gRPC message alike; default 64 MiB as Triton's)"),
    "http-restricted-api": _r("str", "restricted APIs by header are not kept: use --tenants (admin keys for model "
                                     "control, per-tenant model lists)"),
    "allow-grpc": _r("bool", "the gateway always serves gRPC (python models' BLS calls use it; false is "
                             "refused; true is the default)"),
    "grpc-address": _m("str", "`--host` (the HTTP, gRPC and metrics addresses must be the same one)"),
    "grpc-port": _m("int", "`--grpc-port`"),
    "reuse-grpc-port": _i("bool", "the gateway's workers share its ports (`--gateway-workers`); another "
                                  "process cannot join them"),
    "grpc-header-forward-pattern": _r("str", "gRPC metadata is not forwarded to models as request parameters: a "
                                             "model that reads them would not find them"),
    "grpc-infer-thread-count": _i("int", NO_PART.format(what="gRPC completion-queue threads")),
    "grpc-infer-allocation-pool-size": _i("int", NO_PART.format(what="gRPC allocation pool")),
    "grpc-max-response-pool-size": _i("int", NO_PART.format(what="gRPC response pool (a streamed request's "
                                                                 "waiting answers are bounded in bytes: "
                                                                 "--max-stream-backlog-bytes)")),
    "grpc-use-ssl": _m("bool", "`--grpc-use-ssl`"),
    "grpc-use-ssl-mutual": _m("bool", "`--grpc-use-ssl-mutual`"),
    "grpc-server-cert": _m("str", "`--grpc-server-cert`"),
    "grpc-server-key": _m("str", "`--grpc-server-key`"),
    "grpc-root-cert": _m("str", "`--grpc-root-cert`"),
    "grpc-infer-response-compression-level": _i("str", "answers are compressed when the client asks for it "
                                                       "(grpc-accept-encoding), not by a server-wide level"),
    "grpc-keepalive-time": _m("int", "`--keepalive-interval-s` (milliseconds here, seconds there)"),
    "grpc-keepalive-timeout": _m("int", "`--keepalive-timeout-s` (milliseconds here, seconds there)"),
    "grpc-keepalive-permit-without-calls": _i("bool", "a client's PINGs are answered whether calls are open or "
                                                      "not, within the PING flood bound "
                                                      "(--max-pending-control-frames)"),
    "grpc-http2-max-pings-without-data": _i("int", "the server's own PINGs follow --keepalive-interval-s"),
    "grpc-http2-min-recv-ping-interval-without-data": _i("int", "a client's PINGs are bounded by "
                                                                "--max-pending-control-frames, not by an interval"),
    "grpc-http2-max-ping-strikes": _i("int", "a client's PINGs are bounded by --max-pending-control-frames, not "
                                             "by strikes"),
    "grpc-max-connection-age": _i("int", "connections are not aged out (an idle one is closed after "
                                         "--idle-timeout-s)"),
    "grpc-max-connection-age-grace": _i("int", "connections are not aged out (an idle one is closed after "
                                               "--idle-timeout-s)"),
    "grpc-restricted-protocol": _r("str", "restricted protocols by header are not kept: use --tenants (admin keys "
                                          "for model control, per-tenant model lists)"),
    "log-verbose": _m("int", "a level above 0 is `--log-level DEBUG`"),
    "log-info": _m("bool", "false: `--log-level WARNING` (Triton's default shows INFO lines: so does this "
                           "command)"),
    "log-warning": _m("bool", "false (with --log-info=false): `--log-level ERROR`"),
    "log-error": _m("bool", "false (with the other two false): `--log-level CRITICAL`"),
    "log-format": _i("str", "meshserve's own line format (`meshserve service --log-format json` for JSON)"),
    "log-file": _m("str", "every process's output is appended to this file instead of the terminal"),
    "allow-sagemaker": _r("bool", "no SageMaker endpoint (true is refused)"),
    "sagemaker-port": _i("int", "no SageMaker endpoint"),
    "sagemaker-safe-port-range": _i("str", "no SageMaker endpoint"),
    "sagemaker-thread-count": _i("int", "no SageMaker endpoint"),
    "allow-vertex-ai": _r("bool", "no Vertex AI endpoint (true is refused)"),
    "vertex-ai-port": _i("int", "no Vertex AI endpoint"),
    "vertex-ai-thread-count": _i("int", "no Vertex AI endpoint"),
    "vertex-ai-default-model": _i("str", "no Vertex AI endpoint"),
    "allow-metrics": _m("bool", "`--allow-metrics` (false: no metrics port, and /metrics on the HTTP port is "
                                "404)"),
    "allow-gpu-metrics": _i("bool", "GPU metrics come from each service that has a GPU"),
    "allow-cpu-metrics": _i("bool", "CPU and memory metrics are always reported"),
    "metrics-address": _m("str", "`--host` (the HTTP, gRPC and metrics addresses must be the same one)"),
    "metrics-port": _m("int", "`--metrics-port`"),
    "metrics-interval-ms": _i("float", "each /metrics answer is scraped after its request (no interval)"),
    "metrics-config": _i(PAIR, "meshserve's metrics have fixed settings (docs/observability.md)"),
    "trace-config": _i(PAIR, "traces are OpenTelemetry spans (OTEL_* environment, docs/observability.md); "
                             "set Triton's trace settings at /v2/trace/setting"),
    "cache-config": _m(PAIR, "`--cache-config` (Triton's syntax: local,size=N; redis,host=H ...)"),
    "cache-directory": _i("str", "the response cache's kinds are built in (local, redis)"),
    "rate-limit": _i("str", NO_PART.format(what="rate limiter over model instances (per-tenant quotas: "
                                                "--tenants)")),
    "rate-limit-resource": _i(PAIR, NO_PART.format(what="rate limiter over model instances")),
    "pinned-memory-pool-byte-size": _i("int", NO_PART.format(what="pinned memory pool")),
    "cuda-memory-pool-byte-size": _i(PAIR, NO_PART.format(what="CUDA memory pool")),
    "cuda-virtual-address-size": _i(PAIR, NO_PART.format(what="CUDA virtual address reservation")),
    "min-supported-compute-capability": _i("float", "the CUDA runtime decides which GPUs a model may use"),
    "buffer-manager-thread-count": _i("int", NO_PART.format(what="buffer manager threads")),
    "host-policy": _i(PAIR, NO_PART.format(what="host policies (NUMA placement)")),
    "model-load-gpu-limit": _i(PAIR, "GPU memory is budgeted per service: `meshserve up --gpu-memory-budget`"),
    "allow-client-shm": _m("bool", "Triton's default false (since 2026-04): `--max-shm-regions 0`, a region's "
                                   "registration refused in Triton's words; true: the gateway's default bounds"),
    "backend-directory": _m("str", "`--backend-directory` (python-based backends)"),
    "backend-config": _i(PAIR, "backends take no server-wide settings here (a model's config.pbtxt parameters "
                               "still apply)"),
    "repoagent-directory": _i("str", NO_PART.format(what="repository agents")),
    "strict-model-config": _i("bool", "meshserve completes configs as Triton does by default; a complete config "
                                      "is taken as written"),
    "response-cache-byte-size": _m("int", "`--cache-config local,size=N`"),
    "trace-file": _i("str", "traces are OpenTelemetry spans (OTEL_* environment, docs/observability.md)"),
    "trace-level": _i("str", "set at /v2/trace/setting, or OTEL_* environment (docs/observability.md)"),
    "trace-rate": _i("int", "set at /v2/trace/setting, or OTEL_* environment (docs/observability.md)"),
    "trace-count": _i("int", "set at /v2/trace/setting, or OTEL_* environment (docs/observability.md)"),
    "trace-log-frequency": _i("int", "traces are OpenTelemetry spans (OTEL_* environment, docs/observability.md)"),
}

_TRUE = ("true", "on", "1")
_FALSE = ("false", "off", "0")


def parse_bool(value: str) -> bool:
    low = value.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise TritonArgError(f"invalid value for bool option: {value}")


def parse_int(value: str) -> int:
    try:
        return int(value.strip())
    except ValueError:
        raise TritonArgError(f"Invalid option value. Got {value}") from None


def parse_float(value: str) -> float:
    try:
        return float(value.strip())
    except ValueError:
        raise TritonArgError(f"Invalid option value. Got {value}") from None


def _name_of(word: str, given: str) -> str:
    """The option ``word`` (after its ``--``, before any ``=``) names: the option itself, or the
    one option it is a prefix of (getopt_long's abbreviations); ``given``: the argument as
    written, for getopt_long's message."""
    if word in FLAGS:
        return word
    matches = [n for n in FLAGS if n.startswith(word)]
    if not matches:
        raise TritonArgError(f"unrecognized option '{given}'")
    if len(matches) > 1:
        raise TritonArgError(f"option '--{word}' is ambiguous; possibilities: "
                             + " ".join(f"'--{n}'" for n in matches))
    return matches[0]


def split(argv: list[str]) -> list[tuple[str, str | None]]:
    """Triton's command line as (option, value) pairs in order, with getopt_long's grammar: an
    option is ``--name=value`` or ``--name value`` (``--name`` alone for the two without a
    value); anything else is Triton's "Unexpected argument"."""
    out: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        word = argv[i]
        i += 1
        if word == "--":
            if i < len(argv):
                raise TritonArgError(f"Unexpected argument: {argv[i]}")
            break
        if not word.startswith("--") or word == "--":
            raise TritonArgError(f"Unexpected argument: {word}")
        body, eq, value = word[2:].partition("=")
        name = _name_of(body, word)
        if FLAGS[name].arg == "none":
            if eq:
                raise TritonArgError(f"option '--{name}' doesn't allow an argument")
            out.append((name, None))
            continue
        if not eq:
            if i >= len(argv):
                raise TritonArgError(f"option '--{name}' requires an argument")
            value = argv[i]
            i += 1
        out.append((name, value))
    return out


@dataclass
class Translation:
    """What a Triton command line becomes: `meshserve up`'s arguments, the models explicit mode
    loads at start (None: up's default, every model), the file the output goes to, and a line per
    ignored option."""

    up_argv: list[str]
    load_models: list[str] | None
    log_file: str | None = None
    notes: list[str] = field(default_factory=list)
    show_help: bool = False


def _bad(name: str, why: str) -> TritonArgError:
    """Triton's words for a value it refuses."""
    return TritonArgError(f'Bad option: "--{name}".\n{why}')


def translate(argv: list[str]) -> Translation:
    """Triton's command line ``argv`` as `meshserve up`'s (TritonArgError: Triton's refusal in its
    words, or a refused option with why)."""
    pairs = split(argv)
    repositories: list[str] = []
    address: dict[str, str] = {}
    mode = "none"
    load: list[str] = []
    up: list[str] = []
    notes: list[str] = []
    server_id = "triton"
    exit_on_error = True
    log_verbose = 0
    log_on = {"log-info": True, "log-warning": True, "log-error": True}
    log_file: str | None = None
    cache_size: int | None = None
    caches: list[str] = []
    allow_shm = False  # Triton's default since 2026-04 (server #8721)
    for name, value in pairs:
        flag = FLAGS[name]
        try:
            parsed = _parse_value(name, flag, value)
        except TritonArgError as exc:
            raise _bad(name, str(exc)) from None
        if name == "help":
            return Translation([], None, show_help=True)
        if flag.fate == "refused":
            if name in ("model-namespacing", "allow-sagemaker", "allow-vertex-ai") and parsed is False:
                continue
            if name == "allow-grpc" and parsed is True:
                continue
            raise TritonArgError(f"--{name}: not supported by meshserve: {flag.note}")
        if flag.fate == "ignored":
            note = f"--{name} has no effect here: {flag.note}"
            if note not in notes:  # (once per option, however often it is given)
                notes.append(note)
            continue
        if name in ("model-store", "model-repository"):
            if value not in repositories:
                repositories.append(str(value))
        elif name == "id":
            server_id = str(value)
        elif name == "exit-on-error":
            exit_on_error = bool(parsed)
        elif name == "model-control-mode":
            mode = str(value).lower()
            if mode not in ("none", "poll", "explicit"):
                raise _bad(name, "invalid argument for --model-control-mode")
        elif name == "repository-poll-secs":
            up += ["--repository-poll-secs", str(parsed)]
        elif name == "load-model":
            load.append(str(value))
        elif name == "model-load-thread-count":
            up += ["--model-load-thread-count", str(parsed)]
        elif name in ("http-address", "grpc-address", "metrics-address"):
            address[name] = str(value)
        elif name in ("http-port", "grpc-port", "metrics-port"):
            up += [f"--{name}", str(parsed)]
        elif name == "http-max-input-size":
            if _int(parsed) <= 0:
                raise _bad(name, "Error: --http-max-input-size must be greater than 0.")
            up += ["--max-request-bytes", str(parsed)]
        elif name in ("grpc-use-ssl", "grpc-use-ssl-mutual", "allow-http", "allow-metrics"):  # up's own, by name
            up.append(f"--{name}={'true' if parsed else 'false'}")
        elif name in ("grpc-server-cert", "grpc-server-key", "grpc-root-cert", "backend-directory"):
            up += [f"--{name}", str(value)]
        elif name in ("grpc-keepalive-time", "grpc-keepalive-timeout"):
            seconds = _int(parsed) / 1000
            if seconds <= 0:
                raise _bad(name, f"must be greater than 0. Got {value}")
            up += ["--keepalive-interval-s" if name == "grpc-keepalive-time" else "--keepalive-timeout-s",
                   f"{seconds:g}"]
        elif name == "log-verbose":
            log_verbose = _int(parsed)
        elif name in log_on:
            log_on[name] = bool(parsed)
        elif name == "log-file":
            log_file = str(value)
        elif name == "cache-config":
            cache, comma, setting = str(value).partition(",")
            if not comma or not cache:
                raise _bad(name, "No cache specified. --cache-config option format is "
                                 f"<cache name>,<setting>=<value>. Got {value}")
            if "=" not in setting:
                raise _bad(name, f"--cache-config option format is '<cache name>,<setting>=<value>'. Got {value}")
            caches.append(str(value))
        elif name == "response-cache-byte-size":
            cache_size = _int(parsed)
        elif name == "allow-client-shm":
            allow_shm = bool(parsed)
        else:  # a mapped option without a rule above: a bug in this table
            raise AssertionError(f"--{name} is mapped but has no translation")
    if not repositories:
        raise TritonArgError("--model-repository must be specified")
    if len(repositories) > 1:
        raise TritonArgError(f"--model-repository: not supported by meshserve: one repository per mesh, got "
                             f"{len(repositories)} ({', '.join(repositories)}); Triton's several repositories "
                             "(and --model-namespacing) are not served")
    if load and mode != "explicit":
        raise TritonArgError("Error: Use of '--load-model' requires setting '--model-control-mode=explicit' as well.")
    if cache_size is not None and caches:
        raise TritonArgError("Error: Incompatible flags --response-cache-byte-size and --cache-config both provided. "
                             "Please provide one or the other.")
    if cache_size is not None:
        caches.append(f"local,size={cache_size}")
    # Triton's defaults: HTTP and gRPC on every address, metrics on the HTTP address
    address.setdefault("http-address", "0.0.0.0")
    address.setdefault("grpc-address", "0.0.0.0")
    address.setdefault("metrics-address", address["http-address"])
    hosts = set(address.values())
    if len(hosts) > 1:
        raise TritonArgError("--http-address, --grpc-address, --metrics-address: not supported by meshserve: the "
                             "gateway listens on one address, here "
                             + ", ".join(f"--{k}={v}" for k, v in sorted(address.items()))
                             + " (with Triton's defaults: give the same address to each)")
    level = "DEBUG" if log_verbose > 0 else next(
        (lvl for key, lvl in (("log-info", "INFO"), ("log-warning", "WARNING"), ("log-error", "ERROR"))
         if log_on[key]), "CRITICAL")
    up = ["--repository", repositories[0], "--host", hosts.pop(), "--server-name", server_id,
          "--model-control-mode", mode, "--log-level", level, *up,
          *(f for c in caches for f in ("--cache-config", c))]
    if exit_on_error:
        up.append("--exit-on-error")
    if not allow_shm:
        up += ["--max-shm-regions", "0"]
    return Translation(up, load if mode == "explicit" else None, log_file, notes)


def _int(parsed: object) -> int:
    """An int option's value, as _parse_value read it."""
    assert isinstance(parsed, int), parsed
    return parsed


def _parse_value(name: str, flag: Flag, value: str | None) -> object:
    if name == "log-verbose" and str(value).lower() in ("true", "false"):  # Triton's ParseIntBoolOption
        return int(str(value).lower() == "true")
    if flag.arg == "bool":
        return parse_bool(str(value))
    if flag.arg == "int":
        return parse_int(str(value))
    if flag.arg == "float":
        return parse_float(str(value))
    return value


def usage() -> str:
    """Every option of Triton's command line and what it does here."""
    lines = [f"usage: {PROG} --model-repository=PATH [Triton's options]", "",
             "Triton's command line, run as `meshserve up` (docs/tritonserver-flags.md). Each option:", ""]
    for fate in FATES:
        lines.append(f"{fate}:")
        for name, flag in FLAGS.items():
            if flag.fate == fate:
                arg = "" if flag.arg == "none" else f" <{flag.arg}>"
                lines.append(f"  --{name}{arg}\n\t{flag.note}")
        lines.append("")
    return "\n".join(lines)


def doc_table() -> str:
    """The table of docs/tritonserver-flags.md: every option, its fate, what it does here."""
    rows = ["| Triton's option | fate | here |", "|---|---|---|"]
    for name, flag in FLAGS.items():
        rows.append(f"| `--{name}` | {flag.fate} | {flag.note.replace('|', '/')} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str]) -> None:
    """Run Triton's command line ``argv`` as `meshserve up` (exit 1 with Triton's message on a
    command line it refuses, as tritonserver does)."""
    try:
        t = translate(argv)
    except TritonArgError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        print(f"(`{PROG} --help` lists every option and what it does here)", file=sys.stderr)
        raise SystemExit(1) from None
    if t.show_help:
        print(usage())
        return
    if t.log_file is not None:
        _output_to(t.log_file)
    for note in t.notes:
        print(f"{PROG}: {note}", file=sys.stderr, flush=True)
    from meshserve import cli

    argv = ["up", *t.up_argv]
    args = cli.build_parser("up").parse_args(argv)
    args.load_model = t.load_models  # (explicit mode without --load-model: none, which up's flags cannot say)
    print(f"{PROG}: running `meshserve up {' '.join(t.up_argv)}`"
          + (f" with {', '.join(t.load_models) or 'no model'} loaded at start" if t.load_models is not None else ""),
          file=sys.stderr, flush=True)
    cli.run_parsed(args, argv)


def _output_to(path: str) -> None:
    """--log-file: this process's output and its children's (which inherit it), appended to ``path``."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError as exc:
        raise SystemExit(f"{PROG}: --log-file {path}: {exc.strerror}") from None
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """The subcommand's entry in `meshserve --help` (its arguments are Triton's, parsed here)."""
    p = sub.add_parser("tritonserver", help="run Triton's command line (tritonserver's options) as `meshserve up`",
                       add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda a: main(a.rest))
