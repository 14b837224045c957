"""Scaffolding shared by the HTTP/2 gRPC server and client tests (not a test module)."""
from __future__ import annotations

import asyncio
from typing import Any

MiB = 1 << 20


def method_path(service: str, name: str) -> str:
    return f"/{service}/{name}"


class BaseProbe:
    """What the test handlers saw: a test waits on these events instead of sleeping."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()  # CancelledError reached a handler
        self.closed = asyncio.Event()  # a (streaming) handler's finally ran
        self.metadata: list[tuple[tuple[str, Any], ...]] = []
