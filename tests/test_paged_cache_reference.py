"""PagedKVCache vs mlx-lm's own KVCache / RotatingKVCache, on mlx-lm's own model classes."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import (
    KVCache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
    trim_prompt_cache,
)
from tiny_models import greedy, make_model, make_pool, prompt_of

from pagedkv import (
    InvalidValueError,
    NotSupportedError,
    PagedPromptCache,
    PagePool,
    make_paged_cache,
)

STEPS = 64


@pytest.fixture(scope="module")
def models():
    return {k: make_model(k) for k in ("llama", "qwen3", "gemma3n")}


def assert_same(ref, got):
    ref_tokens, ref_logits = ref
    tokens, logits = got
    assert tokens == ref_tokens
    worst = max(mx.abs(a - b).max().item() for a, b in zip(ref_logits, logits))
    assert worst <= 1e-5, worst


def assert_all_pages_back(pool):
    pool.allocator.check()
    assert pool.allocator.num_in_use() == 0


PAGE_FITS = [(16, 32), (16, 33), (1, 20), (64, 64), (64, 65), (13, 26), (13, 27)]  # (page size, prompt)


@pytest.mark.parametrize("kind,page_size,prompt_len", [
    pytest.param(kind, ps, n, marks=[pytest.mark.slow] if kind != "llama" and (ps, n) not in {(13, 27), (1, 20)} else [])
    for kind in ("llama", "qwen3", "gemma3n") for ps, n in PAGE_FITS])  # (qwen3's and gemma3n's: two in the quick loop)
def test_greedy_decode_matches_mlx_lm(models, kind, page_size, prompt_len):
    model = models[kind]
    prompt = prompt_of(prompt_len)
    ref = greedy(model, prompt, make_prompt_cache(model), STEPS)
    pool = make_pool(kind, page_size=page_size, num_pages=512)
    with make_paged_cache(model, pool) as cache:
        got = greedy(model, prompt, cache, STEPS)
        pool.allocator.check()
    assert_same(ref, got)
    assert_all_pages_back(pool)


@pytest.mark.parametrize("kind", ["llama", "gemma3n"])
def test_sliding_window_bounds_pages_held(models, kind):
    model = models[kind]
    pool = make_pool(kind, page_size=4, num_pages=512)
    with make_paged_cache(model, pool) as cache:
        greedy(model, prompt_of(40), cache, 40)
        for table in cache.tables:
            if table.window is not None:
                assert table.num_pages <= -(-table.window // 4) + 1
                assert table.first_visible() > 0  # pages really were dropped


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_trim_and_regenerate_matches_mlx_lm(models, kind):
    model = models[kind]
    prompt = prompt_of(30)
    ref_cache = make_prompt_cache(model)
    greedy(model, prompt, ref_cache, 20)
    pool = make_pool(kind, page_size=8)
    with make_paged_cache(model, pool) as cache:
        greedy(model, prompt, cache, 20)
        held = pool.allocator.num_in_use()
        assert trim_prompt_cache(cache, 17) == 17
        assert trim_prompt_cache(ref_cache, 17) == 17
        assert pool.allocator.num_in_use() < held  # tail pages went back
        assert cache[0].offset == ref_cache[0].offset
        ref = greedy(model, [5, 6, 7], ref_cache, 24)
        got = greedy(model, [5, 6, 7], cache, 24)
        assert_same(ref, got)
        pool.allocator.check()
    assert_all_pages_back(pool)


@pytest.mark.parametrize("kind", ["llama", "gemma3n"])
def test_forked_sequences_each_match_an_unforked_run(models, kind):
    model = models[kind]
    prompt = prompt_of(21)  # ends inside a page: the first write after the fork copies it
    pool = make_pool(kind, page_size=8)
    cache_a = make_paged_cache(model, pool)
    logits = model(mx.array(prompt)[None], cache=cache_a)
    mx.eval(logits)
    cache_b = cache_a.fork()
    shared = pool.allocator.num_in_use()
    out = {}
    for name, cache, first in (("a", cache_a, 3), ("b", cache_b, 9)):
        out[name] = greedy(model, [first], cache, 24)
    assert pool.allocator.num_in_use() > shared  # copy-on-write happened
    for name, first in (("a", 3), ("b", 9)):
        ref_cache = make_prompt_cache(model)
        model(mx.array(prompt)[None], cache=ref_cache)
        assert_same(greedy(model, [first], ref_cache, 24), out[name])
    cache_a.release()
    cache_b.release()
    assert_all_pages_back(pool)


def test_every_layers_state_set_from_mlx_lms_saved_caches_decodes_as_mlx_lm_continues(models, tmp_path):
    """What a user moving an mlx-lm prompt cache (``load_prompt_cache``'s, say) into
    pages does: ``paged.state = kv_cache.state`` layer by layer, mlx-lm's (keys, values,
    offset) with buffers longer than the offset. The second layer on writes into the
    pages the first one's state took."""
    model = models["llama"]
    prompt = prompt_of(21)
    ref_cache = make_prompt_cache(model)
    model(mx.array(prompt)[None], cache=ref_cache)
    save_prompt_cache(str(tmp_path / "c.safetensors"), ref_cache)
    loaded = load_prompt_cache(str(tmp_path / "c.safetensors"))
    pool = make_pool("llama", page_size=8)
    cache = make_paged_cache(model, pool)
    k, v, offset = ref_cache[0].state
    assert k.shape[2] > offset == 21
    with pytest.raises(InvalidValueError, match="offset"):
        cache[0].state = (k, v, k.shape[2] + 1)
    assert cache[0].offset == 0 and pool.allocator.num_in_use() == 0
    for c, kv in zip(cache, loaded):
        c.state = kv.state
    assert [c.offset for c in cache] == [21] * len(cache) and pool.allocator.num_in_use() == 3
    fork = cache.fork()
    before = [c.state for c in cache]
    with pytest.raises(NotSupportedError, match="shared"):  # the fork would see the overwrite
        cache[0].state = before[0]
    fork.release()
    with pytest.raises(NotSupportedError, match="21 tokens"):  # the other layers hold 21
        cache[1].state = tuple(x[..., :10, :] for x in before[1])
    assert all(mx.array_equal(a, b) for c, kv in zip(cache, before) for a, b in zip(c.state, kv))
    assert_same(greedy(model, [3], ref_cache, 24), greedy(model, [3], cache, 24))
    cache.release()
    assert_all_pages_back(pool)


