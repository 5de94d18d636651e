"""Quantised and TurboQuant pages: codecs, attention, mlx-lm QuantizedKVCache equivalence."""

import mlx.core as mx
import pytest
from mlx_lm.models.base import quantized_scaled_dot_product_attention
from mlx_lm.models.cache import QuantizedKVCache
from tiny_models import ON_CPU, greedy, make_model, make_pool, prompt_of

from pagedkv import (
    AffineQuant,
    KvAttentionView,
    NotSupportedError,
    PagedKVCache,
    PagePool,
    PageTable,
    QuantKv,
    make_paged_cache,
    rotated,
)
from pagedkv.codec import QUANT_BITS, hadamard_self_inverse

H, QH, D = 2, 4, 128
SCALE = D ** -0.5


def filled(k_codec, v_codec, n=40, dtype=mx.float32, seed=0):
    pool = PagePool(num_layers=1, num_kv_heads=H, head_dim=D, page_size=8, num_pages=32, dtype=dtype,
                    k_codec=k_codec, v_codec=v_codec)
    cache = PagedKVCache(PageTable(pool), 0)
    mx.random.seed(seed)
    k, v = mx.random.normal((1, H, n, D)).astype(dtype), mx.random.normal((1, H, n, D)).astype(dtype)
    cache.update_and_fetch(k, v)
    return pool, cache, k, v


def rel_err(a, b):
    return (mx.linalg.norm((a - b).reshape(-1)) / mx.linalg.norm(b.reshape(-1))).item()


@pytest.mark.parametrize("bits", QUANT_BITS)
@pytest.mark.parametrize("group", [32, 64, 128])
def test_round_trip_error_is_within_one_quantisation_step(bits, group):
    codec = AffineQuant(bits, group, mx.float32)
    mx.random.seed(bits * group)
    x = mx.random.normal((H, 9, D)) * 3
    parts = codec.encode(x)
    err = mx.abs(codec.decode(parts) - x).reshape(H, 9, D // group, group).max(axis=-1)
    # |scale| is one quantisation step (MLX snaps the zero point, so up to a full step)
    step = mx.abs(parts[1]).reshape(H, 9, D // group)
    assert (err <= step * 1.0001 + 1e-6).all().item()
    assert codec.bytes_per_value_row(D) == D * bits // 8 + 2 * (D // group) * 4


def test_quantised_attention_is_close_to_full_precision_and_improves_with_bits():
    # Measured on this data: 8: 0.008, 6: 0.028, 5: 0.061, 4: 0.130, 3: 0.270, 2: 0.557.
    bounds = {8: 0.012, 6: 0.045, 5: 0.09, 4: 0.2, 3: 0.4, 2: 0.8}
    _, full, _, _ = filled(None, None)
    mx.random.seed(3)
    q = mx.random.normal((1, QH, 2, D))
    errors = []
    with KvAttentionView.of_cache(full) as a:
        ref = a.attend(q, SCALE, "causal")
        for bits, bound in bounds.items():
            codec = AffineQuant(bits, 64, mx.float32)
            _, quant, _, _ = filled(codec, codec)
            with KvAttentionView.of_cache(quant) as b:
                errors.append(rel_err(b.attend(q, SCALE, "causal"), ref))
            assert errors[-1] < bound, (bits, errors[-1])
    assert errors == sorted(errors)


def test_quant_shared_kv_matches_mlx_lm_and_leaves_the_query_alone():
    codec = AffineQuant(4, 64, mx.float32)
    pool, cache, _, _ = filled(codec, codec)
    kv = cache.fetch_shared("quant")
    mx.random.seed(4)
    q = mx.random.normal((1, QH, 3, D))
    q_copy = mx.array(q)
    got = kv.attend(q, SCALE, "causal")
    assert mx.array_equal(q, q_copy)  # mlx-lm's reference scales its query in place
    # mlx-lm's reference runs on the CPU stream: with MLX 0.32.4 on CUDA, its causal
    # mask gives rows off by up to 1.16 from the same attention on dequantised K/V
    # (mx.fast SDPA), which ``got`` matches exactly there.
    with mx.stream(mx.cpu):
        want = quantized_scaled_dot_product_attention(mx.array(q), kv.keys, kv.values, scale=SCALE,
                                                      mask="causal", group_size=64, bits=4)
    assert mx.allclose(got, want, atol=1e-5)
    kv.release()


def test_quant_shared_kv_with_different_key_and_value_bits():
    pool, cache, k, v = filled(AffineQuant(8, 64, mx.float32), AffineQuant(4, 64, mx.float32))
    kv = cache.fetch_shared("quant")
    assert isinstance(kv, QuantKv) and (kv.bits, kv.v_bits) == (8, 4)
    mx.random.seed(5)
    q = mx.random.normal((1, QH, 1, D))
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE)
    assert rel_err(kv.attend(q, SCALE), ref) < 0.12
    kv.release()


def test_turboquant_deferred_v_equals_eager_unrotation():
    codec = rotated(3, D, group_size=64)
    pool, cache, k, v = filled(AffineQuant(8, 64), codec)
    plain = cache.fetch_shared("plain")
    assert plain.v_rotated
    mx.random.seed(6)
    q = mx.random.normal((1, QH, 4, D))
    deferred = plain.attend(q, SCALE, "causal")
    eager = mx.fast.scaled_dot_product_attention(q, plain.keys, codec.unrotate(plain.values),
                                                 scale=SCALE, mask="causal")
    # (CUDA's float32 matmuls round differently: differences of ~1e-4 on the H200)
    assert mx.allclose(deferred, eager, atol=1e-5 if ON_CPU else 1e-3)
    with KvAttentionView.of_cache(cache) as view:  # the packed path defers V the same way
        assert mx.allclose(view.attend(q, SCALE, "causal"), eager, atol=1e-4 if ON_CPU else 1e-3)
    # and it is a good approximation of the unquantised attention
    assert rel_err(eager, mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask="causal")) < 0.25
    plain.release()


