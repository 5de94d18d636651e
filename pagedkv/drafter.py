"""``DrafterKv``: a speculative drafter's read access to the target model's donor K/V.

The drafter holds ``KvAttentionView``s of chosen target layers while it proposes tokens.
It attends with its own queries and its own mask (for example a sliding window); the
target can meanwhile verify, append, and roll back rejected tokens with ``trim``: the
views keep their pages and keep returning what they captured. ``refresh()`` re-captures
the target's current state (releasing the old views); leaving the ``with`` block
releases everything::

    with DrafterKv(target_cache, layers=[3, 7]) as drafter:
        out = drafter.attend(7, q, scale, window=512)
        ...  # target verifies, trims rejected tokens
        drafter.refresh()
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from pagedkv.cache import PagedKVCache
from pagedkv.errors import InvalidValueError, ReleasedError, check_int
from pagedkv.view import KvAttentionView


class DrafterKv:
    def __init__(self, target_cache: Sequence[PagedKVCache], layers: Sequence[int]) -> None:
        self._cache = target_cache
        self.layers = tuple(check_int("layer", i, minimum=0, maximum=len(target_cache) - 1) for i in layers)
        if not self.layers:
            raise InvalidValueError("a drafter needs at least one target layer")
        self._views: dict[int, KvAttentionView] | None = None
        self.refresh()

    def refresh(self) -> None:
        """Capture the target's current K/V for every chosen layer (old views released)."""
        new = {}
        try:
            for layer in self.layers:
                cache = self._cache[layer]  # every key the target still holds
                new[layer] = KvAttentionView.of_cache(cache, start=cache.table.first_visible())
        except BaseException:
            for v in new.values():
                v.release()
            raise
        self._release_views()
        self._views = new

    def view(self, layer: int) -> KvAttentionView:
        if self._views is None:
            raise ReleasedError("DrafterKv used after release()")
        if isinstance(layer, bool) or layer not in self._views:  # (True would find layer 1)
            raise InvalidValueError(f"layer {layer!r} is not one of the drafter's layers {self.layers}")
        return self._views[layer]

    @property
    def length(self) -> int:
        """Tokens captured (the target's offset at the last refresh)."""
        return self.view(self.layers[0]).lengths[0]

    def attend(self, layer: int, q: mx.array, scale: float, mask=None, window: int | None = None) -> mx.array:
        return self.view(layer).attend(q, scale, mask, window=window)

    def _release_views(self) -> None:
        if self._views is not None:
            for v in self._views.values():
                v.release()

    def release(self) -> None:
        if self._views is None:
            raise ReleasedError("DrafterKv released twice")
        self._release_views()
        self._views = None

    def __enter__(self) -> DrafterKv:
        return self

    def __exit__(self, *exc) -> None:
        if self._views is not None:
            self.release()
