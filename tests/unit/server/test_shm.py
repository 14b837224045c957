"""meshserve.server.shm's registry on real /dev/shm objects: keys that stay in /dev/shm, bounds,
limits, tenants, reading inputs into a request and writing outputs from a response."""
from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol.errors import Code, InferError
from meshserve.server import shm
from meshserve.server.limits import ServerLimits
from meshserve.server.workers import SharedState


@pytest.fixture
def obj() -> Iterator[Callable[[str, bytes], str]]:
    """obj(name, contents): a shared-memory object /dev/shm/<unique name>; returns its key."""
    made: list[str] = []

    def create(name: str, contents: bytes) -> str:
        path = f"{shm.SHM_DIR}/mstest-unit-{os.getpid()}-{name}"
        with open(path, "wb") as f:
            f.write(contents)
        made.append(path)
        return "/" + os.path.basename(path)

    yield create
    for path in made:
        if os.path.lexists(path):
            os.unlink(path)


def fails(fn: Callable[[], object], code: Code, *fragments: str) -> InferError:
    with pytest.raises(InferError) as info:
        fn()
    assert info.value.code is code, info.value
    for fragment in fragments:
        assert fragment in info.value.message, (fragment, info.value.message)
    return info.value


def request_with(inputs: dict[str, tuple[str, int, int] | bytes], outputs: dict[str, tuple[str, int, int]]
                 ) -> pb.ModelInferRequest:
    """A request whose inputs are raw bytes or (region, size, offset), in order; outputs likewise."""
    req = pb.ModelInferRequest(model_name="m")
    for name, spec in inputs.items():
        t = req.inputs.add(name=name, datatype="UINT8", shape=[len(spec) if isinstance(spec, bytes) else spec[1]])
        if isinstance(spec, bytes):
            req.raw_input_contents.append(spec)
        else:
            t.parameters[shm.REGION].string_param = spec[0]
            t.parameters[shm.BYTE_SIZE].int64_param = spec[1]
            t.parameters[shm.OFFSET].int64_param = spec[2]
    for name, (region, size, offset) in outputs.items():
        o = req.outputs.add(name=name)
        o.parameters[shm.REGION].string_param = region
        o.parameters[shm.BYTE_SIZE].int64_param = size
        if offset:
            o.parameters[shm.OFFSET].int64_param = offset
    return req


def one_output(data: bytes, name: str = "O") -> pb.ModelInferResponse:
    """A response whose one output, UINT8 ``name``, holds ``data``."""
    resp = pb.ModelInferResponse()
    resp.outputs.add(name=name, datatype="UINT8", shape=[len(data)])
    resp.raw_output_contents.append(data)
    return resp


def test_read_inputs_write_outputs_at_offsets(obj: Callable[[str, bytes], str]) -> None:
    data = bytes(range(256)) * 40
    key = obj("io", data)  # 10240 bytes: past the first page
    reg = shm.SharedMemoryRegistry()
    reg.register_system("", "r", key, 4099, 5000)  # not page-aligned: mapped from the page below
    req = request_with({"A": b"plain", "B": ("r", 3, 10)}, {"OUT": ("r", 8, 100)})
    targets = reg.prepare("", req)
    assert list(req.raw_input_contents) == [b"plain", data[4109:4112]]
    assert shm.REGION not in req.inputs[1].parameters and shm.REGION not in req.outputs[0].parameters
    resp = one_output(b"hello", "OUT")
    reg.deliver("", targets, resp)
    assert resp.raw_output_contents[0] == b"" and resp.outputs[0].parameters[shm.BYTE_SIZE].int64_param == 5
    with open(f"{shm.SHM_DIR}/{key.lstrip('/')}", "rb") as f:
        assert f.read()[4199:4204] == b"hello"
    reg.close()
    assert len(reg) == 0 and reg.registered_bytes == 0


@pytest.mark.parametrize("bad", ["../x", "/../../etc/passwd", "a/b", "..", ".", "/", "", "a\x00b", "a\\b", "x" * 256,
                                 "/sem.mp-1234"])
def test_keys_stay_in_dev_shm(bad: str) -> None:
    fails(lambda: shm.SharedMemoryRegistry().register_system("", "r", bad, 0, 1), Code.INVALID_ARG,
          "invalid shared-memory key")


