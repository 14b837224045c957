"""Instruction counts with valgrind's callgrind: what the bench tools share.

A count of user-space instructions repeats on a busy machine where CPU seconds and throughput do
not, so the per-request tools (`load/bench/per_request.py`, `load/bench/http_path.py`,
`load/bench/hop_instructions.py`) decide on it. Needs valgrind (``apt-get install valgrind``):
``available()`` says whether it is there.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

GC_FUNCTION = "gc_collect_main"  # CPython's collector (inclusive share reported apart)
# glibc's memcpy on this machine (AVX, ERMS): valgrind counts each byte its ``rep movsb`` moves as
# an instruction, so large copies weigh far more in a count than in CPU time (reported apart)
MEMCPY_FUNCTION = "__memcpy_avx_unaligned_erms"


def available() -> bool:
    return all(shutil.which(tool) for tool in ("valgrind", "callgrind_annotate", "callgrind_control"))


def command(out_file: Path, instr_at_start: bool = True) -> list[str]:
    """The valgrind prefix for a process whose counts go to ``out_file`` (a dump made by
    ``control(pid, "--dump")`` is written beside it as ``out_file.N``)."""
    return ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out_file}",
            *([] if instr_at_start else ["--instr-atstart=no"])]


def control(pid: int, *args: str) -> None:
    """``callgrind_control ARGS PID`` (``--zero``, ``--instr=on``, ``--instr=off``, ``--dump``)."""
    subprocess.run(["callgrind_control", *args, str(pid)], capture_output=True, check=False)


def wait_dump(out_file: Path, before: set[Path], timeout: float = 60) -> Path:
    """The dump that appeared next to ``out_file`` since ``before`` (the measured process writes
    it on its own time)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        new = [p for p in out_file.parent.glob(out_file.name + "*") if p not in before and p.stat().st_size]
        if new:
            time.sleep(0.2)  # (written in one go at the end of the dump; let it finish)
            return max(new, key=lambda p: p.stat().st_mtime)
        time.sleep(0.1)
    raise RuntimeError(f"no callgrind dump appeared beside {out_file}")


def totals(dump: Path, function: str = GC_FUNCTION) -> tuple[int, int]:
    """(program total, ``function``'s inclusive count) of one dump."""
    text = subprocess.run(["callgrind_annotate", "--inclusive=yes", str(dump)], capture_output=True,
                          text=True, check=False).stdout
    return parse_totals(text, function)


def parse_totals(annotate_output: str, function: str = GC_FUNCTION) -> tuple[int, int]:
    """(program total, ``function``'s inclusive count) from ``callgrind_annotate --inclusive=yes``'s text."""
    total = re.search(r"^\s*([\d,]+)\s.*PROGRAM TOTALS", annotate_output, re.M)
    part = re.search(rf"^\s*([\d,]+)\s.*[:\s]{re.escape(function)}\b", annotate_output, re.M)
    return (int(total.group(1).replace(",", "")) if total else 0,
            int(part.group(1).replace(",", "")) if part else 0)


def program_total(dump: Path) -> int:
    return totals(dump)[0]


def run_total(argv: list[str], out_file: Path, cwd: Path, env: dict[str, str]) -> int:
    """Program total of ``argv`` run to its end under callgrind (instrumented from the start)."""
    subprocess.run([*command(out_file), *argv], cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=True)
    return program_total(out_file)
