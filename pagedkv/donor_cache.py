"""``DonorCache``: runs an unmodified mlx-lm model through a ``ForwardPass``.

mlx-lm's KV-sharing models (gemma3n) call ``update_and_fetch`` on a donor layer's cache
and ``keys_and_values()`` on the same cache object from its sharer layers. Wrapping each
``PagedKVCache`` in a ``DonorCache`` turns that into the SharedKv contract: the donor's
write is followed by a ``ViewKv`` of exactly the keys this step may see, registered in
the active pass under the donor's cache slot; sharers (and a drafter) read that same
object, and the pass releases it when the model call is over::

    caches = donor_caches(make_paged_cache(model, pool))
    with ForwardPass():
        logits = model(tokens, cache=caches)
"""

from __future__ import annotations

import mlx.core as mx

from pagedkv.cache import PagedKVCache
from pagedkv.errors import PagedKvError
from pagedkv.forward_pass import ForwardPass


class DonorCache:
    """A donor layer's cache that publishes each step's K/V to the active pass."""

    reads_pages = True  # route_attention sends mlx-lm's attention to ``attend``

    def __init__(self, cache: PagedKVCache, donor: int) -> None:
        self.cache = cache
        self.donor = donor

    @property
    def offset(self) -> int:
        return self.cache.offset

    def make_mask(self, *args, **kwargs):
        return self.cache.make_mask(*args, **kwargs)

    def _pass(self) -> ForwardPass:
        fp = ForwardPass.current()
        if fp is None:
            raise PagedKvError("DonorCache used outside a ForwardPass")
        return fp

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        fp = self._pass()
        self.cache.write(keys, values)
        kv = fp.register(self.donor, self.cache.fetch_shared("view"))
        return kv.keys_values()

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        return self._pass().get(self.donor).keys_values()

    def attend(self, queries: mx.array, scale: float, mask) -> mx.array:
        """The donor's or a sharer's attention over the K/V the donor registered in this
        pass (``route_attention`` calls it; it reads the pages through the view)."""
        return self._pass().get(self.donor).attend(queries, scale, mask)

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> DonorCache:
        """The wrapped cache's answer (``LayerFace.to_quantized``: itself, or
        ``NotSupportedError``), keeping this wrapper where mlx-lm puts the result back
        (through ``__getattr__`` it put the bare cache there: the layer stopped
        publishing its K/V to the pass)."""
        self.cache.to_quantized(group_size=group_size, bits=bits)
        return self

    def __getattr__(self, name):  # size, trim, state, nbytes ... of the wrapped cache
        return getattr(self.cache, name)


def donor_caches(prompt_cache: list[PagedKVCache]) -> list:
    """Wrap every attention cache slot i as the donor i of a pass; a hybrid model's
    recurrent slots have no K/V to share and are passed through as they are."""
    return [DonorCache(c, i) if isinstance(c, PagedKVCache) else c for i, c in enumerate(prompt_cache)]
