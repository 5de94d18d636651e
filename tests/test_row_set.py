"""The row-set engine: one step's indices built once for all layers, attention routed
to the pages, and one definition of which keys a query sees."""

import importlib

import mlx.core as mx
import numpy as np
import pytest
import tiny_models
from mlx_lm.models.cache import make_prompt_cache
from tiny_models import PAGE_KINDS, greedy, make_model, make_pool, prompt_of

from pagedkv import KvShapeError, PagedBatch, PagedKVCache, PagePool, PageTable, make_paged_cache
from pagedkv.kernels import paged_decode
from pagedkv.page_read import PageRead
from pagedkv.visibility import key_mask, window_start


def test_one_decode_step_builds_its_read_and_write_indices_once_for_every_layer(monkeypatch):
    model = make_model("llama")  # 3 layers, one table spec
    pool = make_pool("llama", page_size=8)
    built = {"read": 0, "write": 0}
    real_of = PageRead.of.__func__
    monkeypatch.setattr(PageRead, "of", classmethod(lambda cls, *a, **kw: (built.__setitem__("read", built["read"] + 1),
                                                                            real_of(cls, *a, **kw))[1]))
    for index in ("array_rows", "page_slices"):  # (a one-row step's write index is the second)
        real = getattr(pool, index)
        monkeypatch.setattr(pool, index, lambda *a, real=real: (built.__setitem__("write", built["write"] + 1),
                                                                real(*a))[1])
    with make_paged_cache(model, pool) as cache:
        model(mx.array([prompt_of(20)]), cache=cache)
        built.update(read=0, write=0)
        mx.eval(model(mx.array([[3]]), cache=cache))
    assert built == {"read": 1, "write": 1}


def test_routed_attention_reads_the_pages_and_leaves_other_caches_to_mlx_lm():
    model = make_model("llama")
    ref_tokens, ref_logits = greedy(model, prompt_of(30), make_prompt_cache(model), 6)  # before routing
    with make_paged_cache(model, make_pool("llama")) as cache:
        tokens, logits = greedy(model, prompt_of(30), cache, 6)
    module = importlib.import_module(type(model.layers[0].self_attn).__module__)
    assert hasattr(module.scaled_dot_product_attention, "_pagedkv_original")
    again_tokens, again_logits = greedy(model, prompt_of(30), make_prompt_cache(model), 6)  # after
    assert tokens == ref_tokens == again_tokens
    for a, b, c in zip(ref_logits, logits, again_logits):
        assert mx.array_equal(a, c) and mx.abs(a - b).max().item() <= 1e-5


@pytest.mark.parametrize("pages", PAGE_KINDS)
def test_routed_attention_on_packed_pages_equals_attention_on_decoded_keys(pages, monkeypatch):
    """The route reads packed pages (quantised matmuls, deferred un-rotation); without
    it the model gets decoded K/V. Both give the same tokens."""
    if pages == "affine8" and paged_decode.available():
        pytest.skip("mlx-lm's own quantised attention has no CUDA kernel for these shapes (MLX 0.32)")
    model = make_model("llama")
    prompt = prompt_of(25, seed=2)
    pool = make_pool("llama", pages=pages)
    with make_paged_cache(model, pool) as cache:
        routed, routed_logits = greedy(model, prompt, cache, 6)
    from pagedkv.cache import LayerFace
    monkeypatch.setattr(LayerFace, "reads_pages", False)  # the router passes through
    with make_paged_cache(model, pool) as cache:
        plain, plain_logits = greedy(model, prompt, cache, 6)
    assert routed == plain
    tolerance = 1e-5 if pages in ("fp", "affine8") else 2e-3  # rotated: a different summation order
    if not tiny_models.ON_CPU:  # (measured 3.8e-3 on the H200: a flipped 4-bit code, see logits_atol)
        tolerance = max(tolerance, tiny_models.logits_atol(pages))
    assert max(mx.abs(a - b).max().item() for a, b in zip(routed_logits, plain_logits)) <= tolerance


