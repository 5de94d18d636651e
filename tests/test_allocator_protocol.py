"""A user's allocator plugs into PagePool and PrefixCache through the declared protocol."""

import mlx.core as mx
import pytest
from tiny_models import make_model, prompt_of

from allocators import FreeListAllocator, implements_block_allocator
from allocators.stress import run_stress
from pagedkv import (
    InvalidTypeError,
    InvalidValueError,
    PagePool,
    PageTable,
    PrefixCache,
    make_paged_cache,
)
from pagedkv.generation import generate

PROTOCOL = ("allocate", "incref", "decref", "fork", "touch", "set_cacheable", "is_cacheable", "refcount",
            "page_state", "checked_ids", "num_free", "num_cached", "num_available", "check", "stats")


class CountingAllocator:
    """Not a RefCountingAllocator: a user class that counts calls and delegates."""

    def __init__(self, num_pages: int, null_page: bool = True) -> None:
        self._inner = FreeListAllocator(num_pages, null_page=null_page)
        self.evict_listeners = self._inner.evict_listeners
        self.calls: dict[str, int] = {}

    num_pages = property(lambda self: self._inner.num_pages)
    null_page = property(lambda self: self._inner.null_page)

    def __getattr__(self, name):
        if name not in PROTOCOL:
            raise AttributeError(name)
        fn = getattr(self._inner, name)

        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args, **kwargs)

        return counted


def pool_with(alloc):
    return PagePool(num_layers=3, num_kv_heads=2, head_dim=64, page_size=8, num_pages=alloc.num_pages,
                    dtype=mx.float32, allocator=alloc)


def test_a_user_allocator_satisfies_the_protocol_and_the_stress_harness():
    assert implements_block_allocator(CountingAllocator(64))
    report = run_stress(CountingAllocator(256, null_page=False), "decode", ops=3000, seed=1)
    assert report.leaked == 0


def test_a_user_allocator_serves_caching_with_prefix_hits_and_eviction_listeners():
    model = make_model("llama")
    alloc = CountingAllocator(16)
    pool = pool_with(alloc)
    first, second = PrefixCache(pool), PrefixCache(pool, extra_keys="other")  # two listeners
    evicted: list[int] = []
    alloc.evict_listeners.append(evicted.extend)
    tokens = prompt_of(40, seed=3)
    for _ in range(2):
        cache, rest = first.new_cache(model, tokens)
        out = list(generate(model, cache, rest, max_tokens=4))
        first.register(cache, tokens + out)
        cache.release()
    assert first.stats().hit_pages == 4 and alloc.calls["touch"] == 1
    registered = first.stats().registered_pages
    with make_paged_cache(model, pool) as plain:  # needs most pages: cached ones are evicted
        list(generate(model, plain, prompt_of(100, seed=4), max_tokens=4))
        # every listener heard of the evictions: the prefix cache forgot exactly those pages
        assert evicted and first.stats().registered_pages == registered - len(evicted) == alloc.num_cached()
        assert second.stats().registered_pages == 0 and len(alloc.evict_listeners) == 3
    # one page (a decode step's): the protocol has no set_cacheable_page, so set_cacheable marks it
    keys = second.keys(prompt_of(8, seed=5))
    (page,) = alloc.allocate(1).tolist()
    assert second.register_pages([page], keys) == 1 and alloc.is_cacheable(page)
    alloc.decref([page])
    assert second.match(prompt_of(8, seed=5) + [0]) == [page]
    alloc.check()


def test_an_allocator_missing_part_of_the_protocol_is_refused():
    class NoPrefixCalls:
        def __init__(self):
            self._inner = FreeListAllocator(8, null_page=True)

        def __getattr__(self, name):
            if name in ("touch", "set_cacheable", "evict_listeners"):
                raise AttributeError(name)
            return getattr(self._inner, name)

    with pytest.raises(InvalidTypeError, match="BlockAllocator"):
        pool_with(NoPrefixCalls())


def test_a_batch_append_over_a_user_allocator_asks_page_by_page_and_still_copies_shared_pages():
    from pagedkv import PageTable
    from pagedkv.table import BatchAppend

    alloc = CountingAllocator(32)  # no needs_copy: refcount and is_cacheable per page
    pool = pool_with(alloc)
    table = PageTable(pool)
    table.prepare_write(0, 5)
    table.num_tokens = 5
    other = PageTable(pool)
    other.prepare_write(0, 3)
    other.num_tokens = 3
    assert BatchAppend.plan([table, other], 1) is not None
    assert alloc.calls["refcount"] == 2
    fork = table.fork()  # the partial page is now shared: the batch path steps aside
    assert BatchAppend.plan([table, other], 1) is None
    for t in (table, other, fork):
        t.release()
    alloc.check()


def test_adopt_on_a_user_allocator_takes_only_pages_the_caller_holds():
    """``check_held_pages`` asks ``refcount`` page by page where the allocator has no
    vectorised ``refcounts``."""
    alloc = CountingAllocator(16)
    pool = pool_with(alloc)
    held = alloc.allocate(2).tolist()
    for bad in ([held[0], 9], [held[0], held[0]], [0]):
        table = PageTable(pool)
        with pytest.raises(InvalidValueError):
            table.adopt(bad)
        assert table.num_pages == 0
    table = PageTable(pool)
    table.adopt(held)
    assert alloc.calls["refcount"] >= 2 and table.pages.tolist() == held
    table.release()
    assert alloc.stats().in_use == 0
