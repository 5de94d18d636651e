"""PagePool writes and reads, PageTable prepare_write/trim/fork/release, bad input."""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache
from tiny_models import PAGE_KINDS, codecs_for

from pagedkv import (
    AffineQuant,
    InvalidTypeError,
    InvalidValueError,
    KvAttentionView,
    KvDTypeError,
    KvShapeError,
    NotSupportedError,
    PagedKVCache,
    PagePool,
    PageTable,
    PoolExhausted,
    ReleasedError,
    rotated,
)
from pagedkv.kernels import paged_decode
from pagedkv.pool import head_rows_for
from pagedkv.table import BatchAppend, check_dropped, peak_pages

H, D = 2, 32


def pool_of(num_pages=16, page_size=4, dtype=mx.float32, layers=2, pages="fp"):
    k_codec, v_codec = codecs_for(pages, D)
    return PagePool(num_layers=layers, num_kv_heads=H, head_dim=D, page_size=page_size,
                    num_pages=num_pages, dtype=dtype, k_codec=k_codec, v_codec=v_codec)


def kv(t, dtype=mx.float32, seed=0):
    mx.random.seed(seed)
    return (mx.random.normal((1, H, t, D)).astype(dtype), mx.random.normal((1, H, t, D)).astype(dtype))


def pool_snapshot(pool):
    arrays = []
    arrays += [(np.array(k), np.array(v)) for ks, vs in zip(pool._k, pool._v) for k, v in zip(ks, vs)]
    return pool.allocator.stats(), arrays


@pytest.mark.parametrize("tokens, window, rewind, chunk, pages", [
    (100, None, 0, 16, 25),  # no window: every page
    (100, 12, 0, 0, 4),  # between forwards: the window's 12 tokens can straddle 4 pages
    (100, 12, 0, 1, 5),  # a decode step: the window and two tokens
    (100, 12, 0, 16, 12),  # 12 + 2 * 16 = 44 tokens: 11 pages, and one for a straddle
    (100, 12, 5, 16, 14),  # 5 tokens of rewind more: 49 tokens, 13 pages and one
    (10, 12, 0, 16, 3),  # a sequence shorter than that: its own pages
])
def test_peak_pages_of_a_sliding_table_is_its_window_and_two_forwards_not_the_sequence(
        tokens, window, rewind, chunk, pages):
    assert peak_pages(tokens, 4, window, rewind, chunk) == pages


def test_check_dropped_allows_what_no_query_sees_and_refuses_the_rest():
    check_dropped(20, None, 0, 4)  # nothing dropped: any table
    check_dropped(20, 8, 3, 4)  # a query at 20 sees from 13 on: pages 0-2 hold 0-11
    for num_tokens, window, dropped in ((20, 8, 4), (20, None, 1), (20, 8, -1)):
        with pytest.raises(InvalidValueError):
            check_dropped(num_tokens, window, dropped, 4)


def test_a_pools_repr_names_its_page_kinds():
    plain = PagePool(num_layers=2, num_kv_heads=1, head_dim=64, page_size=4, num_pages=8, dtype=mx.float16)
    assert "dtype=mlx.core.float16, k=float16, v=float16" in repr(plain)
    packed = PagePool(num_layers=2, num_kv_heads=1, head_dim=64, page_size=4, num_pages=8, dtype=mx.float16,
                      k_codec=AffineQuant(bits=8, group_size=32), v_codec=rotated(4, 64))
    assert "k=8-bit/g32, v=4-bit/g64 rotated" in repr(packed)


def test_pool_sizes_from_a_byte_budget():
    """The most pages whose arrays fit: 35 pages in 35 pages' bytes, but 31 in 32 pages'
    bytes, as 32 pages of 16 take a row more per head (``head_rows_for``)."""
    per_page = 4 * 2 * (64 + 64) * 2 * 16
    for budget, pages in ((35 * per_page + 100, 35), (1 << 20, 31)):
        p = PagePool(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16, max_bytes=budget, dtype=mx.float16)
        assert p.bytes_per_page == per_page and p.num_pages == p.rows_per_head == pages
        assert p.nbytes <= budget < p.nbytes + p.bytes_per_page * 2
        assert p.allocator.num_pages == pages and p._k[0][0].shape[0] == 2 * pages
    with pytest.raises(InvalidValueError, match="fewer than 2 pages"):  # 2 pages of 128 would take 3 rows
        PagePool(num_layers=1, num_kv_heads=1, head_dim=8, page_size=128, max_bytes=2 * 128 * 16 * 2 + 100)


