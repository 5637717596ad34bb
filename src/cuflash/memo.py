"""Bounded memo tables (checked call signatures, launch plans) that several threads fill at once:
autograd runs the backward in a thread of its own while the caller's thread goes on to the next
forward."""
from __future__ import annotations

from typing import TypeVar

V = TypeVar("V")


def remember(table: dict, key, value: V, limit: int) -> V:
    """table[key] = value, first dropping the oldest entries while the table holds `limit` or more.
    Another thread may drop the same entry meanwhile: pop tolerates that, where `del` would raise
    KeyError."""
    while len(table) >= limit:
        try:
            table.pop(next(iter(table)), None)
        except (StopIteration, RuntimeError):  # emptied, or resized during next(), by another thread
            break
    table[key] = value
    return value
