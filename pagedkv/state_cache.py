"""``PagedStateCache``: mlx-lm's ``ArraysCache`` protocol for one recurrent layer of a
``RowSet`` (one sequence or a batch).

A hybrid model's recurrent layer (gated delta, Mamba) reads ``cache[i]`` (its state
component i for every row, or None before the first token), assigns ``cache[i] = new``
and calls ``cache.advance(T)``; it may read ``lengths``/``left_padding`` (None: pagedkv
rows carry no padding) and ``make_mask`` (None). Everything goes to the row set, which
keeps the state in a ``StatePool`` slot per row and makes the recurrent layers part of
the atomic step (:mod:`pagedkv.row_states`).

Ownership: the face owns nothing; the row set owns the slots.
"""

from __future__ import annotations

import mlx.core as mx

from pagedkv.errors import KvShapeError, NotSupportedError
from pagedkv.row_set import RowSet


class PagedStateCache:
    lengths = None  # no padded rows: pagedkv rows hold exactly their tokens
    left_padding = None

    def __init__(self, rows: RowSet, layer: int) -> None:
        self.rows = rows
        self.layer = layer  # the recurrent layer (index into the state pool's layers)

    def __getitem__(self, component: int) -> mx.array | None:
        self.rows.check_alive()
        return self.rows.states.get(self.layer, component)

    def __setitem__(self, component: int, value: mx.array) -> None:
        self.rows.set_state(self.layer, component, value)

    def advance(self, n: int) -> None:
        """The layer's new state covers ``n`` more tokens per row."""
        self.rows.advance_state(self.layer, n)

    def make_mask(self, N: int) -> None:
        """None (no padded rows). mlx-lm's hybrid models ask for it at the top of every
        forward, before any layer runs, so states a failed earlier forward handed in
        without finishing its step are dropped here and can never be read."""
        self.rows.check_alive()
        self.rows.states.drop_pending()
        return None

    @property
    def offset(self) -> int:
        """Tokens the (first) row's state has absorbed."""
        self.rows.check_alive()
        return int(self.rows.states.tokens[self.layer, 0]) if self.rows.num_rows else 0

    @property
    def batch_size(self) -> int:
        return self.rows.num_rows

    @property
    def state(self) -> list[mx.array]:
        """Owned copies of the rows' state components ([rows, *shape] each)."""
        self.rows.check_alive()
        if self.empty():
            raise KvShapeError("cache is empty")
        out = [self.rows.states.get(self.layer, c) for c in range(len(self.rows.states.pool.shapes[self.layer]))]
        out = [mx.array(x) for x in out]
        mx.eval(out)
        return out

    def storage(self) -> list[mx.array]:
        """The pool arrays of this layer (see ``StatePool.storage``; do not keep them)."""
        return self.rows.states.pool.storage(self.layer)

    def empty(self) -> bool:
        return not self.rows.num_rows or not self.rows.states.tokens[self.layer].any()

    def size(self) -> int:
        return 0

    @property
    def nbytes(self) -> int:
        """This layer's share of the state slots the rows hold."""
        states = self.rows.states
        return states.pool.layer_bytes(self.layer) * int((states.slots != states.pool.null_slot).sum())

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        raise NotSupportedError("recurrent state cannot be trimmed")

    def __repr__(self) -> str:
        return f"PagedStateCache(layer={self.layer}, rows={self.rows.num_rows})"
