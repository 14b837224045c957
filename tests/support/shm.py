"""Requests whose tensors live in shared memory (system or CUDA: the client's calls are the same)."""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
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


@contextmanager
def system_regions(key: Callable[[str], str]) -> Iterator[Callable[[str, int], Any]]:
    """``create(name, byte_size)``: a new POSIX shared-memory object under ``key(name)`` (a key of
    the calling test process: /dev/shm is shared by every test run on the machine); every object
    made is destroyed on exit."""
    import tritonclient.utils.shared_memory as shm

    made: list[Any] = []

    def create(name: str, byte_size: int) -> Any:
        handle = shm.create_shared_memory_region(name, key(name), byte_size, create_only=True)
        made.append(handle)
        return handle

    try:
        yield create
    finally:
        for handle in made:
            shm.destroy_shared_memory_region(handle)
