"""Random appends / trims / forks / views / releases over several sequences.

After every step: the allocator's invariant holds, every live view returns exactly what
it returned when it was taken, and no page a live view covers is in the free set.
"""

import hypothesis.strategies as st
import mlx.core as mx
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from allocators import PageState
from pagedkv import (
    AffineQuant,
    KvAttentionView,
    PagedKVCache,
    PagePool,
    PageTable,
    PoolExhausted,
    rotated,
)

H, QH, D, PS = 1, 2, 32, 3
SCALE = D ** -0.5


class ViewLifetimes(RuleBasedStateMachine):
    codecs = (None, None)

    def __init__(self):
        super().__init__()
        self.pool = PagePool(num_layers=1, num_kv_heads=H, head_dim=D, page_size=PS, num_pages=24,
                             dtype=mx.float32, cache_limit=None, k_codec=self.codecs[0],
                             v_codec=self.codecs[1])
        self.caches: list[PagedKVCache] = []
        self.views: list[tuple[KvAttentionView, mx.array, mx.array]] = []
        self.counter = 0

    def _kv(self, n):
        self.counter += 1
        mx.random.seed(self.counter)
        return mx.random.normal((1, H, n, D)), mx.random.normal((1, H, n, D))

    def _append(self, cache, n):
        before = self.pool.allocator.stats()
        try:
            cache.update_and_fetch(*self._kv(n))
        except PoolExhausted:
            assert self.pool.allocator.stats() == before

    @precondition(lambda self: len(self.caches) < 4)
    @rule(n=st.integers(1, 7))
    def new_sequence(self, n):
        cache = PagedKVCache(PageTable(self.pool), 0)
        self.caches.append(cache)
        self._append(cache, n)

    @precondition(lambda self: self.caches)
    @rule(data=st.data(), n=st.integers(1, 5))
    def append(self, data, n):
        self._append(data.draw(st.sampled_from(self.caches)), n)

    @precondition(lambda self: self.caches)
    @rule(data=st.data(), n=st.integers(0, 8))
    def trim(self, data, n):
        data.draw(st.sampled_from(self.caches)).trim(n)

    @precondition(lambda self: self.caches and len(self.caches) < 4)
    @rule(data=st.data())
    def fork(self, data):
        src = data.draw(st.sampled_from(self.caches))
        cache = PagedKVCache(src.table.fork(), 0)
        cache.offset = src.offset
        self.caches.append(cache)

    @precondition(lambda self: self.caches)
    @rule(data=st.data())
    def release_sequence(self, data):
        i = data.draw(st.integers(0, len(self.caches) - 1))
        self.caches.pop(i).table.release()

    @precondition(lambda self: any(c.offset for c in self.caches))
    @rule(data=st.data())
    def take_view(self, data):
        cache = data.draw(st.sampled_from([c for c in self.caches if c.offset]))
        view = KvAttentionView.of_cache(cache)
        self.counter += 1
        mx.random.seed(self.counter)
        q = mx.random.normal((1, QH, 1, D))
        want = view.attend(q, SCALE)
        mx.eval(want)
        self.views.append((view, q, want))

    @precondition(lambda self: self.views)
    @rule(data=st.data())
    def release_view(self, data):
        i = data.draw(st.integers(0, len(self.views) - 1))
        self.views.pop(i)[0].release()

    @invariant()
    def views_are_frozen_and_their_pages_are_held(self):
        alloc = self.pool.allocator
        alloc.check()
        for view, q, want in self.views:
            assert mx.array_equal(view.attend(q, SCALE), want)
            for page in view._held.tolist():
                assert alloc.page_state(page) == PageState.IN_USE

    def teardown(self):
        for view, _, _ in self.views:
            view.release()
        for cache in self.caches:
            cache.table.release()
        self.pool.allocator.check()
        assert self.pool.allocator.num_in_use() == 0


class QuantizedViewLifetimes(ViewLifetimes):
    codecs = (AffineQuant(4, 32), rotated(3, D, group_size=32))


TestViewLifetimes = ViewLifetimes.TestCase  # a third of the examples in the quick loop
TestViewLifetimes.settings = settings(max_examples=50, stateful_step_count=30, deadline=None)


@pytest.mark.slow
class TestViewLifetimesThorough(ViewLifetimes.TestCase):
    settings = settings(max_examples=100, stateful_step_count=30, deadline=None)


TestQuantizedViewLifetimes = QuantizedViewLifetimes.TestCase
TestQuantizedViewLifetimes.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestQuantizedViewLifetimes.pytestmark = [pytest.mark.slow]  # (the full-precision machine stays in the fast loop)
