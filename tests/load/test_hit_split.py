"""`python -m load.bench.hit_split` (load/bench/hit_split.py), each in-process part once, small and
without callgrind: the frame loop answers every fed call at once (the part itself asserts that no
stream is left open and the connection is alive), the front door's index holds the request."""
from __future__ import annotations

import pytest
import uvloop

from load.bench import hit_split


@pytest.mark.parametrize("part", hit_split.PARTS)
def test_each_part_runs(part: str) -> None:
    uvloop.run(hit_split._run(part, 32, 8))