@pytest.mark.parametrize("pages", PAGE_KINDS)
def test_a_pool_of_a_round_size_takes_one_row_more_per_head_which_no_page_uses(pages):
    """A pool whose pages hold a multiple of 256 tokens a head (64 pages of 4) takes
    65 rows a head, so that views into it are never what MLX's CUDA attention misreads
    (``paged_decode.mlx_attention_misreads``). Page p of head h is row h * 65 + p in
    every array of every codec; the extra row stays zero through writes of every
    page, copies and page loads, and pages read back as written, also into a pool
    without the extra row."""
    assert [head_rows_for(n, ps) for n, ps in ((64, 4), (63, 4), (16, 16), (17, 16), (3, 256), (2, 128))] == \
        [65, 63, 17, 17, 3, 3]
    pool, plain = pool_of(num_pages=64, page_size=4, pages=pages), pool_of(num_pages=67, page_size=4, pages=pages)
    assert pool.rows_per_head == 65 and pool.nbytes == 65 * pool.bytes_per_page and plain.rows_per_head == 67
    assert all(a.shape[0] == H * 65 for ks in pool._k + pool._v for a in ks)
    table, got = PageTable(pool), []
    for p in (pool, plain):  # every usable page of the round pool: 248 tokens, then one more
        cache = PagedKVCache(PageTable(p) if p is plain else table, 0)
        cache.update_and_fetch(*kv(62 * 4, seed=1))
        got.append(cache.update_and_fetch(*kv(1, seed=2)))
    flat = [[x for _, x in tree_flatten(g)] for g in got]  # (quantised pages come as their parts)
    assert all(mx.array_equal(a, b) for a, b in zip(*flat))  # as a pool with no extra row reads them
    ids = table.page_ids(0, table.num_pages)
    assert sorted(ids.tolist()) == list(range(1, 64)) and pool.allocator.num_free() == 0
    pool.copy_pages(ids[:1], ids[1:2])
    pool.write_pages(ids[2:3], pool.read_pages(ids[:1]))
    for layer in range(pool.num_layers):
        for a in pool.storage(layer):
            rows = np.array(a.astype(mx.float32)).reshape(H, 65, *a.shape[1:])
            assert not rows[:, 64].any()  # the extra row of every head stays zero
            assert rows[:, 1:64].any() == (layer == 0)  # (the cache wrote layer 0)
    read = pool.read_pages(ids[:3])
    assert all(np.array_equal(r[0], r[1]) and np.array_equal(r[0], r[2]) for r in read.values())
    held = plain.allocator.allocate(3)  # pages as bytes move between pools of other row counts
    plain.write_pages(held, read)
    assert all(np.array_equal(a, b) for a, b in zip(plain.read_pages(held).values(), read.values()))
    plain.allocator.decref(held)
    table.release()
    assert pool.allocator.num_in_use() == 0


@pytest.mark.parametrize("kwargs", [dict(num_pages=0), dict(page_size=0), dict(num_pages=8, max_bytes=10),
                                    dict(num_pages=None), dict(dtype=mx.int32)])
def test_pool_rejects_bad_configuration(kwargs):
    base = dict(num_layers=1, num_kv_heads=1, head_dim=8, page_size=4, num_pages=8)
    base.update(kwargs)
    with pytest.raises((ValueError, TypeError)):
        PagePool(**base)


def test_the_write_kernel_is_refused_where_there_is_no_cuda_gpu_and_off_by_default():
    base = dict(num_layers=1, num_kv_heads=1, head_dim=8, page_size=4, num_pages=8)
    with pytest.raises(InvalidTypeError):
        PagePool(**base, write_kernel="yes")
    assert not PagePool(**base).write_kernel
    assert not PagePool(**base, write_kernel=False).write_kernel
    if not paged_decode.available():
        with pytest.raises(InvalidValueError, match="CUDA"):
            PagePool(**base, write_kernel=True)


