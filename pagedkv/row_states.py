"""``RowStates``: the recurrent state of a ``RowSet``'s rows, one live slot per row.

A hybrid model's row set (:mod:`pagedkv.row_set`) holds, next to each row's page
tables, the row's recurrent state: a slot of a ``StatePool`` (:mod:`pagedkv.state_pool`)
holding every recurrent layer's arrays after the row's tokens::

    slots:  int64 [rows]            each row's live slot (the null slot: no token seen)
    tokens: int64 [layers, rows]    tokens each recurrent layer's state has absorbed

Within a step (the row set opens and closes it, with the attention layers' pages):

- a layer reads its state from the rows' slots (``get``) and hands the new state in
  (``set``); new states wait in ``pending`` and reach the pool only when the step
  closes (``commit``), so a step that fails part-way leaves every slot as it was;
- a row whose slot is also someone else's (a fork's, a prefix-cache checkpoint's, or
  the null slot) moves to a fresh slot reserved when the step opens (``reserve``):
  copy-on-write that needs no copy, because the step rewrites the state. A component
  that no layer rewrote is copied over at commit.

Ownership: a row holds one reference on its slot (none on the null slot);
``release``/``keep``/``split``/``take`` move or give back those references exactly as
the row set does with tables. Costs: O(rows) bookkeeping per step; the pool's reads and
writes are O(rows × state bytes).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from pagedkv.state_pool import StatePool


class RowStates:
    def __init__(self, pool: StatePool, slots: np.ndarray | None = None, tokens: np.ndarray | None = None) -> None:
        """Rows on ``slots`` (references already held for them) after ``tokens``."""
        self.pool = pool
        self.slots = np.zeros(0, np.int64) if slots is None else slots
        self.tokens = np.zeros((pool.num_layers, self.slots.size), np.int64) if tokens is None else tokens
        self._targets: np.ndarray | None = None  # the open step's slots (None: no step)
        self._reserved = np.zeros(0, np.int64)  # fresh slots the open step took
        self._pending: dict[int, list] = {}  # layer -> new components, this step
        self._advanced: dict[int, np.ndarray] = {}  # layer -> its tokens before this step
        self._reads: dict[tuple[int, int], mx.array] = {}
        self._slots_mx: mx.array | None = None
        self._written = False  # the open step's caller wrote every state (advance_written)

    @classmethod
    def fresh(cls, pool: StatePool, rows: int) -> RowStates:
        return cls(pool, np.full(rows, pool.null_slot, np.int64))

    @property
    def num_rows(self) -> int:
        return self.slots.size

    @property
    def nbytes(self) -> int:
        """Bytes of the slots the rows hold."""
        return int((self.slots != self.pool.null_slot).sum()) * self.pool.bytes_per_slot

    # ------------------------------------------------------------------ one layer's step
    def get(self, layer: int, component: int) -> mx.array | None:
        """Component ``component`` of ``layer``'s state for every row, [rows, *shape]:
        what this step set, else what the rows' slots hold; None while every row is at
        the null slot (the model starts from zeros itself, as with mlx-lm's cache)."""
        pending = self._pending.get(layer)
        if pending is not None and pending[component] is not None:
            return pending[component]
        if (self.slots == self.pool.null_slot).all():
            return None
        key = (layer, component)
        read = self._reads.get(key)
        if read is None:
            if self._slots_mx is None:
                self._slots_mx = mx.array(self.slots.astype(np.int32))
            read = self._reads[key] = self.pool.read(layer, component, self._slots_mx)
        return read

    def set(self, layer: int, component: int, value: mx.array) -> None:
        """Hand in the new component (checked: ``KvShapeError``/``KvDTypeError``)."""
        self.pool.check_state(layer, component, value, self.num_rows)
        pending = self._pending.setdefault(layer, [None] * len(self.pool.shapes[layer]))
        pending[component] = value

    def moving(self) -> np.ndarray:
        """Bool [rows]: the rows a step opened now moves to a fresh slot (their slot is
        the null slot, shared, or a checkpoint)."""
        alloc, null = self.pool.allocator, self.pool.null_slot
        return np.fromiter((s == null or alloc.refcount(int(s)) > 1 or alloc.is_cacheable(int(s))
                            for s in self.slots), bool, self.slots.size)

    def reserve(self, moving: np.ndarray) -> None:
        """Open a step: take fresh slots for the ``moving`` rows (the caller checked that
        the pool has them, so this cannot run out)."""
        self._reserved = self.pool.allocator.allocate(int(moving.sum())) if moving.any() \
            else np.zeros(0, np.int64)
        self._targets = self.slots.copy()
        self._targets[moving] = self._reserved

    @property
    def in_step(self) -> bool:
        return self._targets is not None

    @property
    def targets(self) -> np.ndarray | None:
        """The open step's slot per row (None: no step): the row's slot, or the fresh
        one it moves to. Read-only."""
        return self._targets

    def advance_written(self, count: int) -> None:
        """Every layer advanced ``count`` tokens in the open step, and the caller writes
        every component of every layer into ``targets`` itself (a compiled step,
        :mod:`pagedkv.compiled_decode`): ``commit`` then moves the rows there without
        writing or copying; ``discard`` undoes the step as any other."""
        for layer in range(self.pool.num_layers):
            self.advanced(layer, count)
        self._written = True

    def waits_in_step(self, layer: int) -> bool:
        """A step is open and ``layer`` has not advanced in it yet."""
        return self._targets is not None and layer not in self._advanced

    @property
    def num_advanced(self) -> int:
        """Layers that advanced in the open step."""
        return len(self._advanced)

    def advanced(self, layer: int, count: int) -> None:
        """``layer`` wrote this step's ``count`` tokens (after ``reserve``)."""
        self._advanced[layer] = self.tokens[layer].copy()
        self.tokens[layer] += count

    def commit(self) -> None:
        """Close the step: the states of the layers that advanced go to the rows'
        target slots; rows that moved give their old slot up."""
        targets = self._targets
        if targets is None:
            return
        moved = targets != self.slots
        complete = self._written or len(self._advanced) == self.pool.num_layers and all(
            all(v is not None for v in self._pending.get(r, [None])) for r in self._advanced)
        if moved.any() and not complete:  # the state no layer rewrote moves too
            self.pool.copy_slots(self.slots[moved], targets[moved])
        if self._advanced and not self._written:
            index = mx.array(targets.astype(np.int32))
            for layer in self._advanced:
                values = self._pending.get(layer)
                if values is not None:
                    self.pool.write(layer, values, index)
        old = self.slots[moved]
        self.slots = targets
        for layer in self._advanced:  # (a layer that has not advanced keeps what it set: the next step's)
            self._pending.pop(layer, None)
        self._forget_step()
        old = old[old != self.pool.null_slot]
        if old.size:
            self.pool.allocator.decref(old)

    def discard(self) -> None:
        """Undo the step: tokens back, the reserved slots back (the rows keep theirs)."""
        for layer, before in self._advanced.items():
            self.tokens[layer] = before
        if self._reserved.size:
            self.pool.allocator.decref(self._reserved[::-1].copy())
        self._pending.clear()
        self._forget_step()

    def drop_pending(self) -> None:
        """Forget states handed in by layers that have not advanced (a failed layer)."""
        for layer in [r for r in self._pending if r not in self._advanced]:
            del self._pending[layer]

    def _forget_step(self) -> None:
        self._targets = None
        self._written = False
        self._reserved = np.zeros(0, np.int64)
        self._advanced.clear()
        self._changed()

    def _changed(self) -> None:
        self._reads.clear()
        self._slots_mx = None

    # ------------------------------------------------------------------ rows
    def take(self, other: RowStates) -> None:
        """Append ``other``'s rows (its references move here); ``other`` is emptied."""
        self.slots = np.concatenate([self.slots, other.slots])
        self.tokens = np.concatenate([self.tokens, other.tokens], axis=1)
        other.slots, other.tokens = other.slots[:0], other.tokens[:, :0]
        self._changed()
        other._changed()

    def split(self, row: int) -> RowStates:
        """Move row ``row`` out into a new one-row ``RowStates``."""
        out = RowStates(self.pool, self.slots[row : row + 1].copy(), self.tokens[:, row : row + 1].copy())
        self.slots = np.delete(self.slots, row)
        self.tokens = np.delete(self.tokens, row, axis=1)
        self._changed()
        return out

    def keep(self, keep: list[int]) -> None:
        """Keep rows ``keep`` (in that order); the others give their slot back."""
        drop = np.setdiff1d(np.arange(self.num_rows), keep)
        self._give_back(self.slots[drop])
        self.slots = self.slots[list(keep)]
        self.tokens = self.tokens[:, list(keep)]
        self._changed()

    def fork(self) -> RowStates:
        """The same rows sharing every slot (one more reference each; the first step of
        either side moves that side to fresh slots)."""
        held = self.slots[self.slots != self.pool.null_slot]
        if held.size:
            self.pool.allocator.incref(held)
        return RowStates(self.pool, self.slots.copy(), self.tokens.copy())

    def adopt(self, slot: int, num_tokens: int) -> None:
        """Start the one empty row from checkpoint ``slot`` (one reference already taken
        for it) holding the state after ``num_tokens`` tokens."""
        self.slots[:] = slot
        self.tokens[:] = num_tokens
        self._changed()

    def checkpoint(self, row: int) -> int | None:
        """Keep row ``row``'s slot as a checkpoint of its current state: mark it
        cacheable (it then outlives the row as a CACHED slot; the row moves off it at its
        next step). Returns it, or None for the null slot or a slot that already is one."""
        slot = int(self.slots[row])
        alloc = self.pool.allocator
        if slot == self.pool.null_slot or alloc.is_cacheable(slot):
            return None
        alloc.set_cacheable([slot])
        return slot

    def release(self) -> None:
        self._give_back(self.slots)
        self.slots, self.tokens = self.slots[:0], self.tokens[:, :0]
        self._changed()

    def _give_back(self, slots: np.ndarray) -> None:
        held = slots[slots != self.pool.null_slot]
        if held.size:
            self.pool.allocator.decref(held)
