"""``RowSet``: the one engine under every paged cache. B sequences ("rows") × L layers.

A ``PagedKVCache`` is the one-row face of a ``RowSet`` and a ``PagedBatchKVCache`` the
B-row face; both hand every call here, so validation, the atomic step, the write and
read indices, masks, shared K/V and sizes exist once::

    LayerLayout  specs:  [full (pool, window=None), sliding (pool', W), ...]
                 layers: cache slot i -> (spec, layer in that spec's pool)

                 state_slots: cache slots of recurrent layers (hybrid models), whose
                              state lives in ``state_pool`` (:mod:`pagedkv.state_pool`)

    RowSet       tables:  [spec][row] -> PageTable       (one table per row per spec)
                 offsets:     int64 [layer, row]   tokens each layer of each row holds
                 step_starts: int64 [layer, row]   positions before its last write
                                                    (the RoPE start; SharedKv.offset)
                 states:  RowStates (hybrids): each row's recurrent-state slot

A *step* is one ``write`` of every layer with T tokens per row. mlx-lm calls the layers
one after another, so the row set makes the step atomic:

- the first layer of a step (it writes past its tables' ends) reserves the step's pages
  in every table standing at the same positions, in every spec, after checking that
  each pool has the pages for all of them; a full pool raises ``PoolExhausted`` before
  any layer has written. Each spec's plain appends are one ``BatchAppend`` (one
  allocation for all its rows); a row that must copy its last page first, or drops
  pages behind a window, keeps an ``UndoRecord`` instead, while the step is open;
- a later layer whose input is bad rolls the step back: every layer that wrote it
  returns to its position and every table to its pages, reference counts and free-list
  order included. Closing the step (all its layers wrote, or anything else happens to
  the rows) gives up the pages the tables copied away from or dropped;
- a hybrid model's recurrent layers are layers of the step too: the step reserves the
  fresh state slots its rows move to along with the pages, and their new states reach
  the state pool when the step closes (:mod:`pagedkv.row_states`); a bad state rolls
  the step back like a bad K/V. Recurrent state cannot go back, so a hybrid's rows
  cannot be trimmed;
- a write at positions the tables already hold (a layer trimmed alone, then written
  again) is a rewrite: its pages are made private first (copy-on-write).

The write index (pool rows and slots of the step's tokens) and the read index (every
row's pages from its first visible page, padded with the null page) are built once per
spec per step and memoised until the rows or their pages change; every layer of the
step reuses them.

Ownership: the row set owns its tables. ``release`` gives every page back once;
``take_rows`` moves another row set's rows (tables and positions) in without copying
K/V, after which the other one raises ``ReleasedError``; ``split_row`` moves one row
out into a new one-row set. Recurrent-state slots move, fork and go back with their
rows. Costs per layer call: O(B) numpy work plus the pool write
and gather; the first layer of a step adds O(B · pages of the step) for the indices.
"""

from __future__ import annotations

import functools
from typing import Sequence

import attrs
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
from pagedkv.padded_page_table import PaddedPageTable
from pagedkv.page_read import PageRead
from pagedkv.pool import PagePool
from pagedkv.row_states import RowStates
from pagedkv.shared import PlainKv, QuantKv, SharedKv, ViewKv
from pagedkv.state_pool import StatePool
from pagedkv.table import BatchAppend, PageTable, check_dropped, peak_pages
from pagedkv.view import KvAttentionView
from pagedkv.visibility import range_mask, window_start

_SHARED_KINDS = ("view", "plain", "quant")


@attrs.frozen
class TableSpec:
    """One page table per row lives in ``pool``; ``window`` None means full attention;
    ``rewind``: tokens a windowed table keeps behind its window (``PageTable``);
    ``group``: which of the groups of layers of this kind (``layout_for``) it serves."""

    pool: PagePool = attrs.field(eq=id)  # the same pool, not an equal one
    window: int | None
    rewind: int = 0
    group: int = 0


