"""``PagedKVCache``: mlx-lm's per-layer cache protocol, the one-row face of a ``RowSet``.

One ``PagedKVCache`` per layer of one sequence; all of them face the same ``RowSet``
(:mod:`pagedkv.row_set`), which owns the sequence's page tables (one per attention
kind: full, and each sliding window) and does the work::

    make_paged_cache(model, pool) -> PagedPromptCache [cache_0, cache_1, ...]
                                        │ each: (row set, layer)
                                        └── RowSet: tables, [layer, row] offsets, steps

``update_and_fetch`` writes the step's K/V into the pages (the first layer of a step
reserves pages for every layer, atomically) and returns the keys the step's queries
may see. With ``route_attention(model)`` (done by ``make_paged_cache``) mlx-lm's
attention calls ``attend`` instead, which reads the pages directly: the CUDA kernel on
a GPU, quantised matmuls on packed pages; the returned K/V are then never computed.

Ownership: the ``PagedPromptCache`` owns the row set; ``release()`` gives its pages back
(once). Per-layer caches own nothing.

Protocol (mlx-lm 0.32): ``update_and_fetch``, ``offset``, ``make_mask``, ``state`` (get
and set), ``from_state``, ``is_trimmable``, ``trim``, ``size``, ``empty``, ``nbytes``,
``keys_and_values`` for KV-sharing layers (gemma3n); ``bits``/``group_size`` on
affine-quantised pages with one codec for K and V (mlx-lm's quantised attention path).
"""

from __future__ import annotations

import weakref

import mlx.core as mx
import numpy as np

from pagedkv.codec import AffineQuant
from pagedkv.errors import (
    InvalidTypeError,
    InvalidValueError,
    KvShapeError,
    NotSupportedError,
    PoolExhausted,
    ReleasedError,
    check_int,
)
from pagedkv.mlx_lm_caches import entry_caches
from pagedkv.pool import PagePool
from pagedkv.row_set import LayerLayout, RowSet, TableSpec
from pagedkv.shared import SharedKv
from pagedkv.state_pool import StatePool
from pagedkv.table import PageTable, peak_pages
from pagedkv.visibility import attention_mask, check_mask_request, window_start