def test_a_batch_layer_with_bad_input_rolls_the_whole_step_back():
    model = make_model("llama")
    pool = make_pool("llama", page_size=4, num_pages=64)
    batch = PagedBatch.for_model(model, pool)
    for p in (prompt_of(8, seed=1), prompt_of(5, seed=2)):  # row 0 ends on a page boundary
        c = make_paged_cache(model, pool)
        model(mx.array(p)[None], cache=c)
        batch.extend(c)
    before = (pool.allocator.stats(), batch.rows.offsets.copy(), [t.pages.tolist() for t in batch.tables()])
    k = mx.zeros((2, 2, 1, 64))
    batch.caches[0].update_and_fetch(k, k)  # layer 0 reserves the step for every layer
    with pytest.raises(KvShapeError):
        batch.caches[1].update_and_fetch(k[:, :, :, :32], k[:, :, :, :32])
    after = (pool.allocator.stats(), batch.rows.offsets, [t.pages.tolist() for t in batch.tables()])
    assert after[0].in_use == before[0].in_use and np.array_equal(after[1], before[1]) and after[2] == before[2]
    batch.release()
    assert pool.allocator.num_in_use() == 0


def test_a_step_appends_to_all_groups_of_a_window_as_one_batch_and_rolls_back_whole(monkeypatch):
    """A model laid out in layer groups (gemma3 on a one-layer pool: two sliding, two
    full groups) has a table per group; a step plans one append per window kind, not
    per group. A pool too short for the step raises before anything changes, in every
    group."""
    from pagedkv import PoolExhausted
    from pagedkv.table import BatchAppend

    model = make_model("gemma3_text")
    pool = PagePool(num_layers=1, num_kv_heads=2, head_dim=16, page_size=4, num_pages=64,
                    dtype=mx.float32)
    batch = PagedBatch.for_model(model, pool)
    for p in (prompt_of(8, seed=1), prompt_of(6, seed=2)):  # row 0 ends on a page boundary
        c = make_paged_cache(model, pool)
        model(mx.array(p)[None], cache=c)
        batch.extend(c)
    layout = batch.rows.layout
    assert len(layout.specs) == 4 and len(layout.append_groups) == 2
    plans = []
    real_plan = BatchAppend.plan.__func__
    monkeypatch.setattr(BatchAppend, "plan", classmethod(lambda cls, tables, *a, **kw: (
        plans.append(len(tables)), real_plan(cls, tables, *a, **kw))[1]))
    mx.eval(model(mx.array([[5], [6]]), cache=batch.caches))
    assert plans == [4, 4]  # (2 groups x 2 rows, per window kind)
    assert [t.num_tokens for t in batch.rows.all_tables()] == [9, 7] * 4
    for _ in range(3):  # rows at 12 and 10 tokens: row 0's next token needs a new page in every group
        mx.eval(model(mx.array([[5], [6]]), cache=batch.caches))
    held = pool.allocator.allocate(pool.allocator.num_available())
    before = (pool.allocator.stats(), batch.rows.offsets.copy(), [t.pages.tolist() for t in batch.rows.all_tables()])
    with pytest.raises(PoolExhausted, match="requested 4 pages"):
        model(mx.array([[5], [6]]), cache=batch.caches)
    after = (pool.allocator.stats(), batch.rows.offsets, [t.pages.tolist() for t in batch.rows.all_tables()])
    assert after[0] == before[0] and np.array_equal(after[1], before[1]) and after[2] == before[2]
    pool.allocator.decref(held)
    batch.release()
    assert pool.allocator.num_in_use() == 0