def test_the_write_kernel_comes_on_where_a_layout_writes_a_pool_in_groups_on_a_cuda_gpu():
    from tiny_models import kv_dims, make_model

    from pagedkv import kv_pool_layers, layout_for

    model = make_model("gemma3_text")
    _, heads, head_dim = kv_dims("gemma3_text")
    kw = dict(num_kv_heads=heads, head_dim=head_dim, num_pages=64, dtype=mx.float32)
    grouped, per_layer = (PagePool(num_layers=n, **kw) for n in (kv_pool_layers(model), len(model.layers)))
    forced = PagePool(num_layers=kv_pool_layers(model), write_kernel=False, **kw)
    assert not grouped.write_kernel and not per_layer.write_kernel
    for pool in (grouped, per_layer, forced):
        layout_for(model, pool)
    assert grouped.write_kernel == paged_decode.available()  # (the scatter copies there: page_write)
    assert not per_layer.write_kernel and not forced.write_kernel


def test_pool_needs_an_allocator_of_its_size_with_a_null_page():
    from allocators import FreeListAllocator, SortedAllocator

    base = dict(num_layers=1, num_kv_heads=1, head_dim=8, page_size=4, num_pages=8)
    with pytest.raises(ValueError, match="null page"):
        PagePool(**base, allocator=FreeListAllocator(8))
    with pytest.raises(ValueError, match="pages"):
        PagePool(**base, allocator=FreeListAllocator(9, null_page=True))
    pool = PagePool(**base, allocator=SortedAllocator(8, null_page=True))
    assert pool.null_page == 0


def test_cache_returns_what_was_written_across_pages():
    pool = pool_of()
    cache = PagedKVCache(PageTable(pool), 0)
    k1, v1 = kv(6, seed=1)
    k2, v2 = kv(3, seed=2)
    cache.update_and_fetch(k1, v1)
    k, v = cache.update_and_fetch(k2, v2)
    assert mx.array_equal(k, mx.concatenate([k1, k2], axis=2))
    assert mx.array_equal(v, mx.concatenate([v1, v2], axis=2))
    assert cache.offset == 9 and cache.table.num_pages == 3


@pytest.mark.parametrize("pages", PAGE_KINDS)
def test_tokens_written_across_pages_read_back_as_written_at_once_on_every_page_kind(pages):
    pool = pool_of(pages=pages)
    split, whole = PagedKVCache(PageTable(pool), 0), PagedKVCache(PageTable(pool), 1)
    k1, v1 = kv(6, seed=1)
    k2, v2 = kv(3, seed=2)
    split.update_and_fetch(k1, v1)
    split.update_and_fetch(k2, v2)
    whole.update_and_fetch(mx.concatenate([k1, k2], axis=2), mx.concatenate([v1, v2], axis=2))
    assert all(mx.array_equal(a, b) for a, b in zip(split.state, whole.state))
    assert split.offset == 9 and split.table.num_pages == 3


@pytest.mark.parametrize(
    "keys,values,error",
    [
        (mx.zeros((H, 3, D)), mx.zeros((H, 3, D)), KvShapeError),  # wrong rank
        (mx.zeros((1, H + 1, 3, D)), mx.zeros((1, H + 1, 3, D)), KvShapeError),  # heads
        (mx.zeros((1, H, 3, D + 1)), mx.zeros((1, H, 3, D + 1)), KvShapeError),  # head_dim
        (mx.zeros((1, H, 0, D)), mx.zeros((1, H, 0, D)), KvShapeError),  # T = 0
        (mx.zeros((1, H, 3, D)), mx.zeros((1, H, 2, D)), KvShapeError),  # T mismatch
        (mx.zeros((1, H, 3, D), mx.float16), mx.zeros((1, H, 3, D), mx.float16), KvDTypeError),
        (mx.zeros((2, H, 3, D)), mx.zeros((2, H, 3, D)), NotSupportedError),  # batch
        (np.zeros((1, H, 3, D), np.float32), mx.zeros((1, H, 3, D)), KvShapeError),
    ],
)
@pytest.mark.parametrize("pages", PAGE_KINDS)
def test_bad_input_raises_typed_error_and_changes_nothing(keys, values, error, pages):
    pool = pool_of(pages=pages)
    cache = PagedKVCache(PageTable(pool), 0)
    cache.update_and_fetch(*kv(2))
    cache.update_and_fetch(*kv(3))  # (the pool remembers shapes that passed: 3 tokens is one)
    before = pool_snapshot(pool)
    with pytest.raises(error):
        cache.update_and_fetch(keys, values)
    after = pool_snapshot(pool)
    assert before[0] == after[0]
    assert all(np.array_equal(a, b) for x, y in zip(before[1], after[1]) for a, b in zip(x, y))
    assert cache.offset == 5 and cache.table.num_tokens == 5


