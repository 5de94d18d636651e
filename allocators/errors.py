"""Typed errors of the allocators package.

Every error leaves the allocator exactly as it was before the call that raised it.
Each error also subclasses the closest built-in so callers that only know the built-ins
still catch it: a bad value is a ``ValueError``, a bad type a ``TypeError``, a full pool
a ``MemoryError``.
"""

from __future__ import annotations


class AllocatorError(Exception):
    """Base class of every allocator error."""


class PoolExhausted(AllocatorError, MemoryError):
    """Fewer pages are available than were requested.

    ``requested`` and ``available`` are page counts; ``available`` counts free pages plus
    cached-evictable pages (those can be evicted to satisfy an allocation).
    """

    def __init__(self, requested: int, available: int, what: str = "pages") -> None:
        self.requested = requested
        self.available = available
        super().__init__(f"requested {requested} {what}, only {available} available")


class InvalidPage(AllocatorError, ValueError):
    """A page id that is out of range, reserved, or in the wrong state for the call."""


class RefCountError(AllocatorError, ValueError):
    """A reference count would become invalid: double free, incref of a free page, ..."""


class InvalidArgument(AllocatorError):
    """An argument the allocator cannot take; always one of the two subclasses below."""


class InvalidArgumentType(InvalidArgument, TypeError):
    """An argument of the wrong type: non-integer page ids or counts, a 2-d id array, ..."""


class InvalidArgumentValue(InvalidArgument, ValueError):
    """An integer argument out of its range: a negative count, too few pages, ..."""


class InvariantViolation(AllocatorError, AssertionError):
    """``check()`` found a page in no state, in two states, or counters that do not add up."""