@pytest.mark.parametrize("window", [None, 1, 3, 7])
def test_key_mask_matches_the_definition_of_visibility(window):
    rng = np.random.default_rng(0)
    b, n, width = 4, 3, 24
    query_start = rng.integers(0, 12, b)
    base = rng.integers(0, 3, b) * 4
    lo = np.maximum(base, window_start(query_start, window))
    hi = query_start + n
    got = np.array(key_mask(query_start, n, base, width, lo, hi, window=window))
    for r in range(b):
        for i in range(n):
            q = query_start[r] + i
            for c in range(width):
                j = base[r] + c
                want = lo[r] <= j < hi[r] and j <= q and (window is None or j > q - window)
                assert got[r, 0, i, c] == want


def test_a_routed_step_builds_no_gather_once_its_layers_fetches_go_to_attention(monkeypatch):
    """A sequence whose pages are one run: its first routed step gathers each layer once
    (the gather attention reads), later ones lend views of the pool (no gather at all).
    A model that never calls ``attend`` gets gathered copies, and the layers keep only
    weak references to them."""
    model = make_model("llama")  # 3 layers
    pool = make_pool("llama", page_size=8)
    gathers = []
    real = pool.gather
    monkeypatch.setattr(pool, "gather", lambda *a, **k: (gathers.append(a[0]), real(*a, **k))[1])
    with make_paged_cache(model, pool) as cache:
        model(mx.array([prompt_of(20)]), cache=cache)
        assert sorted(gathers) == [0, 1, 2]  # update_and_fetch's gather is the one attention reads
        gathers.clear()
        for t in (3, 4):
            mx.eval(model(mx.array([[t]]), cache=cache))
        assert gathers == [] and all(c._fetched[2] and c._fetched[3] for c in cache)  # lent, attended
        from pagedkv.cache import LayerFace
        monkeypatch.setattr(LayerFace, "reads_pages", False)  # a model that never calls attend
        for t in (5, 6):
            mx.eval(model(mx.array([[t]]), cache=cache))
        assert sorted(gathers) == [0, 1, 2]  # the first such step still lends; then copies
        assert all(r() is None for c in cache for r in c._fetched[1])  # only weak references


def test_a_caller_that_keeps_lent_views_gets_copies_from_then_on_and_right_values():
    """Once a layer lends views (its fetches went to attention), a caller that keeps
    what ``update_and_fetch`` returned past the next write makes that one write copy
    the layer's array. The layer then returns gathered copies for good, even when the
    caller drops some of them (so no later write copies the array again), and every
    array kept holds the keys it was fetched with."""
    model = make_model("llama")
    pool = make_pool("llama", page_size=8, num_pages=2048)
    with make_paged_cache(model, pool) as cache:
        model(mx.array([prompt_of(20)]), cache=cache)
        mx.eval(model(mx.array([[3]]), cache=cache))
        layer = cache[0]
        rng = np.random.default_rng(0)
        kv = lambda: [mx.array(rng.standard_normal((1, 2, 1, 64)).astype(np.float32)) for _ in range(2)]
        q = mx.array(rng.standard_normal((1, 4, 1, 64)).astype(np.float32))
        written, kept = [], []
        for i in range(6):  # a routed model that keeps every other step's K/V
            written.append(kv())
            fetched = layer.update_and_fetch(*written[-1])
            mx.eval(layer.attend(q, 0.125, None), fetched)
            if i == 0:
                assert layer._fetched[2] and layer._fetched[3]  # lent, attended
            if i % 2 == 0:
                kept.append((i, fetched))
            del fetched
            if i == 1:
                mx.reset_peak_memory()
                base = mx.get_active_memory()
        assert mx.get_peak_memory() - base < pool.nbytes / 8  # copies, not the pool's arrays again
        assert layer._lent_and_held and not layer._fetched[2]
        for i, (got_k, got_v) in kept:
            k, v = written[i]
            assert np.array_equal(np.array(got_k[:, :, -1:]), np.array(k))
            assert np.array_equal(np.array(got_v[:, :, -1:]), np.array(v))


