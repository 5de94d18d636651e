"""``PagedCacheList``: mlx-lm's ``CacheList`` protocol over pagedkv faces of one layer.

Falcon-H1's layers run Mamba and attention side by side, and mlx-lm gives each layer a
``CacheList(ArraysCache, KVCache)``; the layer reads ``cache[0]`` and ``cache[1]``.
``layout_for`` lays those out as two faces of the row set (a recurrent layer and an
attention layer) and ``layer_faces`` groups them back into one ``PagedCacheList``.

Ownership: none; the row set owns the pages and slots.
"""

from __future__ import annotations

import mlx.core as mx


class PagedCacheList:
    def __init__(self, faces: list) -> None:
        self.caches = tuple(faces)
        self.rows = faces[0].rows

    def __getitem__(self, idx: int):
        return self.caches[idx]

    def is_trimmable(self) -> bool:
        return all(c.is_trimmable() for c in self.caches)

    def trim(self, n: int) -> int:
        """Trim every member. A member that cannot trim raises its own typed error
        first (a hybrid's recurrent member: ``NotSupportedError``), before any is trimmed."""
        for c in self.caches:
            if not c.is_trimmable():
                return c.trim(n)
        return min(c.trim(n) for c in self.caches)

    def empty(self) -> bool:
        return all(c.empty() for c in self.caches)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    def storage(self) -> list[mx.array]:
        """The pool arrays of every member (see ``generation.written_state``)."""
        return [a for c in self.caches for a in c.storage()]

    def __repr__(self) -> str:
        return f"PagedCacheList({', '.join(map(repr, self.caches))})"
