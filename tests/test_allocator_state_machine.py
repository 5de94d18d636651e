"""Random allocate / incref / decref / fork / cache / evict / touch sequences vs a model."""

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from allocators import (
    FreeListAllocator,
    PageState,
    PoolExhausted,
    RefCountError,
    SortedAllocator,
)

N = 12


class AllocatorModel(RuleBasedStateMachine):
    """The model: refcount per page, the cacheable set and the LRU list of cached pages."""

    cls = FreeListAllocator

    def __init__(self):
        super().__init__()
        self.evicted = []
        self.a = self.cls(N, null_page=True, on_evict=self.evicted.extend)
        self.rc = {}  # page -> count for IN_USE pages
        self.cacheable = set()
        self.lru = []

    def _in_use(self):
        return sorted(self.rc)

    @staticmethod
    def _as_given(data, pages):
        """The ids as a list (short lists take the allocator's Python loop) or an array."""
        return np.array(pages, dtype=np.int64) if data.draw(st.booleans()) else pages

    @rule(n=st.integers(0, N))
    def allocate(self, n):
        avail = N - 1 - len(self.rc)
        if n > avail:
            with pytest.raises(PoolExhausted):
                self.a.allocate(n)
            return
        self.evicted.clear()
        short = n - (avail - len(self.lru))
        ids = self.a.allocate(n).tolist()
        expected_evicted = self.lru[: max(0, short)]
        assert self.evicted == expected_evicted
        for p in expected_evicted:
            self.cacheable.discard(p)
        self.lru = self.lru[max(0, short) :]
        assert len(set(ids)) == n and 0 not in ids
        for p in ids:
            assert p not in self.rc and p not in self.lru
            self.rc[p] = 1

    @rule()
    def allocate_page(self):
        avail = N - 1 - len(self.rc)
        if avail == 0:
            with pytest.raises(PoolExhausted):
                self.a.allocate_page()
            return
        self.evicted.clear()
        page = self.a.allocate_page()
        if avail == len(self.lru):  # no free page: the LRU page is evicted into use
            assert self.evicted == [self.lru[0]] == [page]
            self.cacheable.discard(page)
            self.lru.pop(0)
        assert type(page) is int and page not in self.rc and page not in self.lru and page != 0
        self.rc[page] = 1

    @precondition(lambda self: self.rc)
    @rule(data=st.data())
    def decref_page(self, data):
        page = data.draw(st.sampled_from(self._in_use()))
        self.a.decref_page(page)
        self.rc[page] -= 1
        if self.rc[page] == 0:
            del self.rc[page]
            if page in self.cacheable:
                self.lru.append(page)

    @precondition(lambda self: self.rc)
    @rule(data=st.data())
    def incref_or_fork(self, data):
        pages = data.draw(st.lists(st.sampled_from(self._in_use()), min_size=1, max_size=4))
        if data.draw(st.booleans()):
            assert self.a.fork(pages).tolist() == pages
        else:
            self.a.incref(pages)
        for p in pages:
            self.rc[p] += 1

    @precondition(lambda self: self.rc)
    @rule(data=st.data())
    def decref(self, data):
        pages = data.draw(st.lists(st.sampled_from(self._in_use()), min_size=1, max_size=4))
        counts = {p: pages.count(p) for p in pages}
        given = self._as_given(data, pages)
        if any(self.rc[p] < c for p, c in counts.items()):
            with pytest.raises(RefCountError):
                self.a.decref(given)
            return
        self.a.decref(given)
        for p in dict.fromkeys(pages):
            self.rc[p] -= counts[p]
            if self.rc[p] == 0:
                del self.rc[p]
                if p in self.cacheable:
                    self.lru.append(p)

    @rule(page=st.integers(0, N - 1), one=st.booleans())
    def decref_free_page_raises(self, page, one):
        if page in self.rc:
            return
        with pytest.raises((RefCountError, ValueError)):
            self.a.decref_page(page) if one else self.a.decref([page])

    @precondition(lambda self: self.rc or self.lru)
    @rule(data=st.data(), flag=st.booleans())
    def set_cacheable(self, data, flag):
        pages = data.draw(st.lists(st.sampled_from(self._in_use() + self.lru), min_size=1, max_size=4))
        self.a.set_cacheable(self._as_given(data, pages), flag)
        for page in pages:
            if flag:
                self.cacheable.add(page)
            else:
                self.cacheable.discard(page)
                if page in self.lru:
                    self.lru.remove(page)

    @precondition(lambda self: self.rc)
    @rule(data=st.data())
    def set_cacheable_page(self, data):
        page = data.draw(st.sampled_from(self._in_use()))
        self.a.set_cacheable_page(page)
        self.cacheable.add(page)

    @precondition(lambda self: self.lru)
    @rule(data=st.data())
    def touch(self, data):
        pages = data.draw(st.lists(st.sampled_from(self.lru + self._in_use()), min_size=1, max_size=5))
        self.a.touch(self._as_given(data, pages))
        for page in pages:
            if page in self.lru:
                self.lru.remove(page)
                self.rc[page] = 0
            self.rc[page] += 1

    @rule(n=st.integers(0, 4))
    def evict(self, n):
        if n > len(self.lru):
            with pytest.raises(PoolExhausted):
                self.a.evict(n)
            return
        assert self.a.evict(n) == self.lru[:n]
        for p in self.lru[:n]:
            self.cacheable.discard(p)
        self.lru = self.lru[n:]

    @invariant()
    def matches_model(self):
        self.a.check()
        assert self.a.cached_pages() == self.lru
        for p in range(1, N):
            want = self.rc.get(p, 0)
            assert self.a.refcount(p) == want
            state = PageState.IN_USE if want else (PageState.CACHED if p in self.lru else PageState.FREE)
            assert self.a.page_state(p) == state
        st_ = self.a.stats()
        assert st_.in_use == len(self.rc) and st_.cached == len(self.lru)
        assert st_.free + st_.in_use + st_.cached + st_.reserved == N


class FreeListModel(AllocatorModel):
    cls = FreeListAllocator


class SortedModel(AllocatorModel):
    cls = SortedAllocator


# A quarter of the examples in the quick loop (``-m 'not slow'``), the rest in the slow set.
QUICK = settings(max_examples=50, stateful_step_count=50, deadline=None)
THOROUGH = settings(max_examples=150, stateful_step_count=50, deadline=None)
TestFreeListStateMachine = FreeListModel.TestCase
TestFreeListStateMachine.settings = QUICK
TestSortedStateMachine = SortedModel.TestCase
TestSortedStateMachine.settings = QUICK


@pytest.mark.slow
class TestFreeListStateMachineThorough(FreeListModel.TestCase):
    settings = THOROUGH


@pytest.mark.slow
class TestSortedStateMachineThorough(SortedModel.TestCase):
    settings = THOROUGH
