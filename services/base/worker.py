"""One model instance's worker thread: runs that instance's batches, one at a time, and hands each
result back to the event loop with one ``call_soon_threadsafe``.

It takes the place of ``loop.run_in_executor(ThreadPoolExecutor, ...)`` on the batch path
(services/base/model.py): that makes a concurrent future (a lock and a condition), wraps it in an
asyncio future chained by two callbacks, and goes through the executor's submit (its shutdown lock,
a work item, the idle semaphore) for every batch; here a batch is one tuple on a SimpleQueue and
one asyncio future, resolved on the loop (docs/perf/mlp-and-onnxruntime.md, "The service process
per served row"). As with the executor: the thread starts with the first batch, ends once its
worker is closed or collected, and a batch in flight at interpreter exit still finishes before the
interpreter goes away (``_stop_all``).
"""
from __future__ import annotations

import asyncio
import atexit
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

_Jobs = queue.SimpleQueue  # of (loop, future, fn, args) tuples; None ends the thread

_RUNNING: dict[threading.Thread, _Jobs[Any]] = {}  # live worker threads and their queues
_EXIT_JOIN_S = 60.0  # at interpreter exit: how long a batch in flight may take to finish


def _resolve(fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if fut.cancelled():  # the batch's caller went away (its result is dropped, as run_in_executor's)
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def _one(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[Any], fn: Callable[..., Any],
         args: tuple[Any, ...]) -> None:
    """Run one job on the worker's thread; its outcome goes to ``fut`` on the loop."""
    try:
        result, exc = fn(*args), None
    except BaseException as e:  # (handed to the awaiting batch, as the executor's future did)
        result, exc = None, e
    try:
        loop.call_soon_threadsafe(_resolve, fut, result, exc)
    except RuntimeError:  # the loop is closed: nobody is waiting any more
        pass


def _serve(jobs: _Jobs[Any]) -> None:
    """A worker thread's loop (it holds the queue, not the worker: a worker dropped without close()
    is collected, and its finalizer ends the thread)."""
    try:
        while True:
            job = jobs.get()
            if job is None:
                return
            _one(*job)
            job = None  # (nothing of a finished batch is held while the thread waits)
    finally:
        _RUNNING.pop(threading.current_thread(), None)


class InstanceWorker:
    """The thread of one model instance (named ``name``, as the executor's threads were)."""

    def __init__(self, name: str):
        self.name = name
        self._jobs: _Jobs[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        weakref.finalize(self, self._jobs.put, None)  # (collected without close(): the thread ends)

    def submit(self, loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        """``fn(*args)`` on this worker's thread; its result (or exception) in the returned future."""
        if self._closed:
            raise RuntimeError(f"worker {self.name} is closed")
        fut = loop.create_future()
        if self._thread is None:
            # daemon: it never holds the interpreter up; _stop_all lets a batch in flight finish at exit
            self._thread = thread = threading.Thread(target=_serve, args=(self._jobs,), name=self.name, daemon=True)
            _RUNNING[thread] = self._jobs
            thread.start()
        self._jobs.put((loop, fut, fn, args))
        return fut

    def close(self) -> None:
        """No more batches; the thread ends after the one it runs."""
        if not self._closed:
            self._closed = True
            self._jobs.put(None)


def _stop_all() -> None:
    """At interpreter exit: every worker thread finishes the batch it runs, then stops."""
    running = list(_RUNNING.items())
    for _, jobs in running:
        jobs.put(None)
    for thread, _ in running:
        thread.join(_EXIT_JOIN_S)


atexit.register(_stop_all)