def test_symlinks_are_not_followed(obj: Callable[[str, bytes], str]) -> None:
    target = obj("target", b"x" * 64)
    link = f"{shm.SHM_DIR}/mstest-unit-{os.getpid()}-link"
    os.symlink(f"{shm.SHM_DIR}/{target.lstrip('/')}", link)
    try:
        fails(lambda: shm.SharedMemoryRegistry().register_system("", "r", os.path.basename(link), 0, 8),
              Code.INVALID_ARG, "Unable to open shared memory region")
    finally:
        os.unlink(link)
    fails(lambda: shm.SharedMemoryRegistry().register_system("", "r", "/mstest-unit-absent", 0, 8),
          Code.INVALID_ARG, "Unable to open shared memory region: '/mstest-unit-absent'")


def test_register_errors_and_limits(obj: Callable[[str, bytes], str]) -> None:
    key = obj("lim", b"\0" * 100)
    reg = shm.SharedMemoryRegistry(ServerLimits(max_shm_regions=2, max_shm_bytes=150))
    fails(lambda: reg.register_system("", "r", key, 60, 41), Code.INVALID_ARG,
          "failed to register shared memory region 'r': invalid args", "offset 60 + byte size 41", "100 bytes")
    fails(lambda: reg.register_system("", "r", key, 0, 0), Code.INVALID_ARG, "byte size 0")
    fails(lambda: reg.register_system("", "", key, 0, 1), Code.INVALID_ARG, "needs a name")
    # the names rule (meshserve/repository/names.py): NAME_MAX = 255 bytes of UTF-8, no control characters
    for call in (lambda: reg.register_system("", "n" * 256, key, 0, 1), lambda: reg.status("", "\u00e9" * 128, shm.SYSTEM),
                 lambda: reg.unregister("", "n" * 5000, shm.SYSTEM),
                 lambda: reg.prepare("", request_with({"A": ("n" * 2000, 1, 0)}, {}))):
        fails(call, Code.INVALID_ARG, "longer than 255")
    for bad in ("a\nb", "a\x7f", "a\x85", "\x1b[31m"):
        fails(lambda: reg.register_system("", bad, key, 0, 1), Code.INVALID_ARG, "control character")  # noqa: B023
    assert reg.register_system("", "n" * 255, key, 0, 1).name == "n" * 255
    reg.unregister("", "n" * 255, shm.SYSTEM)
    reg.register_system("", "a", key, 0, 100)
    fails(lambda: reg.register_system("", "a", key, 0, 1), Code.ALREADY_EXISTS, "'a' already in manager")
    fails(lambda: reg.register_system("", "b", key, 0, 51), Code.RESOURCE_EXHAUSTED, "--max-shm-bytes")
    other = obj("lim2", b"\0" * 100)  # (another tenant's object: the key's object is tenant ""'s)
    reg.register_system("t2", "a", other, 0, 50)  # another tenant may use the same name
    fails(lambda: reg.register_system("t3", "c", other, 0, 1), Code.RESOURCE_EXHAUSTED, "--max-shm-regions 2")
    assert [r.name for r in reg.status("t2", "", shm.SYSTEM)] == ["a"] and reg.status("t3", "", shm.SYSTEM) == []
    fails(lambda: reg.status("t3", "a", shm.SYSTEM), Code.NOT_FOUND, "Unable to find system shared memory region: 'a'")
    fails(lambda: reg.status("", "a", shm.CUDA), Code.NOT_FOUND, "registered as system shared memory, not CUDA")
    reg.unregister("", "a", shm.CUDA)  # another kind: nothing happens (Triton)
    assert len(reg) == 2
    region = reg.status("", "a", shm.SYSTEM)[0]
    reg.unregister("", "", shm.SYSTEM)  # every region of tenant "" only
    assert region.fd == -1 and [r.name for r in reg.status("t2", "", shm.SYSTEM)] == ["a"]
    # registration off (Triton's --allow-client-shm=false): its error, UNSUPPORTED, in its words
    fails(lambda: shm.SharedMemoryRegistry(ServerLimits(max_shm_regions=0)).register_system("", "a", key, 0, 1),
          Code.UNSUPPORTED, f"{shm.CLIENT_SHM_DISABLED} (meshserve: --max-shm-regions 0)")
    reg.close()


