"""services/base/worker.py:InstanceWorker, a model instance's thread (session 10 review): every job
ends exactly once in its future (a result, an exception of any kind, or nothing for a future its
caller cancelled), jobs of one instance run one at a time in order, and close() lets the running
job finish before the thread ends."""
from __future__ import annotations

import asyncio
import threading

import pytest

from services.base.worker import InstanceWorker


class _Fatal(BaseException):
    """Not an Exception: what a runtime might raise (as KeyboardInterrupt or SystemExit are)."""


async def test_results_and_errors_of_any_kind_reach_their_future_once() -> None:
    loop = asyncio.get_running_loop()
    worker = InstanceWorker("t_0")
    try:
        assert await worker.submit(loop, lambda a, b: a + b, 2, 3) == 5

        def boom() -> None:
            raise ValueError("bad batch")

        def fatal() -> None:
            raise _Fatal()

        with pytest.raises(ValueError, match="bad batch"):
            await worker.submit(loop, boom)
        with pytest.raises(_Fatal):
            await worker.submit(loop, fatal)
        assert await worker.submit(loop, lambda: "still serving") == "still serving"  # the thread lives on
    finally:
        worker.close()


async def test_one_job_at_a_time_in_order_and_a_cancelled_caller_is_dropped() -> None:
    loop = asyncio.get_running_loop()
    worker = InstanceWorker("t_1")
    running = threading.Event()
    release = threading.Event()
    order: list[int] = []
    inside = [0, 0]  # jobs inside now, the most at once

    def job(i: int) -> int:
        inside[0] += 1
        inside[1] = max(inside[1], inside[0])
        if i == 0:
            running.set()
            release.wait(10)
        order.append(i)
        inside[0] -= 1
        return i

    try:
        first = worker.submit(loop, job, 0)
        await loop.run_in_executor(None, running.wait, 10)
        rest = [worker.submit(loop, job, i) for i in range(1, 6)]
        first.cancel()  # its caller left while the instance runs it (a row in ORT)
        release.set()
        assert await asyncio.gather(*rest) == [1, 2, 3, 4, 5]
        assert order == [0, 1, 2, 3, 4, 5] and inside[1] == 1
        assert first.cancelled()  # its result was dropped, not set on a cancelled future
    finally:
        worker.close()


async def test_close_lets_the_running_job_finish_then_refuses_more() -> None:
    loop = asyncio.get_running_loop()
    worker = InstanceWorker("t_2")
    release = threading.Event()
    started = threading.Event()

    def slow() -> str:
        started.set()
        release.wait(10)
        return "finished"

    running = worker.submit(loop, slow)
    await loop.run_in_executor(None, started.wait, 10)
    thread = worker._thread
    assert thread is not None
    worker.close()  # service shutdown while the instance still runs a batch
    with pytest.raises(RuntimeError, match="closed"):
        worker.submit(loop, lambda: None)
    release.set()
    assert await running == "finished"
    await loop.run_in_executor(None, thread.join, 10)
    assert not thread.is_alive()
