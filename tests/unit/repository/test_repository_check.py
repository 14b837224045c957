"""check-repo report."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from meshserve.repository import check_repository

ModelWriter = Callable[..., Path]


def test_report_for_a_good_repository(tmp_path: Path, write_model: ModelWriter) -> None:
    write_model("add_sub", 'platform: "onnxruntime_onnx" max_batch_size: 8 version_policy { latest { num_versions: 2 } }',
                versions=(1, 2, 3))
    write_model("auto", None)
    report, ok = check_repository(tmp_path / "models")
    assert ok
    lines = report.splitlines()
    assert lines[0] == f"model repository {tmp_path / 'models'}:"
    add_sub = next(line for line in lines if "add_sub" in line)
    for part in ("ok", "onnx", "versions 2,3 of 1,2,3", "onnxruntime_onnx/onnxruntime", "max_batch_size 8"):
        assert part in add_sub
    auto = next(line for line in lines if " auto " in line)
    assert "versions 1 of 1" in auto and "max_batch_size 4" in auto
    assert lines[-1] == "2 model(s), 0 with problems"


def test_report_lists_problems_under_their_model(tmp_path: Path, write_model: ModelWriter) -> None:
    write_model("good", 'backend: "onnxruntime"')
    write_model("bad", 'backend: "onnxruntime" max_batch_size: 8 dynamic_batching { preferred_batch_size: [16] }')
    report, ok = check_repository(tmp_path / "models")
    assert not ok
    lines = report.splitlines()
    bad = lines.index(next(line for line in lines if line.startswith("FAIL") and "bad" in line))
    assert lines[bad + 1].startswith("    - ")
    assert "model 'bad'" in lines[bad + 1]
    assert "field 'dynamic_batching.preferred_batch_size[0]'" in lines[bad + 1]
    assert lines[-1] == "2 model(s), 1 with problems"


def test_report_for_a_missing_repository(tmp_path: Path) -> None:
    report, ok = check_repository(tmp_path / "nope")
    assert not ok
    assert "nope" in report


def test_report_for_an_empty_repository(tmp_path: Path) -> None:
    report, ok = check_repository(tmp_path)
    assert ok
    assert "no model directories" in report
