"""meshserve/cli.py:build_parser with the subcommand a command line names: only that
subcommand's arguments are defined, so `meshserve service KIND` does not import the gateway and
`meshserve gateway` not the services' core (docs/perf/suite-time.md), and the command line
parses to the same namespace as with the whole parser."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from meshserve.cli import _COMMANDS, build_parser, command_of
from tests.conftest import ROOT

LINES = [
    ["service", "onnx", "--repository", "/r", "--grpc-port", "0", "--http-port", "0",
     "--model-control-mode", "explicit", "--load-model", "*", "--bls-target", "127.0.0.1:1"],
    ["service", "python", "--repository", "/r", "--model-load-thread-count", "2", "--memory-budget", "1Gi"],
    ["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", "127.0.0.1:1", "--workers", "2"],
    ["up", "--repository", "/r", "--mesh-tls", "--cache-config", "local", "--replicas", "2"],
    ["hop-key", "/k"],
    ["check-repo", "/r"],
    ["placement", "--json"],
]


def _subcommands(parser: argparse.ArgumentParser) -> set[str]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return set(sub.choices)


def test_command_of_knows_every_subcommand_and_nothing_else() -> None:
    assert set(_COMMANDS) == _subcommands(build_parser())
    assert [command_of([c, "x"]) for c in _COMMANDS] == list(_COMMANDS)
    assert command_of([]) is None and command_of(["--help"]) is None and command_of(["servic"]) is None


@pytest.mark.parametrize("argv", LINES, ids=lambda a: a[0] + (f"-{a[1]}" if a[0] == "service" else ""))
def test_a_command_line_parses_alike_with_its_subcommand_alone(argv: list[str]) -> None:
    whole, alone = build_parser().parse_args(argv), build_parser(command_of(argv)).parse_args(argv)
    assert vars(alone).keys() == vars(whole).keys()
    assert {k: v for k, v in vars(alone).items() if k != "func"} == {k: v for k, v in vars(whole).items() if k != "func"}
    assert alone.func.__name__ == whole.func.__name__


@pytest.mark.parametrize("argv, code", [(["service", "onnx", "--bad-flag"], 2), (["gateway", "--workers"], 2),
                                        (["service", "nope"], 2), (["service", "onnx", "--help"], 0),
                                        (["gateway", "--help"], 0), (["up", "--help"], 0)])
def test_help_and_refusals_say_the_same(argv: list[str], code: int, capsys: pytest.CaptureFixture[str]) -> None:
    said = []
    for parser in (build_parser(), build_parser(command_of(argv))):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(argv)
        out = capsys.readouterr()
        said.append((exc.value.code, out.out, out.err))
    assert said[0] == said[1] and said[0][0] == code, said


@pytest.mark.parametrize("command, absent", [("service", "gateway"), ("gateway", "services")])
def test_a_process_imports_only_its_own_package_to_parse(command: str, absent: str) -> None:
    code = ("import sys\nfrom meshserve.cli import build_parser, command_of\n"
            f"build_parser(command_of([{command!r}]))\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] == {absent!r}))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
