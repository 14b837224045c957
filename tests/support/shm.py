"""Requests whose tensors live in shared memory (system or CUDA: the client's calls are the same)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Window = tuple[str, str, int, int]  # (tensor name, region, byte size, offset)


def in_regions(mod: Any, datatype: str, shape: list[int], inputs: Sequence[Window],
               outputs: Sequence[Window]) -> tuple[list[Any], list[Any]]:
    """The InferInputs and InferRequestedOutputs of ``mod`` (tritonclient.http or .grpc) for a
    request whose every input is read from, and every output written to, its window."""
    ins, outs = [], []
    for name, region, size, offset in inputs:
        ins.append(mod.InferInput(name, shape, datatype))
        ins[-1].set_shared_memory(region, size, offset=offset)
    for name, region, size, offset in outputs:
        outs.append(mod.InferRequestedOutput(name))
        outs[-1].set_shared_memory(region, size, offset=offset)
    return ins, outs