@pytest.mark.parametrize("codecs", ["fp", "affine8", "rotated4"])
@pytest.mark.parametrize("mask", [None, "causal"])
def test_attention_sinks_on_every_page_kind_match_mlx_fast_sdpa_on_the_decoded_pages(codecs, mask):
    """``attend_parts(..., sinks=)``: one logit per query head joins the softmax (gpt_oss).
    The reference is MLX's own ``scaled_dot_product_attention(..., sinks=)`` over the
    pages the codec decodes to; mlx-lm's quantised attention refuses sinks."""
    from pagedkv.attention import attend_parts

    k_codec, v_codec = {"fp": (None, None), "affine8": (AffineQuant(8, 64), AffineQuant(8, 64)),
                        "rotated4": (rotated(4, D, 64, seed=1), rotated(4, D, 64, seed=2))}[codecs]
    pool, cache, _, _ = filled(k_codec, v_codec)
    k_parts, v_parts = cache.rows.read(0)  # the 40 tokens' page components, as stored
    keys, values = pool.kind.k_codec.decode(k_parts, mx.float32), pool.kind.v_codec.decode(v_parts, mx.float32)
    if codecs == "rotated4":  # (rotated codecs decode into the rotated basis: back to the keys' own)
        keys, values = pool.kind.k_codec.unrotate(keys), pool.kind.v_codec.unrotate(values)
    mx.random.seed(7)
    q, sinks = mx.random.normal((1, QH, 3, D)), mx.random.normal((QH,)) * 2
    got = attend_parts(q, k_parts, v_parts, SCALE, mask, pool.kind, sinks)
    want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=SCALE, mask=mask, sinks=sinks)
    assert mx.allclose(got, want, atol=1e-4 if ON_CPU else 2e-3).item()
    without = attend_parts(q, k_parts, v_parts, SCALE, mask, pool.kind)
    assert not mx.allclose(got, without, atol=1e-2).item()  # the sinks took weight off the keys


def test_rotated_keys_rotate_the_query_to_match():
    codec = rotated(8, D, group_size=64)
    pool, cache, k, v = filled(codec, codec)
    mx.random.seed(7)
    q = mx.random.normal((1, QH, 1, D))
    with KvAttentionView.of_cache(cache) as view:
        got = view.attend(q, SCALE)
    assert rel_err(got, mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE)) < 0.02


@pytest.mark.parametrize("dim", [80, 112, 160])
def test_head_dims_whose_hadamard_is_not_self_inverse_are_rejected(dim):
    assert not hadamard_self_inverse(dim)
    with pytest.raises(NotSupportedError, match="inverse"):
        rotated(4, dim, group_size=32)
    with pytest.raises(NotSupportedError, match="inverse"):
        PagePool(num_layers=1, num_kv_heads=1, head_dim=dim, num_pages=4,
                 v_codec=rotated(4, 96, group_size=32))
    assert hadamard_self_inverse(96) and hadamard_self_inverse(128)


@pytest.mark.parametrize("make", [lambda: AffineQuant(7), lambda: AffineQuant(4, 48), lambda: rotated(9, 64)])
def test_unsupported_bits_or_group_sizes_are_rejected(make):
    with pytest.raises(NotSupportedError):
        make()


def test_head_dim_not_divisible_by_the_group_is_rejected():
    with pytest.raises(NotSupportedError):
        PagePool(num_layers=1, num_kv_heads=1, head_dim=48, num_pages=4, k_codec=AffineQuant(4, 32))


def test_four_bit_pages_take_under_a_third_of_fp16_bytes():
    fp16 = PagePool(num_layers=1, num_kv_heads=H, head_dim=D, num_pages=4, dtype=mx.float16)
    q4 = PagePool(num_layers=1, num_kv_heads=H, head_dim=D, num_pages=4, dtype=mx.float16,
                  k_codec=AffineQuant(4, 64), v_codec=AffineQuant(4, 64))
    assert q4.bytes_per_page / fp16.bytes_per_page <= 0.3


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("bits,group", [(8, 64), (4, 32)])
def test_paged_quantized_cache_matches_mlx_lm_quantized_kvcache(kind, bits, group):
    if not ON_CPU:
        pytest.skip("mlx-lm's own quantised attention has no CUDA kernel for these shapes (MLX 0.32)")
    model = make_model(kind)
    prompt = prompt_of(27)
    ref_cache = [QuantizedKVCache(group_size=group, bits=bits) for _ in model.layers]
    ref_tokens, ref_logits = greedy(model, prompt, ref_cache, 32)
    codec = AffineQuant(bits, group, mx.float32)
    pool = make_pool(kind, page_size=16)
    pool = PagePool(num_layers=pool.num_layers, num_kv_heads=pool.num_kv_heads, head_dim=pool.head_dim,
                    page_size=16, num_pages=64, dtype=mx.float32, k_codec=codec, v_codec=codec)
    with make_paged_cache(model, pool) as cache:
        assert cache[0].bits == bits and cache[0].group_size == group
        tokens, logits = greedy(model, prompt, cache, 32)
    assert tokens == ref_tokens
    assert max(mx.abs(a - b).max().item() for a, b in zip(ref_logits, logits)) <= 1e-4
    pool.allocator.check()
    assert pool.allocator.num_in_use() == 0
