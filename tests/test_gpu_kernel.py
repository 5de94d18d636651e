"""The CUDA paged decode kernel vs gather + SDPA and a float32 reference (GPU only)."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from pagedkv import KvAttentionView, PagedKVCache, PagePool, PageTable
from pagedkv.kernels import paged_decode, paged_prefill

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not paged_decode.available(), reason="needs MLX on a CUDA GPU")]

TOL = {mx.float16: 2e-3, mx.bfloat16: 1.6e-2}


def random_pool(dtype, d, lengths, hkv=4, ps=16, seed=0):
    """A pool whose rows hold ``lengths`` tokens on pages in random order."""
    rng = np.random.default_rng(seed)
    total = sum(-(-n // ps) for n in lengths) + 8
    pool = PagePool(num_layers=1, num_kv_heads=hkv, head_dim=d, page_size=ps, num_pages=total + 1,
                    dtype=dtype, cache_limit=None)
    pool.allocator.allocate(total)  # take everything, then hand out pages in random order
    pool.allocator.decref(rng.permutation(np.arange(1, total + 1)))
    caches, kvs = [], []
    for n in lengths:
        c = PagedKVCache(PageTable(pool), 0)
        k = mx.array(rng.standard_normal((1, hkv, n, d)).astype(np.float32)).astype(dtype)
        v = mx.array(rng.standard_normal((1, hkv, n, d)).astype(np.float32)).astype(dtype)
        c.update_and_fetch(k, v)
        caches.append(c)
        kvs.append((k, v))
    mx.eval(pool.written(0))  # (the tests read the pool's arrays directly, without write_order)
    return pool, caches, kvs


def reference(q, kvs, scale, sinks=None):
    outs = []
    for b, (k, v) in enumerate(kvs):
        outs.append(mx.fast.scaled_dot_product_attention(
            q[b : b + 1].astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32), scale=scale, sinks=sinks))
    return mx.concatenate(outs)


def rel(a, b):
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.linalg.norm((a - b).reshape(-1)) / mx.linalg.norm(b.reshape(-1))).item()


def check_against_references(dtype, d, lengths, hq=16, pipeline=paged_decode.DEFAULT_PIPELINE):
    pool, caches, kvs = random_pool(dtype, d, lengths)
    rng = np.random.default_rng(1)
    q = mx.array(rng.standard_normal((len(lengths), hq, 1, d)).astype(np.float32)).astype(dtype)
    scale = d ** -0.5
    view = KvAttentionView(pool, 0, [c.table for c in caches])
    got = paged_decode.paged_decode(q, *pool.layer_arrays(0), view._read.table, mx.array(lengths, dtype=mx.int32),
                                    mx.zeros((len(lengths),), mx.int32), scale, rows_per_head=pool.rows_per_head,
                                    page_size=pool.page_size, pipeline=pipeline, poison=True)
    assert not mx.isnan(got).any().item()  # every element was written
    ref32 = reference(q, kvs, scale)
    assert rel(got, ref32) < TOL[dtype]
    gathered = mx.concatenate([
        mx.fast.scaled_dot_product_attention(q[b : b + 1], k, v, scale=scale) for b, (k, v) in enumerate(kvs)])
    assert rel(got, gathered) < TOL[dtype]
    if pipeline == paged_decode.DEFAULT_PIPELINE:
        assert rel(view.attend(q, scale), ref32) < TOL[dtype]  # the view dispatches to the kernel
    view.release()


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("lengths", [[1000], [5, 777, 1600, 33], [4096, 17]])
def test_kernel_matches_gather_sdpa_and_float32(dtype, d, lengths):
    check_against_references(dtype, d, lengths)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_cuda_core_path_matches_gather_sdpa_and_float32(dtype, d):
    check_against_references(dtype, d, [5, 777, 1600, 33], pipeline=paged_decode.Pipeline(tensor_cores=False))


@pytest.mark.parametrize("hq", [4, 28, 48, 64, 80])   # 4 KV heads: GQA groups of 1, 7, 12, 16, 20
def test_any_gqa_group_size(hq):
    check_against_references(mx.float16, 128, [300, 1000], hq=hq)


@pytest.mark.parametrize("pipeline", [paged_decode.DEFAULT_PIPELINE, paged_decode.Pipeline(warps=8, stages=4),
                                      paged_decode.Pipeline(2, 8, 2, tensor_cores=False)])
@pytest.mark.parametrize("splits", [1, 3, 64])
def test_any_split_count_and_pipeline_give_the_same_answer(splits, pipeline):
    pool, caches, kvs = random_pool(mx.float16, 128, [3000, 70])
    q = mx.random.normal((2, 8, 1, 128)).astype(mx.float16)
    view = KvAttentionView(pool, 0, [c.table for c in caches])
    got = paged_decode.paged_decode(q, *pool.layer_arrays(0), view._read.table, mx.array([3000, 70], dtype=mx.int32),
                                    mx.zeros((2,), mx.int32), 128 ** -0.5, rows_per_head=pool.rows_per_head,
                                    page_size=16, splits=splits, pipeline=pipeline, poison=True)
    assert rel(got, reference(q, kvs, 128 ** -0.5)) < TOL[mx.float16]


def test_rows_longer_than_one_blocks_page_ids_are_split():
    pool, caches, kvs = random_pool(mx.float16, 64, [5000, 300], ps=1)  # 5000 pages > MAX_PAGES_PER_SPLIT
    q = mx.random.normal((2, 8, 1, 64)).astype(mx.float16)
    view = KvAttentionView(pool, 0, [c.table for c in caches])
    got = paged_decode.paged_decode(q, *pool.layer_arrays(0), view._read.table, mx.array([5000, 300], dtype=mx.int32),
                                    mx.zeros((2,), mx.int32), 0.125, rows_per_head=pool.rows_per_head,
                                    page_size=1, splits=1, poison=True)
    assert rel(got, reference(q, kvs, 0.125)) < TOL[mx.float16]


def test_window_start_skips_early_tokens():
    pool, caches, kvs = random_pool(mx.float16, 64, [900])
    q = mx.random.normal((1, 8, 1, 64)).astype(mx.float16)
    view = KvAttentionView.of_cache(caches[0])
    got = view.attend(q, 0.125, window=256)
    k, v = kvs[0]
    want = mx.fast.scaled_dot_product_attention(q.astype(mx.float32), k[:, :, -256:].astype(mx.float32),
                                                v[:, :, -256:].astype(mx.float32), scale=0.125)
    assert rel(got, want) < TOL[mx.float16]


@pytest.mark.parametrize("one_row", ["mlx attention", "kernel"])
def test_the_models_own_decode_step_and_the_batch_read_the_pages(monkeypatch, one_row):
    """route_attention sends mlx-lm's attention to the pages: a single cache's decode
    steps run MLX's attention over lent views of the pool (these sequences are too short
    for MLX to misread them: ``paged_decode.mlx_attention_misreads``) or, made to, the
    kernel; a batch's call runs the kernel; all give mlx-lm's greedy tokens."""
    from mlx_lm.models.cache import make_prompt_cache
    from tiny_models import greedy, make_model, make_pool, prompt_of

    from pagedkv import PagedBatch, make_paged_cache

    model = make_model("llama")
    model.set_dtype(mx.float16)
    calls = []
    real = paged_decode.paged_decode
    monkeypatch.setattr(paged_decode, "paged_decode", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    if one_row == "kernel":
        monkeypatch.setattr(paged_decode, "MLX_VECTOR_HEAD_DIMS", ())
    prompts = [prompt_of(40, seed=1), prompt_of(75, seed=2)]
    pool = make_pool("llama", page_size=16, num_pages=64, dtype=mx.float16)
    batch = PagedBatch.for_model(model, pool)
    for p in prompts:
        with make_paged_cache(model, pool) as solo:
            tokens, _ = greedy(model, p, solo, 8)
        ref, _ = greedy(model, p, make_prompt_cache(model), 8)
        assert tokens == ref
        c = make_paged_cache(model, pool)
        model(mx.array(p)[None], cache=c)
        batch.extend(c)
    if one_row == "kernel":
        assert len(calls) >= 2 * 7 * len(model.layers)
    else:
        assert calls == []
    calls.clear()
    logits = model(mx.array([[1], [2]]), cache=batch.caches)
    mx.eval(logits)
    assert len(calls) == len(model.layers)
    for row, p in enumerate(prompts):
        ref_cache = make_prompt_cache(model)
        model(mx.array(p)[None], cache=ref_cache)
        ref = model(mx.array([[row + 1]]), cache=ref_cache)
        assert rel(logits[row, -1], ref[0, -1]) < 2e-2
    batch.release()


@pytest.mark.parametrize("num_pages, page_size", [(80, 16), (200, 16), (320, 16), (8, 256)])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_what_one_sequence_hands_mlx_attention_reads_right_on_any_pool_size(dtype, num_pages, page_size):
    """MLX 0.32's CUDA attention reads one query's K/V from their buffer's first token
    when they hold 256 tokens or more in rows a multiple of 256 long (mlx-lm's cache
    slices), so a view that starts later is misread: wrong values, NaN or a crash
    (``paged_decode.mlx_attention_misreads``, bench/RESULTS.md). Pools of 80 and 320
    pages of 16 would have such rows (1280 and 5120 tokens a head), so they take one row
    more (``head_rows_for``) and lend views like the 200-page pool; with pages of 256
    tokens no row count helps, and that pool gathers. One sequence on pages past page 0,
    with and without a window: what ``update_and_fetch`` returns, given to MLX's
    attention as a model that does not route it would, what ``attend`` computes, and
    the plain and view ``SharedKv`` of the step give float32 attention over the same keys."""
    rng = np.random.default_rng(num_pages)
    pool = PagePool(num_layers=1, num_kv_heads=2, head_dim=64, page_size=page_size, num_pages=num_pages,
                    dtype=dtype, cache_limit=None)
    assert pool.rows_per_head == num_pages + (num_pages * page_size % 256 == 0 and page_size < 256)
    held = pool.allocator.allocate(5)
    assert (pool.borrow_run(0, 1, 0, 300) is None) == (page_size == 256)
    q = mx.array(rng.standard_normal((1, 4, 1, 64)).astype(np.float32)).astype(dtype)
    for window in (None, 40):
        cache = PagedKVCache(PageTable(pool, window=window), 0)
        ks, vs = [], []
        for t in (300, 1, 1, 1):
            ks.append(mx.array(rng.standard_normal((1, 2, t, 64)).astype(np.float32)).astype(dtype))
            vs.append(mx.array(rng.standard_normal((1, 2, t, 64)).astype(np.float32)).astype(dtype))
            got_k, got_v = cache.update_and_fetch(ks[-1], vs[-1])
            n, seen = sum(k.shape[2] for k in ks), got_k.shape[2]
            want = mx.fast.scaled_dot_product_attention(
                q.astype(mx.float32), mx.concatenate(ks, axis=2)[:, :, n - seen:].astype(mx.float32),
                mx.concatenate(vs, axis=2)[:, :, n - seen:].astype(mx.float32), scale=0.125)
            assert rel(mx.fast.scaled_dot_product_attention(q, got_k, got_v, scale=0.125), want) < TOL[dtype]
            if t == 1:  # (a decode step: the query is the last position, as attend takes it)
                assert rel(cache.attend(q, 0.125, None), want) < TOL[dtype]
                for kind in ("plain", "view"):  # what a sharer layer or a drafter is handed
                    shared = cache.fetch_shared(kind)
                    assert rel(shared.attend(q, 0.125), want) < TOL[dtype]
                    shared.release()
            del got_k, got_v
        cache.table.release()
    pool.allocator.decref(held)
    assert pool.allocator.num_in_use() == 0


# ---------------------------------------------------------------- prefill kernel
def prefill_reference(q, kvs, lengths, starts, scale, window=None, sinks=None):
    """Float32 SDPA per row: query i at lengths[b] - L + i sees keys [starts[b], that]."""
    lq = q.shape[2]
    outs = []
    for b, (k, v) in enumerate(kvs):
        n = lengths[b]
        pos = np.arange(n - lq, n)[:, None]
        keys = np.arange(n)[None]
        mask = (keys >= starts[b]) & (keys <= pos)
        if window is not None:
            mask &= keys > pos - window
        outs.append(mx.fast.scaled_dot_product_attention(
            q[b : b + 1].astype(mx.float32), k[:, :, :n].astype(mx.float32), v[:, :, :n].astype(mx.float32),
            scale=scale, mask=mx.array(mask), sinks=sinks))
    return mx.concatenate(outs)


def check_prefill(dtype, d, lengths, lq, hq=16, starts=None, window=None, splits=None, ps=16):
    pool, caches, kvs = random_pool(dtype, d, lengths, ps=ps)
    starts = starts or [0] * len(lengths)
    rng = np.random.default_rng(2)
    q = mx.array(rng.standard_normal((len(lengths), hq, lq, d)).astype(np.float32)).astype(dtype)
    scale = d ** -0.5
    view = KvAttentionView(pool, 0, [c.table for c in caches])
    got = paged_prefill.paged_prefill(
        q, *pool.layer_arrays(0), view._read.table, mx.array(lengths, dtype=mx.int32),
        mx.array(starts, dtype=mx.int32), scale, rows_per_head=pool.rows_per_head, page_size=ps, window=window,
        splits=splits, poison=True)
    assert not mx.isnan(got).any().item()  # every element was written
    assert rel(got, prefill_reference(q, kvs, lengths, starts, scale, window)) < TOL[dtype]
    view.release()


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("lengths, lq", [([100], 100), ([1000], 1000), ([700, 90, 1300], 90),
                                         ([4096, 300], 17), ([40, 41], 2)])
def test_prefill_kernel_matches_float32_sdpa(dtype, d, lengths, lq):
    check_prefill(dtype, d, lengths, lq)


@pytest.mark.parametrize("hq", [4, 12, 28, 32])   # 4 KV heads: GQA groups of 1, 3, 7, 8
@pytest.mark.parametrize("splits", [None, 1, 5])
def test_prefill_kernel_any_gqa_group_and_split_count(hq, splits):
    check_prefill(mx.float16, 128, [600, 257], 129, hq=hq, splits=splits)


def test_prefill_kernel_applies_start_window_and_page_size():
    check_prefill(mx.float16, 64, [900, 500], 300, starts=[128, 7], window=200, ps=1)
    check_prefill(mx.bfloat16, 128, [2000], 64, starts=[1700], window=256, ps=32)


def test_prefill_chunked_prefill_and_a_batch_verify_step_run_on_the_prefill_kernel(monkeypatch):
    """A prompt prefilled in chunks, and a batch step of 3 tokens per ragged row (a
    speculative verify), read the pages through the prefill kernel and give mlx-lm's
    logits."""
    from mlx_lm.models.cache import make_prompt_cache
    from tiny_models import make_model, make_pool, prompt_of

    from pagedkv import PagedBatch, make_paged_cache

    model = make_model("llama")
    model.set_dtype(mx.float16)
    calls = []
    real = paged_prefill.paged_prefill
    monkeypatch.setattr(paged_prefill, "paged_prefill", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    pool = make_pool("llama", page_size=16, num_pages=64, dtype=mx.float16)
    batch = PagedBatch.for_model(model, pool)
    refs = []
    for seed, n in ((1, 150), (2, 61)):
        prompt = prompt_of(n, seed=seed)
        c, ref = make_paged_cache(model, pool), make_prompt_cache(model)
        for lo in range(0, n, 64):
            chunk = mx.array(prompt[lo : lo + 64])[None]
            got, want = model(chunk, cache=c), model(chunk, cache=ref)
            assert rel(got, want) < 2e-2
        batch.extend(c)
        refs.append(ref)
    assert len(calls) == (3 + 1) * len(model.layers)
    calls.clear()
    step = mx.array([[5, 6, 7], [8, 9, 10]])
    logits = model(step, cache=batch.caches)
    mx.eval(logits)
    assert len(calls) == len(model.layers)
    for row, ref in enumerate(refs):
        assert rel(logits[row], model(step[row : row + 1], cache=ref)[0]) < 2e-2
    batch.release()


@pytest.mark.parametrize("tiling", [paged_prefill.Tiling(m, k) for m in (1, 2) for k in (16, 32, 64)])
def test_prefill_kernel_every_tiling_gives_the_same_answer(tiling):
    pool, caches, kvs = random_pool(mx.float16, 64, [700, 150, 1100])
    q = mx.random.normal((3, 12, 140, 64)).astype(mx.float16)  # every query sees a key: 10 >= 3
    view = KvAttentionView(pool, 0, [c.table for c in caches])
    lengths, starts = [700, 150, 1100], [0, 3, 200]
    got = paged_prefill.paged_prefill(
        q, *pool.layer_arrays(0), view._read.table, mx.array(lengths, dtype=mx.int32),
        mx.array(starts, dtype=mx.int32), 0.125, rows_per_head=pool.rows_per_head, page_size=16, window=400,
        tiling=tiling, poison=True)
    assert rel(got, prefill_reference(q, kvs, lengths, starts, 0.125, 400)) < TOL[mx.float16]
    view.release()


def large_sinks(hq, seed=3):
    """Sink logits [hq] near the log-sum-exp of these tests' scores (about 6-8), so the
    sink takes a large, head-dependent share of each softmax."""
    return mx.array(6 + 2 * np.random.default_rng(seed).standard_normal(hq), dtype=mx.float32)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("lengths", [[1000], [5, 777, 1600, 33]])
def test_decode_kernel_applies_attention_sinks_as_sdpa_does(dtype, lengths):
    pool, caches, kvs = random_pool(dtype, 64, lengths)
    hq = 8
    q = mx.array(np.random.default_rng(1).standard_normal((len(lengths), hq, 1, 64)).astype(np.float32)).astype(dtype)
    sinks = large_sinks(hq)
    view = KvAttentionView(pool, 0, [c.table for c in caches])
    args = (q, *pool.layer_arrays(0), view._read.table, mx.array(lengths, dtype=mx.int32),
            mx.zeros((len(lengths),), mx.int32), 0.125)
    got = paged_decode.paged_decode(*args, rows_per_head=pool.rows_per_head, page_size=16, poison=True,
                                    sinks=sinks.astype(dtype))
    want = reference(q, kvs, 0.125, sinks.astype(dtype).astype(mx.float32))
    assert rel(got, want) < TOL[dtype]
    without = paged_decode.paged_decode(*args, rows_per_head=pool.rows_per_head, page_size=16)
    assert rel(without, want) > 0.1  # the sinks changed the answer
    view.release()


def test_prefill_kernel_applies_attention_sinks_as_sdpa_does():
    lengths, starts, lq, hq = [700, 90, 1300], [0, 5, 300], 90, 12
    pool, caches, kvs = random_pool(mx.float16, 64, lengths)
    q = mx.array(np.random.default_rng(2).standard_normal((3, hq, lq, 64)).astype(np.float32)).astype(mx.float16)
    sinks = large_sinks(hq)
    view = KvAttentionView(pool, 0, [c.table for c in caches])
    got = paged_prefill.paged_prefill(
        q, *pool.layer_arrays(0), view._read.table, mx.array(lengths, dtype=mx.int32),
        mx.array(starts, dtype=mx.int32), 0.125, rows_per_head=pool.rows_per_head, page_size=16, window=256,
        poison=True, sinks=sinks)
    want = prefill_reference(q, kvs, lengths, starts, 0.125, 256, sinks)
    assert rel(got, want) < TOL[mx.float16]
    assert rel(prefill_reference(q, kvs, lengths, starts, 0.125, 256), want) > 0.1
    view.release()


def test_a_compiled_decode_step_runs_the_kernel_and_gives_the_eager_logits(monkeypatch):
    """CompiledDecode on fp16 pages: the trace calls the decode kernel, and each step's
    logits match the eager batch's (same tokens fed to both)."""
    from tiny_models import make_model, make_pool, prompt_of

    from pagedkv import CompiledDecode, PagedBatch, make_paged_cache

    model = make_model("llama")
    model.set_dtype(mx.float16)
    calls = []
    real = paged_decode.paged_decode
    monkeypatch.setattr(paged_decode, "paged_decode", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    batches = []
    for _ in range(2):
        pool = make_pool("llama", page_size=16, num_pages=64, dtype=mx.float16)
        batch = PagedBatch.for_model(model, pool)
        for seed, n in ((1, 40), (2, 75), (3, 9)):
            c = make_paged_cache(model, pool)
            model(mx.array(prompt_of(n, seed=seed))[None], cache=c)
            batch.extend(c)
        batches.append(batch)
    eager, compiled = batches
    step = CompiledDecode(model, compiled, bucket=4)
    tok = mx.array([[1], [2], [3]])
    traced = 0
    for _ in range(20):
        want = model(tok, cache=eager.caches)
        calls.clear()
        got = step(tok)
        traced += len(calls)  # Python runs the layers only while tracing
        mx.eval(want, got)
        assert rel(got, want) < 2e-2
        tok = mx.argmax(want[:, -1], axis=-1)[:, None]
    assert 1 <= step.traces < 20 and traced == step.traces * len(model.layers)
    assert eager.lengths == compiled.lengths
    eager.release()
    compiled.release()


def test_gpt_oss_decode_steps_read_the_pages_through_the_kernel_with_their_attention_sinks(monkeypatch):
    """gpt_oss's attention has sinks. On fp16 pages its decode steps (one cache made to
    take the kernel, and a compiled step over a batch) call the decode kernel, which
    applies the sinks, and give mlx-lm's logits (its own caches: rotating ones on the
    sliding layers)."""
    from mlx_lm.models.cache import make_prompt_cache
    from test_model_families import BASE, FAMILIES, ragged_rows
    from tiny_models import model_of_config, prompt_of

    from pagedkv import CompiledDecode, make_paged_cache

    model = model_of_config(dict(BASE, hidden_size=128, head_dim=64, model_type="gpt_oss", **FAMILIES["gpt_oss"]))
    for i, layer in enumerate(model.model.layers):  # sinks that take a large share of each softmax
        layer.self_attn.sinks = 3 + mx.random.normal(layer.self_attn.sinks.shape, key=mx.random.key(i))
        layer.mlp = nn.Identity()  # (its MoE's gather_mm would need float32 on a CPU; attention is what counts)
    model.set_dtype(mx.float16)
    calls = []
    real = paged_decode.paged_decode
    monkeypatch.setattr(paged_decode, "paged_decode", lambda *a, **k: (calls.append(k.get("sinks")), real(*a, **k))[1])
    monkeypatch.setattr(paged_decode, "MLX_VECTOR_HEAD_DIMS", ())  # (one row: else MLX's attention)
    pool = PagePool(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16, num_pages=64, dtype=mx.float16)
    prompt, steps = prompt_of(30), [int(t) for t in prompt_of(10, seed=5)]
    ref_cache = make_prompt_cache(model)
    with make_paged_cache(model, pool) as cache:
        for tokens in [prompt] + [[t] for t in steps]:  # past the window (12)
            want = model(mx.array(tokens)[None], cache=ref_cache)[0, -1]
            got = model(mx.array(tokens)[None], cache=cache)[0, -1]
            assert rel(got, want) < 2e-2
    assert len(calls) == len(steps) * 4 and all(s is not None for s in calls)

    eager, compiled = ragged_rows(model, pool), ragged_rows(model, pool)
    step = CompiledDecode(model, compiled, bucket=2)
    calls.clear()
    tok = mx.array([[1], [2], [3]])
    for _ in range(10):
        want, got = model(tok, cache=eager.caches), step(tok)
        assert rel(got, want) < 2e-2
        tok = mx.argmax(want[:, -1], axis=-1)[:, None]
    assert calls  # the trace called the kernel
    eager.release()
    compiled.release()
