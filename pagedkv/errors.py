"""Typed errors of the pagedkv package.

A call that raises one of these leaves the pool, the allocator and every page table
exactly as they were. ``PoolExhausted`` is re-exported from :mod:`allocators`.
"""

from __future__ import annotations

from allocators.errors import PoolExhausted

__all__ = [
    "PagedKvError",
    "KvShapeError",
    "KvDTypeError",
    "ReleasedError",
    "NotSupportedError",
    "KvLeakError",
    "PoolExhausted",
]


class PagedKvError(Exception):
    """Base class of pagedkv errors."""


class KvShapeError(PagedKvError, ValueError):
    """Keys/values/queries of the wrong rank, shape, head count, or an empty token axis."""


class KvDTypeError(PagedKvError, TypeError):
    """An array whose dtype does not match what the pool stores."""


class ReleasedError(PagedKvError, RuntimeError):
    """A view, SharedKv, table or cache used (or released) after it was released."""


class NotSupportedError(PagedKvError, NotImplementedError):
    """A combination pagedkv does not support (yet); the message says which."""


class KvLeakError(PagedKvError, RuntimeError):
    """A SharedKv created during a ForwardPass was neither handed to the pass nor released."""
