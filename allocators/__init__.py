"""Block (page) allocators with reference counts: pure page-id bookkeeping, no MLX.

- :class:`FreeListAllocator`: O(1) LIFO, recently freed pages first.
- :class:`SortedAllocator`: lowest id first, ``allocate_contiguous``, fragmentation.
- :class:`BlockAllocator`: the protocol pagedkv and ``python -m allocators.stress`` use.
"""

from allocators.errors import (
    AllocatorError,
    InvalidArgument,
    InvalidArgumentType,
    InvalidArgumentValue,
    InvalidPage,
    InvariantViolation,
    PoolExhausted,
    RefCountError,
)
from allocators.free_list import FreeListAllocator
from allocators.protocol import (
    AllocatorStats,
    BlockAllocator,
    PageState,
    implements_block_allocator,
)
from allocators.refcounting import NULL_PAGE, RefCountingAllocator
from allocators.sorted import SortedAllocator

__all__ = [
    "AllocatorError",
    "AllocatorStats",
    "BlockAllocator",
    "FreeListAllocator",
    "InvalidArgument",
    "InvalidArgumentType",
    "InvalidArgumentValue",
    "InvalidPage",
    "InvariantViolation",
    "NULL_PAGE",
    "PageState",
    "PoolExhausted",
    "RefCountError",
    "RefCountingAllocator",
    "SortedAllocator",
    "implements_block_allocator",
]
