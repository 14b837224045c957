"""The service's side of one model instance: its worker process (services/python/worker.py),
the batches it runs, and what happens when it dies or hangs.

A reader thread per worker takes the worker's messages off the socket, turns a finished batch's
outputs (in the worker's shared-memory region) into serialized responses off the event loop,
and settles the batch's future on the loop. When the worker exits (killed, crashed) or an
``execute()`` outlives the model's timeout (the worker is then killed), the batches and streams
in flight fail with UNAVAILABLE naming the instance and the reason, and the model version
restarts the worker with backoff (services/python/model.py); other instances and models go on.
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import itertools
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol import datatypes, http_codec
from meshserve.protocol.errors import Code, InferError
from meshserve.protocol.hop import NO_HOP, PRIVATE_PREFIX
from meshserve.protocol.infer_checks import int_value
from meshserve.telemetry import log_settings
from services.base import memory
from services.base.classification import MAX_CLASSIFIED, check_classifiable, classify
from services.base.runtime import RuntimeLoadError
from services.base.scheduling.request import SequenceControl
from services.base.serialization import ResponseEncoder
from services.base.validation import ModelTensors, Pending, prepare
from services.python.execution_env import ExecutionEnv
from services.python.ipc import (
    Channel,
    Region,
    RegionReader,
    RegionRef,
    RegionWriter,
    TensorRef,
    aligned,
    region_ref,
)

log = logging.getLogger("meshserve.python")

# Every worker is started from this one thread, which lives as long as the service: a worker's
# PR_SET_PDEATHSIG (services/python/worker.py) fires when the *thread* that started it ends, not
# the service. Started from a load thread, every worker was killed (SIGKILL, no finalize()) the
# moment the service shut its load pool down at stop, before it asked them to finalize.
_SPAWNER = ThreadPoolExecutor(1, thread_name_prefix="meshserve-spawn")

_ROOT = str(Path(__file__).resolve().parents[2])  # the worker imports services.python from here
# request parameters that are protocol, not the model's: Triton leaves its own out of parameters()
_HIDDEN_PARAMETERS = ("sequence_id", "sequence_start", "sequence_end", "priority", "timeout",
                      "triton_enable_empty_final_response", "binary_data_output")
SEQUENCE_START, SEQUENCE_END = 1, 2
_REQUEST_KEYS = itertools.count(1)
StreamSink = Callable[["tuple[bytes | None, bool] | InferError"], None]


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker is started with."""

    model_py: Path
    args: dict[str, str]  # Triton's initialize(args)
    instance: str  # Triton's instance name: <group>_<index in group>
    model: str
    version: str
    decoupled: bool
    bls_target: str
    execute_timeout_s: float  # 0 = none
    load_timeout_s: float
    log_level: str = "INFO"
    tensors: ModelTensors | None = None  # the model's inputs and outputs (warmup requests are checked)
    execution_env: ExecutionEnv | None = None  # its EXECUTION_ENV_PATH (services/python/execution_env.py)


# a batch's outcome (ModelWorker.execute): each request's answer (bytes, its error, the future of an
# answer its sender gives later, None: none here), the ns execute() took, the keys rescheduled
Executed = tuple["list[bytes | InferError | asyncio.Future[object] | None] | None", int, frozenset[int]]


@dataclass(frozen=True)
class IterativeControl(SequenceControl):
    """A request's place in an iterative sequence (``sequence_batching { iterative_sequence: true }``):
    its model sees this correlation id and these flags (Triton's IterativeSequencer: an id of its
    own and START for a request without one; no START once rescheduled)."""


# how long a readiness check waits for the model's is_ready() (the python backend's
# kUserModelReadinessTimeoutMs): past it the model is reported not ready for that check
READY_CHECK_TIMEOUT_S = 5.0


def request_key() -> int:
    """A new request's key on the worker socket: a process-wide counter, so a key is never reused
    (an ``id()`` is, once its object is gone: a stale cancel for it would hit a later request)."""
    return next(_REQUEST_KEYS)


def _status(code: int) -> str:
    return f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


