"""``CompiledDecode``: a ``PagedBatch``'s decode step under ``mx.compile``, its step
state kept on the device.

An eager step builds the model's graph in Python every token: at B=32 on an H200 that
host work took longer than the GPU's (bench/RESULTS.md, issue 15). Compiling the step
replays a traced graph instead, but pagedkv's caches make their index arrays from numpy
inside the model call, and a trace would freeze those as constants. So the step is cut
in two::

    host (Python, every step)              compiled (traced once per shape)
    -------------------------              ---------------------------------------
    RowSet.reserve_step(1, supply): the    positions = previous + 1 (and the step
      step's pages (a row that crosses       returns them for the next step)
      into a new page takes its            per table kind: the write page of each row
      lookahead page), undo records          = table[row, position // page_size]
    the device state still holds?          model(tokens) with one _StepLayer per layer:
      (same rows, positions one on, no       RoPE at `positions`, pool.scatter of the
      page listed but lookahead ones)        step's K/V at (page rows, position %
      yes: nothing to copy                   page_size), attention through the decode
      no:  top the lookahead up, copy        kernel (GPU) or the pages gathered by the
           positions and padded tables       table (CPU), keys [0, position]
                                           pool arrays: the compiled state, written
                                             back into the pool's own lists

Every copy from the host to the device costs tens of microseconds inside a step on the
H200, so the step state stays on the device from one step to the next: the positions
advance inside the trace, and each table kind's page table ([B, width], padded with the
null page to a multiple of ``bucket`` pages) is copied only when its pages changed in a
way the device copy does not already hold. For that, each row holds one **lookahead
page** ahead of need, already in the device table one column after its listed pages::

    device table, row b:  [ p0 | p1 | ... | p_last | lookahead | null ... null ]
                                              ^ position // page_size, until the row
                                                crosses into the lookahead column

The step that crosses takes that very page (``BatchAppend``'s supply), so the device
table stays right; a row crosses again ``page_size`` steps later, and only then, when
its lookahead is spent, is a table copied (with a fresh lookahead page for every row
that lacks one). A batch decodes about ``page_size`` steps per copy instead of one.

Lookahead pages belong to this object (one allocator reference each) until a step takes
one into a row's table. It takes them only while at least as many pages stay available in
the pool (when that leaves too few for every row, the rows that cross soonest get them,
so a nearly full pool still copies its tables only every few steps, not at every row's
crossing), and gives them all back at the first step after the batch's rows change
(``extend``, ``filter``...), when a step would otherwise run out of pages (retried
without them), when a step finds the batch released, and on ``release_lookahead()``
(call it when the batch goes idle) or when the last reference to this object goes
(it is in no reference cycle, so that is at once). While held
they count as in use in the pool's stats (``lookahead_pages`` says how many); taking one
may evict a cached page ``page_size`` steps before the row would have. ``lookahead=False``
holds none: then a table is copied in every step where a row grows a page.

Everything that varies per step is an input, so the trace is reused until the batch
size, the token dtype or a table's bucketed width changes (``traces`` counts them;
``uploads`` counts the steps that copied their state to the device). The traces depend
on the layout (pools, table kinds, layers), not on the rows, so ``rebind`` hands the
object another batch of the same layout with its traces kept (``generate`` takes one
as ``compiled``, so one sequence after another is traced once).
The pools' arrays are the compiled function's state (``PagePool.compile_state``): MLX
feeds them in and puts the written arrays back, donated, so writes stay in place.

Contract: ``step(tokens)`` is ``model(tokens, cache=batch.caches)`` for one token per
row, with the same bookkeeping (the rows, their pages and positions end up exactly
where the eager step leaves them; the batch can continue either way) and the same
logits up to float rounding. Bad tokens raise a typed error and change nothing; a step
that cannot get its pages raises ``PoolExhausted`` with every row as it was.
Hybrid models (recurrent layers beside attention: qwen3_next, nemotron_h, lfm2...) are
served too: the state pool's arrays are compiled state as the page pools' are, each
recurrent layer reads its rows' state slots and writes the new state, every component,
into the slots ``RowSet.reserve_step`` reserved for the step (a row on a shared slot, a
fork's or a prefix checkpoint's, moves to a fresh one, as in an eager step). The two
int32 [B] slot arrays are copied to the device only when they change.
KV-sharing models (gemma3n) are served: a sharer layer is handed its donor's cache
slot, so its attention reads the pages the donor's write in the same trace filled.

Sliding-window layers (gemma3's local layers) have a table kind of their own, whose
tables replace the pages that left the window by the null page. Their device tables
keep listing such a page until the next copy: it sits in a column before the window's
first key (``position + 1 - window``, computed in the trace): the kernel starts its
reads at that key and the gathered read (CPU) masks the columns before it. So a drop
alone does not copy the table.

Ownership: the batch keeps its rows; this object holds the model, the batch, the traces,
the device step state and the lookahead pages. Costs per step on the host: the
reservation (O(B)), an O(B) check that the device state holds; when it does not, O(B)
index building plus O(width) per row whose pages changed, per table kind, and one
copy of the positions and of each table. No graph building after the first trace.
"""