def test_tensor_errors(obj: Callable[[str, bytes], str]) -> None:
    reg = shm.SharedMemoryRegistry(ServerLimits(max_request_bytes=100))
    reg.register_system("", "r", obj("t", b"\0" * 64), 0, 64)
    fails(lambda: reg.prepare("", request_with({"A": ("nope", 4, 0)}, {})), Code.INVALID_ARG,
          "Unable to find shared memory region: 'nope' (input 'A' of model 'm')")
    fails(lambda: reg.prepare("other", request_with({"A": ("r", 4, 0)}, {})), Code.INVALID_ARG,
          "Unable to find shared memory region: 'r'")  # another tenant's region
    fails(lambda: reg.prepare("", request_with({"A": ("r", 4, 64)}, {})), Code.INVALID_ARG,
          "Invalid offset for shared memory region: 'r'", "offset 64", "64 bytes")
    fails(lambda: reg.prepare("", request_with({}, {"O": ("r", 8, 60)})), Code.INVALID_ARG,
          "Invalid offset + byte size for shared memory region: 'r'", "output 'O'", "offset 60 + byte size 8")
    req = request_with({"A": b"x" * 60, "B": ("r", 64, 0)}, {})
    fails(lambda: reg.prepare("", req), Code.TOO_LARGE, "input 'B'", "100-byte request limit")
    req = request_with({"A": ("r", 4, 0)}, {"O": ("r", 4, 0)})
    req.outputs[0].parameters["classification"].int64_param = 2
    fails(lambda: reg.prepare("", req), Code.INVALID_ARG, "can't set both 'shared_memory_region' and 'classification'")
    req = request_with({"A": ("r", 4, 0)}, {})
    req.inputs[0].parameters[shm.BYTE_SIZE].string_param = "4"
    fails(lambda: reg.prepare("", req), Code.INVALID_ARG, "'shared_memory_byte_size' must be an integer")
    req = request_with({"A": ("r", 4, 0), "B": b"1234"}, {})
    req.raw_input_contents.append(b"extra")
    fails(lambda: reg.prepare("", req), Code.INVALID_ARG, "2 raw_input_contents for the 1 inputs")
    req = request_with({"A": ("r", 4, 0), "B": b""}, {})
    del req.raw_input_contents[:]
    req.inputs[1].contents.fp32_contents.append(1.0)
    fails(lambda: reg.prepare("", req), Code.INVALID_ARG, "input 'B'", "typed 'contents' cannot be combined")

    targets = reg.prepare("", request_with({}, {"O": ("r", 4, 0)}))
    resp = one_output(b"12345")
    fails(lambda: reg.deliver("", targets, resp), Code.INVALID_ARG,
          "for output 'O' (4 bytes) should be at least 5 bytes to hold the results")
    resp.raw_output_contents[0] = b"1234"
    reg.unregister("", "r", shm.SYSTEM)  # unregistered while the request ran
    fails(lambda: reg.deliver("", targets, resp), Code.INVALID_ARG, "Unable to find shared memory region: 'r'")


def test_uses_shared_memory() -> None:
    assert not shm.uses_shared_memory(request_with({"A": b"1"}, {}))
    assert shm.uses_shared_memory(request_with({"A": ("r", 1, 0)}, {}))
    assert shm.uses_shared_memory(request_with({"A": b"1"}, {"O": ("r", 1, 0)}))
    plain = request_with({"A": b"1"}, {})
    plain.outputs.add(name="O")
    assert not shm.uses_shared_memory(plain)


