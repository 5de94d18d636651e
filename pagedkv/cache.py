"""``PagedKVCache``: mlx-lm's per-layer cache protocol on top of a ``PagePool``.

One ``PagedKVCache`` per layer; all layers of a sequence (of one attention kind) share
one ``PageTable``, since a page id names the same slot in every layer of the pool::

    make_paged_cache(model, pool) -> PagedPromptCache [cache_0, cache_1, ...]
                                        │ layer i of the pool
                                        └── table (shared by the layers of the sequence)

The first layer to see a step reserves the step's slots in the table; every layer
then writes its own K/V there (``PagePool.write``, the single write path) and reads its
K/V back with one gather. With a sliding window the cache returns only the keys a
query can still see and drops the rest from the table, so memory stays bounded.

Ownership: the ``PagedPromptCache`` owns its tables; ``release()`` gives their pages
back (once). Per-layer caches own nothing but their ``offset``.

Protocol (mlx-lm 0.32): ``update_and_fetch``, ``offset``, ``make_mask``, ``state`` (get
and set), ``from_state``, ``is_trimmable``, ``trim``, ``size``, ``empty``, ``nbytes``, and
``keys_and_values`` for KV-sharing layers (gemma3n).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from pagedkv.attention import decode_kv, is_plain
from pagedkv.codec import AffineQuant
from pagedkv.errors import (
    InvalidTypeError,
    InvalidValueError,
    KvDTypeError,
    KvShapeError,
    NotSupportedError,
    PoolExhausted,
    ReleasedError,
    check_int,
)
from pagedkv.mask import attention_mask
from pagedkv.pool import PagePool
from pagedkv.sequence import PagedSequence
from pagedkv.shared import PlainKv, QuantKv, SharedKv, ViewKv
from pagedkv.table import PageTable
from pagedkv.view import KvAttentionView


class PagedKVCache:
    """One layer of one sequence: (pool layer, the sequence's table for this layer's
    attention kind, own offset). Its ``PagedSequence`` coordinates the layers' steps."""

    def __init__(self, table: PageTable, layer: int) -> None:
        if not isinstance(table, PageTable):
            raise InvalidTypeError(f"table must be a PageTable, got {type(table).__name__}")
        layer = check_int("layer", layer, minimum=0, maximum=table.pool.num_layers - 1)
        if table.released:
            raise ReleasedError("cannot build a cache on a released page table")
        self.table = table
        self.pool = table.pool
        self.layer = layer
        self.offset = 0
        self._last_start = 0  # first key position returned by the last fetch
        self._step_start = 0  # offset before the last write (the step's RoPE start)
        self.sequence = table.sequence if table.sequence is not None else PagedSequence([table])
        self.sequence.caches.append(self)

    @property
    def window(self) -> int | None:
        return self.table.window

    def save_position(self) -> tuple[int, int, int]:
        return self.offset, self._last_start, self._step_start

    def restore_position(self, position: tuple[int, int, int]) -> None:
        self.offset, self._last_start, self._step_start = position

    # ------------------------------------------------------------------ protocol
    def _validate(self, keys: Any, values: Any) -> None:
        pool = self.pool
        for name, x, d in (("keys", keys, pool.head_dim), ("values", values, pool.v_head_dim)):
            if not isinstance(x, mx.array):
                raise KvShapeError(f"{name} must be an mx.array, got {type(x).__name__}")
            if x.ndim != 4:
                raise KvShapeError(f"{name} must be [B, kv_heads, T, D], got shape {tuple(x.shape)}")
            b, h, t, dd = x.shape
            if b != 1:
                raise NotSupportedError(f"PagedKVCache holds one sequence; got batch {b} (use the batched cache)")
            if h != pool.num_kv_heads:
                raise KvShapeError(f"{name} have {h} kv heads, the pool {pool.num_kv_heads}")
            if dd != d:
                raise KvShapeError(f"{name} head_dim {dd} != pool's {d}")
            if t == 0:
                raise KvShapeError(f"{name} have no tokens (T = 0)")
            if x.dtype != pool.dtype:
                raise KvDTypeError(f"{name} dtype {x.dtype} != pool dtype {pool.dtype}")
        if keys.shape[2] != values.shape[2]:
            raise KvShapeError(f"keys have {keys.shape[2]} tokens, values {values.shape[2]}")

    def _check_alive(self) -> None:
        self.sequence.check_alive()

    def write(self, keys: mx.array, values: mx.array) -> int:
        """Append [1, kv_heads, T, D] keys/values; returns the pre-write offset.

        Validates everything before changing anything; the first layer of a step
        reserves pages for every layer of the sequence at once, and a failing later
        layer rolls the step back (``PagedSequence``).
        """
        self._check_alive()
        sequence = self.sequence
        start = self.offset
        try:
            self._validate(keys, values)
            sequence.prepare(self, start, keys.shape[2])
            rows, slots = self.table.write_index(start, keys.shape[2])
            self.pool.write(self.layer, rows, slots, keys[0], values[0])
        except BaseException:
            sequence.abort_write(self)
            raise
        self.offset = start + keys.shape[2]
        self._last_start = self.visible_start(start)
        self._step_start = start
        sequence.finished_write()
        return start

    def visible_start(self, first_query: int) -> int:
        """First key position a query at ``first_query`` can see (0 without a window)."""
        return 0 if self.window is None else max(0, first_query - self.window + 1)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append [1, kv_heads, T, D] keys/values; return the keys/values attention needs.

        Without a window: all tokens [0, offset + T). With a window W: tokens
        [max(0, offset - W + 1), offset + T), which ``make_mask`` describes.
        """
        self.write(keys, values)
        return self._fetch(self._last_start, self.offset)

    def _gather(self, lo: int, hi: int):
        ps = self.pool.page_size
        first = lo // ps
        index = self.table.read_index(first, -(-hi // ps))
        return self.pool.gather(self.layer, index, lo - first * ps, hi - first * ps)

    def _fetch(self, lo: int, hi: int):
        """Tokens [lo, hi) as attention inputs: float K/V (decoded, un-rotated)."""
        k_parts, v_parts = self._gather(lo, hi)
        pool = self.pool
        if is_plain(pool.k_codec, pool.v_codec, pool.dtype):
            return k_parts[0], v_parts[0]
        return decode_kv(k_parts, v_parts, pool.k_codec, pool.v_codec, pool.dtype)

    def fetch_shared(self, kind: str = "view") -> SharedKv:
        """This step's K/V as a SharedKv (call after the step's write; caller releases it).

        ``view``: a KvAttentionView (any page kind; quantised pages stay packed).
        ``plain``: float keys and values; on rotated (TurboQuant) pages the values stay
        rotated, with ``v_rotated=True`` and ``restore_values`` captured now.
        ``quant``: the packed (packed, scales, biases) triples; affine pages only.
        """
        if kind not in ("view", "plain", "quant"):
            raise InvalidValueError(f"kind must be 'view', 'plain' or 'quant', got {kind!r}")
        self._check_alive()
        lo, hi = self._last_start, self.offset
        if hi == 0:
            raise KvShapeError("cache is empty")
        pool = self.pool
        if kind == "view":
            return ViewKv(KvAttentionView.of_cache(self, start=lo), offset=self._step_start)
        k_parts, v_parts = self._gather(lo, hi)
        if kind == "plain":
            k, v = decode_kv(k_parts, v_parts, pool.k_codec, pool.v_codec, pool.dtype, unrotate_values=False)
            if pool.v_codec.rotated:
                return PlainKv(k, v, offset=self._step_start, restore_values=pool.v_codec.unrotate,
                               v_rotated=True)
            return PlainKv(k, v, offset=self._step_start)
        kc, vc = pool.k_codec, pool.v_codec
        if not (isinstance(kc, AffineQuant) and isinstance(vc, AffineQuant)) or kc.rotated or vc.rotated:
            raise NotSupportedError("quant SharedKv needs affine-quantised, unrotated K and V pages")
        return QuantKv(k_parts, v_parts, bits=kc.bits, group_size=kc.group_size, offset=self._step_start,
                       v_bits=vc.bits, v_group_size=vc.group_size)

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        """What the last ``update_and_fetch`` returned (KV-sharing layers read this)."""
        self._check_alive()
        if self.offset == 0:
            raise KvShapeError("cache is empty")
        return self._fetch(self._last_start, self.offset)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """The mask matching the keys the next ``update_and_fetch(N tokens)`` returns."""
        self._check_alive()
        if self.window is None:
            return attention_mask(N, self.offset, return_array, window_size)
        lo = max(0, self.offset - self.window + 1)
        window = window_size or self.window
        local = self.offset - lo
        if N == 1 and window >= local + 1 and not return_array:
            return None
        if local + N > window or return_array:
            return attention_mask(N, local, True, window)
        return "causal"

    def size(self) -> int:
        return self.offset if self.window is None else min(self.offset, self.window)

    def empty(self) -> bool:
        return self.offset == 0

    @property
    def nbytes(self) -> int:
        """Bytes of this layer's share of the pages the sequence holds (reserved, not live)."""
        return self.table.num_pages * self.pool.bytes_per_page_per_layer

    def is_trimmable(self) -> bool:
        """True when at least one token can be trimmed (always without a window; with
        one, while a query at the shortened end would still find its window held)."""
        return self.offset == 0 or self.max_trim() > 0

    def max_trim(self) -> int:
        """The most tokens ``trim`` accepts now."""
        return self.table.max_rewind(self.offset)

    def trim(self, n: int) -> int:
        """Forget the last ``n`` tokens of this layer (at most ``offset``); returns the
        count trimmed. Once every layer sharing the table has trimmed, the table frees the
        tail pages. Raises ``TrimError`` and changes nothing if a sliding window already
        dropped keys a query at the new end would need (see ``max_trim``).
        """
        self._check_alive()
        n = min(self.offset, check_int("n", n, minimum=0))
        if n == 0:
            return 0
        self.table.check_rewind(self.offset - n)
        self.offset -= n
        self._last_start = min(self._last_start, self.offset)
        self._step_start = min(self._step_start, self.offset)
        self.sequence.trim_tables()
        return n

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        """Owned contiguous float copies of this layer's K/V, [1, kv_heads, offset, D]
        (decoded from quantised pages; setting them re-encodes)."""
        self._check_alive()
        if self.offset == 0:
            raise KvShapeError("cache is empty")
        k, v = PagedKVCache._fetch(self, self.table.first_visible(), self.offset)
        mx.eval(k, v)
        return k, v

    @state.setter
    def state(self, kv: tuple[mx.array, mx.array]) -> None:
        """Replace this layer's contents with ``(keys, values)`` [1, kv_heads, L, D].

        The other layers of the sequence must be empty or hold exactly L tokens, and the
        sequence's pages must not be shared (a fork or a view would see the overwrite).
        """
        self._check_alive()
        keys, values = kv[0], kv[1]
        self._validate(keys, values)
        length = keys.shape[2]
        table = self.table
        others = max((c.offset for c in self.sequence.members(table) if c is not self), default=0)
        if others and others != length:
            raise NotSupportedError(
                f"the sequence's other layers hold {others} tokens; a state of {length} does not fit"
            )
        held = table.pages[table.first_visible() // self.pool.page_size :]
        if any(self.pool.allocator.refcount(int(p)) > 1 for p in held):
            raise NotSupportedError("cannot overwrite pages shared with a fork or a view")
        table.check_rewind(0)
        available = self.pool.allocator.num_available()
        if others:  # the table keeps its pages; this layer rewrites [0, length)
            need = table.pages_needed(length, start=0)
        else:  # the table empties first, so its (unshared) pages become available
            need, available = -(-length // self.pool.page_size), available + table.num_pages
        if need > available:
            raise PoolExhausted(need, available)
        self.trim(self.offset)
        self.write(keys, values)

    @classmethod
    def from_state(cls, state: tuple[mx.array, mx.array], pool: PagePool | None = None) -> PagedKVCache:
        """A one-layer cache holding ``state``; makes a private pool unless one is given."""
        keys, values = state[0], state[1]
        if pool is None:
            _, h, length, d = keys.shape
            ps = 16
            pool = PagePool(
                num_layers=1, num_kv_heads=h, head_dim=d, v_head_dim=values.shape[-1],
                page_size=ps, num_pages=-(-length // ps) + 2, dtype=keys.dtype,
            )
        cache = cls(PageTable(pool), 0)
        cache.state = (keys, values)
        return cache

    def __repr__(self) -> str:
        return f"PagedKVCache(layer={self.layer}, offset={self.offset}, window={self.window})"


class PagedQuantizedKVCache(PagedKVCache):
    """mlx-lm's ``QuantizedKVCache`` protocol on affine-quantised pages.

    ``update_and_fetch`` returns the packed (packed, scales, biases) triples of keys and
    values, and ``bits``/``group_size`` are set, so mlx-lm's attention takes its quantised
    path (it dispatches on ``hasattr(cache, "bits")``). Needs the same bits and group size
    for K and V (mlx-lm's quantised attention takes one of each).
    """

    def __init__(self, table: PageTable, layer: int) -> None:
        kc, vc = table.pool.k_codec, table.pool.v_codec
        if not (isinstance(kc, AffineQuant) and kc == vc) or kc.rotated:
            raise NotSupportedError("PagedQuantizedKVCache needs one affine codec for K and V")
        super().__init__(table, layer)
        self.bits = kc.bits
        self.group_size = kc.group_size

    def _fetch(self, lo: int, hi: int):
        return self._gather(lo, hi)


def cache_class_for(pool: PagePool) -> type[PagedKVCache]:
    """The cache class mlx-lm models should see for ``pool``'s page kind."""
    kc, vc = pool.k_codec, pool.v_codec
    if isinstance(kc, AffineQuant) and kc == vc and not kc.rotated:
        return PagedQuantizedKVCache
    return PagedKVCache


class PagedPromptCache(list):
    """The per-layer caches of one sequence (a list, as mlx-lm expects) and their
    ``PagedSequence``, which owns the tables: ``release()`` (or leaving a ``with`` block)
    returns every page."""

    def __init__(self, caches: list[PagedKVCache]) -> None:
        super().__init__(caches)
        sequences = {id(c.sequence): c.sequence for c in caches}
        if len(sequences) != 1:
            raise InvalidValueError("a prompt cache holds the layers of exactly one sequence")
        self.sequence: PagedSequence = next(iter(sequences.values()))

    @property
    def tables(self) -> list[PageTable]:
        return self.sequence.tables

    def fork(self) -> PagedPromptCache:
        """A second sequence sharing all pages so far (copy-on-write on the next write)."""
        self.sequence.check_alive()
        new_tables = {id(t): t.fork() for t in self.tables}
        PagedSequence(list(new_tables.values()))  # the new layers join it through their tables
        out = []
        for c in self:
            nc = type(c)(new_tables[id(c.table)], c.layer)
            nc.restore_position(c.save_position())
            out.append(nc)
        return PagedPromptCache(out)

    @property
    def released(self) -> bool:
        return self.sequence.released

    def release(self) -> None:
        """Give back every page of this sequence; a second call raises ``ReleasedError``."""
        self.sequence.release()

    @property
    def num_tokens(self) -> int:
        return max((c.offset for c in self), default=0)

    def __enter__(self) -> PagedPromptCache:
        return self

    def __exit__(self, *exc) -> None:
        if not self.released:
            self.release()


def _layer_windows(model, max_kv_size: int | None) -> list[int | None]:
    """Per cache slot: None (full attention) or the sliding-window size, from the model."""
    if hasattr(model, "make_cache"):
        windows = []
        for c in model.make_cache():
            kind = type(c).__name__
            if kind == "KVCache":
                windows.append(None)
            elif kind == "RotatingKVCache":
                if getattr(c, "keep", 0):
                    raise NotSupportedError("rotating caches with keep > 0 are not supported")
                windows.append(c.max_size)
            else:
                raise NotSupportedError(f"model asks for a {kind}; pagedkv pages KVCache and RotatingKVCache")
        return windows
    return [max_kv_size] * len(model.layers)


def make_paged_cache(
    model,
    pool: PagePool,
    *,
    sliding_pool: PagePool | None = None,
    max_kv_size: int | None = None,
) -> PagedPromptCache:
    """The paged twin of ``mlx_lm.models.cache.make_prompt_cache`` for one sequence.

    Full-attention layers share one table in ``pool``; sliding-window layers share a
    second table. With ``sliding_pool`` the sliding layers live there (its layers
    numbered in order of the sliding layers; the full layers take ``pool``'s layers in
    order), so window-bounded pages do not reserve slots in full-attention layers.
    Without it, cache slot i uses layer i of ``pool``. Pools of affine-quantised pages
    (same bits for K and V) give ``PagedQuantizedKVCache``s; other page kinds hand the
    model decoded K/V.
    """
    windows = _layer_windows(model, max_kv_size)
    full_table: PageTable | None = None
    sliding_tables: dict[tuple[int, int], PageTable] = {}
    caches = []
    n_full = n_sliding = 0
    for i, w in enumerate(windows):
        if w is None:
            target, layer = pool, (n_full if sliding_pool is not None else i)
            n_full += 1
            if full_table is None:
                full_table = PageTable(pool)
            table = full_table
        else:
            target = sliding_pool if sliding_pool is not None else pool
            layer = n_sliding if sliding_pool is not None else i
            n_sliding += 1
            key = (id(target), w)
            if key not in sliding_tables:
                sliding_tables[key] = PageTable(target, window=w)
            table = sliding_tables[key]
        if layer >= target.num_layers:
            raise InvalidValueError(f"pool has {target.num_layers} layers; the model needs more")
        caches.append((table, layer, target))
    tables = ([full_table] if full_table is not None else []) + list(sliding_tables.values())
    PagedSequence(tables)  # claims the tables; each layer's cache below joins it through its table
    return PagedPromptCache([cache_class_for(target)(table, layer) for table, layer, target in caches])