from __future__ import annotations

import weakref

import mlx.core as mx
import numpy as np

from pagedkv.attention import attend_parts
from pagedkv.attention_routing import route_attention
from pagedkv.batch import PagedBatch
from pagedkv.cache import PagedPromptCache, layer_faces
from pagedkv.errors import (
    InvalidTypeError,
    InvalidValueError,
    KvShapeError,
    PoolExhausted,
    ReleasedError,
    check_int,
)
from pagedkv.kernels import paged_decode
from pagedkv.padded_page_table import PaddedPageTable
from pagedkv.table import PageTable
from pagedkv.visibility import page_span


class _StepLayer:
    """One layer's cache inside the traced step: reads the step's inputs from
    ``CompiledDecode._inputs``; mlx-lm's attention is routed to ``attend``."""

    reads_pages = True
    takes_sinks = True

    def __init__(self, owner: CompiledDecode, layer: int) -> None:
        self._owner = weakref.ref(owner)  # (a strong one would make a cycle: see CompiledDecode)
        spec, self.pool_layer = owner.batch.rows.layout.layers[layer]
        self.spec = spec
        self.pool = owner.batch.rows.layout.specs[spec].pool

    @property
    def owner(self) -> CompiledDecode:
        return self._owner()

    @property
    def rows(self):
        return self.owner.batch.rows

    @property
    def offset(self) -> mx.array:
        return self.owner._inputs[0]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        """Bool [B, 1, 1, keys] over what ``update_and_fetch`` returns: each row's keys
        [first, length), ``window_size`` narrowing the first. Only attention that is
        not routed to ``attend`` uses it (``attend`` applies the rows' ranges itself),
        so for any other layer the trace drops it."""
        _, _, table, lengths, first = self.owner._inputs[1][self.spec]
        if window_size is not None:
            first = mx.maximum(first, lengths - window_size)
        col = mx.arange(table.shape[1] * self.pool.page_size, dtype=mx.int32)[None]
        return ((col >= first[:, None]) & (col < lengths[:, None]))[:, None, None, :]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Write the step's K/V into the pages; return every key the table lists, as
        mlx-lm's model inputs [B, kv_heads, keys, D] (``make_mask`` says which a row
        sees). Attention routed to ``attend`` never reads them, so the trace drops the
        gather; attention that is not routed (a model's own attention code that does not
        call mlx-lm's ``scaled_dot_product_attention``) reads them, as it reads an eager
        step's."""
        owner = self.owner
        rows, slots, table = owner._inputs[1][self.spec][:3]
        pool = self.pool
        pool.scatter(self.pool_layer, rows, slots, keys, values)
        b, width = table.shape
        parts = pool.gather(self.pool_layer, pool.gather_index(table), 0, width * pool.page_size, rows=b, track=False)
        owner._inputs[2][self] = parts
        return pool.kind.model_inputs(*parts)

    def _written(self) -> tuple:
        """The K and V components this layer's ``update_and_fetch`` gathered in this trace."""
        parts = self.owner._inputs[2].get(self)
        if parts is None:
            raise KvShapeError("a layer's K/V were read before its write of this step")
        return parts

    def keys_and_values(self):
        """A KV-sharing layer's read of its donor (gemma3n): what the donor's
        ``update_and_fetch`` returned in this trace (the sharer's attention, routed to
        this layer's ``attend``, reads the pages the donor wrote instead)."""
        return self.pool.kind.model_inputs(*self._written())

    def attend(self, queries: mx.array, scale: float, mask, sinks: mx.array | None = None) -> mx.array:
        """The step's attention over the pages the table lists, each row's keys [start,
        length): the decode kernel on a GPU (attention sinks included), else the pages
        ``update_and_fetch`` gathered, under ``make_mask``."""
        _, _, table, lengths, starts = self.owner._inputs[1][self.spec]
        pool = self.pool
        if pool.kind.decode_kernel and paged_decode.fits(queries, pool.num_kv_heads, pool.dtype):
            return paged_decode.paged_decode(queries, *pool.layer_arrays(self.pool_layer), table, lengths, starts,
                                             scale, rows_per_head=pool.rows_per_head, page_size=pool.page_size,
                                             sinks=sinks, after=pool.write_order(self.pool_layer))
        return attend_parts(queries, *self._written(), scale, self.make_mask(1), pool.kind, sinks)


class _StepState:
    """One recurrent layer's cache inside the traced step (mlx-lm's ``ArraysCache``
    protocol, as ``PagedStateCache``): a component reads the rows' slots of the state
    pool (``CompiledDecode._inputs[3]``: the slots they read, the slots they write);
    what the model assigns waits here until ``write_back`` writes every component of
    the layer into the write slots, after the model's forward in the same trace. A
    component the model did not assign is written as it was read (a row that moved to a
    fresh slot takes its state along)."""

    lengths = None  # no padded rows
    left_padding = None

    def __init__(self, owner: CompiledDecode, layer: int) -> None:
        self._owner = weakref.ref(owner)
        self.layer = layer
        self.pool = owner.batch.rows.layout.state_pool
        self._new: list = []

    @property
    def rows(self):
        return self._owner().batch.rows

    def __getitem__(self, component: int) -> mx.array:
        if self._new and self._new[component] is not None:
            return self._new[component]
        return self.pool.read(self.layer, component, self._owner()._inputs[3][0], track=False)

    def __setitem__(self, component: int, value: mx.array) -> None:
        self.pool.check_state(self.layer, component, value, self._owner()._inputs[0].shape[0])
        if not self._new:
            self._new = [None] * len(self.pool.shapes[self.layer])
        self._new[component] = value

    def advance(self, n: int) -> None:
        """(The host advanced every recurrent layer when it reserved the step.)"""

    def make_mask(self, N: int) -> None:
        return None

    def write_back(self) -> None:
        _, write = self._owner()._inputs[3]
        values = [self[c] for c in range(len(self.pool.shapes[self.layer]))]
        self.pool.step_write(self.layer, values, write)


def _give_back(allocators: list, supply: list[np.ndarray]) -> None:
    """Free the lookahead pages in ``supply`` (per table kind, -1: none), last first."""
    for alloc, ids in zip(allocators, supply):
        held = ids[ids >= 0]
        if held.size:
            alloc.decref(held[::-1].copy())
        ids[:] = -1


class CompiledDecode:
    def __init__(self, model, batch: PagedBatch | PagedPromptCache, bucket: int = 64,
                 lookahead: bool = True) -> None:
        """Decode steps of ``batch`` (built by ``PagedBatch.for_model(model, ...)``, or
        one sequence's ``make_paged_cache(model, ...)``: a batch of one row) under
        ``mx.compile``; page tables are padded to a multiple of ``bucket`` pages;
        ``lookahead``: hold a page ahead of need per row (see the module doc)."""
        if not isinstance(batch, (PagedBatch, PagedPromptCache)):
            raise InvalidTypeError(f"batch must be a PagedBatch or a PagedPromptCache, got {type(batch).__name__}")
        if not isinstance(lookahead, bool):
            raise InvalidTypeError(f"lookahead must be a bool, got {type(lookahead).__name__}")
        self.bucket = check_int("bucket", bucket, minimum=1)
        layout = batch.rows.layout
        route_attention(model)
        self.model, self.batch, self.lookahead = model, batch, lookahead
        self._states = [_StepState(self, r) for r in range(len(layout.state_slots))]
        self._caches = layer_faces(batch.rows, lambda rows, i: _StepLayer(self, i), lambda rows, r: self._states[r])
        pools = list({id(spec.pool): spec.pool for spec in layout.specs}.values())
        if layout.state_pool is not None:
            pools.append(layout.state_pool)
        self._pools = pools
        self._state = [pool.compile_state() for pool in pools]
        specs = layout.specs
        # per spec: each row's lookahead page (-1: none), this object's references. The
        # list is the finaliser's too, so entries are replaced in place, never the list.
        self._supply = [np.full(0, -1, dtype=np.int64) for _ in specs]
        self._allocators = [spec.pool.allocator for spec in specs]  # (per spec, as the supply)
        self._finalizer = weakref.finalize(self, _give_back, self._allocators, self._supply)
        self._inputs: tuple = ()  # (the step's inputs, while a trace runs: _step)
        self._forget_rows()
        self.busy = False  # a generate loop decodes through this object (it refuses a second one)
        self.traces = 0
        self.uploads = 0  # steps that copied their state to the device (the first, and after changes)
        # The traced function and the layers reach this object through a weak reference:
        # no reference cycle, so dropping the last reference to it gives its lookahead
        # pages back at once (not at the next garbage collection) and frees its traces.
        this = weakref.ref(self)
        self._compiled = mx.compile(lambda *args: this()._step(*args), inputs=self._state, outputs=self._state)

    @property
    def lookahead_pages(self) -> int:
        """Lookahead pages held now (in use in the pool's stats, in no row's table)."""
        return sum(int((ids >= 0).sum()) for ids in self._supply)

    def release_lookahead(self) -> int:
        """Give every lookahead page back to its pool; returns how many. The next step
        copies its state to the device again (and takes new ones)."""
        n = self.lookahead_pages
        _give_back(self._allocators, self._supply)
        self._device = None
        return n

    def rebind(self, batch: PagedBatch | PagedPromptCache) -> None:
        """Decode ``batch`` from now on, keeping the traces: another batch, or another
        one-sequence cache (a new request), of the same layout (``LayerLayout``: the same
        pools, table kinds and layers, as ``PagedBatch.for_model`` or ``make_paged_cache``
        gives for this model and these pools). The lookahead pages go back and the next
        step copies its state to the device; a trace is made again only for a new batch
        size or table width bucket. ``InvalidTypeError``/``InvalidValueError`` for
        another kind of object or layout, or while a ``generate`` loop decodes through
        this object (``busy``), with nothing changed. O(tables)."""
        if not isinstance(batch, (PagedBatch, PagedPromptCache)):
            raise InvalidTypeError(f"batch must be a PagedBatch or a PagedPromptCache, got {type(batch).__name__}")
        if self.busy:
            raise InvalidValueError("this CompiledDecode is decoding in another generate loop; finish or close "
                                    "that one first")
        if batch.rows.layout != self.batch.rows.layout:
            raise InvalidValueError("this CompiledDecode was made for a batch of another layout (other pools, "
                                    "table kinds or layers); make a CompiledDecode for this one")
        self.release_lookahead()
        self.batch = batch
        self._forget_rows()

    def _forget_rows(self) -> None:
        """Drop what this object keeps of the batch's rows: the device step state, the
        kept padded tables, the state slots (after ``__init__`` and ``rebind``)."""
        specs = self.batch.rows.layout.specs
        # a hybrid's state slots on the device, as (read, write) on the host and on the
        # device, kept while the rows' slots stay (they change when a row moves)
        self._slots: tuple = (None, None, ())
        # per spec: the padded page table of the last copy, kept so the next copy
        # rebuilds only the rows whose pages changed
        self._padded = [PaddedPageTable(spec.pool.null_page) for spec in specs]
        # the device step state of the last step: (positions, starts, tables), the rows'
        # positions it stands for, and per spec the tables and their versions it holds
        self._device: tuple | None = None
        self._expect = np.zeros(0, dtype=np.int64)
        self._seen: list[list[PageTable]] = [[] for _ in specs]
        self._versions: list[list[int]] = [[] for _ in specs]
        self._drops: list = [None for _ in specs]  # per windowed spec: each table's first_visible()

    def _step(self, tokens: mx.array, positions: mx.array, starts: mx.array, *arrays: mx.array):
        """``arrays``: each table kind's device table, then (hybrids) the state slots
        the rows read and write."""
        self.traces += 1  # Python runs here only while tracing
        specs = self.batch.rows.layout.specs
        tables, state_slots = arrays[: len(specs)], arrays[len(specs) :]
        positions = positions + 1  # (the state of the previous step, advanced by this one)
        lengths = positions + 1
        per_spec = []
        for spec, table in zip(specs, tables):
            pool = spec.pool
            page = mx.take_along_axis(table, (positions // pool.page_size)[:, None], axis=1)  # [B, 1]
            rows = pool.device_rows(page)  # [B, kv_heads, 1]: the shape of the step's keys
            slots = (positions % pool.page_size)[:, None, None]
            # a sliding window's first key (columns before it may list pages it dropped)
            first = starts if spec.window is None else mx.maximum(lengths - spec.window, 0)
            per_spec.append((rows, slots, table, lengths, first))
        # (the third: each layer's gathered K/V parts of this trace)
        self._inputs = (positions, per_spec, {}, state_slots)
        try:
            logits = self.model(tokens, cache=self._caches)
            for state in self._states:
                state.write_back()
            return logits, positions
        finally:
            self._inputs = ()
            for state in self._states:
                state._new = []

    def __call__(self, tokens: mx.array) -> mx.array:
        """One decode step: ``tokens`` int [B] or [B, 1]; returns the model's logits
        [B, 1, vocab] (see the module doc). The ids are not checked against the
        vocabulary: they stay on the device (the last step's samples, not yet read), and
        MLX's embedding lookup does not check them either (an id past the table read
        outside it: a crash, seen with mlx-lm's own caches too). Ids from a user go
        through ``generate`` or the ``Engine``, which check them."""
        rows = self.batch.rows
        try:
            rows.check_alive()
        except ReleasedError:
            self.release_lookahead()  # the rows are gone: so is the need for their pages
            raise
        if not isinstance(tokens, mx.array):
            raise InvalidTypeError(f"tokens must be an mx.array, got {type(tokens).__name__}")
        if not mx.issubdtype(tokens.dtype, mx.integer):
            raise InvalidTypeError(f"tokens must be integers, got {tokens.dtype}")
        if tokens.ndim == 1:
            tokens = tokens[:, None]
        if tokens.ndim != 2 or tokens.shape != (rows.num_rows, 1) or rows.num_rows == 0:
            raise KvShapeError(f"a decode step takes one token per row: [{rows.num_rows}, 1], "
                               f"got {tuple(tokens.shape)}")
        for pool in self._pools:
            pool.settle_reads()
        specs = range(len(rows.layout.specs))
        same_rows = all(rows.tables(s) == self._seen[s] for s in specs)
        supply = self._supply if same_rows else None  # (other rows: given back once the step stands)
        try:
            start = rows.reserve_step(1, supply=supply)
        except PoolExhausted:
            if not self.lookahead_pages:
                raise
            self.release_lookahead()  # never short of pages for holding some ahead
            supply = None
            start = rows.reserve_step(1)
        # the pool's lists as they are: a trace that fails leaves placeholders in them
        arrays = [(arrs, list(arrs)) for state in self._state for part in state for arrs in part]
        taken = [self._taken(rows, s, start) if supply is not None else [] for s in specs]
        # the tables' versions after the reservation (closing the step leaves them), and
        # per windowed spec how many leading pages each table has dropped
        versions = [[t.version for t in rows.tables(s)] for s in specs]
        drops = [[t.first_visible() for t in rows.tables(s)] if rows.layout.specs[s].window is not None else None
                 for s in specs]
        fresh: list = []  # lookahead pages this call took: given back if it fails
        try:
            device = self._device if same_rows and self._holds(start, versions, drops, taken) else None
            if device is None:
                kept = self._supply if supply is not None else [np.full(rows.num_rows, -1, np.int64) for _ in specs]
                next_supply = [ids.copy() for ids in kept]
                for s, ids in zip(specs, next_supply):
                    ids[taken[s]] = -1
                    if self.lookahead:
                        fresh.append(self._top_up(s, ids, start))
                device = self._upload(rows, start, next_supply)
            else:
                next_supply = None
            logits, positions = self._compiled(tokens, device[0], device[1], *device[2], *self._state_slots(rows))
        except BaseException:
            for arrs, kept_arrays in arrays:
                arrs[:] = kept_arrays
            for s, ids in reversed(list(enumerate(fresh))):
                if ids.size:
                    self._allocators[s].decref(ids[::-1].copy())
            rows.finish_reserved(ok=False)
            raise
        rows.finish_reserved(ok=True)
        if supply is None:  # the rows changed: the old rows' lookahead goes back
            _give_back(self._allocators, self._supply)
        for s in specs:
            if next_supply is not None:
                self._supply[s] = next_supply[s]
            else:
                self._supply[s][taken[s]] = -1
            self._seen[s] = list(rows.tables(s))
        self._versions, self._drops = versions, drops
        self._device = (positions, device[1], device[2])
        self._expect = start + 1
        return logits

    def _state_slots(self, rows) -> tuple:
        """A hybrid's (read, write) state slots of the reserved step on the device, int32
        [B] each: copied when they differ from the last step's (a row moved to a fresh
        slot, or the rows changed), else the device copies kept. () without recurrent
        layers."""
        states = rows.states
        if states is None:
            return ()
        read, write, device = self._slots
        if read is None or not (np.array_equal(read, states.slots) and np.array_equal(write, states.targets)):
            read, write = states.slots.copy(), states.targets.copy()
            device = (mx.array(read.astype(np.int32)), mx.array(write.astype(np.int32)))
            self._slots = (read, write, device)
        return device

    def _taken(self, rows, spec: int, start: np.ndarray) -> list[int]:
        """The rows whose reserved step took their lookahead page of ``spec``: those
        that crossed into a new page, whose table now lists the supplied page there."""
        supply, ps = self._supply[spec], rows.layout.specs[spec].pool.page_size
        tables = rows.tables(spec)
        return [i for i in (start % ps == 0).nonzero()[0].tolist()
                if supply[i] >= 0 and tables[i].num_listed > start[i] // ps
                and tables[i].page_at(int(start[i]) // ps) == supply[i]]

    def _holds(self, start: np.ndarray, versions: list[list[int]], drops: list, taken: list[list[int]]) -> bool:
        """Whether the device state of the last step is this step's, advanced by one:
        the rows one position on, and their pages (``versions``, per spec) changed only
        by taken lookahead pages (which the device tables list already) and by pages a
        sliding window dropped (``drops``: the device tables still list them, in columns
        before the window's first key, which no read reaches; each drop is one version)."""
        if self._device is None or not np.array_equal(start, self._expect):
            return False
        for s, (now, was) in enumerate(zip(versions, self._versions)):
            if now != was:
                bumps = [0] * len(now)
                for i in taken[s]:
                    bumps[i] = 1
                if drops[s] is not None:
                    bumps = [n + (a != b) for n, a, b in zip(bumps, drops[s], self._drops[s])]
                if any(a != b + n for a, b, n in zip(now, was, bumps)):
                    return False
        return True

    def _top_up(self, spec: int, ids: np.ndarray, start: np.ndarray) -> np.ndarray:
        """Give rows of ``spec`` without a lookahead page one, in place: every such row
        when the pool keeps at least as many pages available as this takes, else as many
        as keep that true, to the rows that cross into a new page soonest (a row at
        ``start`` next crosses at the first multiple of the page size after it).
        Returns the pages taken, O(B log B)."""
        lacking = (ids < 0).nonzero()[0]
        alloc = self._allocators[spec]
        take = min(lacking.size, alloc.num_available() // 2)
        if take == 0:
            return np.empty(0, dtype=np.int64)
        if take < lacking.size:
            ps = self.batch.rows.layout.specs[spec].pool.page_size
            # steps after the next one until the row writes a page's first slot
            wait = (-(start[lacking] + 1)) % ps
            lacking = np.sort(lacking[np.argsort(wait, kind="stable")[:take]])
        new = np.asarray(alloc.allocate(take), dtype=np.int64)
        ids[lacking] = new
        return new

    def _upload(self, rows, start: np.ndarray, supply: list[np.ndarray]) -> tuple:
        """The step state on the device, as the previous step would have left it:
        positions ``start - 1``, kernel starts (0: every key from the first), and per
        spec the padded page table with each row's lookahead page after its pages."""
        self.uploads += 1
        tables = []
        for s, config in enumerate(rows.layout.specs):
            # every key from the first: pages [0, stop) are listed after the reservation
            first, stop, width = page_span(start * 0, start + 1, config.pool.page_size)
            ahead = (supply[s] >= 0).nonzero()[0]
            width = max(width, int((stop[ahead] + 1).max()) if ahead.size else 0)
            width = -(-width // self.bucket) * self.bucket
            host = self._padded[s].update(rows.tables(s), first, stop, width)
            if ahead.size:
                host = host.copy()  # (the kept table stays what its rows list)
                host[ahead, stop[ahead]] = supply[s][ahead]
            tables.append(mx.array(host))
        return mx.array((start - 1).astype(np.int32)), mx.zeros(start.shape, dtype=mx.int32), tuple(tables)