def test_uses_shared_memory_from_the_request_bytes() -> None:
    """With the client's bytes: a region on an input or a requested output is still found (the
    parameter's name is in the bytes), a request without one is answered by the byte search, and
    bytes that merely hold the name (a tensor's data) are read as the message."""
    for request in (request_with({"A": ("r", 1, 0)}, {}), request_with({"A": b"1"}, {"O": ("r", 1, 0)}),
                    request_with({"A": ("r", 1, 0), "B": b"2"}, {"O": ("q", 4, 8)})):
        assert shm.uses_shared_memory(request, request.SerializeToString())
    plain = request_with({"A": b"1"}, {})
    plain.outputs.add(name="O")
    plain.outputs[0].parameters["binary_data"].bool_param = True
    assert not shm.uses_shared_memory(plain, plain.SerializeToString())
    named = request_with({"A": shm.REGION.encode()}, {})
    named.outputs.add(name="O")
    assert shm.REGION.encode() in named.SerializeToString()
    assert not shm.uses_shared_memory(named, named.SerializeToString())


def test_uses_shared_memory_reads_a_large_request_as_the_message() -> None:
    """Beyond _SEARCH_MAX bytes the search would cost more than the message's fields (and grows
    with the tensors: ~38 ms at 64 MiB): the message is read, with the same answers."""
    big = b"\0" * (shm._SEARCH_MAX + 1)
    searched: list[int] = []  # the sizes of the bytes searched

    class Raw(bytes):
        def __contains__(self, item: object) -> bool:
            searched.append(len(self))
            return super().__contains__(item)

        def find(self, sub: Any, *args: Any) -> int:  # (the search uses find: see uses_shared_memory)
            searched.append(len(self))
            return super().find(sub, *args)

    plain = request_with({"A": big}, {})
    plain.outputs.add(name="O")
    assert not shm.uses_shared_memory(plain, Raw(plain.SerializeToString()))
    region = request_with({"A": big, "B": ("r", 1, 0)}, {})
    assert shm.uses_shared_memory(region, Raw(region.SerializeToString()))
    assert searched == []  # neither was searched
    small = request_with({"A": b"1"}, {})
    small.outputs.add(name="O")
    assert not shm.uses_shared_memory(small, Raw(small.SerializeToString())) and len(searched) == 1


def test_cuda_without_a_gpu_is_refused() -> None:
    if shm.cuda_devices():
        pytest.skip("this machine has a GPU")
    fails(lambda: shm.SharedMemoryRegistry().register_cuda("", "g", b"\0" * 64, 0, 64), Code.INVALID_ARG,
          "failed to register CUDA shared memory region 'g'", "GPUs not supported")


def test_configure_replaces_and_closes(obj: Callable[[str, bytes], str]) -> None:
    old = shm.configure(ServerLimits())
    old.register_system("", "r", obj("c", b"\0" * 8), 0, 8)
    region = old.status("", "r", shm.SYSTEM)[0]
    new = shm.configure(ServerLimits(max_shm_regions=1))
    assert shm.registry is new and new.max_regions == 1 and region.fd == -1
    shm.configure(ServerLimits())


def test_an_object_truncated_after_registering_is_a_client_error(obj: Callable[[str, bytes], str]) -> None:
    """A client that shrinks its object under a registered region gets a 400 naming the region; the
    process does not die of SIGBUS (as it would touching an mmap past the object's end)."""
    key = obj("shrink", b"\1" * 8192)
    reg = shm.SharedMemoryRegistry()
    reg.register_system("", "r", key, 4096, 4096)
    targets = reg.prepare("", request_with({}, {"O": ("r", 16, 4000)}))
    os.truncate(f"{shm.SHM_DIR}/{key.lstrip('/')}", 100)
    fails(lambda: reg.prepare("", request_with({"A": ("r", 16, 0)}, {})), Code.INVALID_ARG,
          "shared memory region 'r'", "truncated")
    resp = one_output(b"x" * 16)
    fails(lambda: reg.deliver("", targets, resp), Code.INVALID_ARG, "truncated")
    assert os.path.getsize(f"{shm.SHM_DIR}/{key.lstrip('/')}") == 100  # and nothing was written
    reg.close()


