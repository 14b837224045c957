"""Triton's system shared-memory extension, end to end: real gateway and service processes,
tritonclient as the client and tritonclient's own ``tritonclient.utils.shared_memory`` for the
regions, over HTTP and gRPC. The first test walks what NVIDIA's simple_{http,grpc}_shm_client
examples do (unregister everything, register input and output regions, infer, read the outputs
from shared memory, check status, unregister); the others cover BYTES tensors, offsets, a mix
of shared-memory and in-request tensors, every bad-region error, tenants and the limits, and
CUDA shared memory where a GPU is present."""
from __future__ import annotations

import os
import queue
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
import yaml
from tritonclient.utils import InferenceServerException, serialize_byte_tensor

from gateway.auth import hash_key
from meshserve.server.shm import cuda_devices
from tests.conftest import Stack, _wait_http_ready, start
from tests.support.shm import in_regions, system_regions

PROTOCOLS = ["http", "grpc"]
CLIENT_ERROR = {"http": "400", "grpc": "StatusCode.INVALID_ARGUMENT"}
F32 = 16 * 4  # one add_sub tensor: [1, 16] FP32


def lib(proto: str) -> Any:
    return httpclient if proto == "http" else grpcclient


def key(name: str) -> str:
    """A key of this test process (/dev/shm is shared with every other test run on the machine)."""
    return f"/mstest-{os.getpid()}-{name}"


@pytest.fixture
def regions() -> Iterator[Callable[[str, int], Any]]:
    """create(name, byte_size): a new POSIX shared-memory object (key(name)), destroyed after."""
    with system_regions(key) as create:
        yield create


def names(status: Any, proto: str) -> dict[str, tuple[str, int, int]]:
    """{name: (key, offset, byte_size)} of a system shared-memory status answer."""
    if proto == "http":
        return {r["name"]: (r["key"], int(r["offset"]), int(r["byte_size"])) for r in status}
    return {n: (r.key, r.offset, r.byte_size) for n, r in status.regions.items()}


def output_meta(result: Any, name: str, proto: str) -> tuple[str, list[int]]:
    out = result.get_output(name)
    if proto == "http":
        assert "data" not in out, out  # the data went to shared memory
        return out["datatype"], out["shape"]
    return out.datatype, list(out.shape)


def add_sub_inputs(proto: str, in0: np.ndarray, in1: np.ndarray) -> list[Any]:
    inputs = [lib(proto).InferInput("INPUT0", [1, 16], "FP32"), lib(proto).InferInput("INPUT1", [1, 16], "FP32")]
    inputs[0].set_data_from_numpy(in0)
    inputs[1].set_data_from_numpy(in1)
    return inputs


IN0 = np.arange(16, dtype=np.float32).reshape(1, 16)
IN1 = np.full((1, 16), 2.5, np.float32)