class LayerFace:
    """What the one-row and the batched face share: one layer of a ``RowSet``."""

    reads_pages = True  # route_attention sends mlx-lm's attention to ``attend``
    takes_sinks = True  # ... attention sinks included
    exact = True  # keys returned exactly (one row) or page-aligned per row (a batch)

    def __init__(self, rows: RowSet, layer: int) -> None:
        self.rows = rows
        self.layer = layer
        self.pool_layer = rows.layout.layers[layer][1]
        self.pool = rows.pool_of(layer)
        # the last fetch: (read, weak references to what update_and_fetch returned: K's
        # components then V's, lent, attended: its attention took it, how many of the
        # references are K's); checked at the next fetch (see there)
        self._fetched = None
        self._lent_and_held = False  # a caller kept lent views: copies from then on
        kind = self.pool.kind
        if kind.mlx_quantized:  # mlx-lm dispatches on hasattr(cache, "bits")
            self.bits = kind.k_codec.bits
            self.group_size = kind.k_codec.group_size

    @property
    def window(self) -> int | None:
        return self.rows.spec_of(self.layer).window

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Append [B, kv_heads, T, D] keys/values; return the keys/values this step's
        queries may see (float K/V, or packed triples on ``bits`` caches).

        What it returns is a copy gathered from the pages, with one exception. Once the
        layer's last fetch went to ``attend`` and its arrays were dropped before this
        call (a model whose attention is routed, in mlx-lm's own step), a sequence whose
        pages are one run of ids gets views of the pool's arrays instead
        (``PageRead.borrowed``). The routed attention never computes them, so the step
        builds no gather for nothing. A view still held at the layer's next write makes
        that write copy the layer's array (the values stay right), so a layer whose
        caller kept one returns copies from then on. A pool lends no views where MLX's
        attention would misread them (``PagePool.borrow_run``: long runs on CUDA in some
        pools), so this returns copies there. O(1) more than the write."""
        lends, last = False, self._fetched
        if last is not None:  # the previous fetch: went to attend, and dropped?
            held = any([r() is not None for r in last[1]])
            if held and last[2]:
                self._lent_and_held = True
            lends = last[3] and not held and not self._lent_and_held
        self.rows.write(self.layer, keys, values)
        read = self.rows.visible_read(self.layer)
        parts = read.borrowed(self.pool_layer, self.exact) if lends else None
        lent = parts is not None
        if not lent:
            parts = read.parts(self.pool_layer, self.exact)
        k_parts, v_parts = parts
        self._fetched = (read, [weakref.ref(x) for x in (*k_parts, *v_parts)], lent, False, len(k_parts))
        return self.pool.kind.model_inputs(k_parts, v_parts)

    def storage(self) -> list[mx.array]:
        """What to evaluate to settle this layer's writes (``PagePool.written``)."""
        return self.pool.written(self.pool_layer)

    def keys_and_values(self):
        """What the last ``update_and_fetch`` returned (KV-sharing layers read this)."""
        self.rows.check_alive()
        if not self.rows.offsets[self.layer].any():
            raise KvShapeError("cache is empty")
        return self.pool.kind.model_inputs(*self.rows.read(self.layer, exact=self.exact))

    def attend(self, queries: mx.array, scale: float, mask, sinks: mx.array | None = None) -> mx.array:
        """This step's attention, read from the pages (``route_attention`` calls it in
        place of mlx-lm's ``scaled_dot_product_attention``; see the module doc);
        ``sinks``: the layer's attention-sink logits [n_heads] (gpt_oss), or None."""
        self.rows.check_alive()
        # The step's gather, if the model still holds it (weak references: a kept read
        # would keep a copy of the K/V alive and be evaluated at the next write). The
        # row set hands out one read per position of a layer until its rows change, so
        # the same read object means the same keys.
        fetched, parts, lent = self._fetched, None, False
        read = self.rows.visible_read(self.layer)
        if fetched is not None and not fetched[3] and fetched[0] is read:
            self._fetched = (*fetched[:3], True, fetched[4])
            arrays = [r() for r in fetched[1]]
            if all([x is not None for x in arrays]):
                parts = (tuple(arrays[: fetched[4]]), tuple(arrays[fetched[4]:]))
                lent = fetched[2]
        return self.rows.attend(self.layer, queries, scale, mask, self.rows.owns_mask(self.layer, mask),
                                self.exact, parts, sinks, borrow=not lent, read=read)

    def fetch_shared(self, kind: str = "view") -> SharedKv:
        """This step's K/V as a SharedKv (call after the step's write; caller releases
        it): see ``RowSet.shared``."""
        return self.rows.shared(self.layer, kind)

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> LayerFace:
        """What mlx-lm's ``generate_step(kv_bits=..., kv_group_size=...)`` asks of each
        cache. pagedkv quantises in the pool (``PagePool(k_codec=AffineQuant(bits,
        group_size), v_codec=...)``), so this is the cache itself when the layer's K and
        V pages already are affine ``bits``-bit in groups of ``group_size``, and
        ``NotSupportedError`` otherwise: without it mlx-lm skipped the cache, and the
        request for quantised K/V went unheard."""
        pool = self.pool
        if all(isinstance(c, AffineQuant) and not c.rotated and (c.bits, c.group_size) == (bits, group_size)
               for c in (pool.k_codec, pool.v_codec)):
            return self
        raise NotSupportedError(
            f"pagedkv quantises K/V in the pool, not in the cache: for {bits}-bit K/V in groups of {group_size}, "
            f"make the pool with k_codec=v_codec=AffineQuant({bits}, {group_size}) (this layer's pages are "
            f"{pool.k_codec!r} / {pool.v_codec!r})")

    @property
    def nbytes(self) -> int:
        """Bytes of this layer's share of the pages held (reserved, not live)."""
        return self.rows.nbytes(self.layer)

    def is_trimmable(self) -> bool:
        """True when at least one token can be trimmed (always without a window; with
        one, while a query at the shortened end would still find its window held)."""
        return self.max_trim() > 0 or not self.rows.offsets[self.layer].any()

    def max_trim(self) -> int:
        """The most tokens ``trim`` accepts now."""
        return self.rows.max_trim(self.layer)

    def trim(self, n: int) -> int:
        """Forget the last ``n`` tokens of this layer (of every row; at most what the
        shortest holds); returns the count. Once every layer of a table went back, the
        table frees the tail pages. ``TrimError`` (nothing changed) if a sliding window
        already dropped keys a query at the new end would need (see ``max_trim``)."""
        return self.rows.trim(self.layer, n)


class PagedKVCache(LayerFace):
    """One layer of one sequence. ``PagedKVCache(table, layer)`` makes a one-layer
    sequence on ``table`` (layer ``layer`` of its pool); ``make_paged_cache`` builds the
    layers of a model over one shared row set."""

    def __init__(self, table: PageTable | RowSet, layer: int) -> None:
        if isinstance(table, RowSet):
            rows = table
            layer = check_int("layer", layer, minimum=0, maximum=rows.layout.num_layers - 1)
        elif isinstance(table, PageTable):
            layer = table.pool.check_layer(layer)
            if table.released:
                raise ReleasedError("cannot build a cache on a released page table")
            rows = RowSet(LayerLayout.uniform(table.pool, [layer], table.window, table.rewind), [[table]])
            layer = 0
        else:
            raise InvalidTypeError(f"table must be a PageTable, got {type(table).__name__}")
        super().__init__(rows, layer)

    @property
    def table(self) -> PageTable:
        return self.rows.layer_tables(self.layer)[0]

    @property
    def offset(self) -> int:
        """Tokens this layer holds: where its next write goes. Setting it lower is
        ``trim`` (``cache.offset -= n`` as on an mlx-lm ``KVCache``; ``TrimError`` where
        a window dropped keys the new end needs); only writes move it forward (a larger
        value would read tokens never written)."""
        return int(self.rows.offsets[self.layer, 0])

    @offset.setter
    def offset(self, value: int) -> None:
        value = check_int("offset", value, minimum=0, maximum=self.offset)
        self.trim(self.offset - value)

    def write(self, keys: mx.array, values: mx.array) -> int:
        """Append [1, kv_heads, T, D] keys/values; returns the pre-write offset."""
        return int(self.rows.write(self.layer, keys, values)[0])

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """The mask matching the keys the next ``update_and_fetch(N tokens)`` returns."""
        self.rows.check_alive()
        check_mask_request(N, window_size)
        offset = self.offset
        if self.window is None:
            mask = attention_mask(N, offset, return_array, window_size)
            self.rows.note_mask(self.layer, mask if window_size is None else None)
            return mask
        lo = window_start(offset, self.window)
        window = window_size or self.window
        local = offset - lo
        if N == 1 and window >= local + 1 and not return_array:
            mask = None
        elif local + N > window or return_array:
            mask = attention_mask(N, local, True, window)
        else:
            mask = "causal"
        self.rows.note_mask(self.layer, mask if window == self.window else None)
        return mask

    def size(self) -> int:
        self.rows.check_alive()
        return self.offset if self.window is None else min(self.offset, self.window)

    def empty(self) -> bool:
        self.rows.check_alive()
        return self.offset == 0

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        """Owned contiguous float copies of this layer's K/V, [1, kv_heads, offset, D]
        (decoded from quantised pages; setting them re-encodes)."""
        self.rows.check_alive()
        if self.offset == 0:
            raise KvShapeError("cache is empty")
        lo = np.array([self.table.first_visible()])
        k, v = self.pool.kind.decode(*self.rows.read(self.layer, lo, self.rows.offsets[self.layer]))
        mx.eval(k, v)
        return k, v

    @state.setter
    def state(self, kv: tuple[mx.array, mx.array] | tuple[mx.array, mx.array, int]) -> None:
        """Replace this layer's contents with ``(keys, values)`` [1, kv_heads, L, D], or
        with mlx-lm's ``KVCache.state``, ``(keys, values, offset)``: buffers whose first
        ``offset`` tokens are the contents (``paged.state = kv_cache.state`` moves an
        mlx-lm cache, one from ``load_prompt_cache`` say, into pages).

        The other layers of the sequence must be empty or hold exactly L tokens, and the
        sequence's pages must not be shared (a fork or a view would see the overwrite).
        """
        rows = self.rows
        rows.check_alive()
        keys, values = _state_contents(kv)
        rows.check_kv(self.layer, keys, values)
        length = keys.shape[2]
        table = self.table
        spec = rows.layout.layers[self.layer][0]
        others = max((int(rows.offsets[i, 0]) for i in rows.layers_of(spec) if i != self.layer), default=0)
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
    def from_state(cls, state: tuple[mx.array, mx.array] | tuple[mx.array, mx.array, int],
                   pool: PagePool | None = None) -> PagedKVCache:
        """A one-layer cache holding ``state`` (either form the ``state`` setter takes);
        makes a private pool unless one is given."""
        keys, values = _state_contents(state)
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


class PagedPromptCache(list):
    """The per-layer caches of one sequence (a list, as mlx-lm expects) and the row set
    they face, which owns the page tables: ``release()`` (or leaving a ``with`` block)
    returns every page."""

    def __init__(self, caches: list[PagedKVCache]) -> None:
        super().__init__(caches)
        owners = {id(c.rows): c.rows for c in caches}
        if len(owners) != 1:
            raise InvalidValueError("a prompt cache holds the layers of exactly one sequence")
        self.rows: RowSet = next(iter(owners.values()))

    @classmethod
    def of_rows(cls, rows: RowSet) -> PagedPromptCache:
        if rows.num_rows != 1:
            raise InvalidValueError(f"a prompt cache holds one sequence, got {rows.num_rows} rows")
        return cls(layer_faces(rows, PagedKVCache))

    @classmethod
    def of_layers(cls, pool: PagePool, num_layers: int | None = None,
                  window: int | None = None) -> PagedPromptCache:
        """One sequence over layers 0 .. num_layers - 1 of ``pool`` (default: all), one
        table (full attention, or a sliding ``window``)."""
        n = pool.num_layers if num_layers is None else check_int("num_layers", num_layers, minimum=1)
        return cls.of_rows(RowSet.new_row(LayerLayout.uniform(pool, range(n), window)))

    @property
    def tables(self) -> list[PageTable]:
        return self.rows.all_tables()

    def fork(self) -> PagedPromptCache:
        """A second sequence sharing all pages so far (copy-on-write on the next write)."""
        return PagedPromptCache.of_rows(self.rows.fork())

    @property
    def released(self) -> bool:
        return self.rows.released

    def release(self) -> None:
        """Give back every page of this sequence; a second call raises ``ReleasedError``."""
        self.rows.release()

    @property
    def num_tokens(self) -> int:
        return int(self.rows.offsets.max()) if len(self) else 0

    def __enter__(self) -> PagedPromptCache:
        return self

    def __exit__(self, *exc) -> None:
        if not self.released:
            self.release()


def layer_faces(rows: RowSet, kv_face, state_face=None) -> list:
    """The per-layer caches of ``rows`` in the model's cache order: ``kv_face(rows, i)``
    for attention layer i, ``state_face(rows, r)`` (default: a ``PagedStateCache``) for
    recurrent layer r, grouped into a ``PagedCacheList`` where the model bundles a
    layer's caches (``LayerLayout.groups``)."""
    from pagedkv.cache_list import PagedCacheList
    from pagedkv.state_cache import PagedStateCache

    state_face = state_face or PagedStateCache
    faces = [kv_face(rows, i) if kind == "kv" else state_face(rows, i) for kind, i in rows.layout.slot_kinds()]
    if not rows.layout.groups:
        return faces
    out, i = [], 0
    for n in rows.layout.groups:
        out.append(PagedCacheList(faces[i : i + n]) if n > 1 else faces[i])
        i += n
    return out


_RECURRENT = "recurrent"


def _face_kind(c) -> int | None | str:
    """None (full attention), the sliding-window size, or "recurrent" (an
    ``ArraysCache`` layer of a hybrid model)."""
    kind = type(c).__name__
    if kind == "KVCache":
        return None
    if kind == "RotatingKVCache":
        if getattr(c, "keep", 0):
            raise NotSupportedError("rotating caches with keep > 0 are not supported")
        return c.max_size
    if kind == "ArraysCache":
        return _RECURRENT
    raise NotSupportedError(f"model asks for a {kind}; pagedkv pages KVCache and RotatingKVCache "
                            "and keeps ArraysCache state in a StatePool")


def _state_contents(state: object) -> tuple[mx.array, mx.array]:
    """The (keys, values) of a state in either form ``PagedKVCache.state`` takes: as
    given, or the first ``offset`` tokens of mlx-lm ``KVCache.state``'s buffers (which
    have room for more). A typed error for anything else; the shapes' fit to a pool is
    checked by the writer."""
    if not isinstance(state, (tuple, list)) or len(state) not in (2, 3):
        raise InvalidTypeError(f"a state is (keys, values) or mlx-lm's KVCache state (keys, values, offset), "
                               f"got {type(state).__name__}"
                               f"{' of %d' % len(state) if isinstance(state, (tuple, list)) else ''}")
    keys, values = state[0], state[1]
    if not (isinstance(keys, mx.array) and isinstance(values, mx.array) and keys.ndim == values.ndim == 4):
        raise KvShapeError("a state's keys and values are [B, kv_heads, L, D] mx.arrays, "
                           f"got {type(keys).__name__} and {type(values).__name__}")
    if len(state) == 2:
        return keys, values
    offset = check_int("offset", state[2], minimum=1, maximum=min(keys.shape[2], values.shape[2]))
    return keys[..., :offset, :], values[..., :offset, :]


def _layer_windows(model, max_kv_size: int | None) -> list[list[int | None | str]]:
    """Per entry of the model's cache list, the kinds of its caches (``_face_kind``;
    several for a ``CacheList``). ``max_kv_size`` (None or an int >= 1, checked either
    way) applies, as in mlx-lm's ``make_prompt_cache``, only to a model without
    ``make_cache``."""
    if max_kv_size is not None:
        check_int("max_kv_size", max_kv_size, minimum=1)
    if hasattr(model, "make_cache"):
        return [[_face_kind(c) for c in entry_caches(entry)] for entry in model.make_cache()]
    return [[max_kv_size]] * len(model.layers)


def _refuse_latent_attention(model) -> None:
    """``NotSupportedError`` for a model whose attention caches a compressed latent
    (mlx-lm's deepseek_v3, kimi, glm4_moe_lite, mistral4...: multi-head latent attention
    with the up-projections absorbed, ``embed_q`` on the attention module). Its cache holds
    the latent and a RoPE key, which it reads as K = V = latent with the RoPE scores as
    the mask: pagedkv's attention would read the pages as K and V. (deepseek_v2 and
    minicpm3 cache full keys and values of different widths: a pool with ``v_head_dim``
    serves them.) O(layers) attribute reads the first time per model class (an
    architecture caches a latent or never does), O(1) after."""
    latent = _LATENT.get(type(model))
    if latent is None:
        latent = _LATENT[type(model)] = _latent_attention_module(model)
    if latent:
        raise NotSupportedError(f"{latent}: its attention caches a compressed latent (multi-head latent "
                                "attention), which pagedkv's pages do not serve")


_LATENT: dict[type, str] = {}  # model class -> the module of its latent-caching attention, or ""


def _latent_attention_module(model) -> str:
    """The module name of ``model``'s first attention that caches a latent, or ""."""
    for layer in getattr(model, "layers", None) or ():
        attn = getattr(layer, "self_attn", None) or getattr(layer, "attention", None)
        if getattr(attn, "embed_q", None) is not None:
            return type(attn).__module__.rsplit(".", 1)[-1]
    return ""


def layout_for(model, pool: PagePool, *, sliding_pool: PagePool | None = None,
               max_kv_size: int | None = None, state_pool: StatePool | None = None,
               rewind: int = 0) -> LayerLayout:
    """The layer layout of ``model``'s caches: full-attention layers share one table spec
    in ``pool``; each sliding-window size gets its own (in ``sliding_pool`` if given,
    whose layers are numbered in order of the sliding layers; the full layers then take
    ``pool``'s layers in order). Without ``sliding_pool``, attention layer i (the i-th
    cache slot that is not recurrent) uses layer i.

    A pool with fewer layers than the attention layers it serves is used in *groups*:
    the layers of each kind (full attention; each window size), in model order, are cut
    into groups of as many layers as the pool has, each group a table spec, each layer at
    the pool layer of its place in its group. A page then holds one group's layers only:
    a Gemma-3-style model (5 sliding layers per full one) on a pool of
    ``kv_pool_layers(model)`` layers keeps a long prompt's full-attention pages without
    room for the sliding layers, much as vLLM's equal-size layer groups do
    (bench/sliding_memory.py: 5.6x less K/V at 32k). The pool factories make such pools.
    One forward then writes each pool array several times: on a CUDA GPU such a pool
    writes tokens with its in-place kernel (``PagePool.written_in_groups``), as MLX's
    scatter copies an array a kernel still in flight reads.

    A hybrid model's recurrent layers keep their state in ``state_pool``
    (``StatePool.for_model(model, ...)``).
    ``rewind``: tokens the sliding-window tables keep behind their window, so that a
    sequence can always be trimmed back that far (``PageTable``); a draft model that
    proposes k tokens one step at a time needs k - 1."""
    rewind = check_int("rewind", rewind, minimum=0)
    if not isinstance(pool, PagePool) or (sliding_pool is not None and not isinstance(sliding_pool, PagePool)):
        raise InvalidTypeError("pool and sliding_pool must be PagePools")
    if state_pool is not None and not isinstance(state_pool, StatePool):
        raise InvalidTypeError(f"state_pool must be a StatePool, got {type(state_pool).__name__}")
    _refuse_latent_attention(model)
    entries = _layer_windows(model, max_kv_size)
    windows = [w for entry in entries for w in entry]
    groups = tuple(len(e) for e in entries) if any(len(e) != 1 for e in entries) else ()
    state_slots = tuple(i for i, w in enumerate(windows) if w == _RECURRENT)
    if len(state_slots) == len(windows):
        raise NotSupportedError("the model has no attention layers (no K/V for pages to hold): "
                                "run it on mlx-lm's own caches")
    if state_slots and state_pool is None:
        raise NotSupportedError(f"the model has {len(state_slots)} recurrent layers: pass "
                                "state_pool=StatePool.for_model(model, num_slots=...)")
    if state_pool is not None and len(state_slots) != state_pool.num_layers:
        raise InvalidValueError(f"the model has {len(state_slots)} recurrent layers, the state pool "
                                f"{state_pool.num_layers}")
    specs: list[TableSpec] = []
    layers = []
    attn = [w for w in windows if w != _RECURRENT]
    target_of = [pool if w is None or sliding_pool is None else sliding_pool for w in attn]
    serves = {id(t): sum(u is t for u in target_of) for t in target_of}  # id(pool) -> its attention layers
    placed: dict[int, int] = {}  # id(pool) -> its attention layers so far
    seen: dict[int | None, int] = {}  # layers of each kind so far
    for w, target in zip(attn, target_of):
        k = placed.get(id(target), 0)
        placed[id(target)] = k + 1
        if serves[id(target)] <= target.num_layers:  # a pool layer per layer
            group, layer = 0, k
        else:  # groups of the pool's layers per kind
            group, layer = divmod(seen.get(w, 0), target.num_layers)
            target.written_in_groups()
        seen[w] = seen.get(w, 0) + 1
        spec = TableSpec(target, w, 0 if w is None else rewind, group)
        if spec not in specs:
            specs.append(spec)
        layers.append((specs.index(spec), layer))
    return LayerLayout(tuple(specs), tuple(layers), state_slots, state_pool if state_slots else None, groups)


def _attention_kinds(model, max_kv_size: int | None) -> dict[int | None, int]:
    """How many attention layers ``model`` has of each kind (None: full attention, else
    the window), recurrent layers left out."""
    counts: dict[int | None, int] = {}
    for entry in _layer_windows(model, max_kv_size):
        for w in entry:
            if w != _RECURRENT:
                counts[w] = counts.get(w, 0) + 1
    return counts


def kv_pages_for(model, tokens: int, page_size: int, pool_layers: int | None = None, chunk: int = 512,
                 rewind: int = 0) -> int:
    """Pages a pool of ``pool_layers`` layers (default ``kv_pool_layers(model)``) needs
    for one sequence of ``tokens`` tokens written at most ``chunk`` per forward (a
    prefill chunk), the null page included; ``rewind`` as ``make_paged_cache``'s. Each
    table spec of ``layout_for``'s layout holds the sequence's pages, a sliding-window
    one at most its window's and two chunks' (``peak_pages``). Exact for a model without
    sliding windows; O(layers)."""
    tokens = check_int("tokens", tokens, minimum=1)
    page_size = check_int("page_size", page_size, minimum=1)
    chunk = check_int("chunk", chunk, minimum=1)
    rewind = check_int("rewind", rewind, minimum=0)
    layers = kv_pool_layers(model) if pool_layers is None else check_int("pool_layers", pool_layers, minimum=1)
    counts = _attention_kinds(model, None)
    grouped = sum(counts.values()) > layers  # (else a pool layer per layer: one table per kind)
    return 1 + sum((-(-n // layers) if grouped else 1) * peak_pages(tokens, page_size, w, rewind, chunk)
                   for w, n in counts.items())


def kv_pool_layers(model, max_kv_size: int | None = None) -> int:
    """The fewest pool layers that waste no page room on ``model`` (``layout_for``'s
    groups): as many as it has full-attention layers, so they form one group (one
    table, which prefix caching needs) and a long sequence's full-attention pages hold
    no room for other layers; its sliding-window layers then form groups of that many
    (the last one may leave layers unused, in window pages only). A model without
    full-attention layers: its smallest kind of sliding layers. For a model of one kind,
    all of its attention layers. The pool factories size pools with it."""
    counts = _attention_kinds(model, max_kv_size)
    if not counts:
        raise NotSupportedError("the model has no attention layers (no K/V for pages to hold)")
    return counts[None] if None in counts else min(counts.values())


def make_paged_cache(
    model,
    pool: PagePool,
    *,
    sliding_pool: PagePool | None = None,
    max_kv_size: int | None = None,
    state_pool: StatePool | None = None,
    rewind: int = 0,
) -> PagedPromptCache:
    """The paged twin of ``mlx_lm.models.cache.make_prompt_cache`` for one sequence
    (layout: ``layout_for``; a hybrid model's recurrent layers need ``state_pool``;
    ``rewind``: tokens a sliding-window layer keeps behind its window, for trims that
    go back across steps).
    Also routes the model's attention through the caches (``route_attention``), so
    decode steps read the pages directly."""
    from pagedkv.attention_routing import route_attention

    cache = PagedPromptCache.of_rows(RowSet.new_row(layout_for(model, pool, sliding_pool=sliding_pool,
                                                              max_kv_size=max_kv_size, state_pool=state_pool,
                                                              rewind=rewind)))
    route_attention(model)
    return cache
