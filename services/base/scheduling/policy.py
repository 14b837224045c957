"""Dynamic-batching settings, taken once from a model's config at load time."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


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
    # Derived once so that the per-decision code does set lookups, not tuple scans.
    preferred_set: frozenset[int] = field(init=False, repr=False, compare=False)
    max_preferred: int = field(init=False, repr=False, compare=False)

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
        object.__setattr__(self, "preferred_batch_sizes", preferred)
        object.__setattr__(self, "preferred_set", frozenset(preferred))
        # Triton normalises an empty preferred list to [max_batch_size]; this is the same.
        object.__setattr__(self, "max_preferred", preferred[-1] if preferred else self.max_batch_size)

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
        if dynamic_batching.HasField("default_queue_policy"):
            max_queue_size = int(dynamic_batching.default_queue_policy.max_queue_size)
        preserve_ordering = bool(dynamic_batching.preserve_ordering)
        if max_batch_size == 0:
            return cls(max_queue_size=max_queue_size, preserve_ordering=preserve_ordering)
        preferred: Iterable[int] = dynamic_batching.preferred_batch_size
        return cls(
            max_batch_size=max_batch_size,
            preferred_batch_sizes=tuple(int(s) for s in preferred),
            max_queue_delay_ns=int(dynamic_batching.max_queue_delay_microseconds) * 1000,
            max_queue_size=max_queue_size,
            preserve_ordering=preserve_ordering,
        )
