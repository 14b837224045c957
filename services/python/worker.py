"""The model worker: one process per model instance, as Triton's python backend runs one stub
process per instance.

Started by the service (services/python/instance.py) as ``python -m services.python.worker FD``
with one end of a socket pair, in a process group of its own. It loads ``model.py``
(``TritonPythonModel``) with Triton's ``initialize(args)``, then runs ``execute(requests)`` for
each batch the service sends: input tensors are numpy views of the service's shared-memory
region, outputs are written into the worker's own region (services/python/ipc.py: anonymous
memory passed by descriptor over the socket); only names, shapes and offsets travel as messages. A decoupled model's responses (its response sender, from any thread) travel on the socket
with their bytes. ``finalize()`` runs when the service stops the worker or goes away.

``python -m services.python.worker --autocomplete MODEL.py`` reads a JSON ModelConfig on stdin,
runs the model's ``auto_complete_config`` on it and prints the result (services/python/autocomplete.py).
"""
from __future__ import annotations

import collections.abc
import contextlib
import ctypes
import functools
import importlib.util
import inspect
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import types
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from meshserve.telemetry import log_settings
from meshserve.telemetry.text_lines import TextFormatter
from services.python import pb_utils
from services.python.ipc import Channel, Region, RegionReader, RegionWriter, TensorRef, aligned, region_ref

if TYPE_CHECKING:
    import asyncio

log = logging.getLogger("meshserve.python.worker")

# every type asyncio.iscoroutine takes (3.11: these three; 3.12 on: without GeneratorType) or
# more: what is none of them is no coroutine, and asyncio need not be imported to say so
_MAYBE_COROUTINE = (types.CoroutineType, types.GeneratorType, collections.abc.Coroutine)

# (key, request_id, correlation_id, flags, timeout (µs), parameters JSON, requested output names, inputs)
RequestMeta = tuple[int, str, "int | str", int, int, str, list[str], list[TensorRef]]
# a response: (error (code name, message) or None, outputs)
# (error, outputs, parameters: the response's JSON, None when it has none)
ResponseMeta = tuple["tuple[str, str] | None", list[TensorRef], "str | None"]


# meshserve's own modules (the worker, pb_utils, BLS): their frames are not the model's, and a
# client never sees where meshserve is installed (Triton's stub shows the model's frames only)
_OWN_FILES = str(Path(__file__).parent) + "/"


