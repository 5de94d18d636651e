"""Misuse found by driving the public API with hostile sequences (issue 12): each case is
a typed error that leaves the allocator, the pool and every table byte-for-byte as they
were, or the corrected behaviour."""

import copy
import gc
import warnings
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache
from snapshots import state_of, state_pool_of

from allocators import FreeListAllocator, InvalidArgument, SortedAllocator
from pagedkv import (
    AffineQuant,
    DiskTier,
    DrafterKv,
    InvalidTypeError,
    InvalidValueError,
    KvAttentionView,
    KvDTypeError,
    KvShapeError,
    KvSharingPlan,
    NotSupportedError,
    PagedBatch,
    PagedKVCache,
    PagePool,
    PageTable,
    PlainKv,
    PoolExhausted,
    PrefixCache,
    QuantKv,
    ReleasedError,
    StatePool,
    TrimError,
    kv_pages_for,
    make_paged_cache,
    pages_for,
    raise_cache_limit,
)
from pagedkv.row_set import LayerLayout, TableSpec


def P(**k):
    return PagePool(**{**dict(num_layers=1, num_kv_heads=1, head_dim=4, page_size=4, num_pages=16,
                              dtype=mx.float32), **k})


def t(x, n=1):
    return (mx.full((1, 1, n, 4), float(x)),) * 2


def M(n=1):
    return SimpleNamespace(layers=[0] * n)


class SlidingThenFull:
    """A model shape with a sliding-window layer (8) before a full-attention layer."""

    layers = [0, 0]

    def make_cache(self):
        return [RotatingKVCache(8), KVCache()]


def keys_of(cache) -> list[float]:
    return cache.state[0][0, 0, :, 0].tolist()


# 1 ------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [FreeListAllocator, SortedAllocator])
def test_incref_listing_a_page_more_times_than_the_pool_has_pages_counts_every_listing(make):
    a = make(4)
    (page,) = a.allocate(1).tolist()
    a.incref([page] * 9)
    assert a.refcount(page) == 10
    a.decref([page] * 10)
    a.check()
    assert a.num_in_use() == 0


def test_a_view_over_two_rows_sharing_pages_in_a_tiny_pool_is_created_and_released():
    p = P(page_size=1, num_pages=8)
    c = make_paged_cache(M(), p)
    c[0].update_and_fetch(*t(1, 5))
    b = PagedBatch(p, 1)
    b.extend(c.fork())
    b.extend(c.fork())
    b.caches[0].update_and_fetch(*(mx.ones((2, 1, 1, 4)),) * 2)
    kv = b.caches[0].fetch_shared()
    kv.release()
    b.release()
    c.release()
    p.allocator.check()
    assert p.allocator.num_in_use() == 0


# 2 ------------------------------------------------------------------------------------
def test_a_step_that_cannot_get_pages_for_every_layer_writes_no_layer():
    p = P(num_layers=2, num_pages=4)
    c = make_paged_cache(SlidingThenFull(), p)
    before = state_of(p, c)
    with pytest.raises(PoolExhausted):
        c[0].update_and_fetch(*t(1, 8))
    assert state_of(p, c) == before
    assert [x.offset for x in c] == [0, 0]


@pytest.mark.parametrize("model", [SlidingThenFull(), M(3)], ids=["sliding then full", "three layers"])
def test_a_later_layer_with_bad_input_rolls_the_whole_step_back(model):
    """The bad layer is the step's last: the first layer opened the step, and with three
    layers a later one wrote its share too."""
    n = len(model.layers)
    p = P(num_layers=n, num_pages=16)
    c = make_paged_cache(model, p)
    for layer in range(n):
        c[layer].update_and_fetch(*t(1, 3))
    before = state_of(p, c, arrays=False)
    for layer in range(n - 1):
        c[layer].update_and_fetch(*t(2, 2))
    with pytest.raises(KvDTypeError):
        c[n - 1].update_and_fetch(*(x.astype(mx.float16) for x in t(2, 2)))
    after = state_of(p, c, arrays=False)
    assert after[2] == before[2]  # tables and every layer's position
    assert after[0][1:] == before[0][1:]  # page states, counts, LRU, free list
    for layer in range(n):  # and the step runs again as if it never started
        c[layer].update_and_fetch(*t(3, 2))
        assert keys_of(c[layer]) == [1, 1, 1, 3, 3]


def test_the_positions_a_write_returns_cannot_move_the_step():
    p = P(num_layers=3, num_pages=16)
    c = make_paged_cache(M(3), p)
    starts = [c.rows.write(layer, *t(1, 3)) for layer in range(3)]
    starts += [c.rows.write(layer, *t(2)) for layer in range(2)]  # the last layer of the step is to come
    assert [s.tolist() for s in starts] == [[0]] * 3 + [[3]] * 2
    for s in starts:  # each a copy, or the step's own positions, read-only
        if s.flags.writeable:
            s[:] = 99
        else:
            with pytest.raises(ValueError):
                s[:] = 99
    assert c.rows.write(2, *t(2)).tolist() == [3]
    assert c.rows.offsets.tolist() == [[4]] * 3 and c.rows.step_starts.tolist() == [[3]] * 3
    for layer in range(3):
        c[layer].update_and_fetch(*t(3))
        assert keys_of(c[layer]) == [1, 1, 1, 2, 3]