@pytest.mark.parametrize("pages", PAGE_KINDS)
def test_pool_exhausted_leaves_cache_and_pool_unchanged(pages):
    pool = pool_of(num_pages=4, page_size=4, pages=pages)  # 3 usable pages (page 0 is the null page)
    cache = PagedKVCache(PageTable(pool), 0)
    cache.update_and_fetch(*kv(10))
    before = pool.allocator.stats()
    with pytest.raises(PoolExhausted):
        cache.update_and_fetch(*kv(5))
    assert pool.allocator.stats() == before
    assert cache.offset == 10 and cache.table.num_tokens == 10
    cache.update_and_fetch(*kv(2, seed=3))  # still usable
    assert cache.offset == 12 and cache.state[0].shape[2] == 12


@pytest.mark.parametrize("pages", PAGE_KINDS)
def test_trim_returns_tail_pages_and_release_returns_all(pages):
    pool = pool_of(page_size=4, pages=pages)
    t = PageTable(pool)
    t.prepare_write(t.num_tokens, 10)
    assert pool.allocator.num_in_use() == 3
    assert t.trim(5) == 5
    assert t.num_tokens == 5 and pool.allocator.num_in_use() == 2
    assert t.trim(100) == 5 and pool.allocator.num_in_use() == 0
    t.prepare_write(t.num_tokens, 1)
    t.release()
    assert pool.allocator.num_in_use() == 0
    with pytest.raises(ReleasedError):
        t.release()
    with pytest.raises(ReleasedError):
        t.prepare_write(t.num_tokens, 1)
    pool.allocator.check()


@pytest.mark.parametrize("pages", PAGE_KINDS)
def test_fork_shares_pages_and_copies_a_shared_partial_page_on_write(pages):
    pool = pool_of(page_size=4, pages=pages)
    a = PagedKVCache(PageTable(pool), 0)
    k0, v0 = kv(6, seed=4)
    a.update_and_fetch(k0, v0)
    before = a.state[0]
    tb = a.table.fork()
    b = PagedKVCache(tb, 0)
    b.offset = 6
    assert pool.allocator.num_in_use() == 2
    a.update_and_fetch(*kv(1, seed=5))
    b.update_and_fetch(*kv(1, seed=6))
    ka, kb = a.state[0], b.state[0]
    assert pool.allocator.num_in_use() == 3  # one copied page
    assert mx.array_equal(ka[:, :, :6], before) and mx.array_equal(kb[:, :, :6], before)
    assert not mx.array_equal(ka[:, :, 6], kb[:, :, 6])
    assert a.table.pages[0] == tb.pages[0] and a.table.pages[1] != tb.pages[1]
    a.table.release()
    tb.release()
    assert pool.allocator.num_in_use() == 0