def test_attention_after_a_trim_and_rewrite_at_the_same_position_reads_the_new_keys():
    """A layer's attention reuses its step's gather only while the read it came from
    stands: after a trim and a write of other K/V at the same position, it reads those."""
    pool = make_pool("llama", page_size=8)
    with make_paged_cache(make_model("llama"), pool) as cache:
        layer = cache[0]
        rng = np.random.default_rng(0)
        kv = lambda t: [mx.array(rng.standard_normal((1, 2, t, 64)).astype(np.float32)) for _ in range(2)]
        layer.update_and_fetch(*kv(10))
        held = layer.update_and_fetch(*kv(1))  # the model still holds this step's K/V
        layer.trim(1)
        k, v = kv(1)
        layer.write(k, v)  # (a write that fetches nothing)
        q = mx.array(rng.standard_normal((1, 4, 1, 64)).astype(np.float32))
        got = layer.attend(q, 0.125, None)
        new_k, new_v = layer.state
        want = mx.fast.scaled_dot_product_attention(q, new_k, new_v, scale=0.125)
        assert np.allclose(np.array(got), np.array(want), atol=1e-5)
        assert np.array_equal(np.array(new_k[:, :, -1:]), np.array(k))
        stale = mx.fast.scaled_dot_product_attention(q, *held, scale=0.125)
        assert not np.allclose(np.array(got), np.array(stale), atol=1e-3)


@pytest.mark.parametrize("order", ["in order", "interleaved"])
def test_one_sequence_whose_pages_are_one_run_is_attended_from_a_slice_of_the_pool(monkeypatch, order):
    """A sequence that took consecutive page ids is attended from views of the pool's
    arrays (no gather), one whose pages are not is gathered; both decode as mlx-lm."""
    model = make_model("llama")
    pool = make_pool("llama", page_size=4)
    lent = []
    real = pool.borrow_run
    monkeypatch.setattr(pool, "borrow_run", lambda *a: (lent.append(a[1]), real(*a))[1])
    prompt = prompt_of(9)
    want, want_logits = greedy(model, prompt, make_prompt_cache(model), 8)
    other = make_paged_cache(model, pool)
    with make_paged_cache(model, pool) as cache:
        if order == "interleaved":  # another sequence takes a page between each of ours
            got, got_logits = [], []
            for i, t in enumerate(prompt):
                logits = model(mx.array([[t]]), cache=cache)[0, -1]
                if i % 4 == 0:
                    model(mx.array([[t]]), cache=other)
            lent.clear()  # (its first page alone was one run)
            for _ in range(8):
                got_logits.append(logits)
                got.append(int(mx.argmax(logits).item()))
                logits = model(mx.array([[got[-1]]]), cache=cache)[0, -1]
            pages = cache[0].rows.tables(0)[0].pages
            assert (np.diff(pages) != 1).any() and lent == []
        else:
            got, got_logits = greedy(model, prompt, cache, 8)
            assert lent and set(lent) == {int(cache[0].rows.tables(0)[0].pages[0])}
        assert got == want
        for a, b in zip(got_logits, want_logits):
            assert np.allclose(np.array(a), np.array(b), atol=tiny_models.LOGITS_ATOL)
    other.release()


def test_a_pool_written_in_layer_groups_lends_no_views():
    model = make_model("gemma3_text")
    from pagedkv import kv_pool_layers
    pool = PagePool(num_layers=kv_pool_layers(model), num_kv_heads=2, head_dim=16, page_size=4, num_pages=64,
                    dtype=mx.float32)
    with make_paged_cache(model, pool):
        assert pool.borrow_run(0, 1, 0, 4) is None
    solo = make_pool("llama", page_size=4)
    assert solo.borrow_run(0, 1, 0, 4) is not None


