"""``PrefixCache``: reuse the K/V pages of prompt prefixes that were computed before.

A *full* page is found by its key, ``(node of the prefix before it, its token ids)``
(see :mod:`pagedkv.prefix_keys`)::

    root ──[t0..t15]──> page 7 (node 41) ──[t16..t31]──> page 3 (node 42) ──> ...

so a hit compares the token ids themselves and equal keys mean equal whole prefixes. A
page whose sequence ends keeps its key and becomes CACHED (reference count 0,
evictable) in the allocator; it is evicted in LRU order only when an allocation needs
the room, and its key is forgotten then. Node numbers are never reused, so the pages
registered below an evicted page can no longer be reached; they age out of the LRU. A
new request takes every cached page of its longest matching prefix (one more reference
each) and computes only the rest; at least its last token is always computed, so the
model yields logits. Sequences with different ``extra_keys`` (a model or adapter id, a
salt) start from different roots and never share pages.

Hybrid models (``state_pool``): a hit must also restore the recurrent state at the
point it ends, so the cache keeps *checkpoints*: a sequence registered while its state
stands on a checkpoint boundary (every ``checkpoint_every`` pages) leaves its state
slot behind, filed under the node of the page that ends there. ``match`` then ends at
the last page with a checkpoint, and ``new_cache`` starts the row from it (no copy:
the row moves to a fresh slot at its first step). To have checkpoints, prefill in
forwards cut at the boundaries (``aligned_take``; ``generation.prefill`` and the
serving engine do) and register after each. Checkpoint slots are cacheable slots of
the state pool's own allocator, evicted least recently used first like pages.

Sliding-window models (``windows``: the window sizes of the model's sliding layers).
Their sliding layers keep their own page tables, which let pages go as they leave the
window. Registering such a sequence also files the full pages its sliding tables still
hold, under the same nodes (keyed by window size and layer group); they become CACHED like the
others when the window lets them go. A hit must then end where every window's last
pages are cached too (those a query at the hit's end sees); the sliding tables of the
new sequence start from those pages, the earlier ones listed as dropped. Layouts need
one full-attention table (models whose layers all slide are refused), all in ``pool``.
With a disk tier, window pages spill and come back like full pages, and a hit ends where
every window finds its last pages in RAM or on disk.

Ownership: the prefix cache owns the key → page map and no references; pages are kept
alive by the tables that hold them, or by the allocator's CACHED state.

Costs: ``match`` O(pages matched), ``register`` O(pages not yet registered by the same
``PrefixKeys``), forgetting an evicted page O(1). Hand a request's ``PrefixKeys`` to
every call for it: each full page is then cut and looked up once (a list of token ids
works too; its keys are cut again on each call).
"""

from __future__ import annotations

from array import array
from itertools import islice
from typing import Sequence, Union

import attrs
import numpy as np

from allocators import InvariantViolation, PageState
from pagedkv.cache import PagedPromptCache, make_paged_cache
from pagedkv.disk_tier import DiskTier, chain_digest, root_digest, window_digest
from pagedkv.errors import (
    InvalidTypeError,
    InvalidValueError,
    NotSupportedError,
    PoolExhausted,
    ReleasedError,
    check_int,
)
from pagedkv.pool import PagePool
from pagedkv.prefix_keys import PrefixKeys
from pagedkv.row_set import RowSet
from pagedkv.state_pool import StatePool
from pagedkv.table import PageTable

TokensOrKeys = Union[Sequence[int], PrefixKeys]
WindowKey = tuple[int, int]  # a sliding table spec's (window size, group): ``TableSpec``