@attrs.frozen
class LayerLayout:
    """Which table spec and which pool layer every attention layer uses; for hybrid
    models, which cache slots are recurrent layers (their state in ``state_pool``, in
    order). Attention layer i is the i-th cache slot that is not recurrent."""

    specs: tuple[TableSpec, ...]
    layers: tuple[tuple[int, int], ...]
    state_slots: tuple[int, ...] = ()
    state_pool: StatePool | None = attrs.field(default=None, eq=id)
    groups: tuple[int, ...] = ()  # faces per entry of the model's cache list (a CacheList bundles several)

    def __attrs_post_init__(self) -> None:
        if not self.layers:
            raise InvalidValueError("a layout needs at least one attention layer")
        n_state = 0 if self.state_pool is None else self.state_pool.num_layers
        if len(self.state_slots) != n_state:
            raise InvalidValueError(f"{len(self.state_slots)} recurrent cache slots for a state pool of "
                                    f"{n_state} recurrent layers")
        if sorted(set(self.state_slots)) != list(self.state_slots) or any(
                not 0 <= i < self.num_slots for i in self.state_slots):
            raise InvalidValueError(f"bad recurrent cache slots {self.state_slots}")
        if self.groups and (sum(self.groups) != self.num_slots or min(self.groups) < 1):
            raise InvalidValueError(f"groups {self.groups} do not cover the {self.num_slots} cache slots")
        for spec, layer in self.layers:
            pool = self.specs[spec].pool
            if not 0 <= layer < pool.num_layers:
                raise InvalidValueError(f"pool has {pool.num_layers} layers; the model needs more")

    @functools.cached_property
    def append_groups(self) -> tuple[tuple[int, ...], ...]:
        """The table specs that differ only in their group of layers (same pool, window
        and rewind), in spec order: a step appends to all their tables as one
        ``BatchAppend`` (a Gemma-3-style model in layer groups: one for its full layers,
        one for all its sliding groups, instead of one per group)."""
        groups: dict[tuple, list[int]] = {}
        for s, spec in enumerate(self.specs):
            groups.setdefault((id(spec.pool), spec.window, spec.rewind), []).append(s)
        return tuple(tuple(g) for g in groups.values())

    @classmethod
    def uniform(cls, pool: PagePool, layers: Sequence[int], window: int | None = None,
                rewind: int = 0) -> LayerLayout:
        """Every slot in one table spec: slot i uses layer ``layers[i]`` of ``pool``."""
        return cls((TableSpec(pool, window, rewind),), tuple((0, int(x)) for x in layers))

    @property
    def num_layers(self) -> int:
        """Attention layers."""
        return len(self.layers)

    @property
    def num_slots(self) -> int:
        """Cache slots: attention and recurrent layers."""
        return len(self.layers) + len(self.state_slots)

    @property
    def has_windows(self) -> bool:
        """Whether any attention layer is a sliding window."""
        return any(spec.window is not None for spec in self.specs)

    @property
    def windows(self) -> tuple[int, ...]:
        """The window size of each sliding-window table spec, ascending (a size is listed
        once per group of layers with that window)."""
        return tuple(sorted(spec.window for spec in self.specs if spec.window is not None))

    def pages_for(self, tokens: int, chunk: int = 1) -> int:
        """Pages one sequence of ``tokens`` tokens, written at most ``chunk`` per
        forward (0: between forwards), holds at most, over every table spec
        (``peak_pages``; the specs' peaks added up, so an upper bound). O(specs)."""
        tokens, chunk = check_int("tokens", tokens, minimum=0), check_int("chunk", chunk, minimum=0)
        return sum(peak_pages(tokens, spec.pool.page_size, spec.window, spec.rewind, chunk) for spec in self.specs)

    def slot_kinds(self) -> list[tuple[str, int]]:
        """Per cache slot, in order: ("kv", attention layer) or ("state", recurrent layer)."""
        state = {slot: r for r, slot in enumerate(self.state_slots)}
        out, kv = [], 0
        for i in range(self.num_slots):
            if i in state:
                out.append(("state", state[i]))
            else:
                out.append(("kv", kv))
                kv += 1
        return out