def test_mlx_attention_misreads_long_views_past_the_start_of_rows_a_multiple_of_256_long(monkeypatch):
    """The rule (``paged_decode.mlx_attention_misreads``) as the pool applies it, made to
    run as on CUDA. A pool of 80 pages of 16 would have rows of 1280 tokens a head, a
    multiple of 256, so it takes 81 rows a head (``head_rows_for``) and lends runs of
    256 tokens or more, as a pool of 81 pages does. Pages of 256 tokens leave every row
    count a multiple of 256: that pool lends short runs only. A gathered read cut past
    its first token is cut by index where the gather's rows are a multiple of 256
    tokens and the cut is that long."""
    monkeypatch.setattr(paged_decode, "available", lambda: True)
    rule = paged_decode.mlx_attention_misreads
    assert rule(1280, 16, 256) and rule(512, 1, 300)
    assert not (rule(1280, 0, 300) or rule(1280, 16, 255) or rule(1296, 16, 300))
    for num_pages, page_size, rows, lends_long in ((4, 256, 4, False), (80, 16, 81, True), (81, 16, 81, True)):
        pool = PagePool(num_layers=1, num_kv_heads=2, head_dim=8, page_size=page_size, num_pages=num_pages,
                        dtype=mx.float32)
        assert pool.rows_per_head == rows and pool.allocator.num_pages == num_pages
        assert (pool.borrow_run(0, 1, 0, 300) is not None) == lends_long
        assert pool.borrow_run(0, 1, 0, 255) is not None and pool.borrow_run(0, 1, 3, 100) is not None
    cuts = []
    real_take = mx.take
    monkeypatch.setattr(mx, "take", lambda a, i, axis=None: (cuts.append(i.ndim == 1 and a.ndim == 2),
                                                             real_take(a, i, axis=axis))[1])
    index = pool.gather_index(mx.array([list(range(1, 17))], dtype=mx.int32))  # a read of 16 pages: 256 tokens
    for start, stop, by_index in ((5, 256, False), (0, 256, False), (1, 256, False), (0, 200, False)):
        cuts.clear()
        pool.gather(0, index, start, stop, track=False)
        assert cuts == [by_index] * 2
    index = pool.gather_index(mx.array([list(range(1, 33))], dtype=mx.int32))  # 32 pages: 512 tokens
    for start, stop, by_index in ((5, 261, True), (5, 260, False), (0, 512, False)):
        cuts.clear()
        pool.gather(0, index, start, stop, track=False)
        assert cuts == [by_index] * 2


@pytest.mark.parametrize("pages", ["fp", "affine8"])
def test_where_mlx_attention_misreads_views_reads_are_cut_by_index_and_none_are_lent(monkeypatch, pages):
    """Where MLX's attention would misread K/V views (``paged_decode.mlx_attention_misreads``:
    on CUDA, long ones in some pools; bench/RESULTS.md), made to hold for every view
    here: the pool lends no views, and a one-row read that starts inside its first page
    (a sliding window's) gathers those tokens by index instead of slicing the pages it
    gathered. The values are the same as the slice's, for every page component, and a
    sliding-window model still decodes one sequence as on mlx-lm's own caches."""
    misreads = lambda row_tokens, start, length: True  # noqa: E731
    rng = np.random.default_rng(0)
    pool = make_pool("llama", page_size=4, pages=pages)
    pool.allocator.allocate(3)  # (the sequence's pages start past page 0)
    cache = PagedKVCache(PageTable(pool, window=6), 0)
    for t in (11, 1, 1):
        kv = [mx.array(rng.standard_normal((1, 2, t, 64)).astype(np.float32)) for _ in range(2)]
        sliced = cache.update_and_fetch(*kv)
        monkeypatch.setattr(paged_decode, "mlx_attention_misreads", misreads)
        cut = cache.keys_and_values()
        assert pool.borrow_run(0, int(cache.table.pages[0]), 0, 4) is None
        monkeypatch.undo()
        assert pool.borrow_run(0, int(cache.table.pages[0]), 0, 4) is not None
        read = cache.rows.visible_read(0)
        start = int(read.lo[0] - read.key_base[0])
        assert start > 0 or t > 1  # (decode: the window starts inside its first page, the case at issue)
        for a, b in zip(sliced, cut):
            for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
                assert x.shape == y.shape and np.array_equal(np.array(x), np.array(y))
    cache.table.release()
    assert pool.allocator.num_in_use() == 3

    monkeypatch.setattr(paged_decode, "mlx_attention_misreads", misreads)
    model = make_model("gemma3_text")  # sliding layers (window 12) between full ones
    prompt = prompt_of(21)
    want, want_logits = greedy(model, prompt, make_prompt_cache(model), 8)
    with make_paged_cache(model, make_pool("gemma3_text", page_size=4)) as paged:
        got, got_logits = greedy(model, prompt, paged, 8)
    assert got == want
    for a, b in zip(got_logits, want_logits):
        assert np.allclose(np.array(a), np.array(b), atol=tiny_models.LOGITS_ATOL)


