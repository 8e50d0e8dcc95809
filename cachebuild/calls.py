"""What a caller says about the calls it makes: whether they are decode batches.

A forward cannot tell a decode batch (one new token for each of N sequences) from a
prefill of N tokens by its arguments' shapes; a server can. ``decoding()`` marks the calls
made inside it, in this thread, as uniform decode batches, the way vLLM's model runner
hands its ``BatchDescriptor`` (``uniform_decode``) to the graph dispatcher: in the graph
modes with full decode graphs (``full_and_piecewise``, ``full_decode_only``) such calls
replay full graphs, which record the splitting ops (attention) too. A full graph records
one path through the forward: calls it serves must take the path of the call it was
captured by, which is what the mark promises.

Imports nothing: a mark is read on every call of a compiled model.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_MARK = threading.local()


@contextmanager
def decoding(decode: bool = True) -> Iterator[None]:
    """Calls made inside (in this thread) are uniform decode batches (``decode=False``:
    they are not, inside an outer mark); the mark in force before is restored after."""
    before = getattr(_MARK, "decode", False)
    _MARK.decode = bool(decode)
    try:
        yield
    finally:
        _MARK.decode = before


def is_decode() -> bool:
    """Whether the caller marked the call being made now as a uniform decode batch."""
    return getattr(_MARK, "decode", False)