class RowSet:
    def __init__(self, layout: LayerLayout, tables: Sequence[Sequence[PageTable]] = ()) -> None:
        """Rows of ``layout``; ``tables[row][spec]`` are empty tables or tables the
        caller hands over (their layers all at the tables' lengths; for a hybrid layout,
        empty tables only: their recurrent state starts empty)."""
        self.layout = layout
        if layout.state_pool is not None and any(t.num_tokens for row in tables for t in row):
            raise NotSupportedError("a hybrid model's row starts empty: its tables carry no recurrent state")
        self.states = None if layout.state_pool is None else RowStates.fresh(layout.state_pool, len(tables))
        n_specs = len(layout.specs)
        self._tables: list[list[PageTable]] = [[] for _ in range(n_specs)]
        for row in tables:
            if len(row) != n_specs:
                raise InvalidValueError(f"a row needs {n_specs} page tables, got {len(row)}")
            for s, t in enumerate(row):
                _claim(t, layout.specs[s])
                self._tables[s].append(t)
        lengths = [[self._tables[s][b].num_tokens for b in range(len(tables))] for s, _ in layout.layers]
        self.offsets = np.array(lengths, dtype=np.int64).reshape(layout.num_layers, len(tables))
        self.step_starts = self.offsets.copy()
        self._moved: str | None = None  # why the rows are gone, once moved out
        self._checked_at = -1  # PageTable.releases when every table was last seen alive
        self._released = False
        self._memo: dict = {}
        # per spec: the padded page table of the last read, kept so the next read
        # rebuilds only the rows that changed (it checks which itself)
        self._padded = [PaddedPageTable(spec.pool.null_page) for spec in layout.specs]
        self._masks: dict[int, mx.array] = {}  # per spec: the last mask ``mask`` made
        # The open step (none while the journal is empty): (commit, undo) of each change
        # it made to the tables (a BatchAppend, or one table's UndoRecord), in order; the
        # specs it grew; where it started and ends (read-only: ``write`` hands the start
        # out); each written layer's positions before it; how many layers write it in all.
        self._journal: list = []
        self._step_specs: set[int] = set()
        self._step_from = self._step_to = np.zeros(0, dtype=np.int64)
        self._step_key = b""
        self._step_count = 0
        self._saved: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._writers = 0

    @classmethod
    def new_row(cls, layout: LayerLayout) -> RowSet:
        """One row of fresh, empty tables."""
        return cls(layout, [[PageTable(s.pool, window=s.window, rewind=s.rewind) for s in layout.specs]])

    # ------------------------------------------------------------------ queries
    @property
    def num_rows(self) -> int:
        return self.offsets.shape[1]

    def tables(self, spec: int) -> list[PageTable]:
        return self._tables[spec]

    def row_tables(self, row: int) -> list[PageTable]:
        row = self.check_row(row)
        return [ts[row] for ts in self._tables]

    def check_row(self, row: object) -> int:
        """``row`` as an index of an existing row; ``KvShapeError`` when there are no
        rows, ``InvalidTypeError``/``InvalidValueError`` for anything else that is not
        an int in [0, num_rows) (a negative index too: it would name another row)."""
        if not self.num_rows:
            raise KvShapeError(f"row {row!r} needs rows, but there are none (add rows with extend)")
        return check_int("row", row, minimum=0, maximum=self.num_rows - 1)

    def all_tables(self) -> list[PageTable]:
        return [t for ts in self._tables for t in ts]

    def spec_of(self, layer: int) -> TableSpec:
        return self.layout.specs[self.layout.layers[layer][0]]

    def pool_of(self, layer: int) -> PagePool:
        return self.spec_of(layer).pool

    def layer_tables(self, layer: int) -> list[PageTable]:
        return self._tables[self.layout.layers[layer][0]]

    def nbytes(self, layer: int) -> int:
        """Bytes of this layer's share of the pages its rows hold."""
        pool = self.pool_of(layer)
        return sum(t.num_pages for t in self.layer_tables(layer)) * pool.bytes_per_page_per_layer

    def visible_range(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """[lo, hi) per row: the keys the layer's last step returned (a query at its
        step start sees from lo; hi is what the layer holds)."""
        return window_start(self.step_starts[layer], self.spec_of(layer).window), self.offsets[layer]

    # ------------------------------------------------------------------ lifetime
    def __deepcopy__(self, memo: dict) -> RowSet:
        """Refused with a typed error (a deep copy would copy the pool, or share its
        pages with no reference taken); mlx-lm deep-copies caches it keeps for reuse.
        ``fork()`` is the copy: the pages shared copy-on-write, each side released on
        its own. A cache or batch is deep-copied through its row set, so this covers
        them all."""
        raise NotSupportedError("a paged cache cannot be deep-copied: fork() it (pages shared copy-on-write) "
                                "and release() each copy")

    def check_alive(self) -> None:
        if self._moved is not None:
            raise ReleasedError(f"this cache's pages were {self._moved}; use the new owner instead")
        if self._released:
            raise ReleasedError("used after release()")
        if self._checked_at != PageTable.releases:  # (O(rows) only after some table was released)
            for ts in self._tables:
                for t in ts:
                    if t.released:
                        raise ReleasedError("cache used after its pages were released")
            self._checked_at = PageTable.releases

    @property
    def released(self) -> bool:
        return self._moved is not None or self._released or any(t.released for t in self.all_tables())

    def release(self) -> None:
        """Give back every page of every row (once; a second call raises ``ReleasedError``)."""
        if self._moved is not None:
            raise ReleasedError(f"this cache's pages were {self._moved}")
        if self._released:
            raise ReleasedError("released twice")
        self._close_step()
        for t in self.all_tables():
            if not t.released:
                t.release()
        if self.states is not None:
            self.states.release()
        self._released = True
        self._changed()

    def take_rows(self, other: RowSet, where: str) -> range:
        """Move every row of ``other`` to the end of this set (no K/V copied); ``other``
        is dead afterwards. Its layers must all stand at their tables' lengths."""
        self.check_alive()
        other.check_alive()
        if other.layout != self.layout:
            raise InvalidValueError("the rows' layers use other pools, layers or windows than these rows")
        for s, ts in enumerate(other._tables):
            for b, t in enumerate(ts):
                held = other.offsets[self.layers_of(s), b]
                if (held != t.num_tokens).any():
                    raise InvalidValueError(f"every layer must hold the same {t.num_tokens} tokens, "
                                            f"got {held.tolist()}")
                if other.states is not None and (other.states.tokens[:, b] != t.num_tokens).any():
                    raise InvalidValueError(f"every recurrent layer must hold the same {t.num_tokens} tokens, "
                                            f"got {other.states.tokens[:, b].tolist()}")
        self._close_step()
        other._close_step()
        if self.states is not None:
            self.states.take(other.states)
        first = self.num_rows
        for s in range(len(self._tables)):
            self._tables[s].extend(other._tables[s])
            other._tables[s] = []
        self.offsets = np.concatenate([self.offsets, other.offsets], axis=1)
        self.step_starts = np.concatenate([self.step_starts, other.offsets], axis=1)
        other.offsets = other.offsets[:, :0]
        other.step_starts = other.step_starts[:, :0]
        other._moved = where
        self._changed()
        return range(first, self.num_rows)

    def split_row(self, row: int) -> RowSet:
        """Move row ``row`` out into a new one-row set (no copy); the others stay.
        A bad ``row`` (``check_row``) changes nothing."""
        self.check_alive()
        row = self.check_row(row)
        self._close_step()
        out = RowSet(self.layout)
        tables = [ts.pop(row) for ts in self._tables]
        out._tables = [[t] for t in tables]
        if self.states is not None:
            out.states = self.states.split(row)
        out.offsets = self.offsets[:, row : row + 1].copy()
        out.step_starts = out.offsets.copy()
        self.offsets = np.delete(self.offsets, row, axis=1)
        self.step_starts = np.delete(self.step_starts, row, axis=1)
        self._changed()
        return out

    def keep_rows(self, keep: Sequence[int]) -> None:
        """Keep rows ``keep`` (in that order) and release every other row's pages.
        ``keep`` must list distinct rows (``InvalidTypeError``/``InvalidValueError``
        otherwise, and nothing changes): a row kept twice would be two rows writing one
        table, and a negative index would name a row it also releases."""
        self.check_alive()
        if not isinstance(keep, (list, tuple, range)):
            raise InvalidTypeError(f"keep must be a list of row indices, got {type(keep).__name__}")
        keep = [self.check_row(i) for i in keep]
        if len(set(keep)) != len(keep):
            raise InvalidValueError(f"keep lists a row twice: {keep}")
        self._close_step()
        drop = set(range(self.num_rows)) - set(keep)
        for ts in self._tables:
            for b in sorted(drop):
                ts[b].release()
        self._tables = [[ts[b] for b in keep] for ts in self._tables]
        if self.states is not None:
            self.states.keep(list(keep))
        self.offsets = self.offsets[:, list(keep)]
        self.step_starts = self.step_starts[:, list(keep)]
        self._changed()

    def fork(self) -> RowSet:
        """A new row set sharing every page (copy-on-write on the next write)."""
        self.check_alive()
        self._close_step()
        out = RowSet(self.layout)
        out._tables = [[t.fork() for t in ts] for ts in self._tables]
        for t in out.all_tables():
            t.claimed = True
        if self.states is not None:
            out.states = self.states.fork()
        out.offsets = self.offsets.copy()
        out.step_starts = self.step_starts.copy()
        return out

    def adopt_prefix(self, pages: Sequence[int], num_tokens: int | None = None,
                     state_slot: int | None = None, window_pages: dict[int, Sequence[int]] | None = None) -> None:
        """Start the one empty row with ``pages`` (each already referenced once for it: a
        prefix-cache hit, a loaded cache) in its full-attention table, holding
        ``num_tokens`` tokens (default: all pages full); every layer stands after them.
        A hybrid row also needs ``state_slot``: the recurrent state after those tokens
        (one reference taken for it). A layout with sliding windows needs
        ``window_pages``: for each sliding spec (its index in ``layout.specs``) the last
        pages of the same prefix (referenced once each), as many as its window needs;
        the pages before them are listed as dropped. Nothing changes on a refusal."""
        specs = self.layout.specs
        full = [s for s, spec in enumerate(specs) if spec.window is None]
        if self.num_rows != 1 or len(full) != 1:
            raise NotSupportedError("prefix caching serves one row with one full-attention table")
        if (self.states is None) != (state_slot is None):
            raise InvalidValueError("a hybrid row adopts pages with their state slot; other rows take no state")
        window_pages = {} if window_pages is None else window_pages
        if sorted(window_pages) != [s for s in range(len(specs)) if s not in full]:
            raise InvalidValueError("window_pages must give the pages of every sliding spec, and only those")
        for s, held in window_pages.items():  # all checked before any table changes
            ps = specs[s].pool.page_size
            check_dropped(len(pages) * ps, specs[s].window, len(pages) - len(held), ps)
        if window_pages and num_tokens is not None:
            raise InvalidValueError("a prefix with sliding windows ends on a page boundary")
        table = self._tables[full[0]][0]
        table.adopt(pages, num_tokens)
        for s, held in window_pages.items():
            self._tables[s][0].adopt(held, dropped=len(pages) - len(held))
        if self.states is not None:
            self.states.adopt(state_slot, table.num_tokens)
        self.offsets[:] = table.num_tokens
        self.step_starts[:] = table.num_tokens
        self._changed()

    def _changed(self) -> None:
        self._memo.clear()

    # ------------------------------------------------------------------ one layer's step
    def write(self, layer: int, keys: mx.array, values: mx.array) -> np.ndarray:
        """Append [B, kv_heads, T, D] keys/values of ``layer`` at every row's position;
        returns the rows' positions before the write, for reading (a later layer of the
        open step gets the step's own array, read-only). Validated first; atomic. A later
        layer of the open step, the common case, costs the write, a comparison of its
        positions with the step's and one small copy for a rollback."""
        self.check_alive()
        spec, pool_layer = self.layout.layers[layer]
        row = self.offsets[layer]
        end = None
        try:
            count = self.check_kv(layer, keys, values)
            if spec in self._step_specs and layer not in self._saved and self._continues_step(row, count):
                # the common case: a later layer of the open step, whose pages are reserved;
                # it starts and ends where the step does (saved for a rollback)
                start, end = self._step_from, self._step_to
                self._saved[layer] = (start, self.step_starts[layer].copy())
            else:
                start = row.copy()
                self._prepare(layer, start, count)
            rows, slots = self.write_index(spec, start, count)
            self.layout.specs[spec].pool.write_checked(pool_layer, rows, slots, keys, values)  # (indexed as they come)
        except BaseException:
            self._abort_write(layer)
            raise
        row[:] = start + count if end is None else end
        self.step_starts[layer] = start
        self._close_if_done()
        return start

    def reserve_step(self, count: int, supply: Sequence[np.ndarray] | None = None) -> np.ndarray:
        """A step's bookkeeping for every layer, without writing: pages reserved in every
        table (``PoolExhausted`` before anything changes) and every layer advanced by
        ``count`` tokens. The step stays open until ``finish_reserved``; in between the
        caller queues the step's writes itself (a compiled step,
        :mod:`pagedkv.compiled_decode`). Returns the rows' positions before the step.
        Needs every layer at the same positions. Recurrent layers (hybrid models): each
        row's state slot for the step is reserved as in any step (a row on a shared slot
        moves to a fresh one; ``states.targets`` lists them) and every recurrent layer is
        advanced; the caller writes every component of their new state into those slots.

        ``supply``: per table kind, int64 [B] page ids the caller holds (or -1), which a
        row that needs one new page takes instead of an allocated one (``BatchAppend``'s
        supply: the caller's reference passes to the table when the step closes; an undo
        leaves it with the caller). Where a table kind's rows cannot append as one batch
        (a shared last page to copy first), its supply is not used."""
        self.check_alive()
        if self.num_rows == 0:
            raise KvShapeError("a step needs rows, but there are none (add rows with extend)")
        start = self.offsets[0].copy()
        if (self.offsets != start).any():
            raise KvShapeError("layers stand at different positions; a reserved step moves them together")
        if any(not np.array_equal(np.fromiter((t.num_tokens for t in ts), np.int64, len(ts)), start)
               for ts in self._tables):
            raise NotSupportedError("a reserved step appends: the page tables must end where the layers stand")
        offsets, starts = self.offsets.copy(), self.step_starts.copy()
        try:
            self._open_step(start, count, growing=list(range(len(self._tables))), supply=supply,
                            vouched=True)  # (checked above)
            if self.states is not None:
                self.states.advance_written(count)
        except BaseException:
            self._abort_step()
            raise
        self._saved = {layer: (offsets[layer], starts[layer]) for layer in range(self.layout.num_layers)}
        self.offsets[:] = start + count
        self.step_starts[:] = start
        return start

    def finish_reserved(self, ok: bool) -> None:
        """Close the step ``reserve_step`` opened (its writes are queued), or with
        ``ok=False`` undo it: every layer and table exactly as before it."""
        if ok:
            self._close_step()
        else:
            self._abort_step()

    def _close_if_done(self) -> None:
        done = len(self._saved) + (self.states.num_advanced if self.states is not None else 0)
        if self._journal and done >= self._writers:
            self._close_step()

    # ------------------------------------------------------------------ a recurrent layer's step
    def set_state(self, layer: int, component: int, value: mx.array) -> None:
        """Hand in recurrent layer ``layer``'s new state component (for every row) for
        the step it is computing; a bad value rolls the open step back and raises."""
        self.check_alive()
        try:
            self.states.set(layer, component, value)
        except BaseException:
            self._abort_state(layer)
            raise

    def advance_state(self, layer: int, count: int) -> None:
        """Recurrent layer ``layer`` finished a step of ``count`` tokens per row (the
        states it handed in stand once the step closes). Opens the step if it is the
        step's first layer (reserving pages and state slots; ``PoolExhausted`` leaves
        everything as it was)."""
        self.check_alive()
        states = self.states
        try:
            count = check_int("count", count, minimum=1)
            start = states.tokens[layer].copy()
            if not (states.waits_in_step(layer) and self._continues_step(start, count)):
                for ts in self._tables:
                    if any(t.num_tokens != p for t, p in zip(ts, start)):
                        raise KvShapeError(f"recurrent layer {layer} is at {start.tolist()} but the attention "
                                           "layers are not: layers of one sequence must advance together")
                self._open_step(start, count)
            states.advanced(layer, count)
        except BaseException:
            self._abort_state(layer)
            raise
        self._close_if_done()

    def _abort_state(self, layer: int) -> None:
        """A recurrent layer failed: roll the open step back if the layer had not
        finished it yet; otherwise just forget what it handed in."""
        if self.states.waits_in_step(layer):
            self._abort_step()
        self.states.drop_pending()

    def check_kv(self, layer: int, keys: mx.array, values: mx.array) -> int:
        """Raise a typed error unless ``keys``/``values`` fit a write of ``layer`` (one
        [kv_heads, T, D] block per row); returns T. Changes nothing."""
        b = self.num_rows
        if b == 0:
            raise KvShapeError("a step needs rows, but there are none (add rows with extend)")
        try:
            return self.pool_of(layer).check_kv(keys, values, rows=b)
        except KvShapeError:
            if b == 1 and getattr(keys, "ndim", 0) == 4 and keys.shape[0] != 1:
                raise NotSupportedError(f"a one-sequence cache takes batch 1, got {keys.shape[0]} (use PagedBatch)") \
                    from None
            raise

    def _continues_step(self, start: np.ndarray, count: int) -> bool:
        """A write of ``count`` tokens per row at ``start`` belongs to the open step."""
        return count == self._step_count and start.tobytes() == self._step_key

    def _prepare(self, layer: int, start: np.ndarray, count: int) -> None:
        """Make tokens [start, start + count) of every row of ``layer``'s tables writable."""
        spec = self.layout.layers[layer][0]
        tables = self._tables[spec]
        lengths = np.fromiter((t.num_tokens for t in tables), np.int64, len(tables))
        if (start + count > lengths).any():
            if (start != lengths).any():
                raise KvShapeError(
                    f"layer {layer} is at {start.tolist()} but its tables at {lengths.tolist()}: "
                    "layers of one sequence must advance together"
                )
            self._open_step(start, count)
        elif spec not in self._step_specs or (start < self._step_from).any():
            self._rewrite(tables, start, count)  # copy-on-write of shared pages
            return
        if layer not in self._saved:  # a layer of the open step: saved for rollback
            self._saved[layer] = (self.offsets[layer].copy(), self.step_starts[layer].copy())

    def _check_pages(self, needs: list[tuple[PagePool, int]]) -> None:
        """``PoolExhausted`` unless every pool has the pages asked of it in all."""
        by_pool: dict[int, list] = {}
        for pool, need in needs:
            by_pool.setdefault(id(pool), [pool, 0])[1] += need
        for pool, need in by_pool.values():
            available = pool.allocator.num_available()
            if need > available:
                raise PoolExhausted(need, available)

    def _rewrite(self, tables: list[PageTable], start: np.ndarray, count: int) -> None:
        self._check_pages([(t.pool, t.pages_needed(count, start=int(s))) for t, s in zip(tables, start)])
        self._close_step()
        for t, s in zip(tables, start):  # cannot run out now
            t.prepare_write(int(s), count)
        self._changed()

    def _open_step(self, start: np.ndarray, count: int, growing: list[int] | None = None,
                   supply: Sequence[np.ndarray] | None = None, vouched: bool = False) -> None:
        """``vouched``: the caller checked that every table is alive (``check_alive``)."""
        self._close_step()  # a step some layers never finished stands as it is
        if growing is None:  # the specs whose tables end at ``start`` (the caller may know)
            growing = [s for s, ts in enumerate(self._tables)
                       if all(t.num_tokens == p for t, p in zip(ts, start.tolist()))]
        # per append group (``LayerLayout.append_groups``): one vectorised append for all
        # its growing specs' tables (the decode step, a window's drops included), or a
        # plan per table where a page must be copied first
        plans: list = []
        needs: list[tuple[PagePool, int]] = []
        for group in self.layout.append_groups:
            specs = group if len(growing) == len(self._tables) else [s for s in group if s in growing]
            if not specs:
                continue
            tables = self._tables[specs[0]] if len(specs) == 1 else [t for s in specs for t in self._tables[s]]
            batch = BatchAppend.plan(
                tables, count, tokens=start if len(specs) == 1 else np.concatenate((start,) * len(specs)),
                supply=None if supply is None else np.concatenate([supply[s] for s in specs]),
                vouched=vouched)
            if batch is not None:
                plans.append(batch)
                needs.append((batch.pool, batch.num_new_pages))
                continue
            for t in tables:
                plan = t.plan_write(t.num_tokens, count)
                plans.append((t, plan))
                needs.append((t.pool, plan[0] + plan[1].size))
        self._check_pages(needs)
        if self.states is not None:
            if (self.states.tokens != start).any():
                raise KvShapeError(f"the recurrent layers stand at {self.states.tokens.tolist()}, the step at "
                                   f"{start.tolist()}: layers of one sequence must advance together (a model "
                                   "whose recurrent layers never call cache.advance(n) cannot be served)")
            moving = self.states.moving()
            need, available = int(moving.sum()), self.states.pool.allocator.num_available()
            if need > available:
                raise PoolExhausted(need, available)
            self.states.reserve(moving)
        for plan in plans:  # cannot run out now: every pool was checked for all its tables
            if isinstance(plan, BatchAppend):
                plan.apply()
                self._journal.append((plan.commit, plan.undo))
                continue
            t, plan = plan
            records: list = []
            t.prepare_write(int(t.num_tokens), count, undo=records, plan=plan)
            self._journal.append((functools.partial(t.commit, records[0]), functools.partial(t.undo, records[0])))
        self._step_specs = set(growing)
        self._step_from = start.copy()
        self._step_to = start + count
        self._step_from.flags.writeable = self._step_to.flags.writeable = False  # (handed out by ``write``)
        self._step_key = start.tobytes()  # (int64 [B], as ``offsets`` rows: compared per layer)
        self._step_count = count
        self._writers = self.layout.num_slots if len(growing) == len(self._tables) else \
            sum(1 for s, _ in self.layout.layers if s in self._step_specs) + len(self.layout.state_slots)
        self._changed()

    def _close_step(self) -> None:
        """The step stands: tables give up the pages they copied away from or dropped."""
        for commit, _ in self._journal:
            commit()
        if self.states is not None:
            self.states.commit()
        self._forget_step()

    def _abort_write(self, layer: int) -> None:
        """``layer``'s write failed. If it is a layer of the open step that has not
        written it yet (it stands where the step starts), undo the step: layers and
        tables exactly as before it. Any other failed write (a layer trimmed on its own
        stands elsewhere) changed nothing."""
        spec = self.layout.layers[layer][0]
        if (spec not in self._step_specs or layer in self._saved or not self._journal
                or self.offsets[layer].tobytes() != self._step_key):
            return
        self._abort_step()

    def _abort_step(self) -> None:
        """Undo the open step: layers, tables and state slots exactly as before it."""
        for saved, (offsets, starts) in self._saved.items():
            self.offsets[saved], self.step_starts[saved] = offsets, starts
        for _, undo in reversed(self._journal):  # the free list's order returns too
            undo()
        if self.states is not None:  # (reserved before the tables' pages)
            self.states.discard()
        self._forget_step()
        self._changed()

    def _forget_step(self) -> None:
        self._journal = []
        self._step_specs = set()
        self._saved = {}
        self._writers = 0

    # ------------------------------------------------------------------ indices
    def write_index(self, spec: int, start: np.ndarray,
                    count: int) -> tuple[mx.array, mx.array] | tuple[slice, slice]:
        """(pool array rows, slots) of tokens [start, start + count) of every row of
        ``spec``'s tables, int32 [B, kv_heads, count] (slots of a one-token step [B, 1, 1],
        which broadcasts over the heads; flat where the pool writes with its kernel:
        ``PagePool.write_index``): they index a layer array with
        the step's keys/values [B, kv_heads, count, D] as the model makes them, so no
        layer transposes or copies them first. One row whose tokens lie in one page (a
        sequence's decode step) gets the pool's ``page_slices`` instead, where it gives
        them. Memoised until the rows or their pages change."""
        key = ("w", spec, start.tobytes(), count)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        pool = self.layout.specs[spec].pool
        ps, h = pool.page_size, pool.num_kv_heads
        tables = self._tables[spec]
        b = len(tables)
        if b == 1 and start[0] % ps + count <= ps:
            at = int(start[0])
            hit = pool.page_slices(tables[0].page_at(at // ps), at % ps, count)
            if hit is not None:
                self._memo[key] = hit
                return hit
        if count == 1:  # a decode step: one page per row, looked up without arrays
            pages = np.fromiter(map(PageTable.page_at, tables, (start // ps).tolist()), np.int64, b)
            rows = pool.array_rows(pages).T[:, :, None]
            slots = (start % ps)[:, None, None]  # (broadcast over the heads by the write)
        else:
            pos = start[:, None] + np.arange(count)[None, :]  # [B, T]
            pages = np.concatenate([t.page_ids_at(p // ps) for t, p in zip(tables, pos)])
            rows = pool.array_rows(pages).reshape(h, b, count).transpose(1, 0, 2)
            slots = np.broadcast_to((pos % ps)[:, None, :], (b, h, count))
        hit = self._memo[key] = pool.write_index(rows, slots)
        return hit

    def position_array(self, positions: np.ndarray) -> mx.array:
        """``positions`` (int [B]) as an int32 MLX array, memoised by value until the rows
        change: the layers of a step (and RoPE's two reads per layer) share one."""
        key = ("p", positions.tobytes())
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = mx.array(positions.astype(np.int32))
        return hit

    def read_plan(self, layer: int, lo: np.ndarray, hi: np.ndarray) -> PageRead:
        """Where tokens [lo[b], hi[b]) of every row of ``layer`` live; memoised per step
        for all layers of one table spec."""
        spec = self.layout.layers[layer][0]
        key = ("r", spec, lo.tobytes(), hi.tobytes())
        plan = self._memo.get(key)
        if plan is None:
            plan = self._memo[key] = PageRead.of(self.layout.specs[spec].pool, self._tables[spec], lo, hi,
                                                 padded=self._padded[spec])
        return plan

    def visible_read(self, layer: int) -> PageRead:
        """``read_plan`` of the layer's visible range, memoised per spec and position
        (every layer of a step asks for it twice: its read and its attention)."""
        key = ("v", self.layout.layers[layer][0], self.step_starts[layer].tobytes(), self.offsets[layer].tobytes())
        plan = self._memo.get(key)
        if plan is None:
            plan = self._memo[key] = self.read_plan(layer, *self.visible_range(layer))
        return plan

    def read(self, layer: int, lo: np.ndarray | None = None, hi: np.ndarray | None = None,
             exact: bool = True):
        """The gathered page components of tokens [lo, hi) per row (default: the
        layer's visible range); layout as ``PageRead.parts(exact)``."""
        plan = self.visible_read(layer) if lo is None else self.read_plan(layer, lo, hi)
        return plan.parts(self.layout.layers[layer][1], exact)

    def mask(self, layer: int, n_queries: int, window: int | None = None) -> mx.array:
        """Bool [B, 1, n_queries, width] for the keys the layer's next write of
        ``n_queries`` tokens per row will return (``read(exact=False)`` after it)."""
        start = self.offsets[layer]
        mask = range_mask(window_start(start, self.spec_of(layer).window), start + n_queries, n_queries,
                          self.pool_of(layer).page_size, window=window or self.spec_of(layer).window)
        self.note_mask(layer, mask if window in (None, self.spec_of(layer).window) else None)
        return mask

    def note_mask(self, layer: int, mask) -> None:
        """Remember ``mask`` as the one made for the next step of ``layer``'s kind
        (None: it adds more than the rows' ranges), so every layer of that kind knows
        it may let the kernel apply the ranges instead (``owns_mask``)."""
        self._masks[self.layout.layers[layer][0]] = mask

    def owns_mask(self, layer: int, mask) -> bool:
        """``mask`` says no more than the rows' ranges, causality and the layer's window:
        None, ``"causal"`` on a layer without a window, or the one ``note_mask`` recorded
        for ``layer``'s kind."""
        if isinstance(mask, str):
            return mask == "causal" and self.spec_of(layer).window is None
        return mask is None or mask is self._masks.get(self.layout.layers[layer][0])

    def attend(self, layer: int, queries: mx.array, scale: float, mask, mask_is_ours: bool,
               exact: bool = True, parts=None, sinks: mx.array | None = None, borrow: bool = True,
               read: PageRead | None = None) -> mx.array:
        """Attention of this step's queries over the layer's visible keys, read from the
        pages (``PageRead.attend``); ``mask_is_ours``: ``mask`` is None or what ``mask``
        made for this step; ``parts``: what ``read`` already gathered (or lent) for it;
        ``sinks``: [n_heads] attention-sink logits, or None; ``borrow``: read views of
        the pool rather than ``parts`` where it can (False: ``parts`` are such views);
        ``read``: ``visible_read(layer)``, if the caller has it."""
        spec, pool_layer = self.layout.layers[layer]
        return (read or self.visible_read(layer)).attend(
            pool_layer, queries, scale, mask, exact=exact, kernel=mask_is_ours, parts=parts,
            window=self.layout.specs[spec].window, sinks=sinks, borrow=borrow)

    # ------------------------------------------------------------------ sharing
    def view(self, layer: int, lo: np.ndarray | None = None, hi: np.ndarray | None = None) -> KvAttentionView:
        """A reference-holding view of tokens [lo, hi) of every row (default: the
        layer's visible range)."""
        self.check_alive()
        if lo is None:
            lo, hi = self.visible_range(layer)
        return KvAttentionView(self.pool_of(layer), self.layout.layers[layer][1], self.layer_tables(layer),
                               hi.tolist(), lo.tolist())

    def shared(self, layer: int, kind: str = "view") -> SharedKv:
        """This step's K/V of ``layer`` as a SharedKv (after the step's write; the caller
        releases it). ``offset`` is the step's start (the smallest over rows) and, for
        several rows, ``offset_arr`` every row's.

        ``view``: a KvAttentionView (any page kind, any rows; quantised pages stay packed).
        ``plain``: float keys and values of one row; on rotated (TurboQuant) pages the
        values stay rotated, with ``v_rotated=True`` and ``restore_values`` captured now.
        ``quant``: the packed (packed, scales, biases) triples of one row; unrotated
        affine pages only.
        """
        if kind not in _SHARED_KINDS:
            raise InvalidValueError(f"kind must be 'view', 'plain' or 'quant', got {kind!r}")
        self.check_alive()
        lo, hi = self.visible_range(layer)
        if self.num_rows == 0 or (hi == 0).all():
            raise KvShapeError("no step has been written yet")
        starts = self.step_starts[layer]
        offset = int(starts.min())
        offset_arr = mx.array(starts.astype(np.int32)) if self.num_rows > 1 else None
        if kind == "view":
            return ViewKv(self.view(layer, lo, hi), offset=offset, offset_arr=offset_arr)
        if self.num_rows != 1:
            raise NotSupportedError(f"{kind!r} SharedKv holds one row; use kind='view' for several")
        pool = self.pool_of(layer)
        k_parts, v_parts = self.read(layer, lo, hi)
        if kind == "plain":
            k, v = pool.kind.decode(k_parts, v_parts, unrotate_values=False)
            if pool.v_codec.rotated:
                return PlainKv(k, v, offset=offset, restore_values=pool.v_codec.unrotate, v_rotated=True)
            return PlainKv(k, v, offset=offset)
        if not pool.kind.packed_pair:
            raise NotSupportedError("quant SharedKv needs affine-quantised, unrotated K and V pages")
        kc, vc = pool.k_codec, pool.v_codec
        assert isinstance(kc, AffineQuant) and isinstance(vc, AffineQuant)
        return QuantKv(k_parts, v_parts, bits=kc.bits, group_size=kc.group_size, offset=offset,
                       v_bits=vc.bits, v_group_size=vc.group_size)

    # ------------------------------------------------------------------ trimming
    def max_trim(self, layer: int) -> int:
        """The most tokens every row of ``layer`` can go back now (0 on a hybrid): as
        ``trim`` checks, in the tables of every layer that stands where this one does."""
        self.check_alive()
        if self.states is not None:
            return 0
        here = self.offsets[layer].tolist()
        return int(min((t.max_rewind(n) for s in self._trim_peers(layer) for t, n in zip(self._tables[s], here)),
                       default=0))

    def _trim_peers(self, layer: int) -> list[int]:
        """The table specs a trim of ``layer`` must keep whole: its own, and every spec
        with a layer at the same positions (they go back with it when mlx-lm trims the
        model layer by layer). O(layers x rows)."""
        here, own = self.offsets[layer], self.layout.layers[layer][0]
        return [s for s in range(len(self._tables))
                if s == own or any(np.array_equal(self.offsets[other], here) for other in self.layers_of(s))]

    def trim(self, layer: int, n: int) -> int:
        """Forget the last ``n`` tokens of ``layer`` in every row (at most what the
        shortest row holds); once every layer of a table went back, the table frees the
        tail pages. Raises ``TrimError`` and changes nothing if a sliding window already
        dropped keys a query at the new end needs: in this layer's tables, or in those of
        any layer that stands where this one does (mlx-lm trims a model layer by layer,
        so a full-attention layer must not go back when a sliding one beside it cannot)."""
        self.check_alive()
        n = check_int("n", n, minimum=0)
        if self.states is not None and n:
            raise NotSupportedError("a hybrid model's rows cannot be trimmed: recurrent state cannot go back")
        if self.num_rows == 0:
            return 0
        here = self.offsets[layer]
        n = min(n, int(here.min()))
        if n == 0:
            return 0
        for s in self._trim_peers(layer):
            for t, held in zip(self._tables[s], here.tolist()):
                t.check_rewind(held - n)
        self._close_step()
        self.offsets[layer] -= n
        self.step_starts[layer] = np.minimum(self.step_starts[layer], self.offsets[layer])
        self._shrink_tables()
        return n

    def _shrink_tables(self) -> None:
        """Shrink each table to its furthest layer (after layers trimmed)."""
        for s, ts in enumerate(self._tables):
            furthest = self.offsets[self.layers_of(s)].max(axis=0)
            for t, target in zip(ts, furthest):
                if target < t.num_tokens:
                    t.trim(t.num_tokens - int(target))
        self._changed()

    def layers_of(self, spec: int) -> list[int]:
        return [i for i, (s, _) in enumerate(self.layout.layers) if s == spec]


def _claim(table: PageTable, spec: TableSpec) -> None:
    if not isinstance(table, PageTable):
        raise InvalidValueError(f"expected PageTables, got {type(table).__name__}")
    if table.released:
        raise ReleasedError("cannot build a cache on a released page table")
    if table.claimed:
        raise InvalidValueError("this page table already belongs to a cache")
    if table.pool is not spec.pool or table.window != spec.window or table.rewind != spec.rewind:
        raise InvalidValueError("the table's pool, window or rewind differs from its layer's")
    table.claimed = True
