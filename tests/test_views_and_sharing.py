"""KvAttentionView / SharedKv lifetimes, ForwardPass ownership, KvSharingPlan, drafter reads."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from tiny_models import greedy, make_model, make_pool, prompt_of

from pagedkv import (
    AffineQuant,
    DrafterKv,
    ForwardPass,
    KvAttentionView,
    KvLeakError,
    KvSharingPlan,
    NotSupportedError,
    PagedKVCache,
    PagedKvError,
    PagePool,
    PageTable,
    PlainKv,
    ReleasedError,
    ViewKv,
    donor_caches,
    make_paged_cache,
    rotated,
)
from pagedkv.visibility import causal_mask

H, QH, D = 2, 4, 32
SCALE = D ** -0.5

# Lifetime rules must hold for every page kind; only the codec differs.
PAGE_KINDS = {
    "fp32": (None, None),
    "affine4": (AffineQuant(4, 32, mx.float32), AffineQuant(4, 32, mx.float32)),
    "turbo_k8v3": (AffineQuant(8, 32), rotated(3, D, group_size=32)),
}


@pytest.fixture(params=list(PAGE_KINDS), autouse=False)
def page_kind(request):
    return request.param


def pool_of(num_pages=64, page_size=4, kind="fp32"):
    k_codec, v_codec = PAGE_KINDS[kind]
    return PagePool(num_layers=1, num_kv_heads=H, head_dim=D, page_size=page_size,
                    num_pages=num_pages, dtype=mx.float32, k_codec=k_codec, v_codec=v_codec)


def filled(pool, n, seed=0):
    mx.random.seed(seed)
    cache = PagedKVCache(PageTable(pool), 0)
    k, v = mx.random.normal((1, H, n, D)), mx.random.normal((1, H, n, D))
    cache.update_and_fetch(k, v)
    return cache, k, v


def query(b=1, n=1, seed=5):
    mx.random.seed(seed)
    return mx.random.normal((b, QH, n, D))


def reference(q, k, v, mask=None):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=mask)


def test_view_attend_equals_attention_over_contiguous_kv_with_gqa():
    pool = pool_of()
    cache, k, v = filled(pool, 23)
    q = query(n=3)
    with KvAttentionView.of_cache(cache) as view:
        assert mx.allclose(view.attend(q, SCALE, "causal"), reference(q, k, v, "causal"), atol=1e-6)
        kk, vv = view.keys_values()
        assert mx.array_equal(kk, k) and mx.array_equal(vv, v)


def test_view_of_ragged_rows_masks_each_row_to_its_own_length():
    pool = pool_of()
    rows = [filled(pool, n, seed=n) for n in (5, 17, 9)]
    q = query(b=3)
    view = KvAttentionView(pool, 0, [c.table for c, _, _ in rows])
    out = view.attend(q, SCALE)
    for b, (_, k, v) in enumerate(rows):
        assert mx.allclose(out[b : b + 1], reference(q[b : b + 1], k, v), atol=1e-6)
    view.release()


def test_view_output_unchanged_after_the_cache_appends_100_tokens(page_kind):
    pool = pool_of(num_pages=128, kind=page_kind)
    cache, k, v = filled(pool, 10)
    q = query()
    view = KvAttentionView.of_cache(cache)
    before = view.attend(q, SCALE)
    mx.eval(before)
    for i in range(100):
        mx.random.seed(100 + i)
        cache.update_and_fetch(mx.random.normal((1, H, 1, D)), mx.random.normal((1, H, 1, D)))
    assert mx.array_equal(view.attend(q, SCALE), before)
    view.release()


def test_view_keeps_its_pages_through_trim_release_and_reuse_by_another_sequence(page_kind):
    pool = pool_of(num_pages=9, page_size=4, kind=page_kind)  # 8 usable pages
    cache, k, v = filled(pool, 16)  # 4 pages
    q = query()
    view = KvAttentionView.of_cache(cache)
    before = view.attend(q, SCALE)
    mx.eval(before)
    held = set(cache.table.pages.tolist())
    cache.trim(7)
    cache.table.release()
    assert pool.allocator.num_available() == 4  # the view still holds its 4 pages
    other, _, _ = filled(pool, 16, seed=3)  # takes all remaining capacity
    assert held.isdisjoint(other.table.pages.tolist())
    assert mx.array_equal(view.attend(q, SCALE), before)
    view.release()
    assert pool.allocator.num_available() == 4  # now allocatable
    pool.allocator.check()


def test_a_plain_shared_kv_keeps_its_steps_kv_through_trim_release_and_reuse_of_its_pages(page_kind):
    pool = pool_of(num_pages=9, page_size=4, kind=page_kind)  # 8 usable pages
    cache, k, v = filled(pool, 16)
    with KvAttentionView.of_cache(cache) as view:
        want_k, want_v = view.keys_values()  # (the pages decoded: what the codec kept)
        mx.eval(want_k, want_v)
    plain = cache.fetch_shared("plain")  # nothing evaluated yet
    assert plain.kind == "plain" and plain.offset == 0 and plain.v_rotated == pool.v_codec.rotated
    q = query()
    cache.trim(16)
    cache.table.release()
    other, _, _ = filled(pool, 32, seed=3)  # every page again, written in place
    assert pool.allocator.num_available() == 0
    got_k, got_v = plain.keys_values()
    assert mx.array_equal(got_k, want_k)
    if plain.v_rotated:
        got_v = pool.v_codec.unrotate(got_v)
    assert mx.allclose(got_v, want_v, atol=1e-5)
    assert mx.allclose(plain.attend(q, SCALE), reference(q, want_k, want_v), atol=1e-5)
    plain.release()
    with pytest.raises(ReleasedError):
        plain.keys_values()
    other.table.release()
    pool.allocator.check()


def test_double_release_and_use_after_release_raise(page_kind):
    pool = pool_of(kind=page_kind)
    cache, _, _ = filled(pool, 5)
    view = KvAttentionView.of_cache(cache)
    kv = ViewKv(view, offset=4)
    kv.release()
    assert view.released
    for call in (lambda: kv.attend(query(), SCALE), kv.release, view.release,
                 lambda: view.attend(query(), SCALE), view.keys_values):
        with pytest.raises(ReleasedError):
            call()


def test_view_of_a_released_table_or_a_bad_range_is_refused_without_references():
    pool = pool_of()
    cache, _, _ = filled(pool, 5)
    before = pool.allocator.stats()
    with pytest.raises(ValueError):
        KvAttentionView(pool, 0, [cache.table], [9])
    assert pool.allocator.stats() == before
    cache.table.release()
    with pytest.raises(ReleasedError):
        KvAttentionView.of_cache(cache)


def test_offset_arr_is_an_owned_copy_that_survives_the_source_being_rebound():
    positions = mx.array([3, 7, 1], dtype=mx.int32)
    mx.eval(positions)
    k = mx.zeros((3, H, 8, D))
    kv = PlainKv(k, k, offset=7, offset_arr=positions)
    positions[1] = 100  # the cache rebinds its own array in place
    positions += 1
    assert kv.offset_arr.tolist() == [3, 7, 1]
    assert kv.offset_arr.dtype == mx.int32


def test_plain_kv_with_rotated_values_restores_the_output():
    mx.random.seed(1)
    k, v = mx.random.normal((1, H, 6, D)), mx.random.normal((1, H, 6, D))
    sign = mx.where(mx.random.uniform(shape=(D,)) > 0.5, 1.0, -1.0)
    kv = PlainKv(k, v * sign, offset=5, restore_values=lambda out: out * sign, v_rotated=True)
    q = query()
    assert mx.allclose(kv.attend(q, SCALE), reference(q, k, v), atol=1e-5)
    with pytest.raises(ValueError):
        PlainKv(k, v, offset=0, v_rotated=True)


def test_forward_pass_releases_everything_also_when_the_pass_raises(page_kind):
    pool = pool_of(kind=page_kind)
    cache, _, _ = filled(pool, 9)
    in_use = pool.allocator.num_in_use()
    with pytest.raises(RuntimeError, match="model blew up"):
        with ForwardPass() as fp:
            kv = fp.register(0, ViewKv(KvAttentionView.of_cache(cache), offset=8))
            assert fp.get(0) is kv
            assert pool.allocator.num_in_use() == in_use
            assert pool.allocator.refcount(int(cache.table.pages[0])) == 2
            raise RuntimeError("model blew up")
    assert kv.released
    assert pool.allocator.refcount(int(cache.table.pages[0])) == 1


def test_debug_pass_reports_a_shared_kv_it_did_not_own_and_still_frees_its_pages(page_kind):
    pool = pool_of(kind=page_kind)
    cache, _, _ = filled(pool, 9)
    with pytest.raises(KvLeakError):
        with ForwardPass(debug=True):
            ViewKv(KvAttentionView.of_cache(cache), offset=8)  # never registered
    assert pool.allocator.refcount(int(cache.table.pages[0])) == 1


def test_a_forward_pass_refuses_what_it_could_never_release_or_would_release_twice():
    pool = pool_of()
    cache, _, _ = filled(pool, 9)
    page = int(cache.table.pages[0])
    fp = ForwardPass()
    kv = ViewKv(KvAttentionView.of_cache(cache), offset=8)
    with pytest.raises(PagedKvError, match="outside"):
        fp.register(0, kv)  # before the block
    with fp:
        fp.register(0, kv)
        with pytest.raises(PagedKvError, match="already registered"):
            fp.register(0, ViewKv(KvAttentionView.of_cache(cache), offset=8))
        with pytest.raises(PagedKvError, match="has not registered"):
            fp.get(1)
        released = ViewKv(KvAttentionView.of_cache(cache), offset=8)
        released.release()
        with pytest.raises(PagedKvError, match="released"):
            fp.register(1, released)
    assert pool.allocator.refcount(page) == 2  # the one refused while the pass was active: its caller's
    late = ViewKv(KvAttentionView.of_cache(cache), offset=8)
    with pytest.raises(PagedKvError, match="outside"):
        fp.register(1, late)  # after the block, nothing would ever release it
    with pytest.raises(PagedKvError, match="once"):
        fp.__enter__()
    assert ForwardPass.current() is None
    late.release()


def test_a_shared_kv_a_sharer_released_is_an_error_at_the_end_of_the_pass_after_the_rest_is_released():
    pool = pool_of()
    cache, _, _ = filled(pool, 9)
    page = int(cache.table.pages[0])
    with pytest.raises(ReleasedError):
        with ForwardPass() as fp:
            first = fp.register(0, ViewKv(KvAttentionView.of_cache(cache), offset=8))
            second = fp.register(1, ViewKv(KvAttentionView.of_cache(cache), offset=8))
            first.release()  # a sharer must never release what it looked up
    assert second.released and pool.allocator.refcount(page) == 1


def test_sharing_plan_maps_each_sharer_to_the_last_donor_of_its_type():
    plan = KvSharingPlan(["S", "S", "F", "S", "S", "F", "S"], 3)
    assert plan.donors == (0, 1, 2, 3)
    assert plan.source == (0, 1, 2, 3, 3, 2, 3)
    assert plan.sharers_of(3) == (4, 6)
    with pytest.raises(ValueError):
        KvSharingPlan(["S", "S", "F"], 1)  # the F sharer has no F donor


def test_sharing_plan_agrees_with_mlx_lm_gemma3n():
    model = make_model("gemma3n")
    plan = KvSharingPlan.from_model(model)
    assert list(plan.source) == model.model.language_model.layer_idx_to_cache_idx
    assert len(plan.donors) == len(make_prompt_cache(model))


def test_gemma3n_through_forward_pass_and_views_matches_mlx_lm():
    model = make_model("gemma3n")
    prompt = prompt_of(19)
    ref_tokens, ref_logits = greedy(model, prompt, make_prompt_cache(model), 64)
    pool = make_pool("gemma3n", page_size=4, num_pages=256)
    paged = make_paged_cache(model, pool)
    caches = donor_caches(paged)
    tokens, x = [], mx.array(prompt)[None]
    worst = 0.0
    for step in range(64):
        with ForwardPass(debug=True):
            logits = model(x, cache=caches)[0, -1]
            mx.eval(logits)
        worst = max(worst, mx.abs(logits - ref_logits[step]).max().item())
        tokens.append(int(mx.argmax(logits).item()))
        x = mx.array([[tokens[-1]]])
    assert tokens == ref_tokens
    assert worst <= 1e-5
    paged.release()
    pool.allocator.check()
    assert pool.allocator.num_in_use() == 0


def test_donor_caches_stay_donor_caches_when_mlx_lm_asks_for_quantised_kv():
    """mlx-lm's ``kv_bits`` puts back what each cache's ``to_quantized`` returns; a
    ``DonorCache`` answered through its wrapped cache, which then stood in its place."""
    from mlx_lm.generate import maybe_quantize_kv_cache

    model = make_model("llama")  # (gemma3n's tiny head_dim of 16 takes no group of 32)
    pool = make_pool("llama", page_size=4, num_pages=64, pages="affine8")  # AffineQuant(8, 32)
    with make_paged_cache(model, pool) as paged:
        caches = donor_caches(paged)
        before = list(caches)
        maybe_quantize_kv_cache(caches, quantized_kv_start=0, kv_group_size=32, kv_bits=8)
        assert all(a is b for a, b in zip(caches, before))
        with pytest.raises(NotSupportedError, match="in the pool"):
            maybe_quantize_kv_cache(caches, quantized_kv_start=0, kv_group_size=32, kv_bits=4)


def test_drafter_views_survive_target_rollback_and_honour_a_window():
    pool = pool_of(num_pages=64)
    cache, k, v = filled(pool, 20)
    q = query()
    with DrafterKv([cache], layers=[0]) as drafter:
        out = drafter.attend(0, q, SCALE, window=6)
        want = reference(q, k[:, :, -6:], v[:, :, -6:])
        assert mx.allclose(out, want, atol=1e-6)
        mx.random.seed(9)
        cache.update_and_fetch(mx.random.normal((1, H, 4, D)), mx.random.normal((1, H, 4, D)))
        cache.trim(7)  # target rejects draft tokens, below the drafter's captured length
        cache.update_and_fetch(mx.random.normal((1, H, 2, D)), mx.random.normal((1, H, 2, D)))
        assert mx.array_equal(drafter.attend(0, q, SCALE, window=6), out)
        drafter.refresh()
        assert drafter.length == 19
    assert pool.allocator.num_in_use() == cache.table.num_pages


def test_window_mask_for_several_queries_matches_an_explicit_mask():
    pool = pool_of()
    cache, k, v = filled(pool, 15)
    q = query(n=4)
    with KvAttentionView.of_cache(cache) as view:
        got = view.attend(q, SCALE, "causal", window=5)
    assert mx.allclose(got, reference(q, k, v, causal_mask(4, 11, 5)), atol=1e-6)
