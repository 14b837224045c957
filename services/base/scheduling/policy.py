"""Dynamic-batching settings, taken once from a model's config at load time."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from meshserve.priorities import default_level, level_queue_policy, priority_level


@dataclass(frozen=True, slots=True)
class QueuePolicy:
    """Triton's ``ModelQueuePolicy`` for one priority level.

    ``default_timeout_ns`` (0 = none) bounds the time a request may wait in the queue; when
    it passes, ``delay_on_timeout`` False (REJECT) fails the request, True (DELAY) moves it
    behind every request that has not timed out. ``allow_timeout_override`` lets a request's
    own ``timeout`` parameter replace the default. ``max_queue_size`` (0 = unbounded) counts
    this level's queued requests.
    """

    max_queue_size: int = 0
    default_timeout_ns: int = 0
    delay_on_timeout: bool = False
    allow_timeout_override: bool = False

    @classmethod
    def from_config(cls, policy: Any) -> QueuePolicy:
        return cls(max_queue_size=int(policy.max_queue_size),
                   default_timeout_ns=int(policy.default_timeout_microseconds) * 1000,
                   delay_on_timeout=int(policy.timeout_action) == 1,  # ModelQueuePolicy.DELAY
                   allow_timeout_override=bool(policy.allow_timeout_override))


@dataclass(frozen=True, slots=True)
class BatchingPolicy:
    """How a :class:`~services.base.scheduling.dynamic.DynamicBatcher` forms batches.

    ``max_batch_size`` is in rows; 0 disables batching across requests (every request runs
    alone). ``preferred_batch_sizes`` is stored sorted and de-duplicated. ``max_queue_delay_ns``
    is measured from the oldest queued request; 0 means "run whatever is queued as soon as an
    instance is free". ``max_queue_size`` counts queued (not executing) requests; 0 is
    unbounded. ``preserve_ordering`` is carried for the servicer: the batcher dispatches in
    FIFO order, but with several instances batches can finish out of order, so a stream that
    must answer in order awaits its futures in order.
    """

    max_batch_size: int = 0
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_ns: int = 0
    max_queue_size: int = 0
    preserve_ordering: bool = False
    # Priorities (Triton): levels 1..priority_levels, 1 is the highest; 0 levels = one queue.
    priority_levels: int = 0
    default_priority_level: int = 1  # (level 1 without priority levels: priorities.default_level)
    default_queue_policy: QueuePolicy = field(default_factory=QueuePolicy)
    priority_queue_policies: tuple[tuple[int, QueuePolicy], ...] = ()
    # Derived once so that the per-decision code does set lookups, not tuple scans.
    preferred_set: frozenset[int] = field(init=False, repr=False, compare=False)
    max_preferred: int = field(init=False, repr=False, compare=False)
    # each level's queue policy (index level - 1), by the shared rule, once: a request's look-up
    # is an index (the rule's call per look-up cost ~390 instructions, measured: docs/perf/
    # side-by-side-round-3.md, "Session 15")
    level_policies: tuple[QueuePolicy, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.max_batch_size < 0:
            raise ValueError(f"max_batch_size must be >= 0, got {self.max_batch_size}")
        if self.max_queue_delay_ns < 0:
            raise ValueError(f"max_queue_delay_ns must be >= 0, got {self.max_queue_delay_ns}")
        if self.max_queue_size < 0:
            raise ValueError(f"max_queue_size must be >= 0, got {self.max_queue_size}")
        preferred = tuple(sorted(set(self.preferred_batch_sizes)))
        if preferred and self.max_batch_size == 0:
            raise ValueError("preferred_batch_sizes need batching enabled (max_batch_size > 0)")
        for size in preferred:
            if not 1 <= size <= self.max_batch_size:
                raise ValueError(
                    f"preferred_batch_size {size} must be between 1 and max_batch_size "
                    f"{self.max_batch_size}")
        if self.priority_levels < 0:
            raise ValueError(f"priority_levels must be >= 0, got {self.priority_levels}")
        if self.priority_levels and not 1 <= self.default_priority_level <= self.priority_levels:
            raise ValueError(f"default_priority_level {self.default_priority_level} must be between 1 and "
                             f"priority_levels {self.priority_levels}")
        for level, _ in self.priority_queue_policies:
            if not 1 <= level <= max(1, self.priority_levels):
                raise ValueError(f"priority_queue_policy level {level} is outside 1..{self.priority_levels}")
        if self.max_queue_size and not self.default_queue_policy.max_queue_size:
            object.__setattr__(self, "default_queue_policy", QueuePolicy(
                self.max_queue_size, self.default_queue_policy.default_timeout_ns,
                self.default_queue_policy.delay_on_timeout, self.default_queue_policy.allow_timeout_override))
        own = dict(self.priority_queue_policies)
        object.__setattr__(self, "level_policies", tuple(
            level_queue_policy(level, self.priority_levels, own, self.default_queue_policy)
            for level in range(1, self.levels + 1)))
        object.__setattr__(self, "preferred_batch_sizes", preferred)
        object.__setattr__(self, "preferred_set", frozenset(preferred))
        # Triton normalises an empty preferred list to [max_batch_size]; this is the same.
        object.__setattr__(self, "max_preferred", preferred[-1] if preferred else self.max_batch_size)

    @property
    def levels(self) -> int:
        """Number of queues (priority levels; 1 when priorities are off)."""
        return max(1, self.priority_levels)

    def level_for(self, priority: int) -> int:
        """Queue level (1-based) of a request's ``priority`` parameter, by the rule the gateway's
        queue shares use too (``meshserve/priorities.py:priority_level``): 0 or one above the
        levels queues at the default level, as Triton's; ValueError for a negative priority
        (Triton's frontends refuse it: "expected value >= 0")."""
        if priority < 0:
            raise ValueError(f"invalid value for 'priority', expected value >= 0, got {priority}")
        return priority_level(priority, self.priority_levels, self.default_priority_level)

    def queue_policy(self, level: int) -> QueuePolicy:
        """The queue policy of ``level`` (``meshserve/priorities.py:level_queue_policy``, applied
        at construction: ``level_policies``); the default policy for a level outside them."""
        policies = self.level_policies
        return policies[level - 1] if 0 < level <= len(policies) else self.default_queue_policy

    @property
    def batching(self) -> bool:
        """Whether requests may be combined into one batch."""
        return self.max_batch_size > 0

    @classmethod
    def from_config(cls, max_batch_size: int, dynamic_batching: Any | None) -> BatchingPolicy:
        """Build the policy from ``ModelConfig.max_batch_size`` and its ``dynamic_batching``.

        ``dynamic_batching`` is Triton's ``ModelDynamicBatching`` message (or None when the
        config has no ``dynamic_batching`` block). Without it Triton runs every request on
        its own, so batching is off even when ``max_batch_size > 0``; a single request may
        still carry up to ``max_batch_size`` rows (the servicer checks that).
        """
        if max_batch_size < 0:
            raise ValueError(f"max_batch_size must be >= 0, got {max_batch_size}")
        if dynamic_batching is None:
            return cls()
        max_queue_size = 0
        default_qp = QueuePolicy()
        if dynamic_batching.HasField("default_queue_policy"):
            default_qp = QueuePolicy.from_config(dynamic_batching.default_queue_policy)
            max_queue_size = default_qp.max_queue_size
        levels = int(dynamic_batching.priority_levels)
        priorities: dict[str, Any] = dict(
            priority_levels=levels,
            default_priority_level=default_level(levels, int(dynamic_batching.default_priority_level)),
            default_queue_policy=default_qp,
            priority_queue_policies=tuple(sorted(
                (int(k), QueuePolicy.from_config(v)) for k, v in dynamic_batching.priority_queue_policy.items())),
        )
        preserve_ordering = bool(dynamic_batching.preserve_ordering)
        if max_batch_size == 0:
            return cls(max_queue_size=max_queue_size, preserve_ordering=preserve_ordering, **priorities)
        preferred: Iterable[int] = dynamic_batching.preferred_batch_size
        return cls(
            max_batch_size=max_batch_size,
            preferred_batch_sizes=tuple(int(s) for s in preferred),
            max_queue_delay_ns=int(dynamic_batching.max_queue_delay_microseconds) * 1000,
            max_queue_size=max_queue_size,
            preserve_ordering=preserve_ordering,
            **priorities,
        )