class FakeCudaRuntime:
    """cuda-python's runtime calls shm makes, over host memory standing in for a device
    allocation of another process (the real path runs in test_cuda_shared_memory on a GPU)."""

    class cudaError_t:  # cuda-python's names
        cudaSuccess = 0

    class cudaMemcpyKind:
        cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost = 1, 2

    class cudaIpcMemHandle_t:  # like cuda-bindings 13: the struct's address only
        def __init__(self) -> None:
            self.struct = ctypes.create_string_buffer(64)

        def getPtr(self) -> int:
            return ctypes.addressof(self.struct)

    cudaIpcMemLazyEnablePeerAccess = 1

    def __init__(self, device: ctypes.Array) -> None:
        self.device = device
        self.opened: list[bytes] = []
        self.closed: list[int] = []
        self.copies: list[int] = []

    def cudaGetDeviceCount(self) -> tuple[int, int]:
        return 0, 1

    def cudaSetDevice(self, device: int) -> tuple[int]:
        return (0,)

    def cudaIpcOpenMemHandle(self, handle: cudaIpcMemHandle_t, flags: int) -> tuple[int, int]:
        self.opened.append(handle.struct.raw)
        return 0, ctypes.addressof(self.device)

    def cudaMemcpy(self, dst: int, src: int, size: int, kind: int) -> tuple[int]:
        self.copies.append(kind)
        ctypes.memmove(dst, src, size)
        return (0,)

    def cudaIpcCloseMemHandle(self, pointer: int) -> tuple[int]:
        self.closed.append(pointer)
        return (0,)


def test_cuda_regions_over_a_fake_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    device = ctypes.create_string_buffer(bytes(range(64)))
    rt = FakeCudaRuntime(device)
    monkeypatch.setattr(shm, "_cuda_runtime", lambda: rt)
    reg = shm.SharedMemoryRegistry()
    fails(lambda: reg.register_cuda("", "g", b"\7" * 63, 0, 64), Code.INVALID_ARG, "raw_handle is 63 bytes")
    fails(lambda: reg.register_cuda("", "g", b"\7" * 64, 1, 64), Code.INVALID_ARG, "device_id 1")
    reg.register_cuda("", "g", b"\7" * 64, 0, 64)
    assert rt.opened == [b"\7" * 64]  # the handle's bytes reached cudaIpcOpenMemHandle
    assert [(r.name, r.device_id, r.byte_size) for r in reg.status("", "", shm.CUDA)] == [("g", 0, 64)]
    assert reg.status("", "", shm.SYSTEM) == []
    req = request_with({"A": ("g", 8, 16)}, {"O": ("g", 4, 40)})
    targets = reg.prepare("", req)
    assert req.raw_input_contents[0] == bytes(range(16, 24))
    resp = one_output(b"WXYZ")
    reg.deliver("", targets, resp)
    assert device.raw[40:44] == b"WXYZ" and rt.copies == [2, 1]
    reg.unregister("", "", shm.CUDA)
    assert rt.closed == [ctypes.addressof(device)] and len(reg) == 0


@pytest.fixture
def siblings(tmp_path: Path) -> Iterator[Callable[[ServerLimits | None], shm.SharedRegistry]]:
    """worker(limits): the registry of one more gateway worker on the same supervisor directory."""
    SharedState.create(str(tmp_path))
    made: list[shm.SharedRegistry] = []

    def worker(limits: ServerLimits | None = None) -> shm.SharedRegistry:
        made.append(shm.SharedRegistry(limits, SharedState(str(tmp_path), len(made))))
        return made[-1]

    yield worker
    for reg in made:
        reg.close()
        reg.state.close()


def test_workers_share_one_registry(obj: Callable[[str, bytes], str],
                                    siblings: Callable[[ServerLimits | None], shm.SharedRegistry]) -> None:
    """Registered through one worker: listed, read, written and unregistered through another,
    and counted against the limits of all."""
    a, b = siblings(ServerLimits(max_shm_regions=2)), siblings(ServerLimits(max_shm_regions=2))
    key = obj("w", bytes(range(64)))
    a.register_system("t", "r", key, 0, 64)
    assert [(r.name, r.key, r.byte_size) for r in b.status("t", "", shm.SYSTEM)] == [("r", key, 64)]
    assert b.status("", "", shm.SYSTEM) == []  # still per tenant
    fails(lambda: b.register_system("t", "r", key, 0, 8), Code.ALREADY_EXISTS, "already in manager")
    b.register_system("t", "r2", key, 8, 8)
    fails(lambda: a.register_system("t", "r3", key, 0, 8), Code.RESOURCE_EXHAUSTED, "2 regions are registered")
    req = request_with({"A": ("r", 4, 10)}, {"O": ("r", 2, 60)})
    targets = b.prepare("t", req)
    assert req.raw_input_contents[0] == bytes(range(10, 14))
    resp = one_output(b"XY")
    b.deliver("t", targets, resp)
    with open(f"{shm.SHM_DIR}/{key.lstrip('/')}", "rb") as f:
        assert f.read()[60:62] == b"XY"
    b.unregister("t", "r", shm.SYSTEM)
    assert [r.name for r in a.status("t", "", shm.SYSTEM)] == ["r2"]
    fails(lambda: a.prepare("t", request_with({"A": ("r", 4, 0)}, {})), Code.INVALID_ARG, "Unable to find")
    a.unregister("t", "", shm.SYSTEM)
    assert b.status("t", "", shm.SYSTEM) == [] and len(b) == 0 and b.registered_bytes == 0


