"""The pure batching decision, with explicit times: no event loop, no sleeping."""
from __future__ import annotations

import pytest

from services.base.scheduling import IDLE, BatchingPolicy, Run, Wait, next_action
from tests.unit.scheduling.support import MS


def policy(max_batch: int = 8, preferred: tuple[int, ...] = (), delay_ns: int = 100 * MS) -> BatchingPolicy:
    return BatchingPolicy(max_batch_size=max_batch, preferred_batch_sizes=preferred,
                          max_queue_delay_ns=delay_ns)


def test_empty_queue_is_idle() -> None:
    assert next_action([], 0, 0, policy()) is IDLE


def test_batching_disabled_runs_each_request_alone() -> None:
    off = BatchingPolicy()
    assert next_action([3, 1, 1], 0, 0, off) == Run(1)
    assert next_action([1], 0, 10**12, off) == Run(1)


def test_takes_requests_in_fifo_order_up_to_max_batch_size() -> None:
    assert next_action([1, 1, 1, 1, 1, 1], 0, 0, policy(max_batch=4)) == Run(4)
    assert next_action([2, 1, 1, 3], 0, 0, policy(max_batch=4)) == Run(3)


def test_request_that_would_overflow_stays_for_the_next_batch() -> None:
    # 3 + 2 > 4: the second request waits, and the first is ready now (it cannot grow).
    assert next_action([3, 2], 0, 0, policy(max_batch=4)) == Run(1)
    # FIFO: a later request that would fit does not jump the one that overflows.
    assert next_action([2, 3, 1], 0, 0, policy(max_batch=4)) == Run(1)


def test_first_request_larger_than_max_batch_runs_alone() -> None:
    assert next_action([6, 1], 0, 0, policy(max_batch=4)) == Run(1)
    assert next_action([6], 0, 0, policy(max_batch=4)) == Run(1)


def test_full_batch_runs_without_waiting_for_the_delay() -> None:
    assert next_action([2, 2], 0, 1, policy(max_batch=4)) == Run(2)


def test_partial_batch_waits_until_oldest_arrival_plus_delay() -> None:
    assert next_action([1, 1], 10 * MS, 50 * MS, policy()) == Wait(110 * MS)
    # Later arrivals do not move the deadline: it only depends on the oldest request.
    assert next_action([1, 1, 1], 10 * MS, 109 * MS, policy()) == Wait(110 * MS)


def test_expired_delay_runs_everything_that_fits() -> None:
    assert next_action([1, 1, 1], 10 * MS, 110 * MS, policy()) == Run(3)
    assert next_action([4, 4, 1], 10 * MS, 500 * MS, policy()) == Run(2)


def test_zero_delay_runs_whatever_is_queued() -> None:
    p = policy(delay_ns=0)
    assert next_action([1], 0, 0, p) == Run(1)
    assert next_action([1, 2, 1], 0, 0, p) == Run(3)
    assert next_action([5, 4], 0, 0, p) == Run(1)


def test_preferred_size_runs_as_soon_as_it_is_reached() -> None:
    p = policy(preferred=(2, 4))
    assert next_action([1], 0, 0, p) == Wait(100 * MS)
    assert next_action([1, 1], 0, 0, p) == Run(2)
    assert next_action([1, 1, 1], 0, 0, p) == Run(2)
    assert next_action([3, 1], 0, 0, p) == Run(2)


def test_largest_preferred_prefix_wins_before_the_delay_expires() -> None:
    p = policy(preferred=(2, 4))
    assert next_action([1, 1, 1, 1, 1], 0, 0, p) == Run(4)
    assert next_action([1] * 8, 0, 0, p) == Run(4)


def test_after_the_delay_everything_that_fits_runs_even_past_a_preferred_size() -> None:
    # Triton: once the delay is exceeded the pending batch (all that fits) is sent.
    p = policy(preferred=(2, 4))
    assert next_action([1, 1, 1, 1, 1], 0, 100 * MS, p) == Run(5)
    assert next_action([1] * 10, 0, 100 * MS, p) == Run(8)


