"""meshserve/protocol/datatypes.py:check_bytes_framing: a BYTES input's buffer walked as Triton
walks it (core's ValidateBytesInputs): at most one element past its shape's count, in Triton's
words (NVIDIA's L0_input_validation asserts the first two)."""
from __future__ import annotations

import pytest

from meshserve.protocol.datatypes import check_bytes_framing, serialize_bytes
from meshserve.protocol.errors import Code, InferError

WHERE = "inference input 'INPUT1' for model 'm'"


def refused(buf: bytes, count: int) -> str:
    with pytest.raises(InferError) as err:
        check_bytes_framing(buf, count, "INPUT1", "m")
    assert err.value.code is Code.INVALID_ARG
    return err.value.message


def test_exactly_the_shapes_elements_pass() -> None:
    for values in ([], [b""], [b"a", b"", b"xyz" * 100]):
        check_bytes_framing(serialize_bytes(values), len(values), "INPUT1", "m")


def test_too_few_and_too_many_in_tritons_words() -> None:
    assert refused(serialize_bytes([b"1"] * 14), 16) == f"expected 16 string elements for {WHERE}, got 14"
    assert refused(serialize_bytes([b"1"] * 18), 16) == f"unexpected number of string elements 17 for {WHERE}, expecting 16"
    assert refused(serialize_bytes([b"ab"]) + b"\x01\x00", 2) == (
        f"incomplete string length indicator for {WHERE}, expecting 4 bytes but only 2 bytes available. Please make "
        "sure the string length indicator is in one buffer.")
    assert refused(serialize_bytes([b"ab"])[:-1], 1) == f"string element 1 of {WHERE} runs past the end of its data (2 bytes, 1 left)"


def test_a_buffer_of_many_elements_declared_as_one_is_refused_at_the_second() -> None:
    """Not counted to its end: the elements after the second are never read (here the third's
    prefix is cut short, which a walk to the end would have named instead)."""
    assert refused(b"\0\0\0\0" * 2 + b"\x07", 1) == f"unexpected number of string elements 2 for {WHERE}, expecting 1"
