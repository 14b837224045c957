"""`meshserve tritonserver`'s reading of Triton's command line (meshserve/tritonserver.py): the
whole option list of Triton's parser, its grammar, each option's fate, and what `meshserve up`
gets. The running mesh: tests/e2e/test_tritonserver_cli.py."""
from __future__ import annotations

import re

import pytest

from meshserve import cli, tritonserver
from meshserve.tritonserver import FLAGS, TritonArgError, split, translate
from tests.conftest import ROOT

# Every option of Triton's command line: the names of src/command_line_parser.cc's option table
# (server snapshot e1db8a603, 2026-08-19), in its order, and Triton's kind of argument.
TRITON_OPTIONS = """
help:none id:str exit-timeout-secs:int model-store:str model-repository:str exit-on-error:bool
disable-auto-complete-config:none strict-readiness:bool model-control-mode:str repository-poll-secs:int
load-model:str model-config-name:str model-load-thread-count:int model-load-retry-count:int
model-namespacing:bool enable-peer-access:bool allow-http:bool http-address:str http-port:int
reuse-http-port:bool http-header-forward-pattern:str http-thread-count:int http-max-input-size:int
http-restricted-api:str allow-grpc:bool grpc-address:str grpc-port:int reuse-grpc-port:bool
grpc-header-forward-pattern:str grpc-infer-thread-count:int grpc-infer-allocation-pool-size:int
grpc-max-response-pool-size:int grpc-use-ssl:bool grpc-use-ssl-mutual:bool grpc-server-cert:str
grpc-server-key:str grpc-root-cert:str grpc-infer-response-compression-level:str grpc-keepalive-time:int
grpc-keepalive-timeout:int grpc-keepalive-permit-without-calls:bool grpc-http2-max-pings-without-data:int
grpc-http2-min-recv-ping-interval-without-data:int grpc-http2-max-ping-strikes:int
grpc-max-connection-age:int grpc-max-connection-age-grace:int grpc-restricted-protocol:str log-verbose:int
log-info:bool log-warning:bool log-error:bool log-format:str log-file:str allow-sagemaker:bool
sagemaker-port:int sagemaker-safe-port-range:str sagemaker-thread-count:int allow-vertex-ai:bool
vertex-ai-port:int vertex-ai-thread-count:int vertex-ai-default-model:str allow-metrics:bool
allow-gpu-metrics:bool allow-cpu-metrics:bool metrics-address:str metrics-port:int metrics-interval-ms:float
metrics-config:str trace-config:str cache-config:str cache-directory:str rate-limit:str
rate-limit-resource:str pinned-memory-pool-byte-size:int cuda-memory-pool-byte-size:str
cuda-virtual-address-size:str min-supported-compute-capability:float buffer-manager-thread-count:int
host-policy:str model-load-gpu-limit:str allow-client-shm:bool backend-directory:str backend-config:str
repoagent-directory:str strict-model-config:bool response-cache-byte-size:int trace-file:str trace-level:str
trace-rate:int trace-count:int trace-log-frequency:int
""".split()

# a value each refused option is refused with (the others of its kind are Triton's defaults)
REFUSING = {"model-config-name": "alt", "model-namespacing": "true",
            "http-header-forward-pattern": "x-.*", "http-restricted-api": "model-repository:k=v",
            "allow-grpc": "false", "grpc-header-forward-pattern": "x-.*",
            "grpc-restricted-protocol": "model-repository:k=v", "allow-sagemaker": "true",
            "allow-vertex-ai": "true"}
VALUE = {"none": None, "str": "x", "int": "3", "bool": "true", "float": "1.5"}


def _up(argv: list[str]) -> list[str]:
    return translate(["--model-repository=/models", *argv]).up_argv


def _up_args(argv: list[str]):  # type: ignore[no-untyped-def]
    """What `meshserve up`'s own parser makes of the translation."""
    return cli.build_parser("up").parse_args(["up", *_up(argv)])


def test_every_option_of_triton_has_a_fate_and_nothing_else_is_listed() -> None:
    listed = [f"{name}:{flag.arg}" for name, flag in FLAGS.items()]
    assert listed == TRITON_OPTIONS
    assert len(FLAGS) == 91
    for name, flag in FLAGS.items():
        assert flag.fate in tritonserver.FATES and flag.note, name


@pytest.mark.parametrize("name", [n for n, f in FLAGS.items() if f.fate == "ignored"])
def test_an_ignored_option_is_taken_and_named_with_why(name: str) -> None:
    value = {"log-format": "ISO8601", "grpc-infer-response-compression-level": "high",
             "rate-limit": "execution_count"}.get(name, VALUE[FLAGS[name].arg])
    t = translate(["--model-repository=/m", f"--{name}" if value is None else f"--{name}={value}"])
    assert t.notes == [f"--{name} has no effect here: {FLAGS[name].note}"]