def test_batch_that_cannot_reach_a_larger_preferred_size_is_ready() -> None:
    # 3 is not preferred and 3 + 2 passes the largest preferred size 4: Triton sends the 3.
    p = policy(preferred=(4,))
    assert next_action([3, 2], 0, 0, p) == Run(1)
    assert next_action([3, 2], 0, 100 * MS, p) == Run(2)
    # Below every preferred size and nothing that passes one: wait.
    assert next_action([3], 0, 0, p) == Wait(100 * MS)


def test_rows_at_or_above_largest_preferred_run_now() -> None:
    p = policy(max_batch=16, preferred=(4,))
    assert next_action([6], 0, 0, p) == Run(1)


def test_preferred_sizes_with_zero_delay_prefer_the_preferred_prefix() -> None:
    p = policy(preferred=(2,), delay_ns=0)
    assert next_action([1, 1, 1], 0, 0, p) == Run(2)
    assert next_action([1], 0, 0, p) == Run(1)


@pytest.mark.parametrize("rows", [[1] * 20, [3, 3, 3, 3], [7, 1, 1], [8]])
def test_a_run_never_exceeds_max_batch_size(rows: list[int]) -> None:
    p = policy(max_batch=8, preferred=(2, 6))
    for now in (0, 100 * MS):
        action = next_action(rows, 0, now, p)
        assert isinstance(action, Run)
        assert sum(rows[:action.count]) <= 8


def test_a_lone_request_runs_at_once_only_when_the_batcher_says_it_is_alone() -> None:
    """One client at a time (the last batch was one request nothing joined): no delay for company."""
    assert next_action([1], 0, 0, policy(), alone=True) == Run(1)
    assert next_action([1], 0, 0, policy()) == Wait(100 * MS)  # Triton's rule otherwise
    # a second queued request means company: the delay from the oldest applies again
    assert next_action([1, 1], 0, 0, policy(), alone=True) == Wait(100 * MS)


def test_the_expected_company_all_queued_runs_before_the_delay() -> None:
    """Early release: ``members`` (client requests queued) reaching ``company`` (K >= 2) runs now."""
    assert next_action([1, 1, 1], 0, 0, policy(), company=3, members=3) == Run(3, early=True)
    assert next_action([1, 1, 1], 0, 0, policy(), company=3, members=4) == Run(3, early=True)
    # a gateway's merged request counts its clients: 2 requests, 4 members
    assert next_action([2, 2], 0, 0, policy(), company=4, members=4) == Run(2, early=True)
    # not all there yet: Triton's wait
    assert next_action([1, 1], 0, 0, policy(), company=3, members=2) == Wait(100 * MS)
    # K below 2 never releases (one client at a time is the ``alone`` rule's business)
    assert next_action([1], 0, 0, policy(), company=1, members=1) == Wait(100 * MS)
    assert next_action([1, 1], 0, 0, policy()) == Wait(100 * MS)  # company 0: no K learned


def test_early_release_leaves_the_other_rules_first() -> None:
    # a preferred size before the delay still runs the preferred prefix (not early)
    assert next_action([1, 1, 1], 0, 0, policy(preferred=(2, 4)), company=3, members=3) == Run(2)
    # expired, full, zero delay: Triton's own reasons, not early
    assert next_action([1, 1, 1], 0, 100 * MS, policy(), company=3, members=3) == Run(3)
    assert next_action([4, 4, 1], 0, 0, policy(), company=3, members=3) == Run(2)
    assert next_action([1, 1, 1], 0, 0, policy(delay_ns=0), company=3, members=3) == Run(3)
    assert next_action([1], 0, 0, policy(), alone=True, company=3, members=1) == Run(1)
    # batching off: one request per batch
    assert next_action([1, 1, 1], 0, 0, BatchingPolicy(), company=3, members=3) == Run(1)