def describe(exc: BaseException) -> str:
    """An exception as Triton's stub reports it: type, message and the frames (innermost first)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(_OWN_FILES)]
    where = "".join(f"  {f.filename}({f.lineno}): {f.name}\n" for f in reversed(frames))
    text = exc.message() if isinstance(exc, pb_utils.TritonModelException) else str(exc)
    return f"{type(exc).__name__}: {text}" + (f"\n\nAt:\n{where}" if where else "")


def load_model_module(model_py: Path, name: str, model_dir: str = "") -> ModuleType:
    """Import a model.py by path (its directory first on sys.path, as Triton's stub does);
    ``model_dir`` is what pb_utils.get_model_dir() answers (the model's version folder), by
    default model.py's folder (a python-based backend's model.py lives in the backend's)."""
    sys.modules["triton_python_backend_utils"] = pb_utils
    pb_utils._model_dir = model_dir or str(model_py.parent)  # pb_utils.get_model_dir()
    spec = importlib.util.spec_from_file_location(f"meshserve_python_model_{name}", model_py)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {model_py}")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(model_py.parent))
    spec.loader.exec_module(module)
    if not hasattr(module, "TritonPythonModel"):
        raise AttributeError(f"{model_py} defines no class TritonPythonModel")
    return module


class Worker:
    """The worker side of one model instance (implements pb_utils.WorkerRuntime)."""

    def __init__(self, channel: Channel):
        self.channel = channel
        self._inbox: queue.Queue[tuple | None] = queue.Queue()
        # Requests this worker has received and not finished (a batch's until it returns; a
        # decoupled one's until its final response, or its failed batch), and those of them whose
        # client went away. A cancel for any other key is dropped, so ``_cancelled`` never
        # outgrows ``_live``.
        self._requests_lock = threading.Lock()
        self._live: set[int] = set()
        self._cancelled: set[int] = set()
        self._inputs = RegionReader()
        self._outputs = RegionWriter("meshserve-py-out")
        self.model: Any = None
        self.decoupled = False
        self.instance = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_lock = threading.Lock()
        # a non-decoupled batch's request keys while it runs: a deferred request's answer given before
        # the batch's "done" went out waits here (the service learns of the deferral from "done")
        self._held: dict[int, list[tuple]] = {}
        self._bls: Any = None
        self._bls_target = ""

    def send(self, msg: tuple, fd: int = -1) -> None:
        self.channel.send(msg, fd)

    # ---- lifecycle ---------------------------------------------------------------------
    def run(self) -> None:
        msg = self.channel.recv()
        opts = msg[1]
        try:
            self._load(opts)
        except BaseException as exc:  # the model's own code: anything can come out of it
            self.send(("init_error", describe(exc)))
            return
        pb_utils._serving = True  # BLS from initialize()/finalize() is refused, as Triton's stub does
        # (whether the model defines is_ready(): without it the service asks nothing, as the stub
        # caches hasattr(model, "is_ready") once after initialize())
        has_is_ready = hasattr(self.model, "is_ready")
        if has_is_ready and inspect.iscoroutinefunction(self.model.is_ready):
            self._event_loop()  # (made here, on the main thread, whose loop it also is)
        self.send(("ready", os.getpid(), has_is_ready))
        threading.Thread(target=self._read, name="worker-reader", daemon=True).start()
        try:
            while True:
                item = self._inbox.get()
                if item is None or item[0] == "stop":
                    break
                self._execute(item)
        finally:
            self._finalize()

    def _load(self, opts: dict) -> None:
        self.instance = opts["instance"]
        self.decoupled = opts["decoupled"]
        self._bls_target = opts.get("bls_target") or ""
        handler = logging.StreamHandler()  # (stderr; control characters in a message escaped)
        handler.setFormatter(TextFormatter(f"%(asctime)s %(levelname)s [{self.instance}] %(name)s: %(message)s"))
        logging.basicConfig(level=opts.get("log_level", "INFO"), handlers=[handler])
        # The model's own pb_utils.Logger lines at INFO and above show whatever the service's level,
        # as Triton shows them by default (its --log-info); VERBOSE ones only at DEBUG (--log-verbose).
        model_log = logging.getLogger(pb_utils.Logger._log.name)
        model_log.setLevel(min(logging.getLogger().level, logging.INFO))
        # /v2/logging's severities over this worker's lines: info, warning and error on (a model's
        # INFO lines show whatever the service's level, above), verbose as the service's level
        self._log_settings = log_settings.LogSettings(handler, min(logging.getLogger().level, logging.INFO), "default")
        if opts.get("log_settings"):
            self._apply_log_settings(opts["log_settings"])
        pb_utils._install(self)
        args = opts["args"]
        module = load_model_module(Path(opts["model_py"]), args["model_name"],
                                   os.path.join(args["model_repository"], args["model_version"]))
        self.model = module.TritonPythonModel()
        init = getattr(self.model, "initialize", None)
        if init is not None:
            self._maybe_await(init(dict(opts["args"])))

    def _apply_log_settings(self, settings: dict) -> None:
        """The service's /v2/logging settings now in force (its format aside: the worker's lines
        keep their instance tag)."""
        try:
            self._log_settings.update({k: v for k, v in settings.items() if k not in ("log_file", "log_format")})
        except log_settings.SettingError as exc:
            log.warning("log settings from the service not applied: %s", exc)
            return
        logging.getLogger(pb_utils.Logger._log.name).setLevel(min(logging.getLogger().level, logging.INFO))

    def _finalize(self) -> None:
        pb_utils._serving = False
        fin = getattr(self.model, "finalize", None)
        if fin is not None:
            try:
                self._maybe_await(fin())
            except Exception:
                log.exception("finalize() of %s raised", self.instance)
        self._inputs.close()
        self._outputs.close()

    def _read(self) -> None:
        while True:
            try:
                msg = self.channel.recv()
                kind = msg[0]
                if kind == "exec" and msg[2] is not None:  # (generation, size, its descriptor follows)
                    generation, size, follows = msg[2]
                    msg = (kind, msg[1], (generation, size, self.channel.recv_fd() if follows else -1), msg[3])
            except (EOFError, OSError):
                self._inbox.put(None)  # the service is gone: finalize and exit
                return
            if kind == "exec":  # live from now: a cancel that comes while it waits is kept
                with self._requests_lock:
                    self._live.update(m[0] for m in msg[3])
                self._inbox.put(msg)
            elif kind == "cancel":
                with self._requests_lock:
                    if msg[1] in self._live:
                        self._cancelled.add(msg[1])
            elif kind == "end":  # a deferred request the service ended (its wait ran out): no answer now
                self._finished([msg[1]])
            elif kind == "log":  # /v2/logging changed the service's settings
                self._apply_log_settings(msg[1])
            elif kind == "metrics":  # answered here, also while execute() runs
                self.send(("metrics", msg[1], pb_utils.metrics_snapshot()))
            elif kind == "is_ready":  # on a thread of its own, also while execute() runs
                threading.Thread(target=self._is_ready, args=(msg[1],), name="worker-is-ready",
                                 daemon=True).start()
            else:
                self._inbox.put(msg)

    def _is_ready(self, ask: int) -> None:
        """The model's ``is_ready()`` (sync or ``async def``), answered as ``(ready, error)``. The
        service asks at most once at a time per instance (services/python/instance.py), so one
        thread here at most; a check that outlives the service's 5 s wait still ends here and
        answers, as the stub's does. What it raises, or a result that is not a bool, is an error
        with the stub's text: the model is not ready."""
        ready, error = False, None
        try:
            result = self._maybe_await(self.model.is_ready())
            if isinstance(result, bool):  # (a Python bool only, as pybind11's isinstance<bool_>)
                ready = result
            else:
                error = "is_ready() must return a boolean value"
        except BaseException as exc:  # the model's own code: anything can come out of it
            error = describe(exc)
        with contextlib.suppress(OSError):
            self.send(("is_ready", ask, ready, error))

    def _finished(self, keys: list[int]) -> None:
        with self._requests_lock:
            self._live.difference_update(keys)
            self._cancelled.difference_update(keys)

    def _maybe_await(self, value: Any, background: list[pb_utils.InferenceRequest] | None = None) -> Any:
        """Run a coroutine (``async def execute``/``initialize``) on the worker's event loop and wait
        for its result; with ``background`` (a decoupled model's async execute: its requests) do not
        wait, as Triton's stub runs it: the next batch may start while it runs."""
        if not isinstance(value, _MAYBE_COROUTINE):
            return value
        import asyncio  # (only for a model that needs it: ~15% of a worker's start, docs/perf/suite-time.md)

        if not asyncio.iscoroutine(value):
            return value
        future = asyncio.run_coroutine_threadsafe(value, self._event_loop())
        if background is not None:
            future.add_done_callback(functools.partial(self._background_done, background))
            return None
        return future.result()

    def _event_loop(self) -> Any:
        """The worker's event loop, running for good on a thread of its own from its first use, as
        Triton's stub keeps its loop: what a coroutine leaves behind (``asyncio.create_task`` in
        an async execute, to answer after it returned) goes on running between batches; a loop
        run only while each execute() ran froze such a task until the next batch. It is also the
        main thread's loop (``asyncio.get_event_loop()`` in a model's synchronous code)."""
        with self._loop_lock:  # (an async is_ready() may ask from its own thread)
            if self._loop is None:
                import asyncio

                loop = self._loop = asyncio.new_event_loop()
                if threading.current_thread() is threading.main_thread():
                    asyncio.set_event_loop(loop)
                threading.Thread(target=loop.run_forever, name="worker-event-loop", daemon=True).start()
            return self._loop

    def _background_done(self, requests: list[pb_utils.InferenceRequest], future: Any) -> None:
        """A decoupled model's async execute ended (on the loop's thread). What it raised is logged,
        as the stub logs it, and ends each of its requests it had not ended with that error (Triton
        leaves them open; here every request ends)."""
        exc = None if future.cancelled() else future.exception()
        if exc is None:
            return
        text = describe(exc)
        log.error("the async execute() of %s raised: %s", self.instance, text)
        for request in requests:
            sender = request.get_response_sender()
            if not sender._closed:
                with contextlib.suppress(Exception):
                    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(text)),
                                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    # ---- execute -----------------------------------------------------------------------
    def _requests(self, where: tuple[int, int, int] | None, metas: list[RequestMeta]) -> list[pb_utils.InferenceRequest]:
        region = self._inputs.get(*where) if where is not None else None
        out = []
        for key, request_id, corrid, flags, timeout, params, wanted, refs in metas:
            tensors = []
            for ref in refs:
                if ref.nbytes == 0:  # an empty tensor (a 0 in its shape): no bytes, maybe no region
                    arr = np.empty(ref.shape, dtype=np.object_ if ref.datatype == "BYTES"
                                   else pb_utils.wire_to_numpy(ref.datatype))
                    tensors.append(pb_utils.wire_tensor(ref.name, ref.datatype, arr))
                    continue
                assert region is not None
                if ref.datatype == "BYTES":
                    arr = pb_utils.deserialize_bytes_tensor(region.view(ref.offset, ref.nbytes)).reshape(ref.shape)
                else:
                    dtype = np.dtype(pb_utils.wire_to_numpy(ref.datatype))
                    arr = np.frombuffer(region.map, dtype=dtype, count=ref.nbytes // dtype.itemsize,
                                        offset=ref.offset).reshape(ref.shape)
                    if self.decoupled:
                        arr = arr.copy()  # its responses may be sent after execute() returns
                tensors.append(pb_utils.wire_tensor(ref.name, ref.datatype, arr))
            req = pb_utils.InferenceRequest(inputs=tensors, request_id=request_id, correlation_id=corrid, flags=flags,
                                            timeout=timeout, parameters=params)
            req._requested = set(wanted)  # as Triton's stub gives it: a set, every output when none were named
            req._key = key
            req._decoupled = self.decoupled
            out.append(req)
        return out

    def _execute(self, msg: tuple) -> None:
        _, batch_id, where, metas = msg
        t0 = time.perf_counter_ns()
        requests: list[pb_utils.InferenceRequest] = []
        if not self.decoupled:
            with self._requests_lock:
                self._held.update((m[0], []) for m in metas)
        try:
            requests = self._requests(where, metas)
            responses = self._maybe_await(self.model.execute(requests), requests if self.decoupled else None)
            if self.decoupled:
                if responses is not None:
                    raise pb_utils.TritonModelException(  # (the stub's words)
                        f"Python model '{self.instance}' is using the decoupled mode and the execute function "
                        "must return None.")
                self.send(("done", batch_id, None, None, time.perf_counter_ns() - t0,
                           [r._key for r in requests if pb_utils.rescheduled(r)]))
                return
            responses = pb_utils.collect_responses(requests, responses)
            region, results = self._pack(requests, responses)
            again = [r._key for r in requests if pb_utils.rescheduled(r)]  # (they run again: not ended)
        except BaseException as exc:
            again = []
            packed = None if self.decoupled else self._pack_sent(requests, exc)
            if packed is None:
                self._finished([m[0] for m in metas])  # (the service ends a failed decoupled request too)
                try:
                    self.send(("failed", batch_id, describe(exc)))
                finally:
                    self._release_held(metas)
                return
            region, results = packed
        # (a deferred request stays live until its sender's final flag, or the service ends it)
        self._finished([r._key for r in requests if not pb_utils.deferred(r)] if len(requests) == len(metas)
                       else [m[0] for m in metas])
        ref, fd = region_ref(region) if region is not None else (None, -1)
        try:
            self.send(("done", batch_id, ref, results, time.perf_counter_ns() - t0, again), fd)
        finally:
            self._release_held(metas)

    def _release_held(self, metas: list[RequestMeta]) -> None:
        """The batch's "done" (or "failed") is out: the answers its deferred requests' senders gave
        meanwhile go now, after it (the service learns a request is deferred from "done")."""
        if self.decoupled:
            return
        with self._requests_lock:
            held = [self._held.pop(m[0], None) for m in metas]
        for messages in held:
            for message in messages or ():
                with contextlib.suppress(OSError):
                    self.send(message)

    def _pack_sent(self, requests: list[pb_utils.InferenceRequest], exc: BaseException
                   ) -> tuple[Region | None, list[ResponseMeta | None]] | None:
        """A non-decoupled model's execute() raised after some of its requests were answered through
        their response senders (a second send raises, as NVIDIA's response_sender QA model does):
        as in Triton, where a sent response goes out at once and ends its request, those requests
        keep their answer and only the others fail. None when no request was answered."""
        if not any(r._sent_response is not None for r in requests):
            return None
        text = f"Failed to process the request(s) for model '{self.instance}', message: {describe(exc)}"
        try:
            return self._pack(requests, [r._sent_response or pb_utils.InferenceResponse(error=pb_utils.TritonError(text))
                                         for r in requests])
        except BaseException:
            return None

    def _pack(self, requests: list[pb_utils.InferenceRequest], responses: Any
              ) -> tuple[Region | None, list[ResponseMeta | None]]:
        """Write the responses' outputs into the output region; their metadata for the service."""
        if not isinstance(responses, list):
            raise pb_utils.TritonModelException(f"Expected a list in the execute return, found type '{type(responses)}'.")
        if len(responses) != len(requests):
            raise pb_utils.TritonModelException(
                f"Number of InferenceResponse objects do not match the number of InferenceRequest objects. "
                f"InferenceRequest(s) size is:{len(requests)}, and InferenceResponse(s) size is:{len(responses)}")
        staged: list[tuple[tuple[str, str] | None, list[tuple[str, str, tuple[int, ...], Any]], str | None] | None] = []
        total = 0
        for req, resp in zip(requests, responses, strict=True):
            if resp is None and (pb_utils.deferred(req) or pb_utils.rescheduled(req)):
                staged.append(None)  # its sender answers it after execute() returned, or it runs again
                continue
            if not isinstance(resp, pb_utils.InferenceResponse):
                raise pb_utils.TritonModelException(
                    f"Expected an 'InferenceResponse' object in the execute function return list, found "
                    f"type '{type(resp)}'.")
            err = resp.error()
            if err is not None:
                staged.append(((pb_utils.CODE_NAMES.get(err.code(), "INTERNAL"), err.message()), [], None))
                continue
            wanted = req.requested_output_names()
            outs = []
            for t in resp.output_tensors():
                if t.name() not in wanted:
                    continue
                arr, datatype, data = tensor_bytes(t)
                outs.append((t.name(), datatype, tuple(arr.shape), data))
                total += aligned(data.nbytes)
            staged.append((None, outs, _parameters_of(resp)))
        region = self._outputs.ensure(total) if total else None
        offset = 0
        results: list[ResponseMeta | None] = []
        for entry in staged:
            if entry is None:
                results.append(None)
                continue
            err_pair, outs, params = entry
            refs = []
            for name, datatype, shape, data in outs:
                if data.nbytes:  # (an empty tensor has no bytes to write)
                    assert region is not None
                    region.write(offset, data)
                refs.append(TensorRef(name, datatype, shape, offset, data.nbytes))
                offset += aligned(data.nbytes)
            results.append((err_pair, refs, params))
        return region, results

    # ---- pb_utils.WorkerRuntime ----------------------------------------------------------
    def send_response(self, key: int, response: pb_utils.InferenceResponse | None, flags: int) -> None:
        if flags & pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            with self._requests_lock:
                if key not in self._live:
                    return  # (its batch failed: the service ended it with that error)
                self._live.discard(key)
                self._cancelled.discard(key)
        elif key not in self._live:
            return  # a response after the request ended: no one reads it
        message: tuple
        if response is None:
            message = ("resp", key, None, [], flags, None)
        elif (err := response.error()) is not None:
            message = ("resp", key, (pb_utils.CODE_NAMES.get(err.code(), "INTERNAL"), err.message()), [], flags, None)
        else:
            outs = []
            for t in response.output_tensors():
                arr, datatype, data = tensor_bytes(t)
                outs.append((t.name(), datatype, tuple(arr.shape), data.tobytes()))
            message = ("resp", key, None, outs, flags, _parameters_of(response))
        with self._requests_lock:
            held = self._held.get(key)
            if held is not None:  # its batch's "done" is not out yet: after it (_release_held)
                held.append(message)
                return
        self.send(message)

    def is_cancelled(self, key: int) -> bool:
        """True once the request's client went away, and for a request that has ended."""
        return key in self._cancelled or key not in self._live

    def bls_exec(self, request: pb_utils.InferenceRequest, decoupled: bool) -> Any:
        bls = self.bls_client()
        return bls.stream(request) if decoupled else bls.infer(request)

    def bls_client(self) -> Any:
        """The worker's gRPC client of the mesh (BLS and pb_utils.load_model & co.)."""
        if self._bls is None:
            from services.python.bls import BlsClient  # grpc only once a model makes a BLS call
            self._bls = BlsClient(self._bls_target)
        return self._bls


def _parameters_of(response: pb_utils.InferenceResponse) -> str | None:
    """A response's parameters (JSON) for the service; None for none, the common case."""
    params = response.parameters()
    return None if not params or params == "{}" else params


def tensor_bytes(t: pb_utils.Tensor) -> tuple[np.ndarray, str, np.ndarray]:
    """A tensor's array, v2 datatype and bytes (a uint8 or contiguous array) for the wire."""
    arr, datatype = pb_utils.tensor_wire(t)
    if datatype == "BYTES":
        data = pb_utils.serialize_byte_tensor(arr)
        assert data is not None
        return arr, datatype, data
    return arr, datatype, np.ascontiguousarray(arr)


PR_SET_PDEATHSIG = 1

# The worker's guard: a small process in the worker's process group that kills the group (what
# the model started, and itself) when the worker dies, however it dies: killed, or with the
# service (the worker then gets SIGKILL from PR_SET_PDEATHSIG, and the guard SIGTERM from its own).
# The service kills the group too when it sees the worker exit; the guard covers a service that
# died first.
_GUARD = """
import ctypes, os, signal, sys
def end(*_):
    os.killpg(0, signal.SIGKILL)
signal.signal(signal.SIGTERM, end)
ctypes.CDLL(None).prctl(1, signal.SIGTERM)
if os.getppid() != int(sys.argv[1]):
    end()
while True:
    signal.pause()
"""


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def _start_guard() -> None:
    subprocess.Popen([sys.executable, "-S", "-c", _GUARD, str(os.getpid())], stdin=subprocess.DEVNULL)


def autocomplete_main(model_py: str) -> None:
    """Print the model's auto_complete_config result for the JSON config on stdin."""
    config = pb_utils.ModelConfig(sys.stdin.read())
    module = load_model_module(Path(model_py), "autocomplete")
    fn = getattr(module.TritonPythonModel, "auto_complete_config", None)
    if fn is not None:
        result = fn(config)
        if not isinstance(result, pb_utils.ModelConfig):
            raise SystemExit("auto_complete_config must return the ModelConfig object it was given")
        config = result
    sys.stdout.write(json.dumps(config.as_dict()))


def main(argv: list[str]) -> None:
    if argv and argv[0] == "--autocomplete":
        autocomplete_main(argv[1])
        return
    _die_with_parent()
    _start_guard()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the service stops us
    fd = int(argv[0])
    os.set_inheritable(fd, False)  # a program the model starts does not get the socket
    # the model sees the argv of Triton's stub, an embedded interpreter's ['']: NVIDIA's QA models call
    # unittest.main() in execute(), which took the socket's number here for a test name
    sys.argv[:] = [""]
    Worker(Channel(socket.socket(fileno=fd))).run()


if __name__ == "__main__":
    main(sys.argv[1:])