@pytest.mark.parametrize("name", list(REFUSING))
def test_a_refused_option_stops_the_start_naming_it(name: str) -> None:
    assert FLAGS[name].fate == "refused"
    with pytest.raises(TritonArgError, match=f"^--{name}: not supported by meshserve: "):
        translate(["--model-repository=/m", f"--{name}={REFUSING[name]}"])


def test_refused_options_at_their_default_are_taken() -> None:
    t = translate(["--model-repository=/m", "--allow-grpc=1", "--model-namespacing=false", "--allow-sagemaker=off",
                   "--allow-vertex-ai=0"])
    assert t.notes == []
    assert {n for n, f in FLAGS.items() if f.fate == "refused"} == set(REFUSING)


def test_grammar_is_getopt_long() -> None:
    assert split(["--model-repository=/a", "--http-port", "9", "--disable-auto-complete-config"]) == [
        ("model-repository", "/a"), ("http-port", "9"), ("disable-auto-complete-config", None)]
    assert split(["--model-repo=/a", "--load-m", "x"]) == [("model-repository", "/a"), ("load-model", "x")]
    for argv, says in [(["--model-"], "option '--model-' is ambiguous; possibilities: '--model-store'"),
                       (["--nope"], "unrecognized option '--nope'"),
                       (["--http-port"], "option '--http-port' requires an argument"),
                       (["--disable-auto-complete-config=1"], "option '--disable-auto-complete-config' doesn't "
                                                              "allow an argument"),
                       (["models"], "Unexpected argument: models"),
                       (["--http-port=1", "--", "x"], "Unexpected argument: x")]:
        with pytest.raises(TritonArgError) as err:
            split(argv)
        assert str(err.value).startswith(says), (argv, str(err.value))


def test_values_are_read_as_triton_reads_them() -> None:
    for word in ("true", "ON", "1"):
        assert "--exit-on-error" in _up([f"--exit-on-error={word}"])
    for word in ("False", "off", "0"):
        assert "--exit-on-error" not in _up([f"--exit-on-error={word}"])
    with pytest.raises(TritonArgError, match='^Bad option: "--exit-on-error".\ninvalid value for bool option: y$'):
        _up(["--exit-on-error=y"])
    with pytest.raises(TritonArgError, match='^Bad option: "--http-port".\nInvalid option value. Got 8k$'):
        _up(["--http-port=8k"])
    with pytest.raises(TritonArgError, match="invalid argument for --model-control-mode"):
        _up(["--model-control-mode=lazy"])  # meshserve up's own mode is not Triton's
    with pytest.raises(TritonArgError, match="--http-max-input-size must be greater than 0"):
        _up(["--http-max-input-size=0"])
    assert _up_args(["--log-verbose=true"]).log_level == "DEBUG"  # ParseIntBoolOption


def test_the_metrics_address_is_the_http_addresss_by_default() -> None:
    assert _up_args(["--http-address=10.0.0.1", "--grpc-address=10.0.0.1"]).host == "10.0.0.1"


def test_triton_defaults_become_up_flags() -> None:
    args = _up_args([])
    assert (args.repository.as_posix(), args.host, args.server_name, args.model_control_mode, args.log_level,
            args.exit_on_error, args.limit_max_shm_regions) == ("/models", "0.0.0.0", "triton", "none", "INFO",
                                                                True, 0)
    assert translate(["--model-repository=/m"]).load_models is None