def reference_kernel(q, k_pool, v_pool, table, lengths, starts, scale, *, rows_per_head, page_size, sinks=None, after=None):
    """What the CUDA kernel computes, from the same arguments: each row's pages in table
    order, tokens [starts, lengths), attention of its one query (with ``sinks``)."""
    b, hq, _, d = q.shape
    hkv = k_pool.shape[0] // rows_per_head
    out = []
    for row in range(b):
        rows = (mx.arange(hkv)[:, None] * rows_per_head + table[row][None, :]).reshape(-1)
        lo, hi = starts[row].item(), lengths[row].item()
        k = k_pool[rows].reshape(hkv, -1, d)[None, :, lo:hi]
        v = v_pool[rows].reshape(hkv, -1, d)[None, :, lo:hi]
        out.append(mx.fast.scaled_dot_product_attention(q[row : row + 1], k, v, scale=scale, sinks=sinks))
    return mx.concatenate(out)


def pool_with_a_stand_in_kernel(monkeypatch, kind: str = "llama", num_layers: int | None = None
                                ) -> tuple[PagePool, list]:
    """A pool for ``kind`` (pages of 8; ``num_layers``: fewer layers than the model's, so
    it is used in layer groups) whose decode steps may take the CUDA decode kernel, with
    ``reference_kernel`` standing in for it on a CPU; and the list of the table shapes
    each kernel call got."""
    import attrs

    calls = []
    monkeypatch.setattr(paged_decode, "fits", lambda q, *a: q.shape[2] == 1)  # not the GPU check
    monkeypatch.setattr(paged_decode, "paged_decode",
                        lambda *a, **k: (calls.append(a[3].shape), reference_kernel(*a, **k))[1])
    pool = make_pool(kind, page_size=8, num_layers=num_layers)
    pool.kind = attrs.evolve(pool.kind, decode_kernel=True)
    return pool, calls


def test_one_sequence_decodes_with_mlx_attention_where_its_keys_are_at_hand(monkeypatch):
    """Where the decode kernel could run, a one-sequence step attends with MLX's own
    attention if its keys are at hand: views of the pool where its pages are one run (no
    gather, no kernel), else the step's gather
    if it is short (``MLX_SHORT_GATHER_BYTES``); a longer gather takes the kernel. All
    give mlx-lm's tokens."""
    pool, calls = pool_with_a_stand_in_kernel(monkeypatch)
    model = make_model("llama")
    p = prompt_of(13, seed=1)
    want = greedy(model, p, make_prompt_cache(model), 6)[0]
    gathers = []
    real_gather = pool.gather
    monkeypatch.setattr(pool, "gather", lambda *a, **k: (gathers.append(1), real_gather(*a, **k))[1])
    with make_paged_cache(model, pool) as solo:
        tokens, _ = greedy(model, p, solo, 6)
        pages = solo[0].rows.tables(0)[0].pages.tolist()
        assert pages == list(range(pages[0], pages[0] + 3))  # one run of ids
    assert tokens == want and calls == []
    assert len(gathers) <= 2 * len(model.layers)  # (the first steps, before lending starts)
    for short, kernel in ((paged_decode.MLX_SHORT_GATHER_BYTES, False), (0, True)):
        monkeypatch.setattr(paged_decode, "MLX_SHORT_GATHER_BYTES", short)
        calls.clear()
        other = make_paged_cache(model, pool)
        with make_paged_cache(model, pool) as solo:
            for i in range(0, 12, 4):  # the two sequences' pages interleave: not one run
                for c in (solo, other):
                    model(mx.array(p[i : i + 4])[None], cache=c)
            logits = model(mx.array([p[12:]]), cache=solo)
            for _ in range(2):
                token = int(mx.argmax(logits[0, -1]).item())
                logits = model(mx.array([[token]]), cache=solo)
            assert int(mx.argmax(logits[0, -1]).item()) == want[2]
        assert calls == ([(1, 2)] * 9 if kernel else [])  # 3 one-token steps x 3 layers, 2 pages each
        other.release()