def test_generate_step_runs_on_a_paged_cache(models):
    model = models["llama"]
    prompt = mx.array(prompt_of(24))
    greedy_sampler = lambda lp: mx.argmax(lp, axis=-1)  # noqa: E731
    ref = [t for t, _ in generate_step(prompt, model, max_tokens=32, sampler=greedy_sampler,
                                       prompt_cache=make_prompt_cache(model))]
    pool = make_pool("llama", page_size=16)
    with make_paged_cache(model, pool) as cache:
        got = [t for t, _ in generate_step(prompt, model, max_tokens=32, sampler=greedy_sampler,
                                           prompt_cache=cache)]
    assert got == ref
    assert_all_pages_back(pool)


def test_generate_step_asking_for_quantised_kv_runs_on_pages_of_those_bits_and_is_refused_on_others(models):
    """mlx-lm's ``kv_bits`` calls ``to_quantized`` on every cache that has it; a cache
    without one was skipped, so the request went unheard on full-precision pages."""
    model = models["llama"]
    prompt = mx.array(prompt_of(24))

    def tokens(pool, **kv) -> list[int]:
        with make_paged_cache(model, pool) as cache:
            out = [t for t, _ in generate_step(prompt, model, max_tokens=6, prompt_cache=cache, quantized_kv_start=0,
                                               **kv)]
            assert all(type(c).__name__ == "PagedKVCache" for c in cache)  # (mlx-lm puts back what it gets)
            return out

    affine8 = make_pool("llama", page_size=8, pages="affine8")  # AffineQuant(8, 32) K and V
    assert tokens(affine8, kv_bits=8, kv_group_size=32) == tokens(affine8)
    for pool, kv in ((make_pool("llama", page_size=8), dict(kv_bits=8, kv_group_size=32)),
                     (affine8, dict(kv_bits=4, kv_group_size=32)), (affine8, dict(kv_bits=8, kv_group_size=64)),
                     (make_pool("llama", page_size=8, pages="rotated4"), dict(kv_bits=4, kv_group_size=32))):
        with pytest.raises(NotSupportedError, match="in the pool"):
            tokens(pool, **kv)
        assert_all_pages_back(pool)


@pytest.mark.parametrize("draft_seed", [0, 3])  # the model itself (drafts accepted); another (rejected)
def test_mlx_lms_speculative_decoding_on_paged_caches_gives_its_tokens_on_its_own_caches(models, draft_seed):
    """mlx-lm's ``speculative_generate_step`` writes the drafts and trims the rejected
    ones (``trim_prompt_cache``) on both models' caches, step after step: on paged caches
    it gives the tokens and acceptances it gives on mlx-lm's, and every page comes back."""
    from mlx_lm.generate import speculative_generate_step

    model, draft = models["llama"], make_model("llama", seed=draft_seed)
    prompt = mx.array(prompt_of(30))
    greedy_sampler = lambda lp: mx.argmax(lp, axis=-1)  # noqa: E731

    def run(caches):
        return [(int(t), accepted) for t, _, accepted in speculative_generate_step(
            prompt, model, draft, num_draft_tokens=3, max_tokens=40, sampler=greedy_sampler, prompt_cache=caches)]

    ref = run(make_prompt_cache(model) + make_prompt_cache(draft))
    pools = [make_pool("llama", page_size=4), make_pool("llama", page_size=4)]
    with make_paged_cache(model, pools[0]) as main, make_paged_cache(draft, pools[1]) as drafts:
        assert run(list(main) + list(drafts)) == ref
    assert any(a for _, a in ref) == (draft_seed == 0)
    for pool in pools:
        assert_all_pages_back(pool)


@pytest.mark.parametrize("count", [1, 3])
def test_a_layer_trimmed_on_its_own_writes_at_its_own_position_as_mlx_lms_cache_does(count):
    """mlx-lm's caches are per layer: trimming one layer leaves the others. A step whose
    first layer opened it at one position must write a layer that stands elsewhere at
    that layer's own position (not at the step's)."""
    pool = PagePool(num_layers=3, num_kv_heads=2, head_dim=8, page_size=4, num_pages=32, dtype=mx.float32)
    paged, ref = PagedPromptCache.of_layers(pool), [KVCache() for _ in range(3)]
    keys = mx.random.normal((1, 2, 10, 8), key=mx.random.key(0))
    for c in (*paged, *ref):
        c.update_and_fetch(keys, keys * 2)
    for c in (paged[1], ref[1]):
        assert c.trim(3) == 3  # layer 1 alone: 7 tokens, the others 10
    for step in range(3):
        new = mx.random.normal((1, 2, count, 8), key=mx.random.key(step + 1))
        for layer in range(3):
            got = paged[layer].update_and_fetch(new, new * 2)
            want = ref[layer].update_and_fetch(new, new * 2)
            for g, w in zip(got, want):
                assert g.shape == w.shape and mx.array_equal(g, w).item(), (step, layer)
    paged.release()
    assert pool.allocator.num_in_use() == 0
