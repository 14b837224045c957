"""``python -m load.bench --side-by-side --native``: how meshserve's processes are started and
checked (load/bench/sbs.py), without starting any (the real build: tests/unit/test_native.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from load.bench import sbs


def test_native_is_off_by_default_and_given_by_the_flag(tmp_path: Path) -> None:
    assert sbs.parse([str(tmp_path)]).native is False
    assert sbs.parse([str(tmp_path), "--native"]).native is True


def test_the_processes_run_pure_unless_native_whatever_the_caller_s_environment(tmp_path: Path) -> None:
    key = tmp_path / "hop.key"
    caller = {"PATH": "/usr/bin", "MESHSERVE_NATIVE": "1", "PYTHONPATH": "/elsewhere"}
    pure = sbs.meshserve_env(key, False, caller)
    assert "MESHSERVE_NATIVE" not in pure
    assert pure["MESHSERVE_HOP_KEY_FILE"] == str(key)
    assert pure["PYTHONPATH"].split(":") == [str(sbs.ROOT), "/elsewhere"]
    native = sbs.meshserve_env(key, True, {"PATH": "/usr/bin"})
    assert native["MESHSERVE_NATIVE"] == "1"
    assert native["PYTHONPATH"] == str(sbs.ROOT)
    assert caller["MESHSERVE_NATIVE"] == "1"  # (the caller's mapping is left as it was)


def _server(tmp_path: Path, text: str | None) -> sbs.Server:
    log = tmp_path / "gateway.log"
    if text is not None:
        log.write_text(text)
    return sbs.Server("gateway", None, "", "", log)  # type: ignore[arg-type]


def test_a_process_that_runs_the_build_passes_the_check(tmp_path: Path) -> None:
    server = _server(tmp_path, "starting\nmeshserve native: running compiled (10 modules): build abc\nready\n")
    sbs.check_native(server)
    assert sbs.native_line(server.log).endswith("build abc")


@pytest.mark.parametrize("text", [
    "meshserve native: running pure Python: no build for these sources (key k in /c: ...)\n",
    "ready\n",  # (no line at all: MESHSERVE_NATIVE did not reach it)
    None,  # (no log)
])
def test_a_process_that_does_not_run_the_build_stops_the_bench_with_its_line(tmp_path: Path, text: str | None
                                                                            ) -> None:
    with pytest.raises(SystemExit) as stop:
        sbs.check_native(_server(tmp_path, text))
    said = str(stop.value)
    assert "does not run the build" in said and "gateway" in said
    assert ("running pure Python" in said) == (text is not None and "pure" in text)


def test_a_build_that_cannot_be_made_stops_the_bench(monkeypatch: pytest.MonkeyPatch) -> None:
    from meshserve import native

    def fails(base: Path | None = None, out: Path | None = None, jobs: int | None = None) -> Path:
        raise RuntimeError("mypyc failed (1): boom")

    monkeypatch.setattr(native, "build", fails)
    with pytest.raises(SystemExit, match="the build could not be made: mypyc failed"):
        sbs.prepare_native()


def test_the_mode_is_in_every_meshserve_record_and_the_report(tmp_path: Path) -> None:
    rec = {"ok": True, "model": "add_sub", "mode": "grpc", "concurrency": 8, "repeat": 0, "infer_per_s": 1000.0, "p99_us": 900.0,
           "label": "gateway", "native": "compiled k1"}
    meta = {"when": "now", "command": "c", "commit": "x", "repeats": 1, "interval": 1000, "ort_threads": "2",
            "gateway_workers": "1", "triton": "off", "load_start": 0.1, "native": "compiled k1"}
    (tmp_path / "runs.jsonl").write_text(json.dumps(rec) + "\n")
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    assert "meshserve compiled k1" in sbs.rewrite(tmp_path)
    del meta["native"]  # (a run from before the option: pure)
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    assert "meshserve pure" in sbs.rewrite(tmp_path)
