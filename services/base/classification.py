"""Triton's classification extension, made by the services as they encode a response: an output
the request asks ``classification: k`` of is answered as a BYTES tensor of its ``k`` largest
values per row (``[rows, k]``, or ``[k]`` for a model without batching), each entry
``"<value>:<index>"`` or ``"<value>:<index>:<label>"``, largest first.

Triton's rules (server's classification.cc, TopkClassifications and AddClassResults; checked
against Triton 2.51 through its Python backend, docs/security.md "Session 23: classification"):

- only integer and FP32/FP64 outputs are classified; any other datatype (BOOL, FP16, BF16, BYTES)
  is INVALID_ARGUMENT "class result not available for output due to unsupported type 'FP16'";
- ``k`` is cut to the row's elements;
- a value is written as C++'s ``std::to_string`` writes it: an integer as an integer ("255"), a
  float with six decimals ("255.000000");
- order: value descending; equal values by index ascending (Triton's ``std::sort`` leaves it open,
  and answered so in every probe).

Triton bounds none of it. Here a response's classified entries, all its outputs together, are at
most ``MAX_CLASSIFIED``: an entry is a Python string and a row of Python work (~1 us and ~100 bytes),
made from 4 bytes of the client's request, so one 16 MB request of 4 million floats asking for
all of them cost a service 19 s and 1.6 GB before this bound."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from meshserve.protocol import datatypes
from meshserve.protocol.errors import InferError
from meshserve.protocol.infer_checks import MAX_BYTES_ELEMENTS
from meshserve.repository.labels import label_of

# (Triton's switch in TopkClassifications: every other datatype is refused)
CLASSIFIABLE = frozenset({"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP32", "FP64"})
# The classified entries of one response, all its outputs together: as many as a request may
# send BYTES elements (a classified output is a BYTES output the service makes for the client).
MAX_CLASSIFIED = MAX_BYTES_ELEMENTS


# Rows this wide, of which a quarter or less is asked, are not sorted whole (``_smallest``):
# the 5 best of 4 million floats: 0.95 s to sort whole, 0.015 s so (a busy 2-core machine).
PARTIAL_MIN = 1024


def check_classifiable(datatype: str) -> None:
    """INVALID_ARGUMENT, in Triton's words, for an output of a datatype it does not classify."""
    if datatype not in CLASSIFIABLE:
        raise InferError.invalid(f"class result not available for output due to unsupported type '{datatype}'")


def classify(arr: np.ndarray, k: int, datatype: str, labels: Sequence[str], batched: bool, room: int,
             where: str) -> np.ndarray:
    """``arr`` (one request's part of an output of ``datatype``, its rows first when ``batched``)
    classified with ``k``; INVALID_ARGUMENT naming ``where`` if that makes more entries than
    ``room`` (what is left of the response's ``MAX_CLASSIFIED``)."""
    check_classifiable(datatype)
    arr = np.asarray(arr, dtype=datatypes.carrier_dtype(datatype))  # what the wire would carry
    n = arr.shape[0] if batched else 1
    width = arr.size // n if n else int(np.prod(arr.shape[1:], dtype=np.int64))
    rows = arr.reshape((n, width))
    k = min(k, width)
    if n * k > room:
        raise InferError.invalid(
            f"{where}: classification of {k} classes for {n} row(s) makes {n * k} entries, "
            f"more than {MAX_CLASSIFIED} in one response")
    integer = arr.dtype.kind in "iu"
    # descending, equal values by index: the order of a key that reverses the values
    # (~x for integers, which never overflows: -x of a signed minimum does, of an unsigned x wraps)
    key = ~rows if integer else -rows
    if width >= PARTIAL_MIN and k * 4 <= width:
        order = np.array([_smallest(r, k) for r in key], dtype=np.intp).reshape((n, k))
    else:
        order = np.argsort(key, axis=1, kind="stable")[:, :k]
    values = np.take_along_axis(rows, order, axis=1).tolist()
    out = []
    for vals, idx in zip(values, order.tolist(), strict=True):
        if integer:
            entries = [f"{v}:{i}" for v, i in zip(vals, idx, strict=True)]
        else:
            entries = [f"{v:f}:{i}" for v, i in zip(vals, idx, strict=True)]
        if labels:
            for j, i in enumerate(idx):
                label = label_of(labels, i)  # ("" for none: Triton's rule)
                if label:
                    entries[j] += ":" + label
        out.append(entries)
    res = np.empty((n, k), dtype=np.object_)
    for r, entries in enumerate(out):
        res[r, :] = entries
    return res if batched else res.reshape((k,))


def _smallest(key: np.ndarray, k: int) -> np.ndarray:
    """The indices of ``key``'s ``k`` smallest elements, smallest first and equal ones by index:
    what a stable argsort's first ``k`` are, without sorting the rest (1 <= k <= key.size)."""
    t = np.partition(key, k - 1)[k - 1]  # the k-th smallest
    if t != t:  # NaN (fewer than k numbers): the whole sort puts them last, by index
        return np.argsort(key, kind="stable")[:k]
    below = np.flatnonzero(key < t)
    chosen = np.concatenate((below, np.flatnonzero(key == t)[:k - below.size]))
    # (each value's indices are together and ascending in ``chosen``: a stable sort keeps them so)
    return chosen[np.argsort(key[chosen], kind="stable")]