@pytest.mark.parametrize("hop", ["gateway", "service"])
@pytest.mark.parametrize("proto", PROTOCOLS)
def test_simple_shm_client(stack: Stack, proto: str, hop: str, regions: Callable[[str, int], Any]) -> None:
    """What simple_{http,grpc}_shm_client do, against the gateway and directly at a service; the
    second input sits at an offset in the input region, and the output region is registered at
    an (unaligned) offset of its object, with the second output at an offset inside it."""
    url = getattr(getattr(stack, hop), proto)
    mod = lib(proto)
    gap = 40  # bytes between the two tensors of a region
    inp = regions(f"in-{proto}-{hop}", 2 * F32 + gap)
    out = regions(f"out-{proto}-{hop}", 100 + 2 * F32 + gap)
    shm.set_shared_memory_region(inp, [IN0])
    shm.set_shared_memory_region(inp, [IN1], offset=F32 + gap)
    with mod.InferenceServerClient(url) as c:
        c.unregister_system_shared_memory()  # NVIDIA's examples start with this, on a fresh server too
        assert names(c.get_system_shared_memory_status(), proto) == {}
        c.register_system_shared_memory("input_data", key(f"in-{proto}-{hop}"), 2 * F32 + gap)
        c.register_system_shared_memory("output_data", key(f"out-{proto}-{hop}"), 2 * F32 + gap, offset=100)
        assert names(c.get_system_shared_memory_status(), proto) == {
            "input_data": (key(f"in-{proto}-{hop}"), 0, 2 * F32 + gap),
            "output_data": (key(f"out-{proto}-{hop}"), 100, 2 * F32 + gap)}
        assert names(c.get_system_shared_memory_status("output_data"), proto) == {
            "output_data": (key(f"out-{proto}-{hop}"), 100, 2 * F32 + gap)}

        inputs, outputs = in_regions(
            mod, "FP32", [1, 16], [("INPUT0", "input_data", F32, 0), ("INPUT1", "input_data", F32, F32 + gap)],
            [("OUTPUT0", "output_data", F32, 0), ("OUTPUT1", "output_data", F32, F32 + gap)])
        result = c.infer("add_sub", inputs, outputs=outputs)

        assert output_meta(result, "OUTPUT0", proto) == ("FP32", [1, 16])
        assert output_meta(result, "OUTPUT1", proto) == ("FP32", [1, 16])
        np.testing.assert_array_equal(shm.get_contents_as_numpy(out, np.float32, [1, 16], offset=100), IN0 + IN1)
        np.testing.assert_array_equal(
            shm.get_contents_as_numpy(out, np.float32, [1, 16], offset=100 + F32 + gap), IN0 - IN1)

        c.unregister_system_shared_memory("input_data")
        assert set(names(c.get_system_shared_memory_status(), proto)) == {"output_data"}
        c.unregister_system_shared_memory()
        assert names(c.get_system_shared_memory_status(), proto) == {}


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_bytes_tensors_and_mixed_requests(stack: Stack, proto: str, regions: Callable[[str, int], Any]) -> None:
    """BYTES in and out of shared memory at offsets (Triton's 4-byte length + bytes layout), and a
    request with one input and one output in shared memory and the others in the request: the
    in-request output still comes back (gRPC: raw_output_contents stay aligned with outputs)."""
    mod = lib(proto)
    strings = np.array([[b"hello", b"", "\u00fcn\u00ef".encode(), b"x" * 100]], dtype=np.object_)
    serialized = serialize_byte_tensor(strings)
    size = len(serialized.item())
    inp = regions(f"bin-{proto}", 8 + size)
    out = regions(f"bout-{proto}", 24 + size + F32)
    shm.set_shared_memory_region(inp, [serialized], offset=8)
    with mod.InferenceServerClient(getattr(stack.gateway, proto)) as c:
        c.unregister_system_shared_memory()
        c.register_system_shared_memory("bin", key(f"bin-{proto}"), 8 + size)
        c.register_system_shared_memory("bout", key(f"bout-{proto}"), 24 + size + F32)
        i = mod.InferInput("INPUT0", [1, 4], "BYTES")
        i.set_shared_memory("bin", size, offset=8)
        o = mod.InferRequestedOutput("OUTPUT0")
        o.set_shared_memory("bout", size + 16, offset=24)  # room to spare: the written size is reported
        result = c.infer("identity_bytes", [i], outputs=[o])
        assert output_meta(result, "OUTPUT0", proto) == ("BYTES", [1, 4])
        got = shm.get_contents_as_numpy(out, np.object_, [1, 4], offset=24)
        assert got.tolist() == strings.tolist()
        if proto == "grpc":  # gRPC adds the region parameters, with the bytes written (HTTP: as Triton, none)
            params = result.get_output("OUTPUT0").parameters
            assert params["shared_memory_region"].string_param == "bout"
            assert params["shared_memory_byte_size"].int64_param == size
        else:
            assert "parameters" not in result.get_output("OUTPUT0")

        # add_sub: INPUT0 from shared memory, INPUT1 in the request; OUTPUT0 to shared memory, OUTPUT1 back
        shm.set_shared_memory_region(out, [IN0], offset=24 + size)
        c.register_system_shared_memory("f32", key(f"bout-{proto}"), F32, offset=24 + size)
        inputs = add_sub_inputs(proto, IN0, IN1)
        inputs[0].set_shared_memory("f32", F32)
        outputs = [mod.InferRequestedOutput("OUTPUT0"), mod.InferRequestedOutput("OUTPUT1")]
        outputs[0].set_shared_memory("f32", F32)  # overwrites INPUT0's bytes once the model ran
        result = c.infer("add_sub", inputs, outputs=outputs)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), IN0 - IN1)
        np.testing.assert_array_equal(shm.get_contents_as_numpy(out, np.float32, [1, 16], offset=24 + size),
                                      IN0 + IN1)
        c.unregister_system_shared_memory()