def test_a_one_sequence_cache_refuses_a_batch_of_two_at_any_layer_and_changes_nothing():
    p = P(num_layers=2, num_pages=16)
    c = make_paged_cache(M(2), p)
    for layer in range(2):
        c[layer].update_and_fetch(*t(1, 3))
    two = (mx.zeros((2, 1, 1, 4)),) * 2
    before = state_of(p, c)
    with pytest.raises(NotSupportedError, match="PagedBatch"):
        c[0].update_and_fetch(*two)
    assert state_of(p, c) == before
    c[0].update_and_fetch(*t(2))
    with pytest.raises(NotSupportedError, match="PagedBatch"):
        c[1].update_and_fetch(*two)  # a later layer: the step is taken back
    assert state_of(p, c, arrays=False)[::2] == before[::2]


# 3, 10, and the quantised reference matrix live in test_quantized_reference.py
# 4 ------------------------------------------------------------------------------------
@pytest.mark.parametrize("use", [
    lambda c: c[0].state,
    lambda c: c[0].fetch_shared("plain"),
    lambda c: c[0].fetch_shared("view"),
    lambda c: c[0].trim(1),
    lambda c: c[0].update_and_fetch(*t(5)),
    lambda c: c[0].keys_and_values(),
    lambda c: c[0].make_mask(1),
    lambda c: c.fork(),
    lambda c: c.release(),
    lambda c: KvAttentionView.of_cache(c[0]),
])
def test_a_released_cache_raises_released_error_instead_of_reading_reused_pages(use):
    p = P()
    pc = make_paged_cache(M(), p)
    pc[0].update_and_fetch(*t(1, 3))
    pc.release()
    other = make_paged_cache(M(), p)
    other[0].update_and_fetch(*t(9, 3))  # takes the freed pages
    before = state_of(p, other)
    with pytest.raises(ReleasedError):
        use(pc)
    assert state_of(p, other) == before


# 5, 6 ---------------------------------------------------------------------------------
def windowed_cache(writes=13):
    c = PagedKVCache(PageTable(P(), window=4), 0)
    for i in range(writes):
        c.update_and_fetch(*t(i))
    return c


def test_trim_past_what_the_window_still_holds_raises_trim_error_and_changes_nothing():
    c = windowed_cache()
    assert c.max_trim() == 2  # pages before token 8 left; a query at 11 needs keys 8..11
    before = state_of(c.pool, c)
    for n in (3, 4, 9):
        with pytest.raises(TrimError):
            c.trim(n)
        assert state_of(c.pool, c) == before
    assert c.offset == 13 and c.table.num_tokens == 13


def test_windowed_trim_within_the_held_keys_then_attends_over_real_keys():
    c = windowed_cache()
    assert c.is_trimmable()
    c.trim(2)
    k, _ = c.update_and_fetch(*t(100))
    assert k[0, 0, :, 0].tolist() == [8, 9, 10, 100]


@pytest.mark.parametrize("step", [1, 3, 6])
def test_a_windowed_cache_can_always_take_back_its_last_step(step):
    c = windowed_cache(13)
    c.update_and_fetch(*t(50, step))
    assert c.is_trimmable() and c.max_trim() >= step
    c.trim(step)
    k, _ = c.update_and_fetch(*t(100))
    assert k[0, 0, :, 0].tolist() == [10, 11, 12, 100]


def test_a_refused_write_of_a_layer_trimmed_alone_leaves_the_open_step_of_the_others():
    """Layer 1 was trimmed on its own, so it is not a layer of the step layer 0 opened:
    its refused write changes nothing, and layer 0 keeps what it wrote."""
    p = P(num_layers=2, num_pages=16)
    c = make_paged_cache(M(2), p)
    for layer in range(2):
        c[layer].update_and_fetch(*t(1, 3))
    c[1].trim(1)
    c[0].update_and_fetch(*t(2, 2))
    before = state_of(p, c, arrays=False)
    with pytest.raises(KvDTypeError):
        c[1].update_and_fetch(*(x.astype(mx.float16) for x in t(3, 1)))
    assert state_of(p, c, arrays=False) == before
    assert keys_of(c[0]) == [1, 1, 1, 2, 2]
    c[1].update_and_fetch(*t(3, 3))
    assert keys_of(c[1]) == [1, 1, 3, 3, 3]
    assert keys_of(c[0]) == [1, 1, 1, 2, 2]


# 7 ------------------------------------------------------------------------------------
def test_rewriting_a_trimmed_layer_copies_pages_a_fork_shares():
    a = make_paged_cache(M(2), P(num_layers=2))
    for layer in range(2):
        a[layer].update_and_fetch(*t(1, 6))
    f = a.fork()
    a[0].trim(2)
    a[0].update_and_fetch(*t(77))
    assert keys_of(f[0]) == [1] * 6
    assert keys_of(a[0]) == [1, 1, 1, 1, 77]
    assert keys_of(a[1]) == [1] * 6