@pytest.mark.parametrize("pages", PAGE_KINDS)
def test_sliding_table_drops_pages_behind_the_window_and_refuses_deep_trim(pages):
    pool = pool_of(page_size=4, num_pages=32, pages=pages)
    t = PageTable(pool, window=6)
    for _ in range(30):
        t.prepare_write(t.num_tokens, 1)
    assert t.num_pages <= 3
    assert (t.pages[: t.first_visible() // 4] == pool.null_page).all()
    with pytest.raises(ValueError):
        t.trim(20)
    assert t.num_tokens == 30
    t.release()
    assert pool.allocator.num_in_use() == 0


@pytest.mark.parametrize("rewind", [0, 3])
def test_a_table_says_ahead_which_one_token_writes_drop_pages_behind_its_window(rewind):
    """``drops_pages_at(num_tokens)`` is True exactly before the writes that drop a page
    (what the pipelined generation loop runs serially), once per page's worth of
    tokens past the window; a table without a window never drops one."""
    pool = pool_of(page_size=4, num_pages=32)
    t, full = PageTable(pool, window=6, rewind=rewind), PageTable(pool)
    said = []
    for _ in range(30):
        said.append(t.drops_pages_at(t.num_tokens))
        before = t.first_visible()
        t.prepare_write(t.num_tokens, 1)
        assert said[-1] == (t.first_visible() > before)
        assert not full.drops_pages_at(full.num_tokens)
        full.prepare_write(full.num_tokens, 1)
    assert 5 <= sum(said) <= 30 // 4
    t.release()
    full.release()


def test_page_lookups_name_only_pages_the_table_still_holds():
    pool = pool_of(page_size=4, num_pages=32)
    t = PageTable(pool, window=6)
    for _ in range(14):  # pages 0-3 listed; the window dropped the first ones
        t.prepare_write(t.num_tokens, 1)
    listed = len(t.pages)
    held = range(t.first_visible() // 4, listed)
    assert len(held) == 2
    assert [t.page_at(i) for i in held] == t.page_ids_at(np.array(list(held))).tolist() == t.pages[held[0]:].tolist()
    for index in (-1, 0, listed):
        with pytest.raises(ValueError):
            t.page_at(index)
        with pytest.raises(ValueError):
            t.page_ids_at(np.array([index]))
    t.release()


def test_a_pool_of_head_dim_1_round_trips_and_attends():
    pool = PagePool(num_layers=1, num_kv_heads=2, head_dim=1, page_size=4, num_pages=8, dtype=mx.float32)
    cache = PagedKVCache(PageTable(pool), 0)
    k = mx.arange(14, dtype=mx.float32).reshape(1, 2, 7, 1) / 7
    keys, values = cache.update_and_fetch(k, -k)
    assert mx.array_equal(keys, k) and mx.array_equal(values, -k)
    q = mx.ones((1, 4, 1, 1))
    with KvAttentionView.of_cache(cache) as view:
        assert mx.allclose(view.attend(q, 1.0), mx.fast.scaled_dot_product_attention(q, k, -k, scale=1.0))


def test_state_round_trips_and_from_state_builds_a_private_pool():
    pool = pool_of()
    cache = PagedKVCache(PageTable(pool), 0)
    k, v = kv(7, seed=9)
    cache.state = (k, v)
    sk, sv = cache.state
    assert mx.array_equal(sk, k) and mx.array_equal(sv, v)
    other = PagedKVCache.from_state((k, v))
    assert other.offset == 7 and mx.array_equal(other.state[0], k)
    mlx_lm_cache = KVCache()  # its state: (keys, values, offset), buffers with room for more
    mlx_lm_cache.update_and_fetch(k, v)
    moved = PagedKVCache.from_state(mlx_lm_cache.state)
    assert moved.offset == 7 and all(mx.array_equal(a, b) for a, b in zip(moved.state, (k, v)))
    assert cache.nbytes == 2 * pool.bytes_per_page_per_layer


def test_use_after_release_raises():
    pool = pool_of()
    cache = PagedKVCache(PageTable(pool), 0)
    cache.update_and_fetch(*kv(3))
    cache.table.release()
    with pytest.raises(ReleasedError):
        cache.update_and_fetch(*kv(1))
    with pytest.raises(ReleasedError):
        cache.keys_and_values()
    for query in (cache.size, cache.empty, cache.is_trimmable, cache.max_trim):  # (they answered as if alive)
        with pytest.raises(ReleasedError):
            query()


ONE_LAYER_LOOPS_COPY_ON_CUDA = pytest.mark.skipif(paged_decode.available(), reason=(
    "on CUDA, MLX releases a finished step's buffers on a worker thread, so a one-layer "
    "write loop this tight copies now and then whatever the pool does "
    "(pagedkv/in_place_writes.py); whole models are checked by bench/gpu_compiled_step.py's peak growth"))


@ONE_LAYER_LOOPS_COPY_ON_CUDA
def test_token_writes_are_in_place_not_copies_of_the_pool():
    """A regression here silently makes every token write O(pool size)."""
    pool = PagePool(num_layers=1, num_kv_heads=4, head_dim=64, page_size=16, num_pages=8192,
                    dtype=mx.float32)  # 128 MiB of K + V
    cache = PagedKVCache(PageTable(pool), 0)
    k = mx.random.normal((1, 4, 1, 64))
    mx.eval(cache.update_and_fetch(k, k))
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    for _ in range(200):
        keys, values = cache.update_and_fetch(k, k)
        mx.eval(keys, values)
    growth = mx.get_peak_memory() - base
    assert growth < pool.nbytes / 16, growth


@ONE_LAYER_LOOPS_COPY_ON_CUDA
def test_a_caller_holding_an_unevaluated_read_does_not_make_writes_copy():
    pool = PagePool(num_layers=1, num_kv_heads=4, head_dim=64, page_size=16, num_pages=8192,
                    dtype=mx.float32)
    cache = PagedKVCache(PageTable(pool), 0)
    k = mx.ones((1, 4, 1, 64))
    mx.eval(cache.update_and_fetch(k, k))
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    held = []
    for _ in range(20):
        held.append(cache.update_and_fetch(k, k))  # never evaluated by the caller
    mx.eval(held)
    assert mx.get_peak_memory() - base < pool.nbytes / 4


def tables_at(pool, lengths, window=None):
    """Tables holding ``lengths`` tokens each (pages allocated, nothing written)."""
    tables = []
    for n in lengths:
        t = PageTable(pool, window=window)
        if n:
            t.prepare_write(0, n)
            t.num_tokens = n
        tables.append(t)
    return tables


def test_a_batch_append_gives_every_table_the_pages_of_its_own_append_and_undo_puts_all_back():
    lengths = [3, 4, 0, 8, 5]  # partial page, page boundary, empty, boundary, partial
    pool, twin = pool_of(num_pages=32), pool_of(num_pages=32)
    tables, alone = tables_at(pool, lengths), tables_at(twin, lengths)
    alloc = pool.allocator

    def held():  # (counters such as pages_allocated keep counting through an undo)
        return [t.pages.tolist() for t in tables], alloc._free_ids().tolist(), alloc.num_in_use(), alloc.num_free()

    before = held()
    batch = BatchAppend.plan(tables, 1)
    assert batch is not None and batch.num_new_pages == 3
    batch.apply()
    for t in alone:  # the per-table path on an identical pool
        t.prepare_write(t.num_tokens, 1)
        t.num_tokens += 1
    assert [t.pages.tolist() for t in tables] == [t.pages.tolist() for t in alone]
    assert [t.num_tokens for t in tables] == [n + 1 for n in lengths]
    batch.undo()
    assert held() == before and [t.num_tokens for t in tables] == lengths
    alloc.check()


def test_a_batch_append_takes_supplied_pages_and_an_undo_leaves_them_with_the_supplier():
    lengths = [3, 4, 0, 8]  # partial page (needs none), boundary, empty, boundary
    pool = pool_of(num_pages=32)
    tables, alloc = tables_at(pool, lengths), pool.allocator
    held = alloc.allocate(2)  # the supplier's pages for rows 1 and 2; row 3 gets none
    supply = np.array([held[0], held[0], held[1], -1], dtype=np.int64)  # row 0 needs no page: unused
    before = ([t.pages.tolist() for t in tables], alloc.num_free(), alloc.refcount(int(held[0])))
    batch = BatchAppend.plan(tables, 1, supply=supply)
    assert batch.num_new_pages == 1  # row 3 alone is allocated one
    batch.apply()
    assert tables[1].pages.tolist()[-1] == held[0] and tables[2].pages.tolist() == [held[1]]
    assert alloc.num_free() == before[1] - 1 and alloc.refcount(int(held[0])) == 1  # taken, not counted twice
    batch.undo()
    assert ([t.pages.tolist() for t in tables], alloc.num_free(), alloc.refcount(int(held[0]))) == before
    other = int(alloc.allocate(1)[0])
    alloc.incref([other])  # two holders: not the supplier's alone
    for bad in (supply[:3], supply.astype(np.float64), np.array([-1, held[0], held[0], -1]),
                np.array([-1, other, -1, -1]), np.array([-1, 31, -1, -1])):  # 31: a free page
        with pytest.raises(InvalidValueError):
            BatchAppend.plan(tables, 1, supply=bad)
    alloc.decref([other, other])
    assert ([t.pages.tolist() for t in tables], alloc.num_free(), alloc.refcount(int(held[0]))) == before
    batch = BatchAppend.plan(tables, 1, supply=supply)
    batch.apply()
    batch.commit()  # the tables own the supplied pages now: releasing them frees them
    for t in tables:
        t.release()
    alloc.check()
    assert alloc.num_in_use() == 0


def test_a_windowed_batch_append_drops_and_frees_what_appending_table_by_table_does_and_undo_puts_all_back():
    """Sliding-window tables (window 6, pages of 4) through 40 steps: each step's batch
    append lists, drops and frees (in the same order: the free lists match) what a
    journaled ``prepare_write`` per table, committed at the step's end, does on a twin
    pool; a step undone instead leaves the
    tables, their dropped pages and the free list exactly as before it."""
    lengths = [0, 3, 4, 9, 17]
    pool, twin = pool_of(num_pages=40, page_size=4), pool_of(num_pages=40, page_size=4)
    tables, alone = tables_at(pool, lengths, window=6), tables_at(twin, lengths, window=6)
    alloc = pool.allocator

    def held(ts, a):
        return ([t.pages.tolist() for t in ts], [t.first_visible() for t in ts], [t.num_tokens for t in ts],
                a._free_ids().tolist(), a.num_in_use())

    for step in range(40):
        before = held(tables, alloc)
        batch = BatchAppend.plan(tables, 1)
        batch.apply()
        if step % 3 == 2:  # this one is undone, then done again
            batch.undo()
            assert held(tables, alloc) == before
            batch = BatchAppend.plan(tables, 1)
            batch.apply()
        batch.commit()
        records = []  # as a row set's step ran them before: journaled, committed at its close
        for t in alone:
            t.prepare_write(t.num_tokens, 1, undo=records)
        for t, record in zip(alone, records):
            t.commit(record)
        assert held(tables, alloc) == held(alone, twin.allocator)
        assert max(t.num_pages for t in tables) <= 3  # ceil(6 / 4) + 1: the window's pages only
    assert any(t.first_visible() > 0 for t in tables)
    for t in tables:
        t.release()
    alloc.check()
    assert alloc.num_in_use() == 0


def test_a_batch_append_that_cannot_get_its_pages_changes_nothing():
    pool = pool_of(num_pages=4)  # the null page and 3 pages
    tables = tables_at(pool, [4, 4, 4])
    before = ([t.pages.tolist() for t in tables], pool.allocator.stats())
    batch = BatchAppend.plan(tables, 1)
    with pytest.raises(PoolExhausted):
        batch.apply()
    assert ([t.pages.tolist() for t in tables], pool.allocator.stats()) == before  # counters too
    assert [t.num_tokens for t in tables] == [4, 4, 4]


def test_a_batch_append_leaves_shared_and_mixed_tables_to_the_per_table_path():
    pool, other = pool_of(), pool_of()
    forked = tables_at(pool, [6])
    assert BatchAppend.plan(forked + [forked[0].fork()], 1) is None  # the partial page needs a copy
    assert BatchAppend.plan(tables_at(pool, [6, 4]), 1) is not None
    cached = tables_at(pool, [6])
    pool.allocator.set_cacheable([int(cached[0].pages[1])])
    assert BatchAppend.plan(cached, 1) is None  # a prefix cache keeps that page's content
    assert BatchAppend.plan(tables_at(pool, [8]), 1) is not None  # a full cached page needs no copy
    assert BatchAppend.plan([PageTable(pool, window=8)], 1) is not None  # one window: pages drop in the batch
    assert BatchAppend.plan([PageTable(pool, window=8), PageTable(pool)], 1) is None  # two windows
    assert BatchAppend.plan(tables_at(pool, [2]) + tables_at(other, [2]), 1) is None
    released = tables_at(pool, [2])
    released[0].release()
    assert BatchAppend.plan(released, 1) is None
    assert BatchAppend.plan([], 1) is None


def _fresh_table(tables, first, stop, width, null):
    from pagedkv.padded_page_table import PaddedPageTable
    return PaddedPageTable(null).update(tables, first, stop, width).copy()


def test_padded_page_table_follows_every_kind_of_table_change():
    """The kept table equals a fresh build after appends, copy-on-write, trims, undone
    writes, window drops, released and replaced rows, and reordered rows."""
    from pagedkv.padded_page_table import PaddedPageTable

    pool = pool_of(num_pages=64, page_size=4)
    rng = np.random.default_rng(0)
    tables = [PageTable(pool) for _ in range(3)] + [PageTable(pool, window=6)]
    for t in tables:
        t.prepare_write(0, int(rng.integers(1, 9)))
    padded = PaddedPageTable(pool.null_page)

    def check():
        lo = np.array([t.first_visible() for t in tables], dtype=np.int64)
        hi = np.array([t.num_tokens for t in tables], dtype=np.int64)
        first, stop = lo // 4, -(-hi // 4)
        width = int((stop - first).max()) + 1
        got = padded.update(tables, first, stop, width).copy()
        np.testing.assert_array_equal(got, _fresh_table(tables, first, stop, width, pool.null_page))
        np.testing.assert_array_equal(np.array(padded.device()[0]), got)  # the kept MLX copy follows
        for row, t, f, s in zip(got, tables, first, stop):  # and it is what the tables list
            np.testing.assert_array_equal(row[: s - f], t.pages[f:s])

    check()
    for step in range(60):
        i = int(rng.integers(len(tables)))
        t = tables[i]
        op = step % 6
        if op == 0:  # append (maybe a new page)
            t.prepare_write(t.num_tokens, int(rng.integers(1, 6)))
        elif op == 1 and t.window is None:  # a fork shares the last page; writing copies it
            other = t.fork()
            t.prepare_write(t.num_tokens - 1, 1)
            other.release()
        elif op == 2 and t.window is None and t.num_tokens > 1:
            t.trim(int(rng.integers(1, t.num_tokens)))
        elif op == 3:  # a journaled write, undone
            undo = []
            t.prepare_write(t.num_tokens, 5, undo=undo)
            check()
            t.undo(undo[0])
        elif op == 4 and t.window is None:  # the row leaves; a new table takes its place
            t.release()
            tables[i] = PageTable(pool)
            tables[i].prepare_write(0, int(rng.integers(1, 9)))
        elif op == 5:
            tables.reverse()
        check()
    for t in tables:
        t.release()


def test_padded_page_table_rebuilds_only_the_rows_that_changed(monkeypatch):
    from pagedkv.padded_page_table import PaddedPageTable

    pool = pool_of(num_pages=64, page_size=4)
    tables = [PageTable(pool) for _ in range(4)]
    for t in tables:
        t.prepare_write(0, 6)
    padded = PaddedPageTable(pool.null_page)
    read = []
    real = PageTable.page_ids
    monkeypatch.setattr(PageTable, "page_ids", lambda self, f, s: (read.append(self), real(self, f, s))[1])

    def update():
        hi = np.array([t.num_tokens for t in tables], dtype=np.int64)
        padded.update(tables, np.zeros(4, dtype=np.int64), -(-hi // 4), 8)

    update()
    assert len(read) == 4
    read.clear()
    kept = padded.device()
    for t in tables:  # tokens into each row's partial page: no page list changes
        t.prepare_write(t.num_tokens, 1)
    update()
    assert read == []
    assert padded.device() is kept  # nothing changed: the same MLX copy, not a new one
    tables[2].prepare_write(tables[2].num_tokens, 2)  # row 2 grows a page
    update()
    assert read == [tables[2]]
    assert padded.device() is not kept and padded.device()[1] == []
    np.testing.assert_array_equal(np.array(padded.device()[0]), padded.host)
    for t in tables:
        t.release()