def test_stream_infer_with_shared_memory(stack: Stack, regions: Callable[[str, int], Any]) -> None:
    """ModelStreamInfer through the gateway: regions on a streamed request, and a bad region
    answered in band on the stream, which stays open."""
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    inp, out = regions("stream-in", F32), regions("stream-out", F32)
    shm.set_shared_memory_region(inp, [IN0])
    with grpcclient.InferenceServerClient(stack.gateway.grpc) as c:
        c.unregister_system_shared_memory()
        c.register_system_shared_memory("sin", key("stream-in"), F32)
        c.register_system_shared_memory("sout", key("stream-out"), F32)
        c.start_stream(callback=lambda result, error: results.put((result, error)))
        try:
            for region in ("sin", "nope"):
                inputs = add_sub_inputs("grpc", IN0, IN1)
                inputs[0].set_shared_memory(region, F32)
                outputs = [grpcclient.InferRequestedOutput("OUTPUT0")]
                outputs[0].set_shared_memory("sout", F32)
                c.async_stream_infer("add_sub", inputs, outputs=outputs, request_id=region)
                result, error = results.get(timeout=30)
                if region == "sin":
                    assert error is None, error
                    np.testing.assert_array_equal(shm.get_contents_as_numpy(out, np.float32, [1, 16]), IN0 + IN1)
                else:
                    assert result is None and "Unable to find shared memory region: 'nope'" in error.message()
        finally:
            c.stop_stream()
        c.unregister_system_shared_memory()


