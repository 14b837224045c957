"""Helpers the whole suite shares: waiting for a condition (``eventually``) and the test models."""
from tests.support.waiting import eventually, eventually_async, loop_passes

__all__ = ["eventually", "eventually_async", "loop_passes"]