def test_rewriting_a_trimmed_layer_copies_pages_a_live_view_covers():
    a = make_paged_cache(M(2), P(num_layers=2))
    for layer in range(2):
        a[layer].update_and_fetch(*t(1, 6))
    view = KvAttentionView.of_cache(a[0])
    a[0].trim(2)
    a[0].update_and_fetch(*t(77))
    assert view.keys_values()[0][0, 0, :, 0].tolist() == [1] * 6
    view.release()


# 8 ------------------------------------------------------------------------------------
def test_a_view_refuses_a_table_of_another_pool():
    p1, p2 = P(), P()
    c = make_paged_cache(M(), p1)
    c[0].update_and_fetch(*t(1, 3))
    before = state_of(p2)
    with pytest.raises(InvalidValueError, match="pool"):
        KvAttentionView(p2, 0, [c.tables[0]])
    assert state_of(p2) == before


# 9 ------------------------------------------------------------------------------------
def test_prefix_register_refuses_a_windowed_table_and_registers_nothing():
    c = windowed_cache()
    prefix = PrefixCache(c.pool)
    before = state_of(c.pool, c)
    with pytest.raises(NotSupportedError):
        prefix.register(c.table, list(range(13)))
    assert state_of(c.pool, c) == before
    assert prefix.match(list(range(20))) == []


BAD_TOKEN_IDS = {
    "a str among ints": (InvalidTypeError, [1, 2, 3, 4, 5, 6, 7, "x", 9]),
    "an int past 64 bits": (InvalidValueError, [1, 2, 3, 4, 5, 6, 7, 2**64, 9]),
    "a uint64 past int64": (InvalidValueError, np.array([1, 2, 3, 4, 5, 6, 7, 2**63, 9], np.uint64)),
    "floats": (InvalidTypeError, np.arange(9, dtype=np.float32)),
    "a 2-d array": (InvalidTypeError, np.arange(9)[None]),
    "a str": (InvalidTypeError, "123456789"),
}


@pytest.mark.parametrize("name", list(BAD_TOKEN_IDS))
def test_prefix_register_with_bad_token_ids_registers_nothing(name):
    error, tokens = BAD_TOKEN_IDS[name]
    p = P()
    c = make_paged_cache(M(), p)
    c[0].update_and_fetch(*t(1, 9))
    prefix = PrefixCache(p)
    before = state_of(p, c)
    with pytest.raises(error):
        prefix.register(c, tokens)
    assert state_of(p, c) == before
    assert prefix.stats().registered_pages == 0