def _fails(call: Callable[[], Any], proto: str, *fragments: str, status: str | None = None) -> str:
    with pytest.raises(InferenceServerException) as err:
        call()
    message = err.value.message() or ""
    assert str(err.value.status()) == (status or CLIENT_ERROR[proto]), (err.value.status(), message)
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_bad_regions_are_client_errors(stack: Stack, proto: str, regions: Callable[[str, int], Any]) -> None:
    """Unknown regions, offsets past the end, regions too small (input and output), keys that do
    not exist or would leave /dev/shm: 400 / INVALID_ARGUMENT naming the region, offset and
    size; the gateway keeps serving."""
    mod = lib(proto)
    regions(f"small-{proto}", 64)
    with mod.InferenceServerClient(getattr(stack.gateway, proto)) as c:
        c.unregister_system_shared_memory()
        c.register_system_shared_memory("small", key(f"small-{proto}"), F32)

        def infer_with(region: str, size: int, offset: int, output: tuple[int, int] | None = None) -> Callable[[], Any]:
            inputs = add_sub_inputs(proto, IN0, IN1)
            outputs = None
            if output is None:
                inputs[0].set_shared_memory(region, size, offset=offset)
            else:
                outputs = [mod.InferRequestedOutput("OUTPUT0")]
                outputs[0].set_shared_memory(region, output[0], offset=output[1])
            return lambda: c.infer("add_sub", inputs, outputs=outputs)

        _fails(infer_with("nope", F32, 0), proto, "Unable to find shared memory region: 'nope'", "input 'INPUT0'")
        _fails(infer_with("small", F32, F32), proto, "Invalid offset for shared memory region: 'small'",
               "offset 64", "64 bytes")
        _fails(infer_with("small", F32, 8), proto, "Invalid offset + byte size for shared memory region: 'small'",
               "offset 8 + byte size 64")
        _fails(infer_with("small", 2 * F32, 0), proto, "'small'", "byte size 128")
        _fails(infer_with("small", 0, 0, output=(F32, 32)), proto, "'small'", "output 'OUTPUT0'", "offset 32")
        _fails(infer_with("small", 0, 0, output=(32, 0)), proto,
               "shared memory size specified with the request for output 'OUTPUT0' (32 bytes) should be at least "
               "64 bytes to hold the results")

        register = c.register_system_shared_memory
        _fails(lambda: register("r", key("absent"), 64), proto, "Unable to open shared memory region", key("absent"))
        _fails(lambda: register("r", key(f"small-{proto}"), 64, offset=8), proto,
               "failed to register shared memory region 'r': invalid args", "offset 8 + byte size 64")
        _fails(lambda: register("small", key(f"small-{proto}"), 64), proto, "'small' already in manager",
               status="400" if proto == "http" else "StatusCode.ALREADY_EXISTS")
        for bad in ("../../etc/passwd", "/a/b", "..", "/", "a\\b", "x" * 300):
            _fails(lambda bad=bad: register("r", bad, 64), proto, "invalid shared-memory key")
        _fails(lambda: c.get_system_shared_memory_status("nope"), proto,
               "Unable to find system shared memory region: 'nope'",
               status="404" if proto == "http" else "StatusCode.NOT_FOUND")
        c.unregister_system_shared_memory("nope")  # unknown: succeeds, as in Triton
        assert set(names(c.get_system_shared_memory_status(), proto)) == {"small"}

        # a client that shrinks its object under a registered region: a 400, not a dead gateway
        regions(f"shrink-{proto}", 8192)
        c.register_system_shared_memory("shrink", key(f"shrink-{proto}"), 4096, offset=4096)
        os.truncate(f"/dev/shm/{key(f'shrink-{proto}').lstrip('/')}", 100)
        _fails(infer_with("shrink", F32, 0), proto, "shared memory region 'shrink'", "truncated")
        c.unregister_system_shared_memory("shrink")

        np.testing.assert_array_equal(c.infer("add_sub", add_sub_inputs(proto, IN0, IN1)).as_numpy("OUTPUT0"), IN0 + IN1)
        c.unregister_system_shared_memory()


def tenants_file(*names: str) -> str:
    """A tenants.yaml whose tenants (key "<name>-key") may call every model."""
    return yaml.safe_dump({"tenants": [{"name": n, "keys_sha256": [hash_key(f"{n}-key")], "rate": 1e5, "burst": 1e5}
                                       for n in names]})


def test_regions_are_per_tenant_and_bounded(stack: Stack, tmp_path: Any, regions: Callable[[str, int], Any]) -> None:
    """With tenants, each tenant names, lists and uses only its own regions (the same name may
    exist for two tenants); without a key nothing is reachable; --max-shm-regions and
    --max-shm-bytes bound the whole process (429 / RESOURCE_EXHAUSTED naming the flag)."""
    (tmp_path / "tenants.yaml").write_text(tenants_file("acme", "other"))
    g = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", stack.service.grpc,
               "--tenants", str(tmp_path / "tenants.yaml"), "--max-shm-regions", "2", "--max-shm-bytes", "4096"])
    try:
        _wait_http_ready(g.http)
        a, b = {"x-api-key": "acme-key"}, {"x-api-key": "other-key"}
        ha = regions("tenant-a", F32)
        regions("tenant-b", 8192)
        shm.set_shared_memory_region(ha, [IN0])
        with httpclient.InferenceServerClient(g.http) as c, grpcclient.InferenceServerClient(g.grpc) as gc:
            c.register_system_shared_memory("in", key("tenant-a"), F32, headers=dict(a))
            assert names(c.get_system_shared_memory_status(headers=dict(a)), "http") == {"in": (key("tenant-a"), 0, F32)}
            assert names(c.get_system_shared_memory_status(headers=dict(b)), "http") == {}
            assert names(gc.get_system_shared_memory_status(headers=dict(b)), "grpc") == {}

            def infer(who: dict[str, str], client: Any, proto: str) -> Any:
                inputs = add_sub_inputs(proto, IN0, IN1)
                inputs[0].set_shared_memory("in", F32)
                return client.infer("add_sub", inputs, headers=dict(who))

            np.testing.assert_array_equal(infer(a, c, "http").as_numpy("OUTPUT0"), IN0 + IN1)
            np.testing.assert_array_equal(infer(a, gc, "grpc").as_numpy("OUTPUT0"), IN0 + IN1)
            _fails(lambda: infer(b, c, "http"), "http", "Unable to find shared memory region: 'in'")
            _fails(lambda: infer(b, gc, "grpc"), "grpc", "Unable to find shared memory region: 'in'")
            c.unregister_system_shared_memory(headers=dict(b))  # another tenant's "all" is not a's
            _fails(lambda: c.get_system_shared_memory_status(headers={}), "http", "API key", status="401")
            _fails(lambda: c.register_system_shared_memory("x", key("tenant-b"), 64, headers={}), "http", "API key",
                   status="401")

            c.register_system_shared_memory("in", key("tenant-b"), 64, headers=dict(b))  # b's own "in"
            _fails(lambda: gc.register_system_shared_memory("x", key("tenant-b"), 64, headers=dict(b)), "grpc",
                   "2 regions are registered", "--max-shm-regions 2", status="StatusCode.RESOURCE_EXHAUSTED")
            c.unregister_system_shared_memory("in", headers=dict(b))
            _fails(lambda: c.register_system_shared_memory("big", key("tenant-b"), 8192, headers=dict(b)), "http",
                   "--max-shm-bytes", status="429")
            assert set(names(c.get_system_shared_memory_status(headers=dict(a)), "http")) == {"in"}
            c.unregister_system_shared_memory(headers=dict(a))
    finally:
        g.stop()


