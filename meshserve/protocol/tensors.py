"""A tensor as the serving layers see it: metadata plus a byte buffer, never numpy."""
from __future__ import annotations

from dataclasses import dataclass

from meshserve.protocol import datatypes


@dataclass(frozen=True, slots=True)
class Tensor:
    name: str
    datatype: str
    shape: tuple[int, ...]
    data: memoryview  # little-endian row-major; BYTES length-prefixed

    @property
    def element_count(self) -> int:
        return datatypes.element_count(self.shape)

    def expected_byte_size(self) -> int | None:
        """shape x element size, or None for BYTES (variable length)."""
        size = datatypes.element_size(self.datatype)
        return self.element_count * size if size else None