def test_a_sibling_region_whose_key_is_gone(obj: Callable[[str, bytes], str],
                                            siblings: Callable[[ServerLimits | None], shm.SharedRegistry]) -> None:
    """A worker opens a sibling's region through that worker's descriptor (the very object, even
    after the client removed the key); with that worker gone too, a clear client error."""
    a, b = siblings(None), siblings(None)
    key = obj("gone", b"abcdefgh")
    a.register_system("", "r", key, 0, 8)
    os.unlink(f"{shm.SHM_DIR}/{key.lstrip('/')}")
    req = request_with({"A": ("r", 3, 0)}, {})
    b.prepare("", req)
    assert req.raw_input_contents[0] == b"abc"
    a.close()  # the registering worker exits: its descriptor is gone
    c = siblings(None)
    fails(lambda: c.prepare("", request_with({"A": ("r", 3, 0)}, {})), Code.INVALID_ARG,
          "shared memory region 'r'", "no longer holds the object registered")
    assert [r.name for r in c.status("", "", shm.SYSTEM)] == ["r"]  # still registered: unregister works
    c.unregister("", "r", shm.SYSTEM)
    assert b.status("", "", shm.SYSTEM) == []


def test_cuda_regions_shared_by_workers_over_a_fake_runtime(
        monkeypatch: pytest.MonkeyPatch, siblings: Callable[[ServerLimits | None], shm.SharedRegistry]) -> None:
    device = ctypes.create_string_buffer(bytes(range(64)))
    rt = FakeCudaRuntime(device)
    monkeypatch.setattr(shm, "_cuda_runtime", lambda: rt)
    a, b = siblings(None), siblings(None)
    a.register_cuda("", "g", b"\7" * 64, 0, 64)
    req = request_with({"A": ("g", 4, 16)}, {})
    b.prepare("", req)
    assert req.raw_input_contents[0] == bytes(range(16, 20))
    assert rt.opened == [b"\7" * 64] * 2  # each worker opened the handle itself
    b.unregister("", "g", shm.CUDA)
    assert a.status("", "", shm.CUDA) == [] and len(rt.closed) == 2


def test_an_object_belongs_to_the_tenant_that_registered_it_first(obj: Callable[[str, bytes], str]) -> None:
    """Bound by device and inode: another tenant is refused the same object under its key, a
    hard link to it, or a region at another offset, until the owner's last region lets it go."""
    key = obj("own", b"secret!!" * 8)
    link = f"{shm.SHM_DIR}/mstest-unit-{os.getpid()}-hardlink"
    os.link(f"{shm.SHM_DIR}/{key.lstrip('/')}", link)
    try:
        reg = shm.SharedMemoryRegistry()
        reg.register_system("acme", "mine", key, 0, 32)
        reg.register_system("acme", "mine2", key, 32, 32)  # the owner may register it again
        for other_key in (key, "/" + os.path.basename(link)):
            fails(lambda k=other_key: reg.register_system("evil", "r", k, 32, 8), Code.PERMISSION_DENIED,
                  "is registered by another tenant")
            fails(lambda k=other_key: reg.register_system("", "r", k, 0, 8), Code.PERMISSION_DENIED)
        assert reg.status("evil", "", shm.SYSTEM) == []
        reg.unregister("acme", "mine", shm.SYSTEM)
        fails(lambda: reg.register_system("evil", "r", key, 0, 8), Code.PERMISSION_DENIED)  # mine2 still holds it
        reg.unregister("acme", "", shm.SYSTEM)
        reg.register_system("evil", "r", key, 0, 8)  # released: the next registrant owns it
        fails(lambda: reg.register_system("acme", "again", key, 0, 8), Code.PERMISSION_DENIED)
        reg.close()
    finally:
        os.unlink(link)