NEEDS_CUDA = pytest.mark.skipif(cuda_devices() == 0, reason="CUDA shared memory needs cuda-python and a GPU")


@NEEDS_CUDA
@pytest.mark.parametrize("hop", ["gateway", "service"])
@pytest.mark.parametrize("proto", PROTOCOLS)
def test_cuda_shared_memory(stack: Stack, proto: str, hop: str) -> None:
    """simple_{http,grpc}_cudashm_client's calls: device buffers from another process, opened by
    the gateway (or a service, for its direct clients) from their IPC handles; the same
    allocation registered under a second name (an output window at an offset) works alongside."""
    import tritonclient.utils.cuda_shared_memory as cudashm

    mod = lib(proto)
    inp = cudashm.create_shared_memory_region("cuda_in", 2 * F32, 0)
    out = cudashm.create_shared_memory_region("cuda_out", 3 * F32, 0)
    try:
        cudashm.set_shared_memory_region(inp, [IN0, IN1])
        with mod.InferenceServerClient(getattr(getattr(stack, hop), proto)) as c:
            c.unregister_cuda_shared_memory()
            c.register_cuda_shared_memory("cuda_in", cudashm.get_raw_handle(inp), 0, 2 * F32)
            c.register_cuda_shared_memory("cuda_out", cudashm.get_raw_handle(out), 0, 2 * F32)
            c.register_cuda_shared_memory("cuda_out_too", cudashm.get_raw_handle(out), 0, 3 * F32)
            status = c.get_cuda_shared_memory_status()
            got = {r["name"]: (int(r["device_id"]), int(r["byte_size"])) for r in status} if proto == "http" \
                else {n: (r.device_id, r.byte_size) for n, r in status.regions.items()}
            assert got == {"cuda_in": (0, 2 * F32), "cuda_out": (0, 2 * F32), "cuda_out_too": (0, 3 * F32)}
            inputs, outputs = in_regions(
                mod, "FP32", [1, 16], [("INPUT0", "cuda_in", F32, 0), ("INPUT1", "cuda_in", F32, F32)],
                [("OUTPUT0", "cuda_out", F32, 0), ("OUTPUT1", "cuda_out", F32, F32)])
            result = c.infer("add_sub", inputs, outputs=outputs)
            assert output_meta(result, "OUTPUT0", proto) == ("FP32", [1, 16])
            both = cudashm.get_contents_as_numpy(out, np.float32, [2, 16])
            np.testing.assert_array_equal(both[0], (IN0 + IN1)[0])
            np.testing.assert_array_equal(both[1], (IN0 - IN1)[0])

            # the second name's window, once the first is gone: the allocation stays open for it
            c.unregister_cuda_shared_memory("cuda_out")
            outputs = [mod.InferRequestedOutput("OUTPUT0")]
            outputs[0].set_shared_memory("cuda_out_too", F32, offset=2 * F32)
            c.infer("add_sub", add_sub_inputs(proto, IN1, IN1), outputs=outputs)
            np.testing.assert_array_equal(cudashm.get_contents_as_numpy(out, np.float32, [3, 16])[2], (IN1 + IN1)[0])
            c.unregister_cuda_shared_memory()
            assert not (c.get_cuda_shared_memory_status() if proto == "http"
                        else c.get_cuda_shared_memory_status().regions)
    finally:
        cudashm.destroy_shared_memory_region(inp)
        cudashm.destroy_shared_memory_region(out)