@attrs.frozen
class PrefixStats:
    queries: int
    query_tokens: int
    hit_tokens: int
    hit_pages: int  # RAM and disk hits
    disk_hit_pages: int  # of them, read back from the disk tier
    registered_pages: int
    cached_pages: int
    evictions: int
    checkpoints: int = 0  # recurrent-state checkpoints kept (hybrid models)
    cached_state_bytes: int = 0  # their bytes in the state pool, when no sequence holds them

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class PrefixCache:
    def __init__(self, pool: PagePool, *, extra_keys: bytes | str = b"", disk: DiskTier | None = None,
                 state_pool: StatePool | None = None, checkpoint_every: int = 1,
                 windows: Sequence[int] = ()) -> None:
        """``disk``: a ``DiskTier`` for ``pool`` that keeps evicted pages (module doc of
        :mod:`pagedkv.disk_tier`); ``new_cache`` then continues a RAM hit from it.
        ``state_pool``: a hybrid model's recurrent-state pool; a checkpoint is kept
        every ``checkpoint_every`` pages (module doc). ``windows``: the sliding-window
        sizes of the models it serves, a size once per group of layers with that window
        (``LayerLayout.windows``; module doc)."""
        if not isinstance(pool, PagePool):
            raise InvalidTypeError(f"pool must be a PagePool, got {type(pool).__name__}")
        if isinstance(windows, (str, bytes)) or not hasattr(windows, "__iter__"):
            raise InvalidTypeError(f"windows must be a sequence of ints, got {type(windows).__name__}")
        self.windows = tuple(sorted(check_int("window", w, minimum=1) for w in windows))
        # a sliding table spec's window pages are filed under its (window, group)
        self._window_keys: tuple[WindowKey, ...] = tuple(
            (w, g) for w in sorted(set(self.windows)) for g in range(self.windows.count(w)))
        if self.windows and state_pool is not None:
            raise NotSupportedError("prefix caching with sliding windows serves models without recurrent layers")
        if disk is not None and (not isinstance(disk, DiskTier) or disk.pool is not pool):
            raise InvalidValueError("disk must be a DiskTier of the same pool")
        if state_pool is not None and not isinstance(state_pool, StatePool):
            raise InvalidTypeError(f"state_pool must be a StatePool, got {type(state_pool).__name__}")
        if state_pool is not None and disk is not None:
            raise NotSupportedError("the disk tier keeps K/V pages only; it does not serve hybrid models yet")
        self.state_pool = state_pool
        self.checkpoint_every = check_int("checkpoint_every", checkpoint_every, minimum=1)
        self._checkpoint: dict[int, int] = {}  # node -> state slot after the page that made it
        self._node_of_slot: dict[int, int] = {}
        if state_pool is not None:
            state_pool.allocator.evict_listeners.append(self._forget_checkpoints)
        self.pool = pool
        self._num_pages = pool.num_pages
        self.disk = disk
        self._digests: dict[int, tuple[bytes, bytes]] = {}  # node -> (its digest, its parent's); with disk
        self.extra = _extra(extra_keys)
        self._by_key: dict[tuple[int, bytes], int] = {}
        self._key_of_page: dict[int, tuple[int, bytes]] = {}  # registered page -> its key
        # registered page -> its node (read only for registered pages); a numpy view to
        # file a run of new pages at once
        self._node_of_page = array("q", bytes(8 * pool.num_pages))
        self._node_np = np.frombuffer(self._node_of_page, dtype=np.int64)
        # registered page -> the root (``extra_keys``) it was computed under: a page filed
        # again under a newer chain keeps its root (``_check_refile``)
        self._root_of_page = array("q", bytes(8 * pool.num_pages))
        self._root_np = np.frombuffer(self._root_of_page, dtype=np.int64)
        self._roots: dict[bytes, int] = {}
        self._next_node = 1
        self._window_page: dict[tuple[WindowKey, int], int] = {}  # (window key, node) -> its page there
        self._window_key_of: dict[int, tuple[WindowKey, int]] = {}  # registered window page -> its key
        # (window key, node) -> (its page's digest, the node's digest, the page's token bytes); with disk
        self._window_digests: dict[tuple[WindowKey, int], tuple[bytes, bytes, bytes]] = {}
        pool.allocator.evict_listeners.append(self._forget)
        self._set_cacheable = pool.allocator.set_cacheable
        self._set_cacheable_page = getattr(pool.allocator, "set_cacheable_page", None) or self._one_cacheable
        self._queries = self._query_tokens = self._hit_tokens = self._hit_pages = self._evictions = 0
        self._disk_hit_pages = 0

    # ------------------------------------------------------------------ keys
    def keys(self, tokens: Sequence[int] = (), *, extra_keys: bytes | str | None = None) -> PrefixKeys:
        """A ``PrefixKeys`` for a new sequence starting with ``tokens``; ``extra_keys``
        (default: this cache's) separates sequences that must never share pages."""
        extra = self.extra if extra_keys is None else _extra(extra_keys)
        root = self._roots.get(extra)
        if root is None:
            root = self._roots[extra] = self._new_node()
            if self.disk is not None:
                self._digests[root] = (root_digest(extra), b"")
        return PrefixKeys(self, self.pool.page_size, root, tokens)

    def _new_node(self) -> int:
        node = self._next_node
        self._next_node = node + 1
        return node

    def _keys_of(self, tokens: TokensOrKeys) -> PrefixKeys:
        if isinstance(tokens, PrefixKeys):
            if tokens.owner is not self:
                raise InvalidValueError("these PrefixKeys were made by another PrefixCache")
            return tokens
        return self.keys(tokens)

    def _one_cacheable(self, page: int) -> None:
        """``set_cacheable_page`` for an allocator that has only ``set_cacheable``."""
        self._set_cacheable([page])

    def _forget(self, ids: list[int]) -> None:
        """Evict listener: drop the keys of evicted pages (after queuing them for the
        disk tier, if any). O(len(ids)), the lookups in C when every page is ours."""
        key_of, by_key, window_key_of = self._key_of_page, self._by_key, self._window_key_of
        if self.disk is not None:
            self._spill([p for p in ids if p in key_of or p in window_key_of], forget=True)
        if len(ids) > 1 and all(map(key_of.__contains__, ids)):
            for key in map(key_of.pop, ids):
                del by_key[key]
            self._evictions += len(ids)
            return
        for page in ids:
            key = key_of.pop(page, None)
            if key is not None:  # (pages another prefix cache registered have none here)
                del by_key[key]
                self._evictions += 1
            elif window_key_of:
                key = window_key_of.pop(page, None)
                if key is not None:
                    del self._window_page[key]
                    self._evictions += 1

    def _forget_checkpoints(self, slots: list[int]) -> None:
        """Evict listener of the state pool: drop the checkpoints of evicted slots."""
        for slot in slots:
            node = self._node_of_slot.pop(slot, None)
            if node is not None:
                del self._checkpoint[node]

    @property
    def checkpoint_tokens(self) -> int:
        """Tokens between two recurrent-state checkpoints."""
        return self.pool.page_size * self.checkpoint_every

    def aligned_take(self, position: int, take: int) -> int:
        """How many of the next ``take`` prompt tokens from ``position`` to run in one
        forward: on a hybrid model, no further than the next checkpoint boundary (so a
        registration after each forward leaves a checkpoint every ``checkpoint_every``
        pages: forwards of at most that many pages are the cost); otherwise ``take``."""
        position, take = check_int("position", position, minimum=0), check_int("take", take, minimum=0)
        if self.state_pool is None:
            return take
        step = self.checkpoint_tokens
        return min(take, (position // step + 1) * step - position)

    def persist(self) -> int:
        """Queue every registered page that the disk tier lacks for writing (say, before
        the process exits, so a restart hits pages that were never evicted); returns how
        many were queued. Wait with ``disk.flush()``."""
        if self.disk is None:
            raise NotSupportedError("persist needs a PrefixCache with a disk tier")
        before = self.disk.stats.spilled
        pages = [*self._key_of_page, *self._window_key_of]
        step = max(1, self.disk.max_pending_bytes // max(1, self.disk.spec.bytes_per_page) // 2)
        for i in range(0, len(pages), step):  # within the write queue's byte limit
            self._spill(pages[i : i + step], forget=False)
            self.disk.flush()
        return self.disk.stats.spilled - before

    def _spill(self, pages: list[int], forget: bool) -> None:
        """Hand ``pages`` (registered full or window pages, unchanged in the pool) to the
        disk tier; with ``forget`` (they are being evicted) their digests are dropped too.
        Pages registered without a digest (below an evicted page) are not spilled."""
        if not pages:
            return
        digests, parents, chunks, kept = [], [], [], []
        take = self._digests.pop if forget else self._digests.get
        take_window = self._window_digests.pop if forget else self._window_digests.get
        key_of, window_key_of = self._key_of_page, self._window_key_of
        for page in pages:
            if page in key_of:
                entry = take(self._node_of_page[page], None)
                if entry is not None:
                    entry = (entry[0], entry[1], key_of[page][1])
            else:
                entry = take_window(window_key_of[page], None)
            if entry is not None:
                digests.append(entry[0])
                parents.append(entry[1])
                chunks.append(entry[2])
                kept.append(page)
        self.disk.spill(digests, parents, chunks, kept)

    def _hit_with_disk(self, keys: PrefixKeys, layout) -> tuple[list[int], dict[int, list[int]] | None]:
        """The longest prefix of ``keys`` held in RAM or on the disk tier, a reference
        taken on each of its pages for the caller: (full pages, each sliding spec's
        pages or None without windows). The RAM part's pages are touched; what the RAM
        lacks (the full pages after its chain, window pages it evicted) is read back
        into new pool pages and registered. With windows, the hit ends where every
        window finds its last pages in one tier or the other.

        Best effort: a file that fails its checks is deleted by the tier and the hit is
        planned again without it; when the pool cannot take the pages read back, the
        hit is the RAM part alone. Reads all files before any pool change."""
        disk, ps = self.disk, self.pool.page_size
        pages, nodes = self._walk(keys)
        in_ram = len(pages)
        windows = _window_keys_of(layout)
        have = self._window_page
        digests = [self._digests.get(node, (None,))[0] for node in nodes]
        above = digests[-1] if nodes else self._digests.get(keys.root, (None,))[0]
        chain: list[tuple[bytes, bytes]] = []  # (digest, parent digest) of the full pages after RAM's
        if above is not None:
            for i in range(in_ram, max(0, (keys.num_tokens - 1) // ps)):
                digest = chain_digest(above, keys.pages[i])
                if not disk.has(digest):
                    break
                chain.append((digest, above))
                above = digest
        digests += [digest for digest, _ in chain]

        loaded: dict[tuple, dict] = {}  # (0: full, or a window key; page index) -> its bytes
        failed: set[tuple[WindowKey, int]] = set()

        def ram_page(window: WindowKey, i: int) -> int | None:
            return have.get((window, nodes[i])) if i < in_ram else None

        def in_tiers(window: WindowKey, i: int) -> bool:
            return ram_page(window, i) is not None or (
                digests[i] is not None and (window, i) not in failed
                and disk.has(window_digest(window, digests[i])))

        while True:
            m = self._window_end(in_ram + len(chain), windows, in_tiers)
            needed = [(w, i) for w in windows for i in range(self._first_in_window(m, w[0]), m)]
            read = [(0, i) for i in range(in_ram, m)] + [item for item in needed if ram_page(*item) is None]
            for kind, i in read:
                if (kind, i) in loaded:
                    continue
                if kind == 0:
                    data = disk.load(*chain[i - in_ram], keys.pages[i])
                else:
                    data = disk.load(window_digest(kind, digests[i]), digests[i], keys.pages[i])
                if data is None:  # (the tier deleted it) plan again without it
                    if kind == 0:
                        del chain[i - in_ram :], digests[i:]
                    failed.add((kind, i))
                    break
                loaded[(kind, i)] = data
            else:
                break
        m_ram = min(m, in_ram)
        held = pages[:m_ram] + [p for p in (ram_page(*item) for item in needed) if p is not None]
        allocator = self.pool.allocator
        if held:
            allocator.touch(held)
        new: list[int] = []
        try:
            if read:
                try:
                    new = allocator.allocate(len(read)).tolist()
                except PoolExhausted:  # the RAM part alone
                    if held:
                        allocator.decref(held)
                        held = []
                    return self._hit_in_ram(keys, layout)
                self.pool.write_pages(new, {name: np.concatenate([loaded[item][name] for item in read])
                                            for name in loaded[read[0]]})
            keys.nodes = nodes[:m_ram]
            restored = m - m_ram
            if restored:
                self._register(new[:restored], m_ram, keys)
            for w in windows:
                mine = [(i, page, (w, keys.nodes[i])) for (kind, i), page in zip(read, new) if kind == w]
                if mine:
                    self._file_window_pages(w, mine, keys)
        except BaseException:
            allocator.decref(held + new)
            raise
        self._disk_hit_pages += restored
        pages = pages[:m_ram] + new[:restored]
        return pages, self._window_pages(keys.nodes, layout) if windows else None

    def _hit_in_ram(self, keys: PrefixKeys, layout) -> tuple[list[int], dict[int, list[int]] | None]:
        """``_hit_with_disk`` without the disk tier: ``match``, a reference taken on each
        page."""
        pages = self.match(keys)
        window_pages = self._window_pages(keys.nodes, layout) if self.windows else None
        if pages:
            held = pages + [p for run in window_pages.values() for p in run] if window_pages else pages
            self.pool.allocator.touch(held)  # one reference each; revives CACHED pages
        return pages, window_pages

    # ------------------------------------------------------------------ lookups
    def match(self, tokens: TokensOrKeys) -> list[int]:
        """Pages of the longest cached prefix of ``tokens`` (no references taken).

        Only full pages count, and the last token is never covered. Given a
        ``PrefixKeys``, records the matched pages' nodes in it for ``register``.
        """
        keys = self._keys_of(tokens)
        pages, nodes = self._walk(keys)
        if self.state_pool is not None:  # a hybrid hit ends where a state was kept
            checkpoint = self._checkpoint
            while nodes and nodes[-1] not in checkpoint:
                nodes.pop()
            del pages[len(nodes) :]
        if self.windows and nodes:  # and where every window's last pages are kept
            del nodes[self._window_hit(nodes) :]
            del pages[len(nodes) :]
        keys.nodes = nodes
        return pages

    def _walk(self, keys: PrefixKeys) -> tuple[list[int], list[int]]:
        """The cached full pages of ``keys``' longest prefix in RAM, and their nodes."""
        get, node_of = self._by_key.get, self._node_of_page
        parent = keys.root
        pages: list[int] = []
        nodes: list[int] = []
        for chunk in islice(keys.pages, max(0, (keys.num_tokens - 1) // keys.page_size)):
            page = get((parent, chunk))
            if page is None:
                break
            parent = node_of[page]
            pages.append(page)
            nodes.append(parent)
        return pages, nodes

    def _first_in_window(self, num_pages: int, window: int) -> int:
        """Index of the first page a query after ``num_pages`` full pages sees."""
        ps = self.pool.page_size
        return max(0, num_pages * ps - window + 1) // ps

    def _window_hit(self, nodes: list[int]) -> int:
        """The most pages of the chain ``nodes`` after which every window finds the
        pages its next query sees in RAM."""
        have = self._window_page
        return self._window_end(len(nodes), self._window_keys, lambda window, i: (window, nodes[i]) in have)

    def _window_end(self, m: int, windows: Sequence[WindowKey], found) -> int:
        """The most pages, at most ``m``, after which every window finds the pages its
        next query sees (``found(window key, page index)``). A page missing at index i
        rules out every end after it, so the search goes on from i: O(pages checked)."""
        while m:
            for window in windows:
                missing = next((i for i in range(m - 1, self._first_in_window(m, window[0]) - 1, -1)
                                if not found(window, i)), None)
                if missing is not None:
                    m = missing
                    break
            else:
                return m
        return 0

    def _window_pages(self, nodes: list[int], layout) -> dict[int, list[int]]:
        """For each sliding spec of ``layout``, its pages at the end of ``nodes``."""
        have, m = self._window_page, len(nodes)
        return {s: [have[((spec.window, spec.group), node)] for node in nodes[self._first_in_window(m, spec.window) :]]
                for s, spec in enumerate(layout.specs) if spec.window is not None}

    def _check_layout(self, layout) -> None:
        """``NotSupportedError`` unless this cache serves ``layout``'s tables."""
        specs = layout.specs
        if sum(spec.window is None for spec in specs) != 1 or any(spec.pool is not self.pool for spec in specs):
            raise NotSupportedError("prefix caching serves models with one full-attention table in the prefix "
                                    "cache's pool (and sliding-window tables there too)")
        missing = set(_window_keys_of(layout)) - set(self._window_keys)
        if missing:
            raise NotSupportedError(f"the model has sliding windows (size, group) {sorted(missing)} that this "
                                    "prefix cache was not made for: PrefixCache(pool, windows=layout.windows)")

    def new_cache(self, model, tokens: TokensOrKeys) -> tuple[PagedPromptCache, list[int]]:
        """A one-sequence cache already holding the longest cached prefix of ``tokens``.

        Returns (cache, the tokens still to run through the model).
        """
        keys = self._keys_of(tokens)
        if keys.num_tokens == 0:
            raise InvalidValueError("a request needs at least one token")
        cache = make_paged_cache(model, self.pool, state_pool=self.state_pool)
        try:
            self._check_layout(cache.rows.layout)
        except NotSupportedError:
            cache.release()
            raise
        if (cache.rows.states is None) != (self.state_pool is None):
            cache.release()
            raise InvalidValueError("a prefix cache with a state_pool serves hybrid models, and only those")
        self._queries += 1
        self._query_tokens += keys.num_tokens
        try:
            pages, window_pages = (self._hit_in_ram if self.disk is None else self._hit_with_disk)(
                keys, cache.rows.layout)
        except BaseException:
            cache.release()
            raise
        if pages:
            slot = None
            if self.state_pool is not None:
                slot = self._checkpoint[self._node_of_page[pages[-1]]]
                self.state_pool.allocator.touch([slot])  # the row's reference; revives a CACHED slot
            cache.rows.adopt_prefix(pages, state_slot=slot, window_pages=window_pages)
            self._hit_pages += len(pages)
            self._hit_tokens += len(pages) * self.pool.page_size
        if isinstance(tokens, PrefixKeys):
            return cache, keys.token_ids(len(pages) * self.pool.page_size)
        return cache, list(tokens[len(pages) * self.pool.page_size :])

    def register(self, table: PageTable | PagedPromptCache, tokens: TokensOrKeys) -> int:
        """Make the full pages of a sequence findable; ``tokens`` are its token ids (at
        least its first ``num_tokens``) or its ``PrefixKeys``. Returns the number of
        pages newly registered. Pages whose key is already known (maybe as another page
        with the same content) are skipped.

        ``PrefixKeys`` must hold exactly the tokens the table's pages were computed from:
        after trimming the sequence (rejected draft tokens, a preemption), call
        ``keys.truncate`` before extending it again. Its known nodes are trusted, so keys
        that ran ahead of a trim would file the new pages under the old prefix. A page
        registered already is filed again only under the root (``extra_keys``) and the
        token ids it was registered with: keys of another root or other tokens are refused
        with ``InvalidValueError``, and nothing changes; so is a page filed for a sliding
        window (it holds a sliding layer's K/V)."""
        if isinstance(table, PagedPromptCache):
            return self.register_row(table.rows, 0, tokens)
        return self._register_table(table, tokens)

    def register_row(self, rows: RowSet, row: int, tokens: TokensOrKeys) -> int:
        """``register`` for row ``row`` of a row set (a ``PagedBatch``'s ``rows``, a
        prompt cache's). On a hybrid model, when the row's recurrent state stands on a
        checkpoint boundary at the end of its full pages, its state slot is kept as the
        checkpoint there (the row moves off it at its next step)."""
        if not isinstance(rows, RowSet):
            raise InvalidTypeError(f"rows must be a RowSet, got {type(rows).__name__}")
        rows.check_alive()
        row = rows.check_row(row)
        specs = rows.layout.specs
        if len(specs) != 1 or specs[0].window is not None:
            self._check_layout(rows.layout)
        full = next(s for s, spec in enumerate(specs) if spec.window is None)
        table = rows.tables(full)[row]
        keys = self._keys_of(tokens)
        added = self._register_table(table, keys)
        for s, spec in enumerate(specs):
            if spec.window is not None:
                added += self._register_window(rows.tables(s)[row], (spec.window, spec.group), keys)
        states, n = rows.states, table.num_tokens
        if (self.state_pool is not None and states is not None and states.pool is self.state_pool
                and n and n % self.checkpoint_tokens == 0 and not states.in_step
                and (states.tokens[:, row] == n).all() and len(keys.nodes) >= n // self.pool.page_size):
            node = keys.nodes[n // self.pool.page_size - 1]
            if node not in self._checkpoint:
                slot = states.checkpoint(row)
                if slot is not None:
                    self._checkpoint[node] = slot
                    self._node_of_slot[slot] = node
        return added

    def _register_window(self, table: PageTable, window: WindowKey, keys: PrefixKeys) -> int:
        """File the full pages a sliding table still holds under the nodes of the pages
        at the same indices (``keys.nodes``, from registering the full table). A page
        whose (window, node) is filed already, or that is filed under another node or as
        a full page, is skipped. The new pages are marked cacheable (which checks that
        they are held) before anything is filed. O(pages the table holds)."""
        nodes, ps = keys.nodes, self.pool.page_size
        end = min(table.num_tokens // ps, len(nodes))
        first = table.first_visible() // ps
        if first >= end:
            return 0
        have, key_of, full_key_of = self._window_page, self._window_key_of, self._key_of_page
        new = []
        for i, page in enumerate(table.page_ids(first, end).tolist(), first):
            key = (window, nodes[i])
            if key not in have and page not in key_of and page not in full_key_of:
                new.append((i, page, key))
        if new:
            self._file_window_pages(window, new, keys)
        return len(new)

    def _file_window_pages(self, window: WindowKey, new: list[tuple[int, int, tuple[WindowKey, int]]],
                           keys: PrefixKeys) -> None:
        """File window pages ``(page index, page, key)``; with a disk tier, each gets its
        digest (none below a page without one). Marks them cacheable (which checks that
        they are held) before anything is filed."""
        self._set_cacheable([page for _, page, _ in new])  # may refuse: nothing has changed yet
        have, key_of = self._window_page, self._window_key_of
        for _, page, key in new:
            have[key] = page
            key_of[page] = key
        if self.disk is not None:
            digests = self._digests
            for i, _, key in new:
                entry = digests.get(key[1])  # (the node's digest, its parent's)
                if entry is not None:
                    self._window_digests[key] = (window_digest(window, entry[0]), entry[0], keys.pages[i])

    def _register_table(self, table: PageTable, tokens: TokensOrKeys) -> int:
        if not isinstance(table, PageTable):
            raise InvalidTypeError(f"register takes a PageTable or PagedPromptCache, got {type(table).__name__}")
        if table.released:
            raise ReleasedError("cannot register a released page table")
        if table.pool is not self.pool:
            raise InvalidValueError("the table's pages are in another pool than the prefix cache's")
        if table.window is not None:
            raise NotSupportedError("prefix caching serves full-attention tables; a sliding window drops pages")
        keys = self._keys_of(tokens)  # all checked before anything is registered
        full = table.num_tokens // self.pool.page_size
        self._require_tokens(keys, full)
        start = min(len(keys.nodes), full)
        ids = table.page_ids(start, full)
        return self._register(ids.tolist(), start, keys, ids)

    def register_pages(self, pages: Sequence[int], keys: PrefixKeys, first: int = 0) -> int:
        """Register ``pages`` as pages ``first, first + 1, ...`` of the sequence ``keys``
        describes (all full and held): ``register`` without a table, for callers that keep
        their own page lists. ``first`` may not pass the pages whose nodes ``keys``
        knows (from ``match`` or earlier registrations). O(len(pages)); bad input raises
        a typed error and registers nothing."""
        if len(pages) == 1 and keys.__class__ is PrefixKeys and self.disk is None and first.__class__ is int:
            # one page that just filled (a decode step), in as few steps as it takes
            page, nodes, chunks = pages[0], keys.nodes, keys.pages
            if keys.owner is self and page.__class__ is int and 0 <= first <= len(nodes) and first < len(chunks):
                key = (nodes[first - 1] if first else keys.root, chunks[first])
                if (key not in self._by_key and page not in self._key_of_page
                        and page not in self._window_key_of):  # new content
                    self._set_cacheable_page(page)  # may refuse (a page not held): nothing has changed yet
                    node = self._next_node
                    self._next_node = node + 1
                    self._by_key[key] = page
                    self._key_of_page[page] = key
                    self._node_of_page[page] = node
                    self._root_of_page[page] = keys.root
                    del nodes[first:]
                    nodes.append(node)
                    return 1
        if keys.__class__ is not PrefixKeys or keys.owner is not self:
            keys = self._keys_of(keys)
        if first.__class__ is not int or not 0 <= first <= len(keys.nodes):
            check_int("first", first, minimum=0, maximum=len(keys.nodes))
        ids, arr = self._page_list(pages)
        if len(keys.pages) < first + len(ids):
            self._require_tokens(keys, first + len(ids))
        if len(ids) > 1 and len(set(ids)) != len(ids):
            raise InvalidValueError("a page is listed twice")
        return self._register(ids, first, keys, arr)

    def register_next(self, pages: Sequence[int], keys: Sequence[PrefixKeys]) -> int:
        """For each ``j``, register ``pages[j]`` (full and held) as the next page of the
        sequence ``keys[j]``: the page after those whose nodes it knows. This is what a
        decode step does for the rows whose last page just filled, in one call: the
        allocator marks the new pages cacheable once and the keys go in together, so a
        batch costs one call, not one per row. Each sequence at most once per call.

        A page whose content is cached already (another page with the same key) is not
        registered; its sequence continues from the cached page's node, as in
        ``register``. O(len(pages)); bad input raises a typed error and registers
        nothing. Returns the number of pages newly registered."""
        n = len(pages)
        if n != len(keys):
            raise InvalidValueError(f"{n} pages for {len(keys)} sequences")
        if pages.__class__ is list and self.disk is None and n:
            # The common case (int ids, our keys, content not cached yet), filed as it is
            # checked, in one pass over cold keys and maps. Anything else stops the pass,
            # which is undone; the general path then sorts it out. Filing as we go also
            # catches repeats: a page listed twice is in ``key_of`` the second time, the
            # same content twice is in ``by_key``, and a sequence listed twice has a node
            # made in this call (nodes are serials, so one ``>= first``).
            by_key, key_of, node_of, root_of = self._by_key, self._key_of_page, self._node_of_page, self._root_of_page
            window_key_of = self._window_key_of
            node = first = self._next_node
            num_pages = self._num_pages
            for page, k in zip(pages, keys):
                # (the range is checked here although set_cacheable checks it again below:
                # node_of is written first, and a negative id would wrap to the pool's end)
                if (page.__class__ is not int or not 0 <= page < num_pages or k.__class__ is not PrefixKeys
                        or k.owner is not self or page in key_of or page in window_key_of):
                    break
                nodes, chunks = k.nodes, k.pages
                m = len(nodes)
                if m >= len(chunks):
                    break
                parent = nodes[-1] if m else k.root
                if parent >= first:
                    break
                key = (parent, chunks[m])
                if key in by_key:
                    break
                by_key[key] = page
                key_of[page] = key
                node_of[page] = node
                root_of[page] = k.root
                nodes.append(node)
                node += 1
            else:
                try:
                    self._set_cacheable(pages)  # checks that each page is in range and held
                except BaseException:
                    self._unfile_next(pages, keys, n)
                    raise
                self._next_node = node
                return n
            self._unfile_next(pages, keys, node - first)
        elif not n:
            return 0
        return self._register_next_general(pages, keys)

    def _unfile_next(self, pages: list[int], keys: Sequence[PrefixKeys], done: int) -> None:
        """Undo the first ``done`` items of ``register_next``'s one pass."""
        by_key, key_of = self._by_key, self._key_of_page
        for page, k in islice(zip(pages, keys), done):
            del by_key[key_of.pop(page)]
            k.nodes.pop()

    def _register_next_general(self, pages: Sequence[int], keys: Sequence[PrefixKeys]) -> int:
        """``register_next`` checked item by item: numpy ids, a disk tier, content that is
        cached already or repeats in the call, and bad input (typed errors). A plan per
        item first; nothing changes until the allocator accepts the new pages."""
        ids, _ = self._page_list(pages)
        next_keys = []
        try:
            for k in keys:
                if k.__class__ is not PrefixKeys or k.owner is not self:
                    if not isinstance(k, PrefixKeys):
                        raise InvalidTypeError(f"register_next takes PrefixKeys, got {type(k).__name__}")
                    raise InvalidValueError("these PrefixKeys were made by another PrefixCache")
                nodes = k.nodes
                next_keys.append((nodes[-1] if nodes else k.root, k.pages[len(nodes)]))
        except IndexError:
            self._require_tokens(k, len(k.nodes) + 1)
        if len(set(ids)) != len(ids):
            raise InvalidValueError("a page is listed twice")
        if len(set(map(id, keys))) != len(keys):
            raise InvalidValueError("a sequence is listed twice: register its pages with register_pages")
        by_key, key_of, node_of = self._by_key, self._key_of_page, self._node_of_page
        plan = []  # per item: -1 - node to continue from, or the item that brings the content
        fresh: dict[tuple[int, bytes], int] = {}
        refile: dict[tuple[int, bytes], int] = {}  # key -> own page to file under it
        new_pages = []
        for j, (page, key) in enumerate(zip(ids, next_keys)):
            known = by_key.get(key, refile.get(key))
            if known is not None:
                plan.append(-1 - node_of[known])  # continue from the cached page
            elif key in fresh:
                plan.append(fresh[key])  # the same content as an earlier item
            elif page in key_of:
                self._check_refile(page, key, keys[j].root)
                refile[key] = page  # this page, under an older chain: filed under this one too
                plan.append(-1 - node_of[page])
            else:
                fresh[key] = j
                plan.append(j)
                new_pages.append(page)
        if new_pages:
            self._mark_new_full_pages(new_pages)  # may refuse: nothing has changed yet
        for key, page in refile.items():
            self._refile(page, key)
        node = self._next_node
        made = [0] * len(plan)
        for j, (k, key, source) in enumerate(zip(keys, next_keys, plan)):
            if source < 0:
                k.nodes.append(-1 - source)
            elif source == j:
                page = ids[j]
                if self.disk is not None:
                    self._file_digests(key[0], [key[1]], node)
                by_key[key] = page
                key_of[page] = key
                node_of[page] = made[j] = node
                self._root_of_page[page] = k.root
                k.nodes.append(node)
                node += 1
            else:
                k.nodes.append(made[source])
        self._next_node = node
        return len(new_pages)

    def _page_list(self, pages: Sequence[int]) -> tuple[list[int], np.ndarray | None]:
        """Page ids checked (ints in the pool's range) as a list, and as an int64 array
        when they came as one (else None). Raises ``InvalidTypeError``/``InvalidPage``."""
        if pages.__class__ is list:
            n = self.pool.num_pages
            for p in pages:
                if p.__class__ is not int or not 0 <= p < n:
                    break
            else:
                return pages, None
        arr = self.pool.allocator.checked_ids(pages)
        return arr.tolist(), arr

    def _require_tokens(self, keys: PrefixKeys, full: int) -> None:
        if keys.num_full_pages < full:
            ps = self.pool.page_size
            raise InvalidValueError(f"need the ids of the {full * ps} tokens in full pages, got {keys.num_tokens}")

    def _register(self, pages: list[int], start: int, keys: PrefixKeys, as_array: np.ndarray | None = None) -> int:
        """Register ``pages`` (page indices ``start`` on of ``keys``' sequence; ``as_array``:
        the same ids as an int64 array, when the caller has one).

        Walks the keys while they are known (another page with the same content is
        reused as the parent); from the first unknown key on, every key hangs below a
        node made in this call, so the rest are new: they get consecutive nodes and go
        into the maps in one bulk update each. A page of the sequence that is
        registered already under an older chain (its content was filed below a page
        with the same content that has since been evicted) sends the call to
        ``_register_general``. The new pages are marked cacheable (which checks that
        they are held) before anything is inserted, so a refusal changes nothing."""
        if not pages:
            return 0
        by_key, key_of, node_of = self._by_key, self._key_of_page, self._node_of_page
        nodes, chunks = keys.nodes, keys.pages
        parent = nodes[start - 1] if start else keys.root
        end = start + len(pages)
        i = start
        walked = []
        while i < end:  # the known part: pages whose content is cached already
            known = by_key.get((parent, chunks[i]))
            if known is None:
                if pages[i - start] in key_of:
                    return self._register_general(pages, start, keys)
                break
            parent = node_of[known]
            walked.append(parent)
            i += 1
        new = pages[i - start :] if i > start else pages
        m = len(new)
        if m:
            if m > 1 and not key_of.keys().isdisjoint(new):  # (the walk checked new[0])
                return self._register_general(pages, start, keys)
            if as_array is not None:
                as_array = as_array[i - start :]
            self._mark_new_full_pages(new, as_array)  # may refuse: nothing has changed yet
            node = self._next_node
            self._next_node = node + m
            if self.disk is not None:
                self._file_digests(parent, chunks[i:end], node)
            if m == 1:
                page, key = new[0], (parent, chunks[i])
                by_key[key] = page
                key_of[page] = key
                node_of[page] = node
                self._root_of_page[page] = keys.root
                walked.append(node)
            else:
                made = range(node, node + m)
                parents = [parent]
                parents += made[:-1]
                new_keys = list(zip(parents, chunks[i:end]))
                by_key.update(zip(new_keys, new))
                key_of.update(zip(new, new_keys))
                if as_array is None:
                    root_of, root = self._root_of_page, keys.root
                    for page, made_node in zip(new, made):
                        node_of[page] = made_node
                        root_of[page] = root
                else:
                    self._node_np[as_array] = np.arange(node, node + m)
                    self._root_np[as_array] = keys.root
                walked += made
        del nodes[start:]
        nodes.extend(walked)
        return m

    def _register_general(self, pages: list[int], start: int, keys: PrefixKeys) -> int:
        """``_register`` page by page, for sequences some of whose pages are registered
        already under an older chain. That happens when a sequence computed a page
        whose content was cached (so its own copy was not registered), filed its next
        pages below the cached one, and the cached one was then evicted: those next
        pages hang below a node no lookup from the root reaches. Here such a page is
        filed again below this sequence's chain (same content, same node, so its
        children and checkpoints stay valid), which makes it reachable once more.

        A plan first (per page: cached content to continue from, an own page to
        re-file, or a new page); nothing changes until the allocator accepts the new
        pages. O(len(pages))."""
        by_key, key_of, node_of = self._by_key, self._key_of_page, self._node_of_page
        nodes, chunks = keys.nodes, keys.pages
        parent = nodes[start - 1] if start else keys.root
        node = self._next_node
        walked, refile, new = [], [], []  # refile: (page, key); new: (page, key, node)
        for i, page in enumerate(pages, start):
            key = (parent, chunks[i])
            known = by_key.get(key)
            if known is not None:
                parent = node_of[known]
            elif page in key_of:
                self._check_refile(page, key, keys.root)
                refile.append((page, key))
                parent = node_of[page]
            else:
                new.append((page, key, node))
                parent = node
                node += 1
            walked.append(parent)
        if new:
            self._mark_new_full_pages([page for page, _, _ in new])  # may refuse: nothing has changed yet
        for page, key in refile:
            self._refile(page, key)
        for page, key, made in new:
            if self.disk is not None:
                self._file_digests(key[0], [key[1]], made)
            by_key[key] = page
            key_of[page] = key
            node_of[page] = made
            self._root_of_page[page] = keys.root
        self._next_node = node
        del nodes[start:]
        nodes.extend(walked)
        return len(new)

    def _mark_new_full_pages(self, pages: list[int], as_array: np.ndarray | None = None) -> None:
        """Before new full pages are filed: refuse pages filed for a sliding window (they
        hold a sliding layer's K/V, which a full-attention hit must never get, and a page
        filed twice would leave one key behind once evicted), then mark them cacheable,
        which refuses pages not held. ``as_array``: the same ids as an array, if the
        caller has one. Raises before anything changes. O(len(pages))."""
        window_key_of = self._window_key_of
        if window_key_of and not window_key_of.keys().isdisjoint(pages):
            page = next(p for p in pages if p in window_key_of)
            raise InvalidValueError(f"page {page} is registered as a sliding window's page; it cannot be a full page")
        self._set_cacheable(pages if as_array is None else as_array)

    def _check_refile(self, page: int, key: tuple[int, bytes], root: int) -> None:
        """Refuse to file ``page`` again under ``key`` (of a chain from ``root``) unless
        it holds that content: its K/V were computed under the same root (the same
        ``extra_keys``: another adapter's or tenant's pages must never serve this one)
        from the same token ids. Called while planning, before anything changes."""
        if self._root_of_page[page] != root:
            raise InvalidValueError(
                f"page {page} is registered under another extra_keys root; its K/V cannot be filed under this one")
        if self._key_of_page[page][1] != key[1]:
            raise InvalidValueError(f"page {page} is registered for other token ids than these at its position")

    def _refile(self, page: int, key: tuple[int, bytes]) -> None:
        """File ``page``, registered under an older chain, under ``key`` of this one
        instead (``_register_general`` says when); its node stays."""
        del self._by_key[self._key_of_page[page]]
        self._by_key[key] = page
        self._key_of_page[page] = key

    def _file_digests(self, parent: int, chunks: list[bytes], node: int) -> None:
        """The disk tier's chain digests of new nodes ``node, node + 1, ...`` whose pages
        hold ``chunks``, below ``parent``. None when ``parent``'s page was evicted (its
        digest went with it): pages below it can no longer be reached, in RAM or on disk,
        so they are registered without one and never spilled."""
        digests = self._digests
        entry = digests.get(parent)
        if entry is None:
            return
        above = entry[0]
        for chunk in chunks:
            digest = chain_digest(above, chunk)
            digests[node] = (digest, above)
            above = digest
            node += 1

    def check(self) -> None:
        """Verify that the maps agree: each key names one page and each page one key, no
        page is filed both as a full page and as a window page, every filed page is held
        or CACHED and marked cacheable (so its eviction reaches ``_forget``), no two
        filed pages share a node, and checkpoints map both ways. O(pages filed); raises
        ``InvariantViolation`` describing the first problem found. For tests and soaks
        (as ``allocator.check``), not for a serving loop."""
        by_key, key_of = self._by_key, self._key_of_page
        window_page, window_key_of = self._window_page, self._window_key_of
        if len(by_key) != len(key_of) or any(by_key.get(key) != page for page, key in key_of.items()):
            raise InvariantViolation("the key -> page and page -> key maps of full pages disagree")
        if len(window_page) != len(window_key_of) or any(
                window_page.get(key) != page for page, key in window_key_of.items()):
            raise InvariantViolation("the key -> page and page -> key maps of window pages disagree")
        both = key_of.keys() & window_key_of.keys()
        if both:
            raise InvariantViolation(f"page {min(both)} is filed as a full page and as a window page")
        allocator = self.pool.allocator
        for page in [*key_of, *window_key_of]:
            if allocator.page_state(page) not in (PageState.IN_USE, PageState.CACHED):
                raise InvariantViolation(f"filed page {page} is {allocator.page_state(page).name}")
            if not allocator.is_cacheable(page):
                raise InvariantViolation(f"filed page {page} is not marked cacheable")
        nodes = [self._node_of_page[page] for page in key_of]
        if len(set(nodes)) != len(nodes):
            raise InvariantViolation("two filed pages share a node")
        if len(self._checkpoint) != len(self._node_of_slot) or any(
                self._node_of_slot.get(slot) != node for node, slot in self._checkpoint.items()):
            raise InvariantViolation("the node -> checkpoint and checkpoint -> node maps disagree")

    def stats(self) -> PrefixStats:
        return PrefixStats(
            queries=self._queries, query_tokens=self._query_tokens, hit_tokens=self._hit_tokens,
            hit_pages=self._hit_pages, disk_hit_pages=self._disk_hit_pages,
            registered_pages=len(self._by_key) + len(self._window_page),
            cached_pages=self.pool.allocator.num_cached(), evictions=self._evictions,
            checkpoints=len(self._checkpoint),
            cached_state_bytes=0 if self.state_pool is None
            else self.state_pool.allocator.num_cached() * self.state_pool.bytes_per_slot,
        )


def prefix_cache_serves(layout, hybrid: bool) -> bool:
    """Whether a ``PrefixCache`` serves a model of ``layout`` (``hybrid``: it has
    recurrent layers): not one whose attention layers all slide, nor a hybrid with
    sliding layers."""
    if not layout.has_windows:
        return True
    return not hybrid and any(spec.window is None for spec in layout.specs)


def _window_keys_of(layout) -> list[WindowKey]:
    """The (window, group) of each sliding table spec of ``layout``, ascending."""
    return sorted((spec.window, spec.group) for spec in layout.specs if spec.window is not None)


def _extra(extra_keys: bytes | str) -> bytes:
    if isinstance(extra_keys, str):
        return extra_keys.encode()
    if isinstance(extra_keys, (bytes, bytearray)):
        return bytes(extra_keys)
    raise InvalidTypeError(f"extra_keys must be bytes or str, got {type(extra_keys).__name__}")
