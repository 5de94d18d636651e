"""PagedBatch vs mlx-lm's BatchKVCache: ragged rows, rows joining mid-way, leaving, extracting."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache
from tiny_models import (
    LOGITS_ATOL,
    PAGE_KINDS,
    greedy,
    logits_atol,
    make_model,
    make_pool,
    prompt_of,
)

from pagedkv import (
    KvShapeError,
    PagedBatch,
    PagePool,
    PageTable,
    PoolExhausted,
    ReleasedError,
    make_paged_cache,
    pages_for,
)
from pagedkv.padded_page_table import PaddedPageTable

PROMPTS = [prompt_of(9, seed=1), prompt_of(23, seed=2), prompt_of(40, seed=3)]
JOIN_AT, STEPS = 5, 16


def batched_greedy(model, new_cache, join, step_caches):
    """Prefill each row alone, ``join`` the rows, decode STEPS batched greedy steps; the
    third prompt is prefilled and joins at step JOIN_AT. Returns (tokens, logits per step)."""

    def prefill(prompts):
        caches, first = [], []
        for p in prompts:
            c = new_cache()
            first.append(int(mx.argmax(model(mx.array(p)[None], cache=c)[0, -1]).item()))
            caches.append(c)
        join(caches)
        return first

    toks = prefill(PROMPTS[:2])
    tokens, logits_per_step = [[t] for t in toks], []
    for step in range(STEPS):
        if step == JOIN_AT:
            joined = prefill(PROMPTS[2:])
            toks += joined
            tokens += [[t] for t in joined]
        logits = model(mx.array(toks)[:, None], cache=step_caches())[:, -1]
        mx.eval(logits)
        logits_per_step.append(logits)
        toks = mx.argmax(logits, axis=-1).tolist()
        for row, t in zip(tokens, toks):
            row.append(t)
    return tokens, logits_per_step


def ref_run(model):
    """mlx-lm: rows merged into BatchKVCache (left-padded), a late row added with extend."""
    batch = []

    def join(caches):
        new = [BatchKVCache.merge([c[layer] for c in caches]) for layer in range(len(model.layers))]
        if not batch:
            batch.extend(new)
        else:
            for b, n in zip(batch, new):
                b.extend(n)

    return batched_greedy(model, lambda: make_prompt_cache(model), join, lambda: batch)


def paged_run(model, pool):
    """pagedkv: each prefilled one-sequence cache is adopted as a row (no copy)."""
    batch = PagedBatch.for_model(model, pool)

    def join(caches):
        for c in caches:
            batch.extend(c)

    tokens, logits = batched_greedy(model, lambda: make_paged_cache(model, pool), join, lambda: batch.caches)
    return tokens, logits, batch


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_batched_decode_matches_mlx_lm_batch_kv_cache_with_a_row_joining(kind):
    model = make_model(kind)
    ref_tokens, ref_logits = ref_run(model)
    pool = make_pool(kind, page_size=8, num_pages=128)
    tokens, logits, batch = paged_run(model, pool)
    assert tokens == ref_tokens
    for a, b in zip(ref_logits, logits):
        assert a.shape == b.shape
        assert mx.abs(a - b).max().item() <= LOGITS_ATOL
    # and every row equals decoding that row alone
    for p, row in zip(PROMPTS, tokens):
        solo, _ = greedy(model, p, make_prompt_cache(model), len(row))
        assert solo == row
    # no padding: the pool holds exactly the rows' pages
    assert pool.allocator.num_in_use() == sum(-(-n // 8) for n in batch.lengths)
    batch.release()
    pool.allocator.check()
    assert pool.allocator.num_in_use() == 0


@pytest.mark.parametrize("pages", PAGE_KINDS)
def test_every_batched_row_equals_decoding_that_row_alone_on_every_page_kind(pages):
    model = make_model("llama")
    pool = make_pool("llama", page_size=8, num_pages=128, pages=pages)
    tokens, logits, batch = paged_run(model, pool)
    for i, (p, row) in enumerate(zip(PROMPTS, tokens)):
        with make_paged_cache(model, pool) as solo:
            solo_tokens, solo_logits = greedy(model, p, solo, len(row))
        assert solo_tokens == row
        first = 0 if i < 2 else JOIN_AT  # the third row joined at step JOIN_AT
        for step, ref in enumerate(solo_logits[1:], start=first):
            assert mx.abs(logits[step][i] - ref).max().item() <= logits_atol(pages)
    batch.release()
    pool.allocator.check()
    assert pool.allocator.num_in_use() == 0


@pytest.mark.parametrize("pages", PAGE_KINDS)
def test_rows_leave_and_are_extracted_without_touching_other_rows(pages):
    model = make_model("llama")
    pool = make_pool("llama", page_size=8, num_pages=128, pages=pages)
    _, _, batch = paged_run(model, pool)
    pages_before = [t.pages.tolist() for t in batch.tables()]
    lengths = batch.lengths
    row1 = batch.extract(1)  # the middle row
    assert row1.num_tokens == lengths[1] and [c.offset for c in row1] == [lengths[1]] * len(row1)
    assert batch.lengths == [lengths[0], lengths[2]] and batch.caches[0].offset.tolist() == batch.lengths
    batch.filter([1])  # row 0 leaves
    assert [t.pages.tolist() for t in batch.tables()] == [pages_before[2]]
    assert row1.tables[0].pages.tolist() == pages_before[1]
    assert pool.allocator.num_in_use() == len(pages_before[1]) + len(pages_before[2])
    # the extracted row keeps generating on its own, exactly like an unbatched run
    n = row1.num_tokens
    more, _ = greedy(model, [5], row1, 4)
    assert row1.num_tokens == n + 5 and len(more) == 4
    mx.eval(model(mx.array([[3]]), cache=batch.caches))  # and so does the row left in the batch
    assert batch.lengths == [lengths[2] + 1]
    row1.release()
    batch.release()
    pool.allocator.check()
    assert pool.allocator.num_in_use() == 0


def test_offset_is_an_int32_array_of_row_positions_and_shared_offset_arr_is_owned():
    model = make_model("llama")
    pool = make_pool("llama", page_size=8, num_pages=128)
    batch = PagedBatch.for_model(model, pool)
    for p in PROMPTS[:2]:
        c = make_paged_cache(model, pool)
        model(mx.array(p)[None], cache=c)
        batch.extend(c)
    off = batch.caches[0].offset
    assert off.dtype == mx.int32 and off.tolist() == [9, 23]
    model(mx.array([[1], [2]]), cache=batch.caches)
    kv = batch.caches[0].fetch_shared()
    assert kv.offset_arr.tolist() == [9, 23]
    model(mx.array([[3], [4]]), cache=batch.caches)  # the cache's positions move on
    assert batch.caches[0].offset.tolist() == [11, 25]
    assert kv.offset_arr.tolist() == [9, 23]
    assert kv.attention.lengths == [10, 24]
    kv.release()
    batch.release()


@pytest.mark.parametrize("pages", PAGE_KINDS)
def test_a_step_that_cannot_get_pages_for_every_row_changes_nothing(pages):
    model = make_model("llama")
    pool = make_pool("llama", page_size=4, num_pages=8, pages=pages)  # 7 usable pages
    batch = PagedBatch.for_model(model, pool)
    for p in (prompt_of(12, seed=1), prompt_of(12, seed=2)):  # 3 pages each, both full
        c = make_paged_cache(model, pool)
        model(mx.array(p)[None], cache=c)
        batch.extend(c)
    before = (pool.allocator.stats(), batch.lengths, [t.pages.tolist() for t in batch.tables()])
    with pytest.raises(PoolExhausted):
        batch.caches[0].update_and_fetch(mx.zeros((2, 2, 1, 64)), mx.zeros((2, 2, 1, 64)))
    assert (pool.allocator.stats(), batch.lengths, [t.pages.tolist() for t in batch.tables()]) == before
    assert batch.rows.offsets[0].tolist() == [12, 12]
    with pytest.raises(KvShapeError):
        batch.caches[0].update_and_fetch(mx.zeros((3, 2, 1, 64)), mx.zeros((3, 2, 1, 64)))
    batch.release()
    assert pool.allocator.num_in_use() == 0


def test_batch_memory_is_the_sum_of_rows_not_b_times_the_longest():
    pool = make_pool("llama", page_size=16, num_pages=512)
    model = make_model("llama")
    batch = PagedBatch.for_model(model, pool)
    lengths = [3, 200, 17, 64]
    for n in lengths:
        c = make_paged_cache(model, pool)
        model(mx.array(prompt_of(n))[None], cache=c)
        batch.extend(c)
    pages = pool.allocator.num_in_use()
    assert pages == sum(-(-n // 16) for n in lengths)
    with pytest.raises(ReleasedError, match="moved into a batch"):
        c.release()  # the last row's prompt cache: its table belongs to the batch now
    assert pages < len(lengths) * -(-max(lengths) // 16) / 2
    assert np.array_equal(batch.rows.offsets[0], lengths)
    assert batch.lengths == lengths
    batch.release()
    assert pool.allocator.num_in_use() == 0
    for use in (lambda: batch.lengths, lambda: batch.tables(), lambda: batch.tables(0), batch.release):
        with pytest.raises(ReleasedError):  # not the zero lengths of released tables
            use()


def test_a_row_and_its_fork_decoded_in_one_batch_copy_their_shared_page_and_match_alone():
    model = make_model("llama")
    pool = make_pool("llama", page_size=4, num_pages=64)
    prompt = prompt_of(6, seed=7)  # the last page is partial: both rows write into it
    cache = make_paged_cache(model, pool)
    model(mx.array(prompt)[None], cache=cache)
    batch = PagedBatch.for_model(model, pool)
    batch.extend(cache.fork())
    batch.extend(cache)
    shared_page = int(batch.tables(0)[0].pages[1])
    before = pool.read_pages([shared_page])
    logits = [model(mx.array([[t0], [t1]]), cache=batch.caches)[:, -1] for t0, t1 in ((3, 5), (7, 11))]
    mx.eval(logits)
    rows = [batch.tables(r)[0] for r in (0, 1)]
    assert rows[0].pages[0] == rows[1].pages[0] and rows[0].pages[1] != rows[1].pages[1]  # copied on write
    # both rows copied it (the open step keeps the original until it closes); now it is free
    assert pool.allocator.refcount(shared_page) == 0
    for r in (0, 1):  # each row kept the prompt's two keys and values of that page
        after = pool.read_pages([int(rows[r].pages[1])])
        for name, a in before.items():
            np.testing.assert_array_equal(after[name][:, :, :2], a[:, :, :2])
    for r, new in enumerate(((3, 7), (5, 11))):
        with make_paged_cache(model, make_pool("llama", page_size=4)) as alone:
            model(mx.array(prompt)[None], cache=alone)
            want = [model(mx.array([[t]]), cache=alone)[0, -1] for t in new]
            for got, ref in zip(logits, want):
                assert mx.abs(got[r] - ref).max().item() <= LOGITS_ATOL
    batch.release()
    assert pool.allocator.num_in_use() == 0


def test_a_dropped_batch_and_pool_are_freed_without_waiting_for_the_garbage_collector():
    import gc
    import weakref

    model = make_model("llama")
    pool = make_pool("llama", page_size=8, num_pages=64)
    batch = PagedBatch.for_model(model, pool)
    c = make_paged_cache(model, pool)
    model(mx.array(prompt_of(11))[None], cache=c)
    batch.extend(c)
    model(mx.array([[1]]), cache=batch.caches)  # one step: the layer faces have fetched
    gone_batch, gone_pool = weakref.ref(batch), weakref.ref(pool)
    gc.disable()  # no collection may run in between: nothing here is in a reference cycle
    try:
        del batch, pool, c
        assert gone_batch() is None and gone_pool() is None  # the pool's arrays went with it
    finally:
        gc.enable()


def test_a_batch_of_sliding_window_rows_decodes_as_mlx_lm_decodes_each_row_alone():
    """Ragged rows past the window: each row's tokens and logits equal mlx-lm's own
    caches (RotatingKVCache on the windowed layers) decoding that row alone, and the
    windowed tables hold no more pages than the window needs."""
    model = make_model("gemma3_text")
    pool = PagePool(num_layers=4, num_kv_heads=2, head_dim=16, page_size=4, num_pages=256, dtype=mx.float32)
    batch = PagedBatch.for_model(model, pool)
    assert sorted(spec.window or 0 for spec in batch.rows.layout.specs) == [0, 12]
    tokens, logits = batched_greedy(model, lambda: make_paged_cache(model, pool),
                                    lambda caches: [batch.extend(c) for c in caches], lambda: batch.caches)
    for i, (p, row) in enumerate(zip(PROMPTS, tokens)):
        solo_tokens, solo_logits = greedy(model, p, make_prompt_cache(model), len(row))
        assert solo_tokens == row
        first = 0 if i < 2 else JOIN_AT
        for step, ref in enumerate(solo_logits[1:], start=first):
            assert mx.abs(logits[step][i] - ref).max().item() <= LOGITS_ATOL
    for row in range(batch.size):
        for table in batch.tables(row):
            if table.window is not None:
                assert table.num_pages <= -(-table.window // 4) + 1
    batch.release()
    pool.allocator.check()
    assert pool.allocator.num_in_use() == 0


def test_rows_reordered_by_filter_each_read_their_own_pages():
    """Two rows of one length whose tables have the same history (so the same version
    counts): after ``filter([1, 0])`` each row still reads its own pages, not the
    page-table row that the last step's read left at its index."""
    model = make_model("llama")
    pool = make_pool("llama", page_size=4, num_pages=64)
    prompts = [prompt_of(10, seed=5), prompt_of(10, seed=6)]
    batch = PagedBatch.for_model(model, pool)
    refs, toks = [], []
    for p in prompts:
        c = make_paged_cache(model, pool)
        toks.append(int(mx.argmax(model(mx.array(p)[None], cache=c)[0, -1]).item()))
        refs.append(make_prompt_cache(model))
        model(mx.array(p)[None], cache=refs[-1])
        batch.extend(c)
    for step in range(6):
        if step == 3:
            batch.filter([1, 0])
            toks, refs = toks[::-1], refs[::-1]
        logits = model(mx.array(toks)[:, None], cache=batch.caches)[:, -1]
        want = mx.concatenate([model(mx.array([[t]]), cache=r)[:, -1] for t, r in zip(toks, refs)])
        assert mx.allclose(logits, want, atol=LOGITS_ATOL).item(), step
        toks = mx.argmax(want, axis=-1).tolist()
    batch.release()
    assert pool.allocator.num_in_use() == 0


