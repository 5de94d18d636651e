"""Behaviour of both allocator strategies: allocation, refcounts, caching, errors."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from allocators import (
    NULL_PAGE,
    FreeListAllocator,
    InvalidArgument,
    InvalidPage,
    InvariantViolation,
    PageState,
    PoolExhausted,
    RefCountError,
    SortedAllocator,
)

STRATEGIES = [FreeListAllocator, SortedAllocator]


@pytest.fixture(params=STRATEGIES, ids=lambda c: c.__name__)
def make(request):
    return request.param


def snapshot(a):
    return (a.stats(), a.cached_pages(), [a.refcount(i) for i in range(a.num_pages)])


def test_allocate_hands_out_distinct_pages_with_count_one(make):
    a = make(10)
    ids = a.allocate(4)
    assert len(set(ids)) == 4
    assert all(a.refcount(i) == 1 and a.page_state(i) == PageState.IN_USE for i in ids)
    assert a.num_free() == 6 and a.num_in_use() == 4
    a.check()


def test_allocate_zero_returns_empty(make):
    a = make(4)
    assert a.allocate(0).size == 0
    assert a.num_free() == 4


def test_exhaustion_is_atomic_and_reports_counts(make):
    a = make(8)
    a.allocate(5)
    before = snapshot(a)
    with pytest.raises(PoolExhausted) as e:
        a.allocate(4)
    assert (e.value.requested, e.value.available) == (4, 3)
    assert isinstance(e.value, MemoryError)
    assert snapshot(a) == before
    a.check()


def test_page_returns_to_free_only_at_zero(make):
    a = make(4)
    (p,) = a.allocate(1)
    a.incref([p])
    a.decref([p])
    assert a.page_state(p) == PageState.IN_USE and a.refcount(p) == 1
    a.decref([p])
    assert a.page_state(p) == PageState.FREE
    a.check()


def test_fork_shares_pages(make):
    a = make(6)
    ids = a.allocate(3)
    shared = a.fork(ids)
    assert shared.tolist() == ids.tolist() and shared is not ids
    assert all(a.refcount(i) == 2 for i in ids)
    a.decref(ids)
    assert a.num_in_use() == 3
    a.decref(shared)
    assert a.num_in_use() == 0
    a.check()


def test_decref_with_repeated_ids_drops_one_reference_each(make):
    a = make(4)
    (p,) = a.allocate(1)
    a.incref([p, p])
    a.decref([p, p])
    assert a.refcount(p) == 1
    before = snapshot(a)
    with pytest.raises(RefCountError):
        a.decref([p, p])
    assert snapshot(a) == before


def test_double_free_raises_and_changes_nothing(make):
    a = make(4)
    x, y = a.allocate(2)
    a.decref([x])
    before = snapshot(a)
    with pytest.raises(RefCountError):
        a.decref([y, x])  # y is valid, x is already free: nothing may change
    assert snapshot(a) == before
    assert a.refcount(y) == 1


def test_incref_of_free_page_raises(make):
    a = make(4)
    before = snapshot(a)
    with pytest.raises(RefCountError):
        a.incref([2])
    assert snapshot(a) == before


@pytest.mark.parametrize("bad", [
    [-1], [4], [0, 99], [2**40], [-2**40], [2**62], [-2**62], np.array([2**63 + 5], dtype=np.uint64),
    np.array([0] * 40 + [-1]), np.array([1] * 40 + [4]), np.array([2] * 40 + [2**56 + 1]), np.array([-2**63] + [3] * 40),
    np.array([0] * 2000 + [-1]), np.array([1] * 2000 + [4]),  # (long lists: checked by a reduction)
], ids=lambda bad: f"{np.asarray(bad).dtype}{np.asarray(bad).tolist()[-3:]}")
def test_out_of_range_ids_raise_invalid_page(make, bad):
    a = make(4)
    a.allocate(4)
    before = snapshot(a)
    wrong = next(int(i) for i in np.asarray(bad).reshape(-1) if not 0 <= int(i) < 4)
    for call in (a.incref, a.decref, a.fork, a.touch):
        with pytest.raises(InvalidPage, match=f"page id {wrong} out of range"):  # (the bad id, not page 0)
            call(bad)
    assert snapshot(a) == before


@pytest.mark.parametrize("null_page, num_pages", [(False, 1), (True, 2)])
def test_the_smallest_allocator_has_one_usable_page(make, null_page, num_pages):
    a = make(num_pages, null_page=null_page)
    page = a.allocate_page()
    assert a.num_available() == 0 and page != a.null_page
    with pytest.raises(PoolExhausted):
        a.allocate(1)
    a.decref_page(page)
    a.check()


def test_a_long_release_caches_only_its_cacheable_pages(make):
    a = make(100)
    ids = a.allocate(40)  # (past the short-list loop: the array path)
    a.set_cacheable(ids[::2])
    a.decref(ids)
    assert sorted(a.cached_pages()) == sorted(ids[::2].tolist())
    assert a.num_free() == 60 + 20 and a.num_cached() == 20
    a.check()


@pytest.mark.parametrize("bad", [[1.0], [True], ["1"], np.zeros((1, 1), np.int64), 3, None, {1}])
def test_non_integer_ids_raise_invalid_argument(make, bad):
    a = make(4)
    a.allocate(2)
    before = snapshot(a)
    with pytest.raises(InvalidArgument):
        a.decref(bad)
    assert snapshot(a) == before


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True, None])
def test_bad_counts_raise_invalid_argument(make, bad):
    a = make(4)
    with pytest.raises(InvalidArgument):
        a.allocate(bad)
    with pytest.raises(InvalidArgument):
        a.evict(bad)
    assert a.num_free() == 4


def test_numpy_ids_are_accepted(make):
    a = make(8)
    ids = np.asarray(a.allocate(3), dtype=np.int32)
    a.incref(ids)
    a.decref(ids)
    a.decref(ids)
    assert a.num_in_use() == 0


def test_null_page_is_never_handed_out(make):
    a = make(5, null_page=True)
    assert a.null_page == NULL_PAGE
    ids = a.allocate(4)
    assert NULL_PAGE not in ids
    with pytest.raises(PoolExhausted):
        a.allocate(1)
    for call in (a.incref, a.decref, a.touch):
        with pytest.raises(InvalidPage):
            call([NULL_PAGE])
    st = a.stats()
    assert (st.reserved, st.in_use, st.free) == (1, 4, 0)
    a.check()


def test_cacheable_pages_become_cached_then_evict_in_lru_order(make):
    evicted = []
    a = make(6, on_evict=evicted.extend)
    ids = a.allocate(4).tolist()
    a.set_cacheable(ids[:3])
    a.decref([ids[2], ids[0], ids[1]])  # release order = LRU order
    assert a.cached_pages() == [ids[2], ids[0], ids[1]]
    assert a.num_free() == 2 and a.num_available() == 5
    a.touch([ids[2]])  # revived: count 1, out of the LRU
    assert a.page_state(ids[2]) == PageState.IN_USE and a.refcount(ids[2]) == 1
    assert a.evict(1) == [ids[0]]
    assert evicted == [ids[0]]
    assert a.page_state(ids[0]) == PageState.FREE
    assert not a.is_cacheable(ids[0])
    a.check()


def test_allocate_evicts_cached_pages_only_when_free_runs_out(make):
    evicted = []
    a = make(4, on_evict=evicted.extend)
    ids = a.allocate(4).tolist()
    a.set_cacheable(ids)
    a.decref(ids)
    assert a.num_free() == 0 and a.num_cached() == 4
    got = a.allocate(3)
    assert evicted == ids[:3] and sorted(got) == sorted(ids[:3])
    assert a.cached_pages() == [ids[3]]
    assert a.stats().pages_evicted == 3
    a.check()


def test_uncaching_a_cached_page_frees_it(make):
    a = make(3)
    (p,) = a.allocate(1)
    a.set_cacheable([p])
    a.decref([p])
    a.set_cacheable([p], False)
    assert a.page_state(p) == PageState.FREE and a.num_cached() == 0
    a.check()


def test_a_release_listing_a_page_twice_caches_in_first_sight_order(make):
    a = make(8)
    p, q = a.allocate(2).tolist()
    a.incref([p])  # p is held twice: it reaches 0 at its second listing, after q
    a.set_cacheable([p, q])
    a.decref([p, q, p])
    assert a.cached_pages() == [p, q]  # least recently used first: the order ids were first listed
    a.check()


def test_a_full_allocator_has_no_free_run(make):
    a = make(4)
    a.allocate(4)
    st = a.stats()
    assert (st.free_runs, st.largest_free_run) == (0, 0)


def test_touch_of_free_page_and_evict_past_cached_raise(make):
    a = make(3)
    before = snapshot(a)
    with pytest.raises(RefCountError):
        a.touch([1])
    with pytest.raises(PoolExhausted):
        a.evict(1)
    assert snapshot(a) == before


def test_stats_count_peak_and_counters(make):
    a = make(8)
    x = a.allocate(5)
    a.decref(x[:3])
    a.allocate(1)
    st = a.stats()
    assert (st.total, st.in_use, st.free, st.peak_in_use) == (8, 3, 5, 5)
    assert (st.pages_allocated, st.pages_freed) == (6, 3)
    assert st.available == 5


@pytest.mark.parametrize("n", [3, 40], ids=["short list", "array path"])
def test_peak_in_use_counts_the_cached_pages_a_touch_revives(make, n):
    a = make(64)
    pages = a.allocate(n)
    a.set_cacheable(pages)
    a.decref(pages)  # all cached, none in use: the peak so far is n
    a.allocate(5)
    a.touch(pages)  # n revived next to the 5
    assert a.stats().peak_in_use == n + 5
    a.decref(pages)
    assert a.stats().peak_in_use == n + 5 and a.num_in_use() == 5


def test_peak_in_use_counts_a_contiguous_allocation():
    a = SortedAllocator(64)
    a.allocate(5)
    run = a.allocate_contiguous(40)
    assert a.stats().peak_in_use == 45
    a.decref(run)
    assert a.stats().peak_in_use == 45 and a.num_in_use() == 5


def test_free_list_reuses_most_recently_freed_page_first():
    a = FreeListAllocator(8)
    ids = a.allocate(4).tolist()
    a.decref([ids[1]])
    a.decref([ids[3]])
    assert a.allocate(2).tolist() == [ids[3], ids[1]]


def test_sorted_hands_out_lowest_ids_and_reports_fragmentation():
    a = SortedAllocator(10)
    ids = a.allocate(10).tolist()
    a.decref([ids[7], ids[2], ids[3], ids[8], ids[9]])
    st = a.stats()
    assert (st.free_runs, st.largest_free_run) == (2, 3)
    assert a.allocate(1).tolist() == [2]


def test_sorted_allocate_contiguous_finds_a_run_or_fails_atomically():
    a = SortedAllocator(10)
    a.allocate(10)
    a.decref([1, 3, 4, 6, 7, 8])
    assert a.allocate_contiguous(3).tolist() == [6, 7, 8]
    before = snapshot(a)
    with pytest.raises(PoolExhausted) as e:
        a.allocate_contiguous(3)
    assert e.value.available == 2
    assert snapshot(a) == before
    assert a.allocate_contiguous(2).tolist() == [3, 4]
    assert a.allocate_contiguous(1).tolist() == [1]
    a.check()
    fresh = SortedAllocator(5)
    assert fresh.allocate_contiguous(5).tolist() == [0, 1, 2, 3, 4]  # a run of every page
    fresh.check()


def test_check_detects_a_corrupted_state(make):
    a = make(4)
    ids = a.allocate(2)
    a._refcount[ids[0]] = 0  # simulate a bug: in use with no reference
    with pytest.raises(InvariantViolation):
        a.check()


def test_debug_env_runs_check_after_every_call(make, monkeypatch):
    monkeypatch.setenv("PAGEDKV_CHECK_INVARIANTS", "1")
    a = make(4)
    ids = a.allocate(2)
    a._state[ids[0]] = 2  # corrupt (in use, marked CACHED); the next mutating call must notice
    with pytest.raises(InvariantViolation):
        a.allocate(1)


def test_single_page_queries_validate_their_argument(make):
    a = make(4)
    (p,) = a.allocate(1).tolist()
    assert a.refcount(p) == 1 and a.page_state(np.int64(p)) == PageState.IN_USE
    with pytest.raises(InvalidPage):
        a.refcount(4)
    with pytest.raises(InvalidPage):
        a.is_cacheable(-1)
    for bad in (1.0, True, "1", None):
        with pytest.raises(InvalidArgument):
            a.page_state(bad)


def test_one_page_calls_refuse_bad_input_and_change_nothing(make):
    a = make(4, null_page=True)
    page = a.allocate_page()
    before = (a.stats(), a._refcount.tobytes(), a._state.tobytes())
    for bad, error in ((0, InvalidPage), (4, InvalidPage), (-1, InvalidPage), (1.0, InvalidArgument),
                       (True, InvalidArgument), (page + 1, RefCountError)):
        with pytest.raises(error):
            a.decref_page(bad)
        assert (a.stats(), a._refcount.tobytes(), a._state.tobytes()) == before
    for bad, error in ((0, InvalidPage), (4, InvalidPage), (-1, InvalidPage), (1.0, InvalidArgument),
                       (True, InvalidArgument), (page + 1, RefCountError)):
        with pytest.raises(error):
            a.set_cacheable_page(bad)
        assert (a.stats(), a._refcount.tobytes(), a._state.tobytes(), a._cacheable.tobytes()) == before + (bytes(4),)
    a.decref_page(np.int64(page))  # numpy ints are page ids too
    assert a.num_free() == 3
    a.allocate(3)
    with pytest.raises(PoolExhausted):
        a.allocate_page()
    a.check()


def test_set_cacheable_page_keeps_the_page_cached_as_set_cacheable_does(make):
    one, many = make(4), make(4)
    for a, mark in ((one, lambda a, p: a.set_cacheable_page(p)), (many, lambda a, p: a.set_cacheable([p]))):
        p, q = a.allocate_page(), a.allocate_page()
        mark(a, p)
        mark(a, np.int64(q))  # numpy ints too
        a.decref([q, p])
        assert a.cached_pages() == [q, p] and a.is_cacheable(p)
        a.check()
    assert snapshot(one) == snapshot(many)


def test_the_lru_log_keeps_order_and_stays_bounded_through_many_cache_and_revive_cycles(make):
    a = make(64)
    pages = a.allocate(64)
    a.set_cacheable(pages)
    a.decref(pages)  # all cached, 0 oldest
    order = pages.tolist()
    rng = np.random.default_rng(0)
    for _ in range(20_000):  # revive a random cached page and cache it again: it becomes newest
        p = int(rng.integers(64))
        a.touch([p])
        a.decref_page(p)
        order.remove(p)
        order.append(p)
    assert a.cached_pages() == order
    assert len(a._log) <= 2 * 64 + 1024 + 1  # compacted, not 20 064 entries
    assert a.evict(5) == order[:5]
    assert sorted(a.allocate_page() for _ in range(5)) == sorted(order[:5])  # the freed pages
    a.check()


@pytest.mark.parametrize("batched", [False, True])
def test_pages_cached_before_a_log_compaction_stay_cached_and_are_evicted_first(make, batched):
    # Only half the cached pages are revived and cached again (one page at a time, or
    # 33 at a time: past the short loops, the array path), so the log compacts around
    # the other half, whose entries must stay live where compaction moved them.
    a = make(128)
    pages = a.allocate(128)
    a.set_cacheable(pages)
    a.decref(pages)
    order = pages.tolist()
    rng = np.random.default_rng(1)
    for _ in range(200 if batched else 3000):
        if batched:
            picked = rng.choice(64, size=33, replace=False)
            a.touch(picked)
            a.decref(picked)
            picked = picked.tolist()
        else:
            picked = [int(rng.integers(64))]
            a.touch(picked)
            a.decref_page(picked[0])
        for p in picked:
            order.remove(p)
            order.append(p)
    assert len(a._log) < 3000  # compacted at least once
    assert a.cached_pages() == order and a.num_cached() == 128
    a.check()
    assert a.evict(64) == order[:64]  # the half never revived, oldest first
    assert a.num_cached() == 64 and a.cached_pages() == order[64:]
    a.check()


def test_refcounts_reads_every_listed_pages_count_as_refcount_does(make):
    a = make(8)
    pages = a.allocate(3)
    a.incref([int(pages[1])])
    a.decref([int(pages[2])])  # free again: 0
    assert a.refcounts(pages).tolist() == [a.refcount(int(p)) for p in pages] == [1, 2, 0]
    for bad in ([8], [-1]):
        with pytest.raises(InvalidPage):
            a.refcounts(bad)


def test_needs_copy_is_true_exactly_for_shared_or_cacheable_pages(make):
    a = make(8)
    pages = a.allocate(4)
    a.incref([int(pages[1])])  # shared
    a.set_cacheable([int(pages[2])])  # kept for a prefix cache
    got = a.needs_copy(pages)
    assert got.tolist() == [False, True, True, False]
    assert got.tolist() == [a.refcount(int(p)) > 1 or a.is_cacheable(int(p)) for p in pages]
    assert a.needs_copy([]).tolist() == []
    before = snapshot(a)
    for bad in ([8], [-1], [int(pages[0]), 99]):
        with pytest.raises(InvalidPage):
            a.needs_copy(bad)
    with pytest.raises(TypeError):
        a.needs_copy([1.5])
    assert snapshot(a) == before
    a.check()


@pytest.mark.parametrize("size", [2, 32, 33, 80])
def test_short_lists_and_arrays_take_the_loop_and_end_where_the_array_path_ends(make, size):
    """Lists and arrays of up to 32 ids take a Python loop (decref, touch,
    set_cacheable); a tuple always takes the array path. The same calls given each way
    end in the same state, refusals included, and a refusal anywhere in the list
    changes nothing."""
    def run(wrap):
        a = make(2 * size + 4, null_page=True)
        pages = a.allocate(2 * size).tolist()
        held, cached = pages[:size], pages[size:]
        a.set_cacheable(wrap(cached))
        a.decref(wrap(cached[::-1]))  # all cached, newest first in the LRU
        a.touch(wrap(cached[: size // 2] + cached[:1]))  # revive half, the first twice
        a.incref(wrap(held))
        errors = []
        for call, ids in ((a.decref, held + [held[0]]),  # one id listed twice: dropped twice
                          (a.decref, held[1:] + [held[1]]),  # held[1] has no reference left for the repeat
                          (a.decref, held[:-1] + [cached[-1]]),  # a CACHED page at the end
                          (a.touch, cached + [2 * size + 3]),  # a FREE page at the end
                          (a.touch, cached[:1] + [-1]),
                          (a.decref, held[:1] + [10 * size]),
                          (a.set_cacheable, held[1:] + [2 * size + 3]),  # a FREE page at the end
                          (a.set_cacheable, held[1:] + [-1]),
                          (a.set_cacheable, held[1:])):  # marked: dropping them now caches them
            before = snapshot(a)
            try:
                call(wrap(ids))
            except (RefCountError, InvalidPage) as e:
                errors.append(type(e).__name__)
                assert snapshot(a) == before
        a.decref(wrap(held[1:]))
        a.check()
        return snapshot(a), errors

    as_list = run(list)
    assert as_list == run(lambda ids: np.array(ids, dtype=np.int64)) == run(tuple)
    assert as_list[1] == ["RefCountError", "RefCountError", "RefCountError", "InvalidPage", "InvalidPage",
                          "RefCountError", "InvalidPage"]


@settings(max_examples=150, deadline=None)
@given(dtype=st.sampled_from(["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]),
       values=st.lists(st.one_of(st.integers(-3, 12), st.integers(-2**63, 2**64 - 1)), max_size=40),
       repeat=st.sampled_from([1, 60]))
def test_an_id_array_of_any_integer_dtype_is_read_exactly_or_refused_whole(dtype, values, repeat):
    """``refcounts`` of ids of any integer dtype, short (a Python loop's range check) or
    long (the array's): the counts of the ids as the dtype holds them, or ``InvalidPage``
    exactly when one of them is not a page."""
    a = FreeListAllocator(10)
    a.allocate(10)
    a.incref([3, 3])
    info = np.iinfo(dtype)
    ids = np.array([v for v in values if info.min <= v <= info.max] * repeat, dtype=dtype)
    if all(0 <= int(v) < 10 for v in ids.tolist()):
        assert a.refcounts(ids).tolist() == [3 if int(v) == 3 else 1 for v in ids.tolist()]
    else:
        with pytest.raises(InvalidPage):
            a.refcounts(ids)
