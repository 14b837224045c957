"""The work of a test model or fake service that must be slow: the one fixed wait they share.

Some tests need a backend that takes time on purpose: a request that asks for N ms per answer
(Triton's repeat model), a service slower than a deadline, two pipeline steps that must overlap
in time, a run measured above a bound, a slow request that a fast one may or may not overtake.
Time itself is what those tests are about, so this is a fixed sleep and not a poll; a test that
waits *for* something uses ``tests/support/waiting.py`` instead. (Model sources that run in a
Python-backend stub process cannot import this and keep their own sleep, commented.)
"""
from __future__ import annotations

import asyncio
import time


def work_for(seconds: float) -> None:
    """A model's run that takes ``seconds`` (blocking, as a model's compute blocks its thread)."""
    time.sleep(seconds)  # the point: the model is slow


async def work_for_async(seconds: float) -> None:
    """A fake service's or upstream's work that takes ``seconds`` without blocking its loop."""
    await asyncio.sleep(seconds)  # the point: the service is slow
