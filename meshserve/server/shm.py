"""Triton's system and CUDA shared-memory extensions, for any V2Core (gateway and services).

A client registers a region (a POSIX shared-memory key, or a CUDA IPC handle and a device id)
under a name; inference requests then name the region, an offset and a byte size instead of
carrying a tensor (``shared_memory_region`` / ``_byte_size`` / ``_offset`` on inputs and on
requested outputs). This module keeps the process's registry (one per process, like the
admission gate: ``configure`` sets its limits, ``serve`` closes it at exit) and runs such a
request: ``infer`` reads the input regions into ``raw_input_contents`` (one entry per input,
in input order, as for any other request), strips the output region parameters so the core
returns the data, then writes each output into its region and answers with the output's
metadata and no data (over gRPC also its region parameters). So a core never sees shared memory, and the
gateway, the front door, reads and writes the client's memory itself: a service never needs
it. (A service is a valid v2 server too, and runs the same code for its own direct clients.)

Regions are per tenant: the gateway's access table gives every call the caller's tenant
(``Grant.tenant``), and a tenant names, lists, uses and unregisters only its own regions. The
memory behind them is per tenant too: a system region's object (its device and inode, read with
fstat after the O_NOFOLLOW open, so a second name or a hard link is the same object) and a CUDA
region's IPC handle belong to the tenant that registered them first, and another tenant's
registration of the same object is refused (403 / PERMISSION_DENIED) while any region of the
owner holds it. Keys that name meshserve's own objects (``meshserve-``, RESERVED_KEY_PREFIX) are
refused to everyone. With tenants (``share_of``, set by the gateway), one tenant holds at most
its share of ``--max-shm-regions`` and ``--max-shm-bytes`` (docs/security.md).

A region keeps ``/dev/shm/<key>`` open (the key checked by the names rule, opened with
O_NOFOLLOW), not a ``multiprocessing.shared_memory`` segment: that module registers every
segment it opens with Python's resource tracker, which unlinks it, the client's memory, when
this process exits. Unregistering (or exit) closes it; nothing is ever unlinked: the object is
the client's. Tensors are copied with pread/pwrite (see Region: an mmap would let a client
crash the process by truncating its object); no buffer outlives a call, so a region can be
unregistered while requests that used it still run (a write after an unregister fails cleanly).

CUDA regions go through cuda-python (``cuda.bindings.runtime``, optional): the IPC handle is
opened with ``cudaIpcOpenMemHandle`` on the given device and tensors are copied device<->host
with ``cudaMemcpy``. Without cuda-python or a GPU, registering one is refused as Triton's
CPU-only build does.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import stat
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol import wire
from meshserve.protocol.errors import Code, InferError
from meshserve.repository.names import check_region_name, check_shm_key
from meshserve.server import observe
from meshserve.server.access import Op
from meshserve.server.admission import tenant_cap
from meshserve.server.core import InferResult, RequestContext, V2Core
from meshserve.server.limits import ServerLimits, flag
from meshserve.server.workers import SHM, SharedState
from meshserve.telemetry.spans import Span

log = logging.getLogger("meshserve.shm")

SHM_DIR = "/dev/shm"
SYSTEM, CUDA = "system", "cuda"
REGION, BYTE_SIZE, OFFSET = wire.SHM_REGION, wire.SHM_BYTE_SIZE, wire.SHM_OFFSET
_PARAMS = (REGION, BYTE_SIZE, OFFSET)
CUDA_IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
# Triton's answer to a registration while client shared memory is off (server src/common.h)
CLIENT_SHM_DISABLED = "Client shared memory is disabled. Start the server with '--allow-client-shm=true' to enable."
# Region names are the client's and touch no filesystem (Triton takes any string), but they are
# kept for as long as the region lives and echoed in errors and logs: the one names rule bounds
# them (NAME_MAX bytes, no control characters; perf_analyzer's are ~12 bytes).
# meshserve's own IPC objects carry this prefix (the python service's tensors, services/python):
# never a client's region, whatever else keeps them out of reach
RESERVED_KEY_PREFIX = "meshserve-"
# A tenant's share of the registry's caps (0 < share <= 1), or None without tenants (then nothing
# is counted per tenant). The gateway sets it from its tenants file (gateway/auth.py:Admission.share_of).
share_of: Callable[[str], float] | None = None


@dataclass(eq=False)
class Region:
    """One registered region: ``byte_size`` bytes starting at ``offset`` of the key's object
    (system), or of the device allocation behind the IPC handle (CUDA)."""

    name: str
    kind: str
    byte_size: int
    key: str = ""
    offset: int = 0
    device_id: int = 0
    fd: int = -1  # the key's object, open read-write while the region is registered (system)
    _cuda: _CudaMemory | None = field(default=None, repr=False)
    handle: bytes = b""  # the CUDA IPC handle (kept by a gateway worker's SharedRegistry)
    unavailable: str = ""  # a gateway worker could not open a sibling's registration: why
    ino: tuple[int, int] | None = None  # (st_dev, st_ino) of a system region's object: whose memory it is

    # System regions are read and written with pread/pwrite on the open object, not through an
    # mmap: a client may shrink its object after registering it, and touching an mmap past the
    # object's end raises SIGBUS, which would kill the whole process. pread just comes back
    # short, and a write checks the size first (a shrink racing it can only make pwrite extend
    # the client's object again). Measured (dev VM): 16 MiB pread 1.8 ms vs 0.6 ms for an mmap
    # slice, 64 B 0.5 vs 0.1 us: under 1% of such a request's time through gateway + service.
    def read(self, offset: int, size: int) -> bytes:
        if self._cuda is not None:
            return self._cuda.read(offset, size)
        if self.fd < 0:
            raise self._unopened()
        data = os.pread(self.fd, size, self.offset + offset)
        if len(data) != size:
            raise self._truncated()
        return data

    def write(self, offset: int, data: bytes) -> None:
        if self._cuda is not None:
            self._cuda.write(offset, data)
            return
        if self.fd < 0:
            raise self._unopened()
        start = self.offset + offset
        if os.fstat(self.fd).st_size < start + len(data):
            raise self._truncated()
        view = memoryview(data)
        while view:
            view = view[os.pwrite(self.fd, view, start + len(data) - len(view)):]

    def _truncated(self) -> InferError:
        return InferError.invalid(f"shared memory region '{self.name}': key '{self.key}' now holds fewer than the "
                                  f"{self.offset + self.byte_size} bytes it had when registered (truncated)")

    def _unopened(self) -> InferError:
        return InferError.invalid(f"shared memory region '{self.name}': {self.unavailable or 'closed'}")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self._cuda is not None:
            self._cuda.close()


class SharedMemoryRegistry:
    """The registered regions of one process, keyed by (tenant, region name)."""

    def __init__(self, limits: ServerLimits | None = None):
        limits = limits or ServerLimits()
        self.max_regions = limits.max_shm_regions
        self.max_bytes = limits.max_shm_bytes
        self.max_request_bytes = limits.max_request_bytes
        self._regions: dict[tuple[str, str], Region] = {}
        self.registered_bytes = 0

    def __len__(self) -> int:
        return len(self._regions)

    # ---- register / unregister / status ------------------------------------------------
    def _admit(self, tenant: str, name: str, byte_size: int, kind: str) -> None:
        check_region_name(name)
        if not name:
            raise InferError.invalid(f"a {kind} shared memory region needs a name")
        if (tenant, name) in self._regions:
            raise InferError(Code.ALREADY_EXISTS, f"shared memory region '{name}' already in manager")
        if byte_size <= 0:
            raise InferError.invalid(f"failed to register shared memory region '{name}': invalid args "
                                     f"(byte size {byte_size}; a region holds at least one byte)")
        if not self.max_regions:  # registration off: Triton's --allow-client-shm=false, in its words
            raise InferError.unsupported(f"{CLIENT_SHM_DISABLED} (meshserve: {flag('max_shm_regions')} 0)")
        if len(self._regions) >= self.max_regions:
            raise InferError.exhausted(
                f"cannot register shared memory region '{name}': {len(self._regions)} regions are registered, "
                f"the most this server allows ({flag('max_shm_regions')} {self.max_regions})")
        if self.registered_bytes + byte_size > self.max_bytes:
            raise InferError.exhausted(
                f"cannot register shared memory region '{name}' of {byte_size} bytes: {self.registered_bytes} "
                f"bytes are registered already, and this server takes at most {self.max_bytes} "
                f"({flag('max_shm_bytes')})")
        if share_of is not None:
            self._admit_share(tenant, name, byte_size, share_of(tenant))

    def _admit_share(self, tenant: str, name: str, byte_size: int, share: float) -> None:
        """One tenant's share of the caps (registration only: the registry holds at most
        --max-shm-regions regions, so counting them costs microseconds)."""
        mine = [r for (t, _), r in self._regions.items() if t == tenant]
        who = f"tenant '{tenant}'" if tenant else "anonymous callers"
        cap = tenant_cap(self.max_regions, share)
        if len(mine) >= cap:
            raise InferError.exhausted(
                f"cannot register shared memory region '{name}': {who} holds {len(mine)} regions, its share "
                f"({share:g} of {flag('max_shm_regions')} {self.max_regions}: {cap})")
        held = sum(r.byte_size for r in mine)
        cap = tenant_cap(self.max_bytes, share)
        if held + byte_size > cap:
            raise InferError.exhausted(
                f"cannot register shared memory region '{name}' of {byte_size} bytes: {who} holds {held} bytes "
                f"of regions, and its share is {cap} ({share:g} of {flag('max_shm_bytes')} {self.max_bytes})")

    def _check_owner(self, tenant: str, name: str, key: str, same: Callable[[Region], bool]) -> None:
        """Refuse memory that another tenant's region holds (PERMISSION_DENIED): the first
        tenant to register an object owns it while any of its regions holds it."""
        for (owner, _), region in self._regions.items():
            if owner != tenant and same(region):
                raise InferError(Code.PERMISSION_DENIED,
                                 f"cannot register shared memory region '{name}': {key} is registered by "
                                 "another tenant")

    def _add(self, tenant: str, region: Region) -> None:
        self._regions[(tenant, region.name)] = region
        self.registered_bytes += region.byte_size
        log.info("registered %s shared memory region '%s'%s (%d bytes)", region.kind, region.name,
                 f" of tenant '{tenant}'" if tenant else "", region.byte_size)

    def register_system(self, tenant: str, name: str, key: str, offset: int, byte_size: int) -> Region:
        """Open the POSIX shared-memory object ``key``; the region is its ``byte_size`` bytes at ``offset``."""
        self._admit(tenant, name, byte_size, SYSTEM)
        filename = check_shm_key(key)  # one name under /dev/shm: never a path elsewhere
        if filename.startswith("sem."):  # POSIX named semaphores live there too: never a region
            raise InferError.invalid(f"invalid shared-memory key '{key}': it names a POSIX semaphore")
        if filename.startswith(RESERVED_KEY_PREFIX):
            raise InferError(Code.PERMISSION_DENIED, f"cannot register shared memory region '{name}': keys "
                             f"starting with '{RESERVED_KEY_PREFIX}' are reserved for meshserve's own processes")
        if offset < 0:
            raise InferError.invalid(f"failed to register shared memory region '{name}': invalid args "
                                     f"(offset {offset})")
        try:
            fd = os.open(os.path.join(SHM_DIR, filename), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:  # Triton answers INTERNAL here: a missing key is the client's mistake
            raise InferError.invalid(f"Unable to open shared memory region: '{key}' ({exc.strerror})") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise InferError.invalid(f"Invalid shared memory region: '{key}' (not a shared-memory object)")
            if offset + byte_size > st.st_size:
                raise InferError.invalid(
                    f"failed to register shared memory region '{name}': invalid args (offset {offset} + "
                    f"byte size {byte_size} is past the end of the {st.st_size} bytes of key '{key}')")
            ino = (st.st_dev, st.st_ino)
            self._check_owner(tenant, name, f"the object of key '{key}'", lambda r: r.ino == ino)
        except BaseException:
            os.close(fd)
            raise
        region = Region(name, SYSTEM, byte_size, key=key, offset=offset, fd=fd, ino=ino)
        self._add(tenant, region)
        return region

    def register_cuda(self, tenant: str, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> Region:
        """Open a CUDA IPC handle (``cudaIpcMemHandle_t`` bytes) on device ``device_id``."""
        self._admit(tenant, name, byte_size, CUDA)
        handle = bytes(raw_handle)
        self._check_owner(tenant, name, "its CUDA IPC handle",
                          lambda r: r.kind == CUDA and r.handle == handle and r.device_id == device_id)
        memory = _CudaMemory.open(name, raw_handle, device_id, byte_size)
        region = Region(name, CUDA, byte_size, device_id=device_id, _cuda=memory, handle=handle)
        self._add(tenant, region)
        return region

    def unregister(self, tenant: str, name: str, kind: str) -> None:
        """Unregister one region of ``kind`` (nothing if there is none: Triton's rule), or every
        region of the tenant of that kind when ``name`` is empty."""
        keys = [(tenant, check_region_name(name))] if name else [k for k in self._regions if k[0] == tenant]
        for k in keys:
            region = self._regions.get(k)
            if region is None or region.kind != kind:
                continue
            del self._regions[k]
            self.registered_bytes -= region.byte_size
            try:
                region.close()
            except Exception as exc:  # the region is gone from the registry either way
                log.warning("closing shared memory region '%s' failed: %s", region.name, exc)

    def status(self, tenant: str, name: str, kind: str) -> list[Region]:
        """The tenant's regions of ``kind`` (sorted by name), or the one named."""
        if not name:
            return sorted((r for (t, _), r in self._regions.items() if t == tenant and r.kind == kind),
                          key=lambda r: r.name)
        region = self._regions.get((tenant, check_region_name(name)))
        label = "cuda" if kind == CUDA else "system"
        if region is None:
            raise InferError.not_found(f"Unable to find {label} shared memory region: '{name}'")
        if region.kind != kind:
            other = "CUDA" if region.kind == CUDA else "system"
            raise InferError.not_found(f"The region named '{name}' is registered as {other} shared memory, "
                                       f"not {'CUDA' if kind == CUDA else 'system'} shared memory")
        return [region]

    def close(self) -> None:
        """Unmap every region (at exit)."""
        for tenant, name in list(self._regions):
            region = self._regions[(tenant, name)]
            self.unregister(tenant, name, region.kind)

    # ---- tensors --------------------------------------------------------------------------
    def _locate(self, tenant: str, name: str, offset: int, size: int, where: str) -> Region:
        region = self._regions.get((tenant, name))
        if region is None:  # Triton: NOT_FOUND; a bad region is a 400 like the other region errors
            raise InferError.invalid(f"Unable to find shared memory region: '{name}' ({where})")
        if offset >= region.byte_size:
            raise InferError.invalid(
                f"Invalid offset for shared memory region: '{name}' ({where}: offset {offset} is past the end "
                f"of the region's {region.byte_size} bytes)")
        if offset + size > region.byte_size:
            raise InferError.invalid(
                f"Invalid offset + byte size for shared memory region: '{name}' ({where}: offset {offset} + "
                f"byte size {size} is past the end of the region's {region.byte_size} bytes)")
        return region

    def prepare(self, tenant: str, request: pb.ModelInferRequest) -> list[_OutputTarget]:
        """Read the request's shared-memory inputs into ``raw_input_contents`` (every input then
        has its entry, in input order) and take the region parameters off its requested outputs;
        returns where each such output goes. Every region, offset and size is checked first."""
        model = request.model_name
        targets: list[_OutputTarget] = []
        for out in request.outputs:
            params = out.parameters
            if not params or REGION not in params:
                continue
            where = f"output '{out.name}' of model '{model}'"
            if "classification" in params:
                raise InferError.invalid(f"{where}: output can't set both '{REGION}' and 'classification'")
            name, size, offset = _tensor_params(params, where)
            self._locate(tenant, name, offset, size, where)
            targets.append(_OutputTarget(out.name, name, size, offset, where))
        inputs = request.inputs
        if not any(REGION in t.parameters for t in inputs):
            return _strip_outputs(request, targets)
        raws = request.raw_input_contents
        plain = sum(1 for t in inputs if REGION not in t.parameters)
        if len(raws) != plain:
            typed = next((t.name for t in inputs if REGION not in t.parameters and t.HasField("contents")), None)
            if typed is not None:
                raise InferError.invalid(
                    f"input '{typed}' of model '{model}': typed 'contents' cannot be combined with shared-memory "
                    "inputs in one request; send it in raw_input_contents")
            raise InferError.invalid(
                f"the request for model '{model}' has {len(raws)} raw_input_contents for the {plain} inputs "
                "that are not in shared memory")
        total = sum(map(len, raws))
        contents: list[bytes] = []
        pending = iter(list(raws))
        for t in inputs:
            params = t.parameters
            if REGION not in params:
                contents.append(next(pending))
                continue
            where = f"input '{t.name}' of model '{model}'"
            if t.HasField("contents"):
                raise InferError.invalid(f"unexpected 'content' provided when using shared memory for {where}")
            name, size, offset = _tensor_params(params, where)
            region = self._locate(tenant, name, offset, size, where)
            total += size
            if self.max_request_bytes and total > self.max_request_bytes:
                raise InferError.too_large(
                    f"the inputs of the request for model '{model}' (with {where} read from shared memory region "
                    f"'{name}') exceed the {self.max_request_bytes}-byte request limit ({flag('max_request_bytes')})")
            contents.append(region.read(offset, size))
            for key in _PARAMS:
                if key in params:
                    del params[key]
        del raws[:]
        raws.extend(contents)
        return _strip_outputs(request, targets)

    def deliver(self, tenant: str, targets: list[_OutputTarget], response: pb.ModelInferResponse) -> None:
        """Write the response's outputs into their regions; each keeps its name, datatype and
        shape, gets the region parameters (``shared_memory_byte_size``: the bytes written; the
        HTTP front end renders none, as Triton) and an empty ``raw_output_contents`` entry
        (Triton's gRPC response has one per output)."""
        by_name = {t.output: t for t in targets}
        raws = response.raw_output_contents
        for i, out in enumerate(response.outputs):
            target = by_name.get(out.name)
            if target is None:
                continue
            if i >= len(raws):
                raise InferError.internal(f"{target.where}: the response carries no raw_output_contents")
            data = raws[i]
            if len(data) > target.byte_size:
                raise InferError.invalid(
                    f"shared memory size specified with the request for output '{out.name}' ({target.byte_size} "
                    f"bytes) should be at least {len(data)} bytes to hold the results "
                    f"(region '{target.region}', offset {target.offset})")
            self._locate(tenant, target.region, target.offset, len(data), target.where).write(target.offset, data)
            raws[i] = b""
            params = out.parameters
            params[REGION].string_param = target.region
            params[BYTE_SIZE].int64_param = len(data)
            if target.offset:
                params[OFFSET].int64_param = target.offset


class SharedRegistry(SharedMemoryRegistry):
    """The registry of a gateway worker (``meshserve gateway --workers N``): the same regions in
    every worker, as in one process, since a client's next call may land on any of them.

    Each registration is a record in the workers' directory (``shm/<id>.json``: tenant, name,
    kind, key, offset, size, device, the registering worker's pid and fd and the object's
    inode); a register or unregister changes the records under the directory's lock and bumps
    the SHM generation. Before any use a worker compares that generation (one 8-byte read of
    the shared mmap) with the one its copy was made at, and if it moved, opens the records it
    lacks and closes those that are gone. A sibling's system region is opened through the
    registering worker's own fd (``/proc/PID/fd/FD``, the very object even if the client has
    unlinked the key since) or else by its key, and used only if it is the same object (inode);
    otherwise requests naming it get a clear error. Only requests that name regions, and the
    shared-memory calls, pay the check: every other request never reaches the registry."""

    def __init__(self, limits: ServerLimits | None, state: SharedState):
        super().__init__(limits)
        self.state = state
        self.records = state.path("shm")
        os.makedirs(self.records, exist_ok=True)
        self._seen = -1
        self._ids: dict[tuple[str, str], str] = {}  # (tenant, name) -> record id

    def _sync(self) -> None:
        if self.state.generation(SHM) != self._seen:
            with self.state.locked(exclusive=False):
                self._load()

    def _load(self) -> None:
        """Make this worker's regions the records' (call it holding the lock)."""
        self._seen = self.state.generation(SHM)
        records: dict[str, dict[str, Any]] = {}
        for fn in os.listdir(self.records):
            if fn.endswith(".json"):
                with contextlib.suppress(OSError, ValueError):
                    with open(os.path.join(self.records, fn), "rb") as f:
                        records[fn.removesuffix(".json")] = json.loads(f.read())
        for key, rid in list(self._ids.items()):
            if rid not in records:
                del self._ids[key]
                region = self._regions.pop(key, None)
                if region is not None:
                    self.registered_bytes -= region.byte_size
                    with contextlib.suppress(Exception):
                        region.close()
        mine = set(self._ids.values())
        for rid, rec in records.items():
            if rid not in mine:
                key = (rec["tenant"], rec["name"])
                region = _open_record(rec)
                self._regions[key] = region
                self._ids[key] = rid
                self.registered_bytes += region.byte_size

    def _publish(self) -> None:
        """Write the records of regions registered here, remove those unregistered (holding the lock)."""
        for key, region in self._regions.items():
            if key not in self._ids:
                rid = uuid.uuid4().hex
                st = os.fstat(region.fd) if region.fd >= 0 else None
                record = {"tenant": key[0], "name": region.name, "kind": region.kind, "key": region.key,
                          "offset": region.offset, "byte_size": region.byte_size, "device_id": region.device_id,
                          "handle": region.handle.hex(), "pid": os.getpid(), "fd": region.fd,
                          "ino": [st.st_dev, st.st_ino] if st is not None else None}
                tmp = os.path.join(self.records, f".{rid}.tmp")
                with open(tmp, "w") as f:
                    json.dump(record, f)
                os.replace(tmp, os.path.join(self.records, f"{rid}.json"))
                self._ids[key] = rid
        for key, rid in list(self._ids.items()):
            if key not in self._regions:
                del self._ids[key]
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.records, f"{rid}.json"))
        self._seen = self.state.bump(SHM)

    def _shared(self, register: Callable[..., Region], *args: Any) -> Region:
        """``register(*args)`` against the shared state: read it first, publish it after, locked."""
        with self.state.locked():
            self._load()
            region = register(*args)
            self._publish()
        return region

    def register_system(self, tenant: str, name: str, key: str, offset: int, byte_size: int) -> Region:
        return self._shared(super().register_system, tenant, name, key, offset, byte_size)

    def register_cuda(self, tenant: str, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> Region:
        return self._shared(super().register_cuda, tenant, name, raw_handle, device_id, byte_size)

    def unregister(self, tenant: str, name: str, kind: str) -> None:
        with self.state.locked():
            self._load()
            super().unregister(tenant, name, kind)
            self._publish()

    def status(self, tenant: str, name: str, kind: str) -> list[Region]:
        self._sync()
        return super().status(tenant, name, kind)

    def prepare(self, tenant: str, request: pb.ModelInferRequest) -> list[_OutputTarget]:
        self._sync()
        return super().prepare(tenant, request)

    def deliver(self, tenant: str, targets: list[_OutputTarget], response: pb.ModelInferResponse) -> None:
        self._sync()
        super().deliver(tenant, targets, response)

    def close(self) -> None:
        """Close this worker's view at exit; the registrations stay the siblings'."""
        for region in self._regions.values():
            with contextlib.suppress(Exception):
                region.close()
        self._regions.clear()
        self._ids.clear()
        self.registered_bytes = 0


def _open_record(rec: dict[str, Any]) -> Region:
    """This worker's handle on a sibling's registration (``unavailable`` says why not)."""
    name = rec["name"]
    if rec["kind"] == CUDA:
        region = Region(name, CUDA, rec["byte_size"], device_id=rec["device_id"], handle=bytes.fromhex(rec["handle"]))
        try:
            region._cuda = _CudaMemory.open(name, region.handle, region.device_id, region.byte_size)
        except InferError as exc:
            region.unavailable = f"not usable in this gateway worker: {exc.message}"
        return region
    ino = rec["ino"]
    region = Region(name, SYSTEM, rec["byte_size"], key=rec["key"], offset=rec["offset"],
                    ino=(ino[0], ino[1]) if ino else None)  # owned even where it cannot be opened here
    for path in (f"/proc/{rec['pid']}/fd/{rec['fd']}", os.path.join(SHM_DIR, check_shm_key(rec["key"]))):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue
        st = os.fstat(fd)
        if rec["ino"] == [st.st_dev, st.st_ino]:
            region.fd = fd
            return region
        os.close(fd)
    region.unavailable = (f"key '{rec['key']}' no longer holds the object registered (it was removed or replaced, "
                          "and the gateway worker that registered it is gone)")
    return region


@dataclass(frozen=True, slots=True)
class _OutputTarget:
    output: str
    region: str
    byte_size: int
    offset: int
    where: str


def _strip_outputs(request: pb.ModelInferRequest, targets: list[_OutputTarget]) -> list[_OutputTarget]:
    if targets:
        names = {t.output for t in targets}
        for out in request.outputs:
            if out.name in names:
                for key in _PARAMS:
                    if key in out.parameters:
                        del out.parameters[key]
    return targets


def _int_param(p: pb.InferParameter, key: str, where: str) -> int:
    which = p.WhichOneof("parameter_choice")
    if which not in ("int64_param", "uint64_param"):
        raise InferError.invalid(f"{where}: '{key}' must be an integer, got {which or 'no value'}")
    value: int = getattr(p, which)
    if value < 0:
        raise InferError.invalid(f"{where}: '{key}' must not be negative, got {value}")
    return value


def _tensor_params(params: Any, where: str) -> tuple[str, int, int]:
    """(region, byte size, offset) of a tensor's shared-memory parameters."""
    region = params[REGION]
    if region.WhichOneof("parameter_choice") != "string_param" or not region.string_param:
        raise InferError.invalid(f"{where}: '{REGION}' must be a non-empty string")
    check_region_name(region.string_param)
    if BYTE_SIZE not in params:
        raise InferError.invalid(f"{where}: '{BYTE_SIZE}' is missing (needed with '{REGION}')")
    size = _int_param(params[BYTE_SIZE], BYTE_SIZE, where)
    offset = _int_param(params[OFFSET], OFFSET, where) if OFFSET in params else 0
    return region.string_param, size, offset


# ---- the process's registry and the infer path ------------------------------------------------

registry = SharedMemoryRegistry()


def configure(limits: ServerLimits, shared: SharedState | None = None) -> SharedMemoryRegistry:
    """A fresh registry with ``limits`` for this process (meshserve.server.process.serve); a
    gateway worker's (``shared``: its supervisor's directory) is its siblings' too."""
    global registry
    registry.close()
    registry = SharedMemoryRegistry(limits) if shared is None else SharedRegistry(limits, shared)
    return registry


_REGION_BYTES = REGION.encode()
# The byte search pays up to here only: measured (one-input request with a requested output, as
# perf_analyzer sends): 0.21 us at 512 bytes, 0.67 at 4 KiB, 2.1 at 16 KiB, 9.9 at 64 KiB and
# ~38 ms at 64 MiB (on the event loop), against ~1.7 us to read the message at any size.
_SEARCH_MAX = 8 * 1024


def uses_shared_memory(request: pb.ModelInferRequest, raw: bytes | None = None) -> bool:
    """Does any input or requested output name a region? The common request (every input in
    raw_input_contents, no requested outputs) is answered by two length checks. With ``raw``,
    the request's serialized bytes (up to _SEARCH_MAX of them: a search grows with the tensors),
    a request whose bytes do not hold the parameter's name anywhere names no region (a map key is
    serialized verbatim): one substring search instead of the lengths and each tensor's
    ``parameters`` (a upb read is ~3k instructions; perf_analyzer names its outputs). Bytes that
    hold it (a region, or the name in a tensor's data), or more bytes, are read as the message."""
    # (find, not `in`: bytes.__contains__ tries the argument as an int first, a TypeError each time)
    if raw is not None and len(raw) <= _SEARCH_MAX and raw.find(_REGION_BYTES) < 0:
        return False
    if len(request.raw_input_contents) == len(request.inputs) and not request.outputs:
        return False
    return any(REGION in t.parameters for t in request.inputs) \
        or any(REGION in o.parameters for o in request.outputs)


async def infer(core: V2Core, request: pb.ModelInferRequest, ctx: RequestContext
                ) -> tuple[InferResult, Span | None]:
    """observe.infer for a request that uses shared memory (see the module docstring). The
    caller's tenant comes from the access table (a request with regions needs what naming
    regions needs: any valid key)."""
    tenant = core.authorize(Op.SHM_STATUS, "", ctx).tenant
    reg = registry
    targets = reg.prepare(tenant, request)
    ctx.raw = None  # the request changed: a gateway forwards it re-serialized
    ctx.nbytes = sum(map(len, request.raw_input_contents))  # what admission counts
    result, span = await observe.infer(core, request, ctx)
    if targets:
        response = result.message()
        reg.deliver(tenant, targets, response)
        result = InferResult(message=response)
    return result, span


# ---- wire shapes (shared by the HTTP and gRPC front ends) -------------------------------------

def system_status_json(regions: Iterable[Region]) -> list[dict[str, Any]]:
    return [{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size} for r in regions]


def cuda_status_json(regions: Iterable[Region]) -> list[dict[str, Any]]:
    return [{"name": r.name, "device_id": r.device_id, "byte_size": r.byte_size} for r in regions]


def system_status_pb(regions: Iterable[Region]) -> pb.SystemSharedMemoryStatusResponse:
    out = pb.SystemSharedMemoryStatusResponse()
    for r in regions:
        out.regions[r.name].CopyFrom(pb.SystemSharedMemoryStatusResponse.RegionStatus(
            name=r.name, key=r.key, offset=r.offset, byte_size=r.byte_size))
    return out


def cuda_status_pb(regions: Iterable[Region]) -> pb.CudaSharedMemoryStatusResponse:
    out = pb.CudaSharedMemoryStatusResponse()
    for r in regions:
        out.regions[r.name].CopyFrom(pb.CudaSharedMemoryStatusResponse.RegionStatus(
            name=r.name, device_id=r.device_id, byte_size=r.byte_size))
    return out


# ---- CUDA (cuda-python, optional) -------------------------------------------------------------

def _cuda_runtime() -> Any:
    """cuda-python's runtime module, or None when cuda-python is not installed."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        try:
            from cuda import cudart as runtime  # cuda-python < 12.6
        except ImportError:
            return None
    return runtime


def cuda_devices() -> int:
    """CUDA devices usable here (0 without cuda-python, a driver or a GPU)."""
    rt = _cuda_runtime()
    if rt is None:
        return 0
    try:
        err, count = rt.cudaGetDeviceCount()
    except Exception:
        return 0
    return int(count) if err == rt.cudaError_t.cudaSuccess else 0


class _CudaMemory:
    """A device allocation of another process, opened from its IPC handle."""

    def __init__(self, rt: Any, pointer: int, device_id: int):
        self.rt = rt
        self.pointer = pointer
        self.device_id = device_id

    @classmethod
    def open(cls, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> _CudaMemory:
        def refuse(why: str) -> InferError:
            return InferError.invalid(f"failed to register CUDA shared memory region '{name}': {why}")

        rt = _cuda_runtime()
        if rt is None:
            raise refuse("GPUs not supported (cuda-python is not installed)")
        devices = cuda_devices()
        if devices == 0:
            raise refuse("GPUs not supported (no CUDA device)")
        if not 0 <= device_id < devices:
            raise refuse(f"invalid args (device_id {device_id}; this server has {devices} CUDA devices)")
        if len(raw_handle) != CUDA_IPC_HANDLE_BYTES:
            raise refuse(f"invalid args (raw_handle is {len(raw_handle)} bytes, a cudaIpcMemHandle_t is "
                         f"{CUDA_IPC_HANDLE_BYTES})")
        _check(rt, rt.cudaSetDevice(device_id), refuse)
        handle = rt.cudaIpcMemHandle_t()
        if hasattr(handle, "getPtr"):  # cuda-bindings >= 13 exposes the struct's address only
            ctypes.memmove(handle.getPtr(), raw_handle, CUDA_IPC_HANDLE_BYTES)
        else:
            handle.reserved = raw_handle
        err, pointer = rt.cudaIpcOpenMemHandle(handle, rt.cudaIpcMemLazyEnablePeerAccess)
        if err != rt.cudaError_t.cudaSuccess:
            log.error("cudaIpcOpenMemHandle for region '%s' failed: %s", name, err)
            raise refuse("invalid args (the IPC handle cannot be opened on this device)")
        memory = cls(rt, int(pointer), device_id)
        size = memory.allocation_size()
        if size is not None and byte_size > size:
            memory.close()
            raise refuse(f"invalid args (byte size {byte_size} > the {size} bytes of the allocation)")
        return memory

    def allocation_size(self) -> int | None:
        try:
            from cuda.bindings import driver
        except ImportError:
            return None
        try:
            err, _base, size = driver.cuMemGetAddressRange(driver.CUdeviceptr(self.pointer))
        except Exception:  # not a driver allocation we can ask about: the size is not checked
            return None
        return int(size) if err == driver.CUresult.CUDA_SUCCESS else None

    def _copy(self, dst: int, src: int, size: int, kind: Any) -> None:
        rt = self.rt

        def fail(why: str) -> InferError:
            return InferError.internal(f"CUDA shared memory copy failed: {why}")

        _check(rt, rt.cudaSetDevice(self.device_id), fail)
        _check(rt, rt.cudaMemcpy(dst, src, size, kind), fail)

    def read(self, offset: int, size: int) -> bytes:
        import numpy as np

        host = np.empty(size, np.uint8)
        if size:
            self._copy(host.ctypes.data, self.pointer + offset, size, self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost)
        return host.tobytes()

    def write(self, offset: int, data: bytes) -> None:
        import numpy as np

        host = np.frombuffer(data, np.uint8)
        if len(data):
            self._copy(self.pointer + offset, host.ctypes.data, len(data), self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice)

    def close(self) -> None:
        self.rt.cudaIpcCloseMemHandle(self.pointer)


def _check(rt: Any, result: Any, error: Any) -> None:
    err = result[0] if isinstance(result, tuple) else result
    if err != rt.cudaError_t.cudaSuccess:
        raise error(str(err))