@pytest.mark.parametrize("pages, run", [
    ([2, 3, 4], 2), ([7], 7), ([2, 4, 5], -1), ([2, 4, 3, 5], -1), ([5, 4, 3], -1)])
def test_one_rows_pages_of_consecutive_ids_are_read_as_one_run(pages, run):
    """A read reports a run (its first id) only for one row whose pages are consecutive
    ids in order: such a row's keys are one slice of the pool (``PagePool.borrow_run``)."""
    pool = make_pool("llama", page_size=4, num_pages=16)
    held = pool.allocator.allocate(8).tolist()
    assert held == list(range(1, 9))
    table = PageTable(pool)
    table.adopt(pages)  # (the table takes our reference to these)
    padded = PaddedPageTable(pool.null_page)
    n = len(pages)
    padded.update([table], np.array([0]), np.array([n]), n)
    assert padded.run == run
    padded.update([table, table], np.array([0, 0]), np.array([n, n]), n)  # two rows: no run
    assert padded.run == -1
    table.release()
    pool.allocator.decref([p for p in held if p not in pages])
    assert pool.allocator.num_in_use() == 0


def test_trimming_every_layer_of_a_batch_gives_back_each_rows_own_tail_pages():
    model = make_model("llama")
    pool = make_pool("llama", page_size=4, num_pages=96)
    _, _, batch = paged_run(model, pool)
    for c in batch.caches:
        assert c.trim(6) == 6
    pages = [pages_for(n, pool.page_size) for n in batch.lengths]
    assert [t.num_pages for t in batch.tables()] == pages and pool.allocator.num_in_use() == sum(pages)
    batch.release()
    assert pool.allocator.num_in_use() == 0
