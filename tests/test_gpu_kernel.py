"""The CUDA paged decode kernel vs gather + SDPA and a float32 reference (GPU only)."""

import mlx.core as mx
import numpy as np
import pytest

from pagedkv import KvAttentionView, PagedKVCache, PagePool, PageTable
from pagedkv.kernels import paged_decode

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
    return pool, caches, kvs


def reference(q, kvs, scale):
    outs = []
    for b, (k, v) in enumerate(kvs):
        outs.append(mx.fast.scaled_dot_product_attention(
            q[b : b + 1].astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32), scale=scale))
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
                                    mx.zeros((len(lengths),), mx.int32), scale, num_pages=pool.num_pages,
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
                                    mx.zeros((2,), mx.int32), 128 ** -0.5, num_pages=pool.num_pages,
                                    page_size=16, splits=splits, pipeline=pipeline, poison=True)
    assert rel(got, reference(q, kvs, 128 ** -0.5)) < TOL[mx.float16]


def test_rows_longer_than_one_blocks_page_ids_are_split():
    pool, caches, kvs = random_pool(mx.float16, 64, [5000, 300], ps=1)  # 5000 pages > MAX_PAGES_PER_SPLIT
    q = mx.random.normal((2, 8, 1, 64)).astype(mx.float16)
    view = KvAttentionView(pool, 0, [c.table for c in caches])
    got = paged_decode.paged_decode(q, *pool.layer_arrays(0), view._read.table, mx.array([5000, 300], dtype=mx.int32),
                                    mx.zeros((2,), mx.int32), 0.125, num_pages=pool.num_pages,
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


def test_the_models_own_decode_step_and_the_batch_run_on_the_kernel(monkeypatch):
    """route_attention sends mlx-lm's attention to the pages: a single cache's and a
    batch's decode steps call the kernel and give mlx-lm's greedy tokens."""
    from mlx_lm.models.cache import make_prompt_cache
    from tiny_models import greedy, make_model, make_pool, prompt_of

    from pagedkv import PagedBatch, make_paged_cache

    model = make_model("llama")
    model.set_dtype(mx.float16)
    calls = []
    real = paged_decode.paged_decode
    monkeypatch.setattr(paged_decode, "paged_decode", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
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
    assert len(calls) >= 2 * 7 * len(model.layers)
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