def test_token_ids_as_numpy_or_mlx_arrays_key_the_pages_a_list_keys():
    p = P()
    c = make_paged_cache(M(), p)
    c[0].update_and_fetch(*t(1, 9))
    prefix = PrefixCache(p)
    tokens = [5, 1, 4, 1, 5, 9, 2, 6, 5]
    assert prefix.register(c, np.array(tokens, np.int32)) == 9 // p.page_size
    pages = c.tables[0].page_ids(0, 9 // p.page_size).tolist()
    assert prefix.match(tokens) == pages
    assert prefix.match(mx.array(tokens + [3])) == pages
    assert prefix.match(np.array(tokens, np.uint16)) == pages


# 11 -----------------------------------------------------------------------------------
def test_a_cache_moved_into_a_batch_can_no_longer_write_its_row():
    p = P()
    c = make_paged_cache(M(), p)
    c[0].update_and_fetch(*t(1, 3))
    old = c[0]
    b = PagedBatch(p, 1)
    b.extend(c)
    before = state_of(p, b)
    with pytest.raises(ReleasedError, match="moved into a batch"):
        old.update_and_fetch(*t(5))
    with pytest.raises(ReleasedError, match="moved into a batch"):
        b.extend(c)
    assert state_of(p, b) == before
    b.release()


# 12 -----------------------------------------------------------------------------------
def test_a_drafter_over_a_windowed_target_sees_every_key_the_target_holds():
    p = P()
    c = make_paged_cache(M(), p, max_kv_size=4)
    for i in range(13):
        c[0].update_and_fetch(*t(i))
    with DrafterKv(c, [0]) as drafter:
        k, _ = drafter.view(0).keys_values()
        assert k[0, 0, :, 0].tolist() == [8, 9, 10, 11, 12]
        q = mx.ones((1, 1, 1, 4))
        out = drafter.attend(0, q, 0.5, window=4)
        ref = mx.fast.scaled_dot_product_attention(q, k[:, :, 1:], k[:, :, 1:], scale=0.5)
        assert mx.allclose(out, ref)
        for bad in (1, False):  # (False found layer 0)
            with pytest.raises(InvalidValueError):
                drafter.view(bad)


# 13 -----------------------------------------------------------------------------------
def _quant_triple(length=3):
    return (mx.zeros((1, 1, length, 2), dtype=mx.uint32), mx.zeros((1, 1, length, 1)), mx.zeros((1, 1, length, 1)))


def _batch_of_one(pool: PagePool) -> PagedBatch:
    batch = PagedBatch(pool, 1)
    batch.extend(make_paged_cache(M(), pool))
    return batch


BAD_CALLS = {
    "cache layer 1.5": (InvalidTypeError, lambda p: PagedKVCache(PageTable(p), 1.5)),
    "cache layer True": (InvalidTypeError, lambda p: PagedKVCache(PageTable(p), True)),
    "cache layer past the pool": (InvalidValueError, lambda p: PagedKVCache(PageTable(p), 1)),
    "table window True": (InvalidTypeError, lambda p: PageTable(p, window=True)),
    "table window 0": (InvalidValueError, lambda p: PageTable(p, window=0)),
    "table of no pool": (InvalidTypeError, lambda p: PageTable("pool")),
    "batch of more layers than the pool": (InvalidValueError, lambda p: PagedBatch(p, 5)),
    "quant kv bits 7 group 0": (InvalidValueError, lambda p: QuantKv(_quant_triple(), _quant_triple(), bits=7,
                                                                     group_size=0, offset=0)),
    "quant kv group 0": (InvalidValueError, lambda p: QuantKv(_quant_triple(), _quant_triple(), bits=4,
                                                              group_size=0, offset=0)),
    "quant kv keys 3 values 5": (KvShapeError, lambda p: QuantKv(_quant_triple(3), _quant_triple(5), bits=4,
                                                                 group_size=32, offset=0)),
    "plain kv keys 3 values 5": (KvShapeError, lambda p: PlainKv(mx.zeros((1, 1, 3, 4)), mx.zeros((1, 1, 5, 4)),
                                                                 offset=0)),
    "copy float page ids": (InvalidArgument, lambda p: p.copy_pages([1.5], [0])),
    "copy into the null page": (InvalidValueError, lambda p: p.copy_pages([1], [0])),
    "copy into a free page": (InvalidValueError, lambda p: p.copy_pages([1], [15])),
    "copy lengths differ": (InvalidValueError, lambda p: p.copy_pages([1, 2], [3])),
    "codec 'fp'": (InvalidTypeError, lambda p: P(k_codec="fp")),
    "pool of 10**9 layers": (InvalidValueError, lambda p: P(num_layers=10**9)),
    "pool of one page": (InvalidValueError, lambda p: P(num_pages=1)),
    "step on an empty batch": (KvShapeError, lambda p: PagedBatch(p, 1).caches[0].update_and_fetch(
        *(mx.zeros((0, 1, 1, 4)),) * 2)),
    "pages_for page size 0": (InvalidValueError, lambda p: pages_for(3, 0)),
    "pages_for a float": (InvalidTypeError, lambda p: pages_for(3.0, 4)),
    "a cache limit of True bytes": (InvalidTypeError, lambda p: raise_cache_limit(True)),
    "pages needed for 2.5 tokens": (InvalidTypeError, lambda p: PageTable(p).pages_needed(2.5)),  # (they answered)
    "pages needed from 1.5": (InvalidTypeError, lambda p: PageTable(p).pages_needed(2, start=1.5)),
    "a rewind of 2.5 tokens": (InvalidTypeError, lambda p: PageTable(p, window=4).max_rewind(2.5)),
    "a rewind check to True": (InvalidTypeError, lambda p: PageTable(p, window=4).check_rewind(True)),
    "pages dropped at -1": (InvalidValueError, lambda p: PageTable(p, window=4).drops_pages_at(-1)),
    "layer arrays of layer -1": (InvalidValueError, lambda p: p.layer_arrays(-1)),
    "storage of a layer past the pool": (InvalidValueError, lambda p: p.storage(p.num_layers)),
    "storage of layer -1": (InvalidValueError, lambda p: p.storage(-1)),
    "written of layer 0.0": (InvalidTypeError, lambda p: p.written(0.0)),
    "donor of layer -1": (InvalidValueError, lambda p: KvSharingPlan(["S", "F", "S"], 1).donor_of(-1)),
    "donor of a layer past the plan": (InvalidValueError, lambda p: KvSharingPlan(["S", "F", "S"], 1).donor_of(3)),
    "sharers of donor -1": (InvalidValueError, lambda p: KvSharingPlan(["S", "F", "S"], 1).sharers_of(-1)),
    "a sharing plan of no donor": (InvalidValueError, lambda p: KvSharingPlan(["S", "F"], 2)),
    "fetch_shared of an unknown kind": (InvalidValueError, lambda p: make_paged_cache(M(), p)[0].fetch_shared("x")),
    "a cache of no pool": (InvalidTypeError, lambda p: make_paged_cache(M(), "pool")),
    "a mask for 2.5 queries": (InvalidTypeError, lambda p: make_paged_cache(M(), p)[0].make_mask(2.5)),
    "a mask for -1 queries": (InvalidValueError, lambda p: make_paged_cache(M(), p)[0].make_mask(-1)),
    "a mask of window True": (InvalidTypeError, lambda p: make_paged_cache(M(), p)[0].make_mask(2, window_size=True)),
    "a batch's mask of window 0": (InvalidValueError, lambda p: _batch_of_one(p).caches[0].make_mask(1, window_size=0)),
    "a batch's mask for 1.0 queries": (InvalidTypeError, lambda p: _batch_of_one(p).caches[0].make_mask(1.0)),
    "an aligned take from -1": (InvalidValueError, lambda p: PrefixCache(p).aligned_take(-1, 4)),
    "a layout's pages for 2.5 tokens": (InvalidTypeError, lambda p: LayerLayout.uniform(p, [0]).pages_for(2.5)),
    "a cache of max_kv_size 5.5": (InvalidTypeError, lambda p: make_paged_cache(M(), p, max_kv_size=5.5)),
    "a cache of max_kv_size 0 for a model that makes its caches": (InvalidValueError, lambda p: make_paged_cache(
        SimpleNamespace(layers=[0], make_cache=lambda: [KVCache()]), p, max_kv_size=0)),
    "a cache of a sliding pool that is not a pool": (InvalidTypeError, lambda p: make_paged_cache(M(), p, sliding_pool=3)),
    "quant kv of float packed keys": (KvShapeError, lambda p: QuantKv(
        (mx.zeros((1, 1, 3, 2)),) + _quant_triple()[1:], _quant_triple(), bits=4, group_size=32, offset=0)),
    "quant kv of 3-d packed keys": (KvShapeError, lambda p: QuantKv(
        tuple(x[0] for x in _quant_triple()), _quant_triple(), bits=4, group_size=32, offset=0)),
    "kv_pages_for 0 pool layers": (InvalidValueError, lambda p: kv_pages_for(M(2), 8, 4, 0)),
    "a layout's recurrent slot past its slots": (InvalidValueError, lambda p: LayerLayout(
        (TableSpec(p, None),), ((0, 0),), state_slots=(2,), state_pool=StatePool([[((4,), mx.float32)]], num_slots=2))),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_input_raises_a_typed_error_and_changes_nothing(name):
    error, call = BAD_CALLS[name]
    p = P()
    c = make_paged_cache(M(), p)
    c[0].update_and_fetch(*t(1, 5))
    before = state_of(p, c)
    with pytest.raises(error):
        call(p)
    assert state_of(p, c) == before


STATE_POOL_BAD_CALLS = {
    "layer bytes of layer -1": (InvalidValueError, lambda s: s.layer_bytes(-1)),
    "storage of layer -1": (InvalidValueError, lambda s: s.storage(-1)),
    "storage of a layer past the pool": (InvalidValueError, lambda s: s.storage(2)),
    "read of layer -1": (InvalidValueError, lambda s: s.read(-1, 0, mx.array([1]))),
    "read of component -1": (InvalidValueError, lambda s: s.read(1, -1, mx.array([1]))),
    "read of layer 1.0": (InvalidTypeError, lambda s: s.read(1.0, 0, mx.array([1]))),
    "check of layer -1": (InvalidValueError, lambda s: s.check_state(-1, 0, mx.zeros((1, 3)), 1)),
    "write of layer -1": (InvalidValueError, lambda s: s.write(-1, [mx.ones((1, 3))], mx.array([1]))),
    "step write of layer True": (InvalidTypeError, lambda s: s.step_write(True, [mx.ones((1, 3))], mx.array([1]))),
}


@pytest.mark.parametrize("name", list(STATE_POOL_BAD_CALLS))
def test_a_state_pool_refuses_a_layer_or_component_out_of_range_and_changes_nothing(name):
    # -1 would otherwise name the last layer, whose state has the same shape here
    error, call = STATE_POOL_BAD_CALLS[name]
    states = StatePool([[((3,), mx.float32)], [((3,), mx.float32)]], num_slots=3)
    states.write(0, [mx.ones((1, 3))], mx.array([1]))
    before = state_pool_of(states)
    with pytest.raises(error):
        call(states)
    assert state_pool_of(states) == before


def test_every_value_error_is_a_value_error_and_every_type_error_a_type_error():
    with pytest.raises(ValueError):
        P(num_pages=1)
    with pytest.raises(ValueError):
        P(num_pages=0)
    with pytest.raises(TypeError):
        P(num_pages=1.0)
    with pytest.raises(ValueError):
        FreeListAllocator(1, null_page=True)
    with pytest.raises(TypeError):
        FreeListAllocator("4")


def test_batch_misuse_names_the_mistake():
    p = P()
    b = PagedBatch(p, 1)
    c = make_paged_cache(M(), p)
    c[0].update_and_fetch(*t(1, 3))
    b.extend(c)
    before = state_of(p, b)
    with pytest.raises(InvalidValueError, match="row"):
        b.extract(3)
    with pytest.raises(InvalidValueError, match="row"):
        b.filter([0, 5])
    with pytest.raises(InvalidTypeError):
        b.extend([1, 2])
    assert state_of(p, b) == before
    b.release()
    with pytest.raises(ReleasedError):
        b.caches[0].update_and_fetch(*t(1))
    with pytest.raises(ReleasedError):
        b.extract(0)


def test_a_row_sets_row_indices_are_checked_and_a_refused_call_changes_nothing():
    """``RowSet`` is public: a negative row used to split off a row set with a table and
    no positions, and ``keep_rows`` kept a row it released ([-1]) or one table as two
    rows ([0, 0])."""
    p = P()
    b = PagedBatch(p, 1)
    for n in (3, 6):
        c = make_paged_cache(M(), p)
        c[0].update_and_fetch(*t(1, n))
        b.extend(c)
    rows = b.rows
    before = state_of(p, b)
    for bad, error in ((-1, InvalidValueError), (2, InvalidValueError), ("0", InvalidTypeError),
                       (1.0, InvalidTypeError)):
        with pytest.raises(error):
            rows.split_row(bad)
        with pytest.raises(error):
            rows.row_tables(bad)
    for bad, error in (([-1], InvalidValueError), ([0, 0], InvalidValueError), ([2], InvalidValueError),
                       ([0, "1"], InvalidTypeError), ({0, 1}, InvalidTypeError), ("01", InvalidTypeError)):
        with pytest.raises(error):
            rows.keep_rows(bad)
    assert state_of(p, b) == before
    rows.keep_rows([1])  # what is left works: the 6-token row
    assert rows.num_rows == 1 and rows.row_tables(0)[0].num_tokens == 6
    b.release()
    assert p.allocator.num_in_use() == 0
    empty = PagedBatch(p, 1).rows
    with pytest.raises(KvShapeError, match="no"):
        empty.split_row(0)


def test_adopt_takes_only_distinct_pages_in_use_and_a_refusal_leaves_the_table_empty():
    """``adopt`` used to list any id it was given: -1 read the pool's last page and
    then failed at release; a free page was read and handed out again."""
    p = P()
    held = p.allocator.allocate(3).tolist()
    for bad, error in (([-1], ValueError), ([99], ValueError), (["a"], TypeError),
                       ([9], InvalidValueError), ([0, held[0]], InvalidValueError),
                       ([held[0], held[0]], InvalidValueError)):
        table = PageTable(p)
        before = state_of(p, table)
        with pytest.raises(error):
            table.adopt(bad)
        assert state_of(p, table) == before and table.num_pages == 0
    for tokens, error in ((10.5, InvalidTypeError), ("10", InvalidTypeError), (8, InvalidValueError),
                          (13, InvalidValueError)):  # (10.5 was taken: the table held a float count)
        table = PageTable(p)
        with pytest.raises(error):
            table.adopt(held, num_tokens=tokens)
        assert table.num_pages == table.num_tokens == 0
    table = PageTable(p)
    table.adopt(held, num_tokens=10)
    assert table.pages.tolist() == held and table.num_tokens == 10
    with pytest.raises(InvalidValueError):
        table.page_ids(0, -1)  # (a negative stop read the table's spare capacity)
    with pytest.raises(InvalidValueError):
        table.page_ids(-1, 2)
    assert table.page_ids(1, 9).tolist() == held[1:]
    table.release()
    assert p.allocator.num_in_use() == 0


def test_a_prefix_cache_or_disk_tier_of_something_else_than_a_pool_is_a_type_error(tmp_path):
    with pytest.raises(InvalidTypeError):
        PrefixCache("pool")
    with pytest.raises(InvalidTypeError):
        DiskTier(tmp_path / "a", "pool", max_bytes=1 << 20)
    with pytest.raises(InvalidTypeError):
        DiskTier(tmp_path / "b", P(), max_bytes=1 << 20, model_id=5)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # (refused before any directory)


def test_a_views_window_and_mask_are_checked_and_its_mask_is_gone_after_release():
    """A window of 0 or less used to attend over no key and return zeros, silently."""
    p = P(num_kv_heads=2)
    c = PagedKVCache(PageTable(p), 0)
    k = mx.random.normal((1, 2, 6, 4), key=mx.random.key(0))
    c.update_and_fetch(k, k)
    view = KvAttentionView.of_cache(c)
    q = mx.ones((1, 4, 1, 4))
    for bad in (0, -1):
        with pytest.raises(InvalidValueError):
            view.attend(q, 0.5, window=bad)
        with pytest.raises(InvalidValueError):
            view.valid_mask(1, True, window=bad)
    with pytest.raises(InvalidValueError):
        view.attend(q, 0.5, mask="bogus")
    with pytest.raises(InvalidValueError):
        view.valid_mask(0, True)
    assert view.attend(q, 0.5, window=2).shape == (1, 4, 1, 4)
    view.release()
    with pytest.raises(ReleasedError):
        view.valid_mask(1, True)
    c.table.release()
    assert p.allocator.num_in_use() == 0


def test_prefix_keys_refuse_a_start_outside_their_tokens():
    keys = PrefixCache(P()).keys(list(range(9)))
    for bad in (-3, 10):
        with pytest.raises(InvalidValueError):
            keys.token_ids(bad)
    assert keys.token_ids(5) == [5, 6, 7, 8] and keys.token_ids(9) == []


def test_a_cache_dropped_without_release_says_its_pages_stay_in_use():
    """As an unclosed file does (``python -W default`` or ``-X dev`` shows it); nothing
    is given back, since a finalizer may run on another thread mid-call."""
    p = P()
    with warnings.catch_warnings():  # (earlier tests' unreleased caches: collected, unheard, now)
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
    gc.disable()  # (and none of theirs collected in the middle of this test)
    try:
        check_a_dropped_cache_warns(p)
    finally:
        gc.enable()


def check_a_dropped_cache_warns(p: PagePool) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        kept = make_paged_cache(M(), p)
        kept[0].update_and_fetch(*t(1, 9))
        moved = make_paged_cache(M(), p)
        moved[0].update_and_fetch(*t(1, 5))
        batch = PagedBatch(p, 1)
        batch.extend(moved)  # its table lives on in the batch
        released = make_paged_cache(M(), p)
        released[0].update_and_fetch(*t(1, 5))
        released.release()
        del moved, released
        gc.collect()
        assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
        del kept
        gc.collect()
    leaks = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert len(leaks) == 1 and "3 pages" in leaks[0]
    assert p.allocator.num_in_use() == 3 + 2  # the dropped cache's, and the batch's
    batch.release()


def test_a_deep_copy_of_a_cache_or_batch_is_refused_with_a_pointer_to_fork():
    """mlx-lm deep-copies the prompt caches it keeps for reuse; a paged one raised
    "cannot pickle 'Dtype' object" from inside the pool."""
    p = P()
    c = make_paged_cache(M(), p)
    c[0].update_and_fetch(*t(1, 5))
    b = PagedBatch(p, 1)
    b.extend(c.fork())
    before = state_of(p, c, b)
    for obj in (c, c[0], list(c), b, b.caches):
        with pytest.raises(NotSupportedError, match="fork"):
            copy.deepcopy(obj)
    assert state_of(p, c, b) == before


def test_setting_a_caches_offset_lower_trims_and_higher_is_refused():
    """The setter used to take any value: ``offset = 100`` on 9 tokens made ``state``
    read 100, the rest from pages never written."""
    p = P()
    c = PagedKVCache(PageTable(p), 0)
    c.update_and_fetch(*t(1, 9))
    before = state_of(p, c)
    for bad, error in ((10, InvalidValueError), (-1, InvalidValueError), (2.0, InvalidTypeError)):
        with pytest.raises(error):
            c.offset = bad
    assert state_of(p, c) == before
    c.offset -= 6  # as mlx-lm's KVCache: a trim, which gives back the pages past the end
    assert c.offset == c.table.num_tokens == 3 and c.table.num_pages == pages_for(3, p.page_size)
    assert mx.array_equal(c.state[0], t(1, 9)[0][..., :3, :])


def test_a_state_too_large_for_the_pool_raises_before_the_layer_is_emptied():
    p = P(num_pages=3)
    c = PagedKVCache(PageTable(p), 0)
    c.update_and_fetch(*t(1, 4))
    before = state_of(p, c)
    with pytest.raises(PoolExhausted):
        c.state = t(2, 12)
    assert state_of(p, c) == before


def test_a_state_that_is_not_a_keys_values_pair_is_a_type_error_and_changes_nothing():
    c = PagedKVCache(PageTable(P()), 0)
    c.update_and_fetch(*t(1, 4))
    before = state_of(c.rows.layout.specs[0].pool, c)
    k, _ = t(1, 2)
    for bad in ((k,), (k, k, k), k, None):
        with pytest.raises(InvalidTypeError):
            c.state = bad
    assert state_of(c.rows.layout.specs[0].pool, c) == before


def test_bf16_pages_with_the_default_affine_codec_keep_values_beyond_fp16_range():
    p = P(dtype=mx.bfloat16, head_dim=64, k_codec=AffineQuant(8, 64), v_codec=AffineQuant(8, 64))
    c = PagedKVCache(PageTable(p), 0)
    k = mx.full((1, 1, 1, 64), 7e4, dtype=mx.bfloat16)
    c.update_and_fetch(k, k)
    got = c.state[0].astype(mx.float32)
    assert not mx.isnan(got).any().item()
    assert mx.allclose(got, k.astype(mx.float32), rtol=1e-2).item()


def test_a_full_pool_at_a_new_step_leaves_an_unfinished_earlier_step_alone():
    p = P(num_layers=2, num_pages=5)
    c = make_paged_cache(SlidingThenFull(), p)
    for layer in range(2):
        c[layer].update_and_fetch(*t(1, 4))
    c[0].update_and_fetch(*t(2, 4))  # layer 1 never writes this step
    before = state_of(p, c)
    with pytest.raises(PoolExhausted):
        c[0].update_and_fetch(*t(3, 8))
    assert state_of(p, c) == before
    assert keys_of(c[0]) == [1, 1, 1, 1, 2, 2, 2, 2]


@pytest.mark.parametrize("call", [
    "prefill chunk 0", "prefill chunk 2.0", "generate max_tokens -1", "generate prefill_chunk 0",
    "generate empty prompt", "generate id past the vocabulary", "generate negative id",
    "prefill id past the vocabulary", "prefill float id", "prefill bool id", "generate temperature nan",
    "generate temperature -1", "generate temperature '1'", "generate eos 5", "generate eos 'a'", "generate eos -1"])
def test_generate_and_prefill_refuse_bad_arguments_before_writing_anything(call):
    """A chunk of 0 tokens (which would never advance), a negative token budget, an
    empty prompt or a token id the embedding does not have (MLX reads past the table
    and the model writes what it read: it generated tokens from such prompts) raise a
    typed error and the cache holds no token and no page. (A NaN temperature sampled
    garbage; "1" raised a bare TypeError after the prompt was written; an eos of 5 or
    "a" was taken apart or raised one.)"""
    from tiny_models import VOCAB, make_model, make_pool

    from pagedkv import InvalidTypeError, InvalidValueError, make_paged_cache
    from pagedkv.generation import generate, prefill

    model, pool = make_model("llama"), make_pool("llama", page_size=4)
    calls = {
        "prefill chunk 0": lambda c: prefill(model, c, [1, 2, 3], 0),
        "prefill chunk 2.0": lambda c: prefill(model, c, [1, 2, 3], 2.0),
        "generate max_tokens -1": lambda c: list(generate(model, c, [1, 2, 3], max_tokens=-1)),
        "generate prefill_chunk 0": lambda c: list(generate(model, c, [1, 2, 3], max_tokens=2, prefill_chunk=0)),
        "generate empty prompt": lambda c: list(generate(model, c, [], max_tokens=2)),
        "generate id past the vocabulary": lambda c: list(generate(model, c, [1, 2, VOCAB], max_tokens=2)),
        "generate negative id": lambda c: list(generate(model, c, [1, -3, 2], max_tokens=2)),
        "prefill id past the vocabulary": lambda c: prefill(model, c, [1] * 9 + [VOCAB + 5], 4),
        "prefill float id": lambda c: prefill(model, c, [1, 2.0, 3]),
        "prefill bool id": lambda c: prefill(model, c, [True, 2, 3]),
        "generate temperature nan": lambda c: list(generate(model, c, [1, 2], max_tokens=2, temperature=float("nan"))),
        "generate temperature -1": lambda c: list(generate(model, c, [1, 2], max_tokens=2, temperature=-1)),
        "generate temperature '1'": lambda c: list(generate(model, c, [1, 2], max_tokens=2, temperature="1")),
        "generate eos 5": lambda c: list(generate(model, c, [1, 2], max_tokens=2, eos_ids=5)),
        "generate eos 'a'": lambda c: list(generate(model, c, [1, 2], max_tokens=2, eos_ids="a")),
        "generate eos -1": lambda c: list(generate(model, c, [1, 2], max_tokens=2, eos_ids=[-1])),
    }
    with make_paged_cache(model, pool) as cache:
        with pytest.raises(InvalidTypeError if "2.0" in call or "'" in call or "eos 5" in call else InvalidValueError):
            calls[call](cache)
        assert cache.num_tokens == 0 and pool.allocator.num_in_use() == 0


def test_kv_pages_for_a_pool_of_fewer_layers_counts_each_group_of_the_models_layers():
    assert kv_pages_for(M(2), 8, 4) == kv_pages_for(M(2), 8, 4, 2) == 1 + 2  # the null page, 2 pages of 4
    assert kv_pages_for(M(2), 8, 4, 1) == 1 + 2 * 2  # both layers in the pool's one layer: two tables


def test_an_empty_cache_says_so_until_its_first_write_and_again_after_a_trim_to_zero():
    c = make_paged_cache(M(2), P(num_layers=2))
    assert all(layer.empty() for layer in c)
    c[0].update_and_fetch(*t(1, 3))
    assert not c[0].empty() and c[1].empty()
    c[0].trim(3)
    assert c[0].empty()
    c.release()


def test_every_layer_of_a_kind_owns_the_mask_its_kinds_faces_made_for_the_next_step():
    """A layer may let the kernels apply the rows' ranges only for a mask that says no
    more: the one ``make_mask`` of any layer of its kind made for this step."""
    p = P(num_layers=2)
    c = make_paged_cache(M(2), p)
    c[0].update_and_fetch(*t(1, 3))
    c[1].update_and_fetch(*t(1, 3))
    mask = c[1].make_mask(2, return_array=True)
    assert c.rows.owns_mask(1, mask) and c.rows.owns_mask(0, mask)
    assert not c.rows.owns_mask(1, mx.array(mask))  # an equal mask the caller made: not vouched for
    assert c.rows.owns_mask(1, None) and c.rows.owns_mask(1, "causal")
    c.release()


def test_values_of_another_dtype_are_refused_after_a_write_of_the_same_shapes():
    """The pool remembers shapes that passed its check; a later write of those shapes
    with values of another dtype must still be refused, and change nothing."""
    p = P()
    c = make_paged_cache(M(), p)
    c[0].update_and_fetch(*t(1, 2))
    c[0].update_and_fetch(*t(2, 2))  # (the shapes are remembered now)
    before = state_of(p, c)
    keys = mx.full((1, 1, 2, 4), 3.0)
    for bad in ((keys, keys.astype(mx.float16)), (keys.astype(mx.float16), keys)):
        with pytest.raises(KvDTypeError):
            c[0].update_and_fetch(*bad)
        assert state_of(p, c) == before
    c.release()


def test_a_sliding_layers_mask_without_a_window_size_is_the_mask_for_its_own_window():
    """mlx-lm's models that do not pass ``window_size`` get the layer's window."""
    c = make_paged_cache(SlidingThenFull(), P(num_layers=2))
    for n in (3, 1, 1, 4, 2):
        for layer in c:
            for queries in (1, 3):
                got, want = layer.make_mask(queries), layer.make_mask(queries, window_size=layer.window)
                assert (got is None and want is None) or (isinstance(got, str) and got == want) \
                    or mx.array_equal(got, want).item(), (layer.offset, queries)
        for layer in c:
            layer.update_and_fetch(*t(n, n))
    sliding = c[0]
    assert sliding.offset >= sliding.window == 8
    narrower = sliding.make_mask(1, window_size=7)  # one key fewer than the layer holds for its query
    assert narrower is not None and np.array(narrower).reshape(-1).tolist() == [False] + [True] * 7
    c.release()