def test_a_sliding_layers_gathered_window_goes_to_mlx_attention_and_a_long_read_to_the_kernel(monkeypatch):
    """gemma3 on a pool in layer groups (which lends no views): where the decode kernel
    could run, a sliding layer's step attends with MLX's own attention over the window
    its fetch gathered already; a full layer over a longer context takes the kernel.
    The tokens are mlx-lm's."""
    pool, calls = pool_with_a_stand_in_kernel(monkeypatch, "gemma3_text", num_layers=2)
    monkeypatch.setattr(paged_decode, "MLX_VECTOR_HEAD_DIMS", (16,))  # (the tiny model's head size)
    per_token = pool.bytes_per_page_per_layer // pool.page_size
    monkeypatch.setattr(paged_decode, "MLX_SHORT_GATHER_BYTES", 20 * per_token)  # a window of 12 fits; 40 do not
    model = make_model("gemma3_text")
    p = prompt_of(40, seed=3)
    want = greedy(model, p, make_prompt_cache(model), 4)[0]
    with make_paged_cache(model, pool) as c:
        assert pool.borrow_run(0, 0, 0, 1) is None  # (in groups: no views)
        tokens, _ = greedy(model, p, c, 4)
    assert tokens == want
    assert len(calls) == 2 * 4  # the 2 full layers of each of the 4 decode steps


def test_the_decode_kernel_gets_each_rows_pages_and_range(monkeypatch):
    """On a CPU, stand a Python reference in for the CUDA kernel: a single cache's and a
    ragged batch's decode steps through it must give mlx-lm's tokens, so the page table,
    starts and lengths the engine hands the kernel are right."""
    pool, calls = pool_with_a_stand_in_kernel(monkeypatch)
    monkeypatch.setattr(paged_decode, "MLX_VECTOR_HEAD_DIMS", ())  # one row too: the kernel
    model = make_model("llama")
    prompts = [prompt_of(13, seed=1), prompt_of(30, seed=2)]
    batch = PagedBatch.for_model(model, pool)
    for p in prompts:
        with make_paged_cache(model, pool) as solo:
            tokens, _ = greedy(model, p, solo, 6)
        assert tokens == greedy(model, p, make_prompt_cache(model), 6)[0]
        c = make_paged_cache(model, pool)
        model(mx.array(p)[None], cache=c)
        batch.extend(c)
    assert calls and all(shape[0] == 1 for shape in calls)
    calls.clear()
    logits = model(mx.array([[1], [2]]), cache=batch.caches)[:, -1]
    assert calls == [(2, 4)] * 3  # one call per layer, both rows, the longer row's 4 pages
    for row, p in enumerate(prompts):
        ref_cache = make_prompt_cache(model)
        model(mx.array(p)[None], cache=ref_cache)
        ref = model(mx.array([[row + 1]]), cache=ref_cache)[0, -1]
        assert mx.abs(logits[row] - ref).max().item() <= tiny_models.LOGITS_ATOL
    batch.release()
