"""`meshserve up` passes its children's output on in bounded chunks (issue 29, finding 5): a
child that prints 64 MiB without a newline grew `up` by 150 MiB (its pump read line by line).
The pump (meshserve/cli.py:Child) runs here in a process of its own, as in `up`, in front of
such a child; its peak RSS must stay within a few chunks of its baseline, every byte must be
passed on, and the ready line after the long one must still be seen."""
from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT

MiB = 1 << 20
GROWTH_MAX = 16 * MiB  # (the suite's rule is 100 MiB; a bounded pump needs far less)

CHILD = ("import sys; out = sys.stdout.buffer; block = b'x' * (1 << 20)\n"
         "for _ in range(64): out.write(block)\n"
         "out.write(b'\\nMESHSERVE_READY noisy grpc=1\\n'); out.flush()\n")

UP = f"""
import sys
from meshserve.cli import Child

def rss(field):
    for line in open('/proc/self/status'):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

base = rss('VmRSS:')
child = Child('noisy', [sys.executable, '-c', {CHILD!r}])
child.wait_ready(60)
child.proc.wait(30)
sys.stdout.flush()
print(base, rss('VmHWM:'), child.ports.get('grpc'), file=sys.stderr)
"""


def test_a_child_printing_64_mib_without_a_newline(tmp_path) -> None:
    out = tmp_path / "up.out"
    with out.open("wb") as f:
        done = subprocess.run([sys.executable, "-c", UP], cwd=ROOT, stdout=f, stderr=subprocess.PIPE, text=True,
                              timeout=120)
    assert done.returncode == 0, done.stderr
    base, peak, port = done.stderr.split()[-3:]
    assert port == "1", "the ready line after the long one was not seen"
    assert out.stat().st_size >= 64 * MiB, "the child's output was not all passed on"
    assert int(peak) - int(base) < GROWTH_MAX, f"up grew {(int(peak) - int(base)) / MiB:.0f} MiB"