def test_meshserve_s_own_keys_are_refused(obj: Callable[[str, bytes], str]) -> None:
    path = f"{shm.SHM_DIR}/meshserve-py-{os.getpid()}-unit"
    with open(path, "wb") as f:
        f.write(b"\0" * 64)
    try:
        for key in ("/" + os.path.basename(path), os.path.basename(path)):
            fails(lambda k=key: shm.SharedMemoryRegistry().register_system("", "r", k, 0, 8),
                  Code.PERMISSION_DENIED, "reserved for meshserve's own processes")
    finally:
        os.unlink(path)


def test_a_tenant_holds_at_most_its_share(obj: Callable[[str, bytes], str], monkeypatch: pytest.MonkeyPatch) -> None:
    """With tenants (share_of set), one tenant takes at most max(1, cap * share) of the regions
    and of their bytes; the others still register theirs."""
    monkeypatch.setattr(shm, "share_of", lambda tenant: 0.25 if tenant == "small" else 0.5)
    reg = shm.SharedMemoryRegistry(ServerLimits(max_shm_regions=8, max_shm_bytes=1000))
    keys = {t: obj(t, b"\0" * 600) for t in ("hog", "small", "good")}
    for i in range(4):
        reg.register_system("hog", f"r{i}", keys["hog"], i, 10)
    fails(lambda: reg.register_system("hog", "r4", keys["hog"], 0, 10), Code.RESOURCE_EXHAUSTED,
          "tenant 'hog' holds 4 regions", "0.5 of --max-shm-regions 8: 4")
    fails(lambda: reg.register_system("good", "big", keys["good"], 0, 501), Code.RESOURCE_EXHAUSTED,
          "its share is 500", "--max-shm-bytes 1000")
    reg.register_system("good", "big", keys["good"], 0, 500)
    reg.register_system("small", "a", keys["small"], 0, 10)
    reg.register_system("small", "b", keys["small"], 0, 10)
    fails(lambda: reg.register_system("small", "c", keys["small"], 0, 1), Code.RESOURCE_EXHAUSTED,
          "'small' holds 2 regions")
    monkeypatch.setattr(shm, "share_of", None)  # no tenants: only the caps themselves
    reg.register_system("", "x", obj("anon", b"\0" * 8), 0, 8)
    reg.close()


def test_workers_bind_objects_to_tenants_across_processes(
        obj: Callable[[str, bytes], str], siblings: Callable[[ServerLimits | None], shm.SharedRegistry]) -> None:
    """The owner registered through one worker: another tenant is refused through any worker."""
    a, b = siblings(None), siblings(None)
    key = obj("wown", b"\0" * 64)
    a.register_system("acme", "r", key, 0, 64)
    fails(lambda: b.register_system("evil", "r", key, 0, 8), Code.PERMISSION_DENIED, "another tenant")
    a.unregister("acme", "r", shm.SYSTEM)
    b.register_system("evil", "r", key, 0, 8)
    fails(lambda: a.register_system("acme", "r", key, 0, 8), Code.PERMISSION_DENIED, "another tenant")


def test_a_cuda_handle_belongs_to_its_first_tenant(monkeypatch: pytest.MonkeyPatch) -> None:
    device = ctypes.create_string_buffer(bytes(range(64)))
    monkeypatch.setattr(shm, "_cuda_runtime", lambda: FakeCudaRuntime(device))
    reg = shm.SharedMemoryRegistry()
    reg.register_cuda("acme", "g", b"\7" * 64, 0, 64)
    fails(lambda: reg.register_cuda("evil", "g", b"\7" * 64, 0, 64), Code.PERMISSION_DENIED, "CUDA IPC handle")
    reg.register_cuda("evil", "h", b"\x08" * 64, 0, 64)  # its own handle
    reg.close()