def test_mapped_options_become_up_flags_up_accepts() -> None:
    argv = ["--id=edge", "--model-store=/models", "--exit-on-error=false", "--model-control-mode=Explicit",
            "--load-model=a", "--load-model", "b", "--model-load-thread-count=2", "--http-address=10.0.0.1",
            "--grpc-address=10.0.0.1", "--metrics-address=10.0.0.1", "--http-port=1", "--grpc-port=2",
            "--metrics-port=3", "--http-max-input-size=1000", "--grpc-use-ssl-mutual=true", "--grpc-server-cert=c",
            "--grpc-server-key=k", "--grpc-root-cert=r", "--grpc-keepalive-time=7000",
            "--grpc-keepalive-timeout=500", "--log-info=false", "--log-file=/tmp/x.log",
            "--cache-config=local,size=1024", "--allow-client-shm=true", "--backend-directory=/b"]
    t = translate(argv)
    assert t.load_models == ["a", "b"] and t.log_file == "/tmp/x.log" and t.notes == []
    args = cli.build_parser("up").parse_args(["up", *t.up_argv])
    assert args.server_name == "edge" and args.repository.as_posix() == "/models" and not args.exit_on_error
    assert args.model_control_mode == "explicit" and args.model_load_thread_count == 2 and args.host == "10.0.0.1"
    assert (args.http_port, args.grpc_port, args.metrics_port) == (1, 2, 3)
    assert args.limit_max_request_bytes == 1000 and args.limit_max_shm_regions == 256  # (shm allowed: the default)
    assert args.tls_grpc_mutual and str(args.tls_grpc_cert) == "c" and str(args.tls_grpc_key) == "k"
    assert str(args.tls_grpc_root) == "r"
    assert (args.limit_keepalive_interval_s, args.limit_keepalive_timeout_s) == (7.0, 0.5)
    assert args.log_level == "WARNING" and args.cache_config == ["local,size=1024"]
    assert str(args.backend_directory) == "/b"
    every_mapped = {n for n, f in FLAGS.items() if f.fate == "mapped"}
    used = {a.split("=")[0][2:] for a in argv if a.startswith("--")} | {"model-repository", "help",
                                                                       "repository-poll-secs", "log-verbose",
                                                                       "log-warning", "log-error",
                                                                       "response-cache-byte-size", "grpc-use-ssl",
                                                                       "allow-http", "allow-metrics"}
    assert every_mapped <= used | {"load-model"}  # each mapped option is exercised here or below


def test_the_rest_of_the_mapped_options() -> None:
    assert _up_args(["--model-control-mode=POLL", "--repository-poll-secs=3"]).repository_poll_secs == 3
    assert _up_args(["--response-cache-byte-size=4096"]).cache_config == ["local,size=4096"]
    assert _up_args(["--grpc-use-ssl=1"]).tls_grpc_use_ssl
    on = _up_args(["--allow-http=on", "--allow-metrics=1"])
    off = _up_args(["--allow-http=false", "--allow-metrics=OFF"])
    assert (on.allow_http, on.allow_metrics, off.allow_http, off.allow_metrics) == (True, True, False, False)
    assert _up_args(["--log-info=0", "--log-warning=0"]).log_level == "ERROR"
    assert _up_args(["--log-info=0", "--log-warning=0", "--log-error=0"]).log_level == "CRITICAL"
    assert translate(["--help"]).show_help
    assert translate(["--model-repository=/m", "--model-control-mode=explicit"]).load_models == []  # none at start


def test_command_lines_triton_refuses_after_parsing() -> None:
    for argv, says in [([], "--model-repository must be specified"),
                       (["--model-repository=/b"], "one repository per mesh, got 2 (/a, /b)"),
                       (["--load-model=x"], "Error: Use of '--load-model' requires setting "
                                            "'--model-control-mode=explicit' as well."),
                       (["--response-cache-byte-size=1", "--cache-config=local,size=2"],
                        "Error: Incompatible flags --response-cache-byte-size and --cache-config both provided."),
                       (["--http-address=127.0.0.1", "--grpc-address=0.0.0.0"], "listens on one address"),
                       (["--http-address=127.0.0.1"], "--grpc-address=0.0.0.0, --http-address=127.0.0.1, "
                                                      "--metrics-address=127.0.0.1 (with Triton's defaults"),
                       (["--cache-config=size=1"], "No cache specified. --cache-config option format is")]:
        with pytest.raises(TritonArgError) as err:
            translate((["--model-repository=/a"] if argv else []) + argv)
        assert says in str(err.value), (argv, str(err.value))


def test_up_takes_load_model_only_in_explicit_mode() -> None:
    args = cli.build_parser("up").parse_args(["up", "--model-control-mode", "poll", "--load-model", "a"])
    assert cli._up_refusal(args) == ("meshserve up: Use of '--load-model' requires setting "
                                     "'--model-control-mode=explicit' as well.")
    explicit = cli.build_parser("up").parse_args(["up", "--model-control-mode", "EXPLICIT", "--load-model", "a"])
    assert cli._up_refusal(explicit) is None
    assert cli._up_mesh_service_flags(explicit)[:4] == ["--model-control-mode", "explicit", "--load-model", "a"]
    explicit.load_model = None  # up's own default: every model
    assert cli._up_mesh_service_flags(explicit)[:4] == ["--model-control-mode", "explicit", "--load-model", "*"]
    explicit.load_model = []  # Triton's explicit mode without --load-model: none
    assert "--load-model" not in cli._up_mesh_service_flags(explicit)


def test_the_doc_lists_every_option_with_its_fate() -> None:
    doc = (ROOT / "docs" / "tritonserver-flags.md").read_text()
    rows = dict(re.findall(r"^\| `--([a-z0-9-]+)` \| (\w+) \|", doc, re.M))
    assert rows == {name: flag.fate for name, flag in FLAGS.items()}
    assert tritonserver.doc_table() in doc