def _parameters(request: pb.ModelInferRequest) -> tuple[str, int | str, int, int]:
    """(parameters() JSON, correlation id, sequence flags, timeout in µs: the client's ``timeout``
    parameter, 0 without one) of a request as the model sees them."""
    params: dict[str, object] = {}
    timeout = 0
    for key, p in request.parameters.items():
        if key.startswith(PRIVATE_PREFIX) or key in _HIDDEN_PARAMETERS:
            if key == "timeout":  # (its form and sign were checked when it was queued)
                timeout = max(0, int_value(p) or 0)
            continue
        which = p.WhichOneof("parameter_choice")
        if which is not None:
            params[key] = getattr(p, which)
    corrid: int | str = 0
    flags = 0
    if "sequence_id" in request.parameters:
        sid = request.parameters["sequence_id"]
        corrid = sid.string_param if sid.WhichOneof("parameter_choice") == "string_param" else sid.int64_param
        if request.parameters["sequence_start"].bool_param if "sequence_start" in request.parameters else False:
            flags |= SEQUENCE_START
        if request.parameters["sequence_end"].bool_param if "sequence_end" in request.parameters else False:
            flags |= SEQUENCE_END
    return json.dumps(params, separators=(",", ":")), corrid, flags, timeout  # (JSON compact, as Triton writes it)