@NEEDS_CUDA
@pytest.mark.parametrize("proto", PROTOCOLS)
def test_bad_cuda_regions_are_client_errors(stack: Stack, proto: str) -> None:
    """On a GPU: a handle that is not one, a device that does not exist, a size past the
    allocation, a window past the region: 400 / INVALID_ARGUMENT; then a good region still works."""
    import base64

    import tritonclient.utils.cuda_shared_memory as cudashm

    mod = lib(proto)
    region = cudashm.create_shared_memory_region("cuda_bad", 2 * F32, 0)
    try:
        handle = cudashm.get_raw_handle(region)
        with mod.InferenceServerClient(getattr(stack.gateway, proto)) as c:
            c.unregister_cuda_shared_memory()
            register = c.register_cuda_shared_memory
            garbage = base64.b64encode(bytes(range(64)))
            _fails(lambda: register("g", garbage, 0, 64), proto, "failed to register CUDA shared memory region 'g'")
            _fails(lambda: register("g", base64.b64encode(b"short"), 0, 64), proto, "raw_handle is 5 bytes")
            _fails(lambda: register("g", handle, 99, 64), proto, "device_id 99")
            _fails(lambda: register("g", handle, 0, 1 << 30), proto, "byte size 1073741824")
            assert not (c.get_cuda_shared_memory_status() if proto == "http"
                        else c.get_cuda_shared_memory_status().regions)

            cudashm.set_shared_memory_region(region, [IN0, IN1])
            register("good", handle, 0, 2 * F32)
            inputs = add_sub_inputs(proto, IN0, IN1)
            inputs[1].set_shared_memory("good", F32, offset=2 * F32)
            _fails(lambda: c.infer("add_sub", inputs), proto, "Invalid offset for shared memory region: 'good'")
            inputs = add_sub_inputs(proto, IN0, IN1)
            inputs[1].set_shared_memory("good", F32, offset=F32)
            np.testing.assert_array_equal(c.infer("add_sub", inputs).as_numpy("OUTPUT0"), IN0 + IN1)
            c.unregister_cuda_shared_memory()
    finally:
        cudashm.destroy_shared_memory_region(region)


def test_cuda_register_without_a_gpu_is_a_client_error(stack: Stack) -> None:
    """Where there is no GPU (or no cuda-python), registering a CUDA region is refused as
    Triton's CPU-only build does: 400 / INVALID_ARGUMENT, and status lists nothing."""
    if cuda_devices():
        pytest.skip("this machine has a GPU")
    with httpclient.InferenceServerClient(stack.gateway.http) as c:
        _fails(lambda: c.register_cuda_shared_memory("g", "AAAA", 0, 64), "http",
               "failed to register CUDA shared memory region 'g'", "GPUs not supported")
        assert c.get_cuda_shared_memory_status() == []
    with grpcclient.InferenceServerClient(stack.gateway.grpc) as gc:
        _fails(lambda: gc.register_cuda_shared_memory("g", b"AAAA", 0, 64), "grpc", "GPUs not supported")
        assert not gc.get_cuda_shared_memory_status().regions
        gc.unregister_cuda_shared_memory()
