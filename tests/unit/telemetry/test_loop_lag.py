"""meshserve/telemetry/loop_lag.py: the timer that says how late the event loop runs."""
from __future__ import annotations

import asyncio
import time

import pytest
import uvloop
from prometheus_client.parser import text_string_to_metric_families

from meshserve.telemetry import loop_lag, metrics
from tests.support.waiting import eventually_async

FACTORIES = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def over(watch: loop_lag.LoopLag, seconds: float) -> int:
    """Observations above ``seconds`` (a bucket bound)."""
    h = watch.histogram
    return sum(h.counts[h.bounds.index(seconds) + 1:])


@pytest.mark.parametrize("loop", FACTORIES)
def test_a_held_loop_is_one_late_observation_then_the_timer_keeps_its_period(loop: str) -> None:
    async def main() -> tuple[int, int, int]:
        watch = loop_lag.LoopLag(interval=0.02)
        watch.start()
        await eventually_async(lambda: watch.histogram.count >= 3, what="the timer running")
        assert over(watch, 0.25) == 0
        time.sleep(0.4)  # the loop held: no callback runs
        await asyncio.sleep(0)  # (the late timer runs in this pass or the next)
        await eventually_async(lambda: over(watch, 0.25) >= 1, what="the stall observed")
        count = watch.histogram.count
        await eventually_async(lambda: watch.histogram.count >= count + 3, what="the timer after the stall")
        late = over(watch, 0.25)
        watch.stop()
        stopped = watch.histogram.count
        await asyncio.sleep(0.1)
        return late, stopped, watch.histogram.count

    with asyncio.Runner(loop_factory=FACTORIES[loop]) as runner:
        late, stopped, after = runner.run(main())
    assert late == 1  # one stall, one observation: the next is due an interval after it ran
    assert after == stopped  # stop() ends the watch


def test_the_histogram_renders_in_seconds_and_parses() -> None:
    watch = loop_lag.LoopLag()
    for value in (0.0004, 0.003, 0.3):
        watch.histogram.observe(value)
    text = metrics.render(loop_lag.samples(watch), loop_lag.FAMILIES).decode()
    (family,) = text_string_to_metric_families(text)
    assert family.name == "meshserve_event_loop_lag_seconds" and family.type == "histogram"
    got = {(s.name, s.labels.get("le")): s.value for s in family.samples}
    assert got[("meshserve_event_loop_lag_seconds_bucket", "0.001")] == 1
    assert got[("meshserve_event_loop_lag_seconds_bucket", "0.005")] == 2
    assert got[("meshserve_event_loop_lag_seconds_bucket", "0.25")] == 2
    assert got[("meshserve_event_loop_lag_seconds_bucket", "0.5")] == 3
    assert got[("meshserve_event_loop_lag_seconds_count", None)] == 3
    assert got[("meshserve_event_loop_lag_seconds_sum", None)] == pytest.approx(0.3034)


def test_a_second_start_moves_the_watch_to_the_new_loop() -> None:
    """A process's watch (``WATCH``) outlives an event loop (the tests run many): started again on
    another loop it leaves the first one's timer behind and counts on the new one."""
    watch = loop_lag.LoopLag(interval=0.01)

    async def counted() -> int:
        watch.start()
        count = watch.histogram.count
        await eventually_async(lambda: watch.histogram.count >= count + 3, what="the timer on this loop")
        return watch.histogram.count - count

    assert asyncio.run(counted()) >= 3  # (asyncio.run closes the loop with the timer still set)
    assert asyncio.run(counted()) >= 3
    watch.stop()
