"""Typed errors of the pagedkv package.

A call that raises one of these leaves the pool, the allocator and every page table
exactly as they were. ``PoolExhausted`` is re-exported from :mod:`allocators`.

Hierarchy (each also subclasses the closest built-in, so ``except ValueError`` works)::

    PagedKvError
    ├── InvalidValueError (ValueError)     an argument of the right type, wrong value
    │   ├── KvShapeError                   keys/values/queries of the wrong shape
    │   └── TrimError                      a trim that would reach dropped window pages
    ├── InvalidTypeError (TypeError)       an argument of the wrong type
    │   └── KvDTypeError                   an array of the wrong dtype
    ├── ReleasedError (RuntimeError)       use of a released or moved object
    ├── NotSupportedError (NotImplementedError)
    ├── KvLeakError (RuntimeError)
    └── KvFileError (ValueError)           a KV file that cannot be used; nothing is loaded
        ├── CorruptKvFileError             truncated, bad header, checksum mismatch
        ├── KvFileVersionError             written by another format version
        ├── KvFileMismatchError            another model, page size, head_dim, dtype or codec
        └── DiskTierInUseError             a disk-tier directory another open tier holds
    PoolExhausted (allocators; MemoryError)
"""

from __future__ import annotations

from allocators.errors import PoolExhausted

__all__ = [
    "PagedKvError",
    "InvalidValueError",
    "InvalidTypeError",
    "KvShapeError",
    "KvDTypeError",
    "TrimError",
    "ReleasedError",
    "NotSupportedError",
    "KvLeakError",
    "KvFileError",
    "CorruptKvFileError",
    "KvFileVersionError",
    "KvFileMismatchError",
    "DiskTierInUseError",
    "PoolExhausted",
]


class PagedKvError(Exception):
    """Base class of pagedkv errors."""


class InvalidValueError(PagedKvError, ValueError):
    """An argument of an accepted type whose value cannot be used (a layer out of range,
    a table of another pool, a zero window, a row index past the batch, ...)."""


class InvalidTypeError(PagedKvError, TypeError):
    """An argument of the wrong type (a float layer index, a string codec, ...)."""


class KvShapeError(InvalidValueError):
    """Keys/values/queries of the wrong rank, shape, head count, or an empty token axis."""


class KvDTypeError(InvalidTypeError):
    """An array whose dtype does not match what the pool stores."""


class TrimError(InvalidValueError):
    """A trim that would reach tokens whose pages already left the sliding window."""


class ReleasedError(PagedKvError, RuntimeError):
    """A view, SharedKv, table or cache used (or released) after it was released, or a
    cache used after its pages were moved into a batch."""


class NotSupportedError(PagedKvError, NotImplementedError):
    """A combination pagedkv does not support (yet); the message says which."""


class KvLeakError(PagedKvError, RuntimeError):
    """A SharedKv created during a ForwardPass was neither handed to the pass nor released."""


class KvFileError(PagedKvError, ValueError):
    """A saved cache or disk-tier page that cannot be loaded; the pool is unchanged."""


class CorruptKvFileError(KvFileError):
    """Truncated bytes, a malformed header or tensor table, or a checksum mismatch."""


class KvFileVersionError(KvFileError):
    """A file of another (newer or unknown) format version."""


class KvFileMismatchError(KvFileError):
    """A file written for another model or pool layout (page size, head_dim, dtype, codec)."""


class DiskTierInUseError(KvFileError):
    """A disk-tier directory that another open ``DiskTier`` holds (in this process or
    another): two tiers in one directory would delete each other's files in flight."""


def check_int(name: str, value: object, *, minimum: int | None = None,
              maximum: int | None = None) -> int:
    """``value`` as an int, or a typed error: ``InvalidTypeError`` unless it is an int
    (bools are not), ``InvalidValueError`` outside [minimum, maximum]. A plain int in
    range, what the hot paths pass, costs a class test and two comparisons."""
    if value.__class__ is int and (minimum is None or minimum <= value) and (maximum is None or value <= maximum):
        return value
    import numpy as np  # local: keeps this module import-light

    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise InvalidTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise InvalidValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise InvalidValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_number(name: str, value: object, minimum: float, maximum: float, *, lo_open: bool = False) -> float:
    """``value`` as a number (an int or float; not a bool), or a typed error:
    ``InvalidTypeError`` for anything else, ``InvalidValueError`` outside [minimum,
    maximum] (``lo_open``: (minimum, maximum]), NaN included."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidTypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not (minimum < value if lo_open else minimum <= value) or not value <= maximum:
        raise InvalidValueError(f"{name} must be in {'(' if lo_open else '['}{minimum}, {maximum}], got {value}")
    return value


def check_index(name: str, value: object, size: int) -> int:
    """``value`` as an index into ``size`` items, [0, size): a typed error otherwise, as
    ``check_int`` gives (-1 too: it would name the last item)."""
    return check_int(name, value, minimum=0, maximum=size - 1)