class ModelWorker:
    """One model instance's worker process, seen from the service."""

    def __init__(self, spec: WorkerSpec, loop: asyncio.AbstractEventLoop):
        self.spec = spec
        self.loop = loop
        self.alive = False
        self.reason = ""  # why it is down
        self.failures = 0  # consecutive deaths (restart backoff)
        self.on_death: Callable[[ModelWorker], None] | None = None
        self._process: _Process | None = None
        self._inputs = RegionWriter("meshserve-py-in")
        self._outputs = RegionReader()
        self._ids = itertools.count(1)
        # batches sent to the worker: their future, requests and keys
        self._pending: dict[int, tuple[asyncio.Future[object], Sequence[Pending], Sequence[int]]] = {}
        self._streams: dict[int, StreamSink] = {}
        self._stream_classes: dict[int, dict[str, int]] = {}  # a streamed request's classified outputs, if any
        self._running: set[int] = set()  # keys of the requests in the batch execute() is running
        self._metric_requests: dict[int, asyncio.Future[object]] = {}
        # the model's is_ready(), when it defines one (the worker says so once it initialized), and
        # the one check in flight (its ask id and future (ready, error)): at most one at a time
        self.has_is_ready = False
        # a non-decoupled request execute() left open (its response sender answers it later): its
        # key -> the future of its answer and the request (the reader adds them at "done", the loop
        # ends them), and the timer that ends one never answered
        self._deferred: dict[int, tuple[asyncio.Future[object], Pending]] = {}
        self._deferred_timers: dict[int, asyncio.TimerHandle] = {}
        self._ready_check: tuple[int, asyncio.Future[object]] | None = None
        self._stopping = False
        # the model version's response encoder, for its outputs' classification labels (which the
        # load sets after the instances are made: services/base/core.py); PythonModelVersion sets it
        self.encoder: ResponseEncoder | None = None

    @property
    def name(self) -> str:
        return self.spec.instance

    @property
    def pid(self) -> int | None:
        return self._process.proc.pid if self._process is not None else None

    def resident_bytes(self) -> int:
        """The worker process's proportional set size (services/base/memory.py: a version's size)."""
        pid = self.pid
        return memory.pss_bytes(pid) if pid is not None else 0

    # ---- lifecycle (start/stop block: call them off the event loop) ----------------------
    def start(self) -> None:
        """Start the worker and wait for the model's initialize(); RuntimeLoadError if it fails."""
        self.spawn()
        self.wait_initialized()

    def spawn(self) -> None:
        """Start the worker process and hand it the model (initialize() runs in it meanwhile)."""
        ours, theirs = socket.socketpair()
        execution_env = self.spec.execution_env
        env = dict(os.environ) if execution_env is None else execution_env.environ(dict(os.environ))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH", "")) if p)
        python = sys.executable if execution_env is None else str(execution_env.python)
        try:
            # a session and process group of its own: signals to the service's group are the
            # service's alone, and the worker's group (whatever the model starts) is killed with it
            proc = _SPAWNER.submit(subprocess.Popen, [python, "-m", "services.python.worker",
                                                      str(theirs.fileno())],
                                   pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL,
                                   start_new_session=True).result()
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        process = self._process = _Process(proc, Channel(ours))
        self._stopping = False
        threading.Thread(target=process.watch, name=f"{self.name}-watcher", daemon=True).start()
        process.reader = threading.Thread(target=self._read, args=(process,), name=f"{self.name}-reader",
                                          daemon=True)
        process.reader.start()
        self._send(("init", {"model_py": str(self.spec.model_py), "args": self.spec.args, "instance": self.name,
                             "decoupled": self.spec.decoupled, "bls_target": self.spec.bls_target,
                             "log_level": self.spec.log_level, "log_settings": _log_settings_now()}))

    def wait_initialized(self) -> None:
        """Wait for the spawned worker's initialize(); RuntimeLoadError (worker killed) if it fails."""
        process = self._process
        assert process is not None
        try:
            msg = process.init.get(timeout=self.spec.load_timeout_s)
        except queue.Empty:
            process.kill()
            raise RuntimeLoadError(f"model '{self.spec.model}': instance '{self.name}' did not initialize "
                                   f"within {self.spec.load_timeout_s:g} s") from None
        if msg is None:  # it exited
            raise RuntimeLoadError(f"model '{self.spec.model}': the worker of instance '{self.name}' "
                                   f"{process.status()} while loading")
        if msg[0] == "init_error":
            process.kill()
            raise RuntimeLoadError(f"model '{self.spec.model}': initialize() of instance '{self.name}' failed: "
                                   f"{msg[1]}")

    def close(self) -> None:
        """Stop the worker (finalize() runs), kill it if it does not exit within 5 s; whatever
        the model started (the worker's process group) is killed with it."""
        self._stopping = True
        self.alive = False
        process = self._process
        if process is not None:
            try:
                self._send(("stop",))
            except OSError:
                pass
            if not process.exited.wait(5):
                process.kill()
            if process.reader is not None:
                process.reader.join(5)
        self._inputs.close()
        self._outputs.close()

    def kill(self, reason: str) -> None:
        """Kill a worker that misbehaves (a hung execute); the reader reports it as dead."""
        self.reason = reason
        self.alive = False
        if self._process is not None and not self._process.exited.is_set():
            _kill_group(self._process.proc.pid)

    def log_settings(self) -> None:
        """Hand the worker the log settings /v2/logging gave the service."""
        settings = _log_settings_now()
        if settings is not None and self.alive:
            with contextlib.suppress(OSError):
                self._send(("log", settings))

    def down_message(self) -> str:
        """Triton's text for a dead stub, with why and what happens next."""
        return f"Stub process '{self.name}' is not healthy ({self.reason or 'not started'})."

    # ---- batches (event loop) ----------------------------------------------------------
    def _send(self, msg: tuple, fd: int = -1) -> None:
        assert self._process is not None
        self._process.channel.send(msg, fd)

    def cancel(self, key: int) -> None:
        """A request's client went away: its responses are dropped and, if this worker still runs
        it (its batch, or a decoupled request before its final response), the model is told
        (``request.is_cancelled()``); a finished or unknown request is left alone."""
        self._stream_classes.pop(key, None)
        if (self._streams.pop(key, None) is not None or key in self._running) and self.alive:
            try:
                self._send(("cancel", key))
            except OSError:
                pass

    async def execute(self, payloads: Sequence[Pending], keys: Sequence[int],
                      sinks: Mapping[int, StreamSink] | None = None) -> Executed:
        """Run one batch: every request's serialized response or error (None for a decoupled
        model, whose responses go to ``sinks``; a future for a request answered later: _encode),
        the ns execute() took in the worker, and the keys of the requests the model rescheduled."""
        if not self.alive:
            raise InferError.unavailable(self.down_message())
        total = sum(aligned(len(item.data)) for p in payloads for item in p.inputs.values())
        region = self._inputs.ensure(total) if total else None
        metas = []
        offset = 0
        for p, key in zip(payloads, keys, strict=True):
            refs = []
            for name, item in p.inputs.items():
                size = len(item.data)
                if size:  # (an empty tensor, a 0 in its shape, has no bytes: maybe no region)
                    assert region is not None
                    region.write(offset, item.data)
                refs.append(TensorRef(name, item.spec.datatype, item.shape, offset, size))
                offset += aligned(size)
            params, corrid, flags, timeout_us = _parameters(p.request)
            if isinstance(p.sequence, IterativeControl):  # (its id may be the service's; a rescheduled pass: no START)
                corrid, flags = p.sequence.corrid, (SEQUENCE_START if p.sequence.start else 0) | (
                    SEQUENCE_END if p.sequence.end else 0)
            wanted = [name for name, _ in p.outputs]  # all the model's outputs when the request names none
            request_id = p.request.id if p.request_id is None else p.request_id  # (the client's, behind a gateway)
            metas.append((key, request_id, corrid, flags, timeout_us, params, wanted, refs))
        if sinks:
            for p, key in zip(payloads, keys, strict=True):
                if key in sinks and any(k for _, k in p.outputs):  # (its responses classified: _stream_item)
                    self._stream_classes[key] = {name: k for name, k in p.outputs if k}
            self._streams.update(sinks)
        batch_id = next(self._ids)
        fut: asyncio.Future[object] = self.loop.create_future()
        self._pending[batch_id] = (fut, payloads, keys)
        ref, fd = region_ref(region) if region is not None else (None, -1)
        try:
            self._send(("exec", batch_id, ref, metas), fd)
        except OSError:
            self._pending.pop(batch_id, None)
            raise InferError.unavailable(self.down_message()) from None
        timeout = self.spec.execute_timeout_s
        # a timer per batch, not wait_for + shield (two more futures and a task per batch)
        timer = self.loop.call_later(timeout, self._timed_out, batch_id, timeout) if timeout else None
        self._running.update(keys)
        try:
            result = await fut
        finally:
            self._running.difference_update(keys)
            if timer is not None:
                timer.cancel()
            del fut  # (it holds the batch's error, whose traceback holds this frame: docs/security.md, "Session 11: error cycles")
        self.failures = 0
        return result  # type: ignore[return-value]

    def _timed_out(self, batch_id: int, timeout: float) -> None:
        """A batch's execute() outlived the timeout: fail it and kill the worker (restarted)."""
        entry = self._pending.pop(batch_id, None)
        if entry is None:
            return
        self.kill(f"execute() did not return within {timeout:g} s; the worker was killed")
        _settle(entry[0], InferError.unavailable(self.down_message()))

    def run(self, inputs: dict[str, np.ndarray], output_names: list[str]) -> dict[str, np.ndarray]:
        """One request through ``execute()``, from a thread other than the loop's (model_warmup
        calls it at load: services/base/warmup.py); its outputs, or the request's error raised."""
        request = pb.ModelInferRequest(model_name=self.spec.model)
        for name, arr in inputs.items():
            datatype = "BYTES" if arr.dtype == np.object_ else datatypes.from_numpy(arr.dtype)
            request.inputs.add(name=name, datatype=datatype, shape=list(arr.shape))
            request.raw_input_contents.append(datatypes.serialize_bytes(arr.reshape(-1).tolist())
                                              if datatype == "BYTES" else np.ascontiguousarray(arr).tobytes())
        for name in output_names:
            request.outputs.add(name=name)
        assert self.spec.tensors is not None, "a worker that runs warmup requests knows the model's tensors"
        pending = prepare(self.spec.tensors, request, NO_HOP)
        timeout = self.spec.execute_timeout_s or None
        out, _, _ = asyncio.run_coroutine_threadsafe(self.execute([pending], [request_key()]), self.loop).result(timeout)
        answer = out[0] if out else None
        if isinstance(answer, InferError):
            # raised from a local, the error's traceback would hold this frame and the frame the
            # error (a cycle only the collector frees): the frame lets go of it as it leaves
            error, answer, out = answer, None, None
            try:
                raise error
            finally:
                del error
        if answer is None:
            return {}  # a decoupled model's responses go to no one here
        resp = pb.ModelInferResponse.FromString(answer)
        result = {}
        for i, t in enumerate(resp.outputs):
            raw = resp.raw_output_contents[i]
            arr = (np.array(datatypes.deserialize_bytes(raw), dtype=np.object_) if t.datatype == "BYTES"
                   else np.frombuffer(raw, dtype=datatypes.numpy_dtype(t.datatype)))
            result[t.name] = arr.reshape(list(t.shape))
        return result

    async def metrics(self, timeout: float = 2.0) -> list:
        """The worker's custom metrics (pb_utils.metrics_snapshot); [] when it is down or slow."""
        if not self.alive:
            return []
        ask = next(self._ids)
        fut: asyncio.Future[object] = self.loop.create_future()
        self._metric_requests[ask] = fut
        try:
            self._send(("metrics", ask))
            return cast(list, await asyncio.wait_for(fut, timeout))
        except (OSError, TimeoutError):
            return []
        finally:
            self._metric_requests.pop(ask, None)

    async def check_ready(self) -> str | None:
        """None when the instance is ready, else why not (Triton's TRITONBACKEND_ModelInstanceReady
        of the python backend, its texts): a worker that is down is not ready; a model with
        ``is_ready()`` is asked, at most once at a time per instance (a check asked for while one
        runs waits for that one's answer), for at most READY_CHECK_TIMEOUT_S. A check that outlives
        the wait stays in flight until the worker answers (the next caller waits for it), so a
        slow ``is_ready()`` never piles up calls in the worker."""
        if not self.alive:
            return f"Stub process '{self.name}' is not healthy."
        if not self.has_is_ready:
            return None
        joined = self._ready_check is not None
        if self._ready_check is None:
            ask = next(self._ids)
            self._ready_check = (ask, self.loop.create_future())
            try:
                self._send(("is_ready", ask))
            except OSError:
                self._ready_check = None
                return "Stub process is not healthy while waiting for user-defined is_ready() response"
        check = self._ready_check[1]
        try:
            ready, error = cast(tuple[bool, 'str | None'], await asyncio.wait_for(asyncio.shield(check),
                                                                              READY_CHECK_TIMEOUT_S))
        except TimeoutError:
            return ("Timed out waiting for in-flight is_ready() response" if joined
                    else "Timed out waiting for user-defined is_ready() response")
        if error is not None:
            return error
        return None if ready else f"Model '{self.name}' is not ready (user-defined check failed)."

    def _ready_answered(self, ask: int, ready: bool, error: str | None) -> None:
        """The worker's answer to a readiness check (event loop)."""
        if self._ready_check is not None and self._ready_check[0] == ask:
            _settle(self._ready_check[1], (ready, error))
            self._ready_check = None

    # ---- the reader thread ---------------------------------------------------------------
    def _read(self, process: _Process) -> None:
        """Take the worker's messages until its socket ends (the watcher ends it when the process
        exits, whoever else holds the worker's end), then report the death."""
        channel = process.channel
        serving = False
        while True:
            try:
                msg = channel.recv()
                kind = msg[0]
                if kind == "done" and msg[2] is not None and msg[2][2]:  # its new output region's descriptor
                    self._outputs.get(msg[2][0], msg[2][1], channel.recv_fd())
            except Exception as exc:  # (EOFError: the socket ended; anything else: a broken message)
                if not isinstance(exc, EOFError) and not process.exited.is_set():
                    log.error("instance '%s': the worker broke the protocol (%s); killing it", self.name, exc)
                    process.kill()
                break
            if kind == "ready":
                serving = True
                self.has_is_ready = bool(msg[2])
                self.alive, self.reason = True, ""
                process.init.put(msg)
                continue
            if kind == "init_error":
                process.init.put(msg)
                continue
            try:
                self._dispatch(msg)
            except Exception:
                log.exception("instance '%s': bad message from the worker", self.name)
        if not process.exited.wait(5):  # its socket ended, the process did not: it goes now
            process.kill()
        channel.close()
        if not serving:
            process.init.put(None)
            return
        try:
            self.loop.call_soon_threadsafe(self._died, process.status())
        except RuntimeError:
            pass  # the service's loop is closed: it is shutting down

    def _dispatch(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "resp":
            _, key, err, outs, flags, params = msg
            deferred = self._deferred.pop(key, None)
            if deferred is not None:  # a non-decoupled request's answer after execute() returned
                self._streams.pop(key, None)
                fut, p = deferred
                self.loop.call_soon_threadsafe(self._answer_late, key, fut, self._response(p, err, outs, params))
                return
            final = bool(flags & 1)
            sink = self._streams.pop(key, None) if final else self._streams.get(key)
            classes = self._stream_classes.pop(key, None) if final else self._stream_classes.get(key)
            if sink is not None:
                try:
                    item = self._stream_item(err, outs, final, classes, params)
                except InferError as exc:  # a classification past its bound: the request ends with it
                    item = exc
                    self.loop.call_soon_threadsafe(self.cancel, key)  # (its model is told; the rest dropped)
                self.loop.call_soon_threadsafe(sink, item)
            return
        if kind == "metrics":
            asked = self._metric_requests.pop(msg[1], None)
            if asked is not None:
                self.loop.call_soon_threadsafe(_settle, asked, msg[2])
            return
        if kind == "is_ready":
            _, ask, ready, error = msg
            self.loop.call_soon_threadsafe(self._ready_answered, ask, bool(ready),
                                           None if error is None else str(error))
            return
        entry = self._pending.pop(msg[1], None)
        if entry is None:
            return  # a batch that already timed out
        fut, payloads, keys = entry
        value: object
        if kind == "done":
            _, _, ref, results, elapsed_ns, again = msg
            rescheduled = frozenset(again)
            value = (None if results is None else self._encode(payloads, keys, ref, results, rescheduled),
                     elapsed_ns, rescheduled)
        else:  # "failed": execute() raised: a decoupled request ends with that error (model.py)
            for key in keys:
                self._streams.pop(key, None)
                self._stream_classes.pop(key, None)
            # Triton 2.51's stub text (it names the instance "model")
            value = InferError.internal(f"Failed to process the request(s) for model '{self.name}', message: {msg[2]}")
        self.loop.call_soon_threadsafe(_settle, fut, value)

    def _encode(self, payloads: Sequence[Pending], keys: Sequence[int], ref: RegionRef | None, results: list,
                rescheduled: frozenset[int]) -> list[bytes | InferError | asyncio.Future[object] | None]:
        """A finished batch's answers (reader thread): each request's response or error, or, for a
        request execute() left open (None: deferred), the future of the answer its sender gives
        later (``_answer_late``), or None for a request its model rescheduled. A batch with a
        deferred request retires the input region: the worker may still read its inputs in place."""
        region = self._outputs.get(ref[0], ref[1], -1) if ref is not None else None
        out: list[bytes | InferError | asyncio.Future[object] | None] = []
        for p, key, result in zip(payloads, keys, results, strict=True):
            if key in rescheduled:  # it runs again (its model released it so): no answer yet
                out.append(None)
                continue
            if result is None:
                fut: asyncio.Future[object] = self.loop.create_future()
                self._deferred[key] = (fut, p)
                self._streams[key] = functools.partial(_settle, fut)  # (the worker's death, a cancel)
                self._inputs.retire()
                out.append(fut)
                continue
            err, refs, params = result
            out.append(self._response(p, err, ((t.name, t.datatype, t.shape,
                                                b"" if t.nbytes == 0 else bytes(cast(Region, region).view(t.offset, t.nbytes)))
                                               for t in refs), params))
        return out

    def _response(self, p: Pending, err: tuple[str, str] | None, outs: Iterable[tuple[str, str, Sequence[int], bytes]],
                  params: str | None) -> bytes | InferError:
        """One request's serialized response (its outputs classified as it asked) or its error."""
        if err is not None:
            return InferError(Code[err[0]] if err[0] in Code.__members__ else Code.INTERNAL, err[1])
        resp = pb.ModelInferResponse(model_name=self.spec.model, model_version=self.spec.version, id=p.request.id)
        wanted = {name: k for name, k in p.outputs}
        room = MAX_CLASSIFIED
        try:
            for name, datatype, shape, data in outs:
                if name in wanted:  # (the worker's batch path filters already; a sender's answer here)
                    room -= self._add_output(resp, name, datatype, shape, data, wanted[name], room)
            if params is not None:
                _set_parameters(resp, params)
        except InferError as exc:  # this request's own
            return exc
        return resp.SerializeToString()

    def watch_deferred(self, key: int) -> None:
        """Bound a deferred request's wait for its answer (event loop): the model's execute timeout
        (``execute_timeout_seconds`` / --python-execute-timeout; 0: none), counted from the
        batch's end. Past it the request fails and the worker forgets it (``is_cancelled()``
        true, a later answer dropped); the worker is not killed: nothing runs for it."""
        timeout = self.spec.execute_timeout_s
        if timeout and key in self._deferred:
            self._deferred_timers[key] = self.loop.call_later(timeout, self._deferred_expired, key, timeout)

    def _deferred_expired(self, key: int, timeout: float) -> None:
        self._deferred_timers.pop(key, None)
        entry = self._deferred.pop(key, None)
        self._streams.pop(key, None)
        if entry is not None:
            _settle(entry[0], InferError.internal(
                f"Failed to process the request(s) for model '{self.name}', message: execute() returned without a "
                f"response for the request and its response sender sent none within {timeout:g} s"))
        if self.alive:
            with contextlib.suppress(OSError):
                self._send(("end", key))

    def _answer_late(self, key: int, fut: asyncio.Future[object], value: bytes | InferError) -> None:
        timer = self._deferred_timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        _settle(fut, value)

    def _stream_item(self, err: tuple[str, str] | None, outs: list, final: bool,
                     classes: Mapping[str, int] | None, params: str | None) -> tuple[bytes | None, bool] | InferError:
        if err is not None:
            return InferError(Code[err[0]] if err[0] in Code.__members__ else Code.INTERNAL, err[1])
        if not outs and final and params is None:
            return None, True  # Triton's empty final response
        resp = pb.ModelInferResponse(model_name=self.spec.model, model_version=self.spec.version)
        room = MAX_CLASSIFIED
        for name, datatype, shape, data in outs:
            room -= self._add_output(resp, name, datatype, shape, data, classes.get(name, 0) if classes else 0, room)
        if params is not None:
            _set_parameters(resp, params)
        return resp.SerializeToString(), final

    def _add_output(self, resp: pb.ModelInferResponse, name: str, datatype: str, shape: Sequence[int], data: bytes,
                    k: int, room: int) -> int:
        """One output into ``resp``: as it is, or classified with ``k`` within ``room`` entries, as
        Triton classifies any backend's (services/base/classification.py). The entries it took."""
        if not k:
            resp.outputs.add(name=name, datatype=datatype, shape=shape)
            resp.raw_output_contents.append(data)
            return 0
        check_classifiable(datatype)  # (before its bytes are read as that type)
        arr = np.frombuffer(data, dtype=datatypes.carrier_dtype(datatype)).reshape(shape)
        batched = self.spec.tensors is not None and self.spec.tensors.max_batch_size > 0
        labels = self.encoder.labels.get(name, ()) if self.encoder is not None else ()
        part = classify(arr, k, datatype, labels, batched, room, f"model '{self.spec.model}' output '{name}'")
        resp.outputs.add(name=name, datatype="BYTES", shape=part.shape)
        resp.raw_output_contents.append(datatypes.serialize_bytes(part.reshape(-1).tolist()))
        return int(part.size)

    def _died(self, status: str) -> None:
        """The worker process ended (event loop)."""
        self.alive = False
        if self._ready_check is not None:
            _settle(self._ready_check[1], (False, "Stub process is not healthy while waiting for user-defined "
                                                  "is_ready() response"))
            self._ready_check = None
        for timer in self._deferred_timers.values():
            timer.cancel()
        self._deferred_timers.clear()
        if self._stopping:  # (unloaded, or the service stops): a deferred request gets no answer now
            for key, (fut, _) in self._deferred.items():
                self._streams.pop(key, None)
                _settle(fut, InferError.unavailable(f"model instance '{self.name}' stopped before the request "
                                                    "was answered"))
            self._deferred.clear()
            return
        self._deferred.clear()  # (their futures are in _streams: they fail below with the rest)
        self.reason = self.reason or status
        if self.reason != status:
            self.reason = f"{self.reason} ({status})"
        log.error("model instance '%s' is down: %s", self.name, self.reason)
        err = InferError.unavailable(self.down_message())
        for fut, _, _ in self._pending.values():
            _settle(fut, err)
        self._pending.clear()
        for sink in self._streams.values():
            sink(err)
        self._streams.clear()
        self._stream_classes.clear()
        self._inputs.close()  # a restarted worker gets new regions
        self._outputs.close()
        self.failures += 1
        if self.on_death is not None:
            self.on_death(self)

    def restart_delay(self) -> float:
        """Backoff before the next start: 0.5 s doubling per consecutive death, at most 30 s."""
        return min(30.0, 0.5 * 2 ** max(0, self.failures - 1))


def _log_settings_now() -> dict | None:
    """The /v2/logging settings the service was given since it started (None: none)."""
    settings = log_settings.active
    return dict(settings.explicit) if settings is not None and settings.explicit else None


def _set_parameters(resp: pb.ModelInferResponse, params: str) -> None:
    """A python model's response parameters (pb_utils.InferenceResponse(parameters=...): JSON of
    bool/int/str values, as the stub checks them) onto the response, as Triton's backend sets them
    (an int past 64 bits: this request's INVALID_ARG)."""
    for key, value in json.loads(params).items():
        http_codec.set_parameter(resp.parameters[key], value, f"response parameter '{key}'")


def _settle(fut: asyncio.Future[object], value: object) -> None:
    if fut.done():
        return
    if isinstance(value, BaseException):
        fut.set_exception(value)
    else:
        fut.set_result(value)



class _Process:
    """One start of a worker: its process, socket and fate (a restart gets a new one)."""

    def __init__(self, proc: subprocess.Popen[bytes], channel: Channel):
        self.proc = proc
        self.channel = channel
        self.exited = threading.Event()  # set once the process is reaped and its group killed
        self.init: queue.Queue[tuple | None] = queue.Queue()  # "ready" or "init_error"; None: it exited
        self.reader: threading.Thread | None = None

    def watch(self) -> None:
        """Wait for the process's exit by its pid (a process the model forked may hold the worker's
        end of the socket, so no EOF would come), kill its process group (what the model started)
        while the pid cannot be reused (not yet reaped), reap it, and end the reader's wait."""
        pid = self.proc.pid
        with contextlib.suppress(ChildProcessError):
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        _kill_group(pid)
        self.proc.wait()
        reap_session(pid)
        self.exited.set()
        self.channel.shutdown()

    def kill(self) -> None:
        """Kill the worker and its process group; returns once it is reaped."""
        if not self.exited.is_set():
            _kill_group(self.proc.pid)
        self.exited.wait()

    def status(self) -> str:
        code = self.proc.returncode
        return "exited" if code is None else _status(code)


PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Make the service the subreaper of its workers' descendants: what a model started becomes
    the service's child when its worker dies, not init's, so the service reaps it
    (``reap_session``): no zombie piles up where the service runs as a container's pid 1."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def reap_session(sid: int) -> None:
    """Kill and reap this process's children in session ``sid`` (a dead worker's: what its model
    started, orphaned; only that worker's descendants can be in a session of its pid)."""
    me = os.getpid()
    orphans = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and int(fields[3]) == sid:
            orphans.append(int(entry))
    for pid in orphans:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def _kill_group(pid: int) -> None:
    """SIGKILL a worker and its process group (the worker leads it: started in a session of its
    own; the worker itself too, should the model have moved it to another group)."""
    for kill, target in ((os.killpg, pid), (os.kill, pid)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(target, signal.SIGKILL)
