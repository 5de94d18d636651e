"""pagedkv: a paged KV-cache memory manager for MLX.

- :class:`PagePool`: the physical K/V pages of all layers (the only writer).
- :class:`PageTable`: one sequence's pages and length; reserve / trim / fork / release.
- :class:`RowSet`: the engine under every cache: B rows' tables, per-layer positions, steps.
- :class:`PagedKVCache`, :func:`make_paged_cache`: mlx-lm's cache protocol on pages (one
  row); :class:`PagedBatch`: B rows decoded together; :class:`CompiledDecode`: its
  decode step under ``mx.compile``; :func:`route_attention`: mlx-lm's attention reads
  the pages directly.
- :class:`KvAttentionView`, :data:`SharedKv` (:class:`PlainKv`, :class:`QuantKv`,
  :class:`ViewKv`), :class:`ForwardPass`, :class:`KvSharingPlan`: the donor/sharer contract.
- :class:`StatePool`, :class:`PagedStateCache`: hybrid models' recurrent-layer state
  (mlx-lm ``ArraysCache`` layers) in slots that live and die with the rows.
- :class:`DonorCache`: run an mlx-lm model through a ForwardPass; :class:`DrafterKv`:
  a speculative drafter's views of the target's K/V.
"""

from allocators import PoolExhausted
from pagedkv.attention_routing import route_attention
from pagedkv.batch import PagedBatch, PagedBatchKVCache
from pagedkv.cache import (
    PagedKVCache,
    PagedPromptCache,
    kv_pages_for,
    kv_pool_layers,
    layout_for,
    make_paged_cache,
)
from pagedkv.cache_file import load_cache, save_cache
from pagedkv.codec import AffineQuant, FullPrecision, RotatedAffineQuant, rotated
from pagedkv.compiled_decode import CompiledDecode
from pagedkv.disk_tier import DiskTier
from pagedkv.donor_cache import DonorCache, donor_caches
from pagedkv.drafter import DrafterKv
from pagedkv.errors import (
    CorruptKvFileError,
    DiskTierInUseError,
    InvalidTypeError,
    InvalidValueError,
    KvDTypeError,
    KvFileError,
    KvFileMismatchError,
    KvFileVersionError,
    KvLeakError,
    KvShapeError,
    NotSupportedError,
    PagedKvError,
    ReleasedError,
    TrimError,
)
from pagedkv.forward_pass import ForwardPass
from pagedkv.pool import PagePool, raise_cache_limit
from pagedkv.pool_factory import pools_for_model
from pagedkv.prefix import PrefixCache, PrefixStats
from pagedkv.prefix_keys import PrefixKeys
from pagedkv.row_set import LayerLayout, RowSet, TableSpec
from pagedkv.scheduling import can_admit, pages_for, preempt
from pagedkv.shared import PlainKv, QuantKv, SharedKv, ViewKv
from pagedkv.sharing_plan import KvSharingPlan
from pagedkv.state_cache import PagedStateCache
from pagedkv.state_pool import StatePool
from pagedkv.table import PageTable
from pagedkv.view import KvAttentionView

__all__ = [
    "StatePool",
    "pools_for_model",
    "PagedStateCache",
    "PrefixCache",
    "PrefixKeys",
    "DiskTier",
    "save_cache",
    "load_cache",
    "KvFileError",
    "CorruptKvFileError",
    "KvFileVersionError",
    "KvFileMismatchError",
    "DiskTierInUseError",
    "PrefixStats",
    "can_admit",
    "pages_for",
    "preempt",
    "PagedBatch",
    "PagedBatchKVCache",
    "CompiledDecode",
    "AffineQuant",
    "FullPrecision",
    "route_attention",
    "kv_pages_for",
    "kv_pool_layers",
    "layout_for",
    "RotatedAffineQuant",
    "rotated",
    "DonorCache",
    "DrafterKv",
    "ForwardPass",
    "KvAttentionView",
    "KvLeakError",
    "KvSharingPlan",
    "PlainKv",
    "QuantKv",
    "SharedKv",
    "ViewKv",
    "donor_caches",
    "InvalidTypeError",
    "InvalidValueError",
    "KvDTypeError",
    "KvShapeError",
    "NotSupportedError",
    "PagePool",
    "PageTable",
    "PagedKVCache",
    "PagedKvError",
    "PagedPromptCache",
    "PoolExhausted",
    "ReleasedError",
    "TrimError",
    "LayerLayout",
    "RowSet",
    "TableSpec",
    "make_paged_cache",
    "raise_cache_limit",
]
