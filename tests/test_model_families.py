"""Paged caches under many of mlx-lm's model families: each family's own model class
(tiny, random weights) decodes with pagedkv exactly as with mlx-lm's own caches, and a
family pagedkv cannot serve is refused up front with a typed error (latent attention;
recurrent layers that never report how many tokens their state covers; no attention).

The families differ in what their attention does around the cache: soft-capped scores
(gemma2), sliding windows on some layers (cohere2, olmo3, exaone4, gpt_oss, whose
attention sinks go to pagedkv's attention with the pages), layers without RoPE (smollm3, llama4_text), partial RoPE
(glm4, gpt_neox, stablelm), qk-norms, MoE MLPs, and scaled residuals or logits."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from tiny_models import (
    LOGITS_ATOL,
    ON_CPU,
    VOCAB,
    greedy,
    make_model,
    make_pool,
    model_of_config,
    prompt_of,
)

from pagedkv import (
    CompiledDecode,
    NotSupportedError,
    PagedBatch,
    PagePool,
    PoolExhausted,
    StatePool,
    make_paged_cache,
    pools_for_model,
)

BASE = dict(hidden_size=64, num_hidden_layers=4, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, rms_norm_eps=1e-5, vocab_size=VOCAB, rope_theta=10000.0, max_position_embeddings=1024,
            tie_word_embeddings=False, layer_norm_eps=1e-5, norm_eps=1e-5, sliding_window=12,
            rope_traditional=False, attention_bias=False, mlp_bias=False)
_YARN = {"type": "linear", "factor": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
         "original_max_position_embeddings": 1024}
SLIDING = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]
FAMILIES = {
    "gemma": {},
    "gemma2": dict(query_pre_attn_scalar=16, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "cohere": dict(logit_scale=0.1, use_qk_norm=False, layer_norm_bias=False),
    "cohere2": dict(sliding_window_pattern=2, logit_scale=0.1, use_qk_norm=False, layer_norm_bias=False),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, swiglu_limit=7.0,
                    layer_types=["sliding_attention", "full_attention"] * 2),
    "smollm3": dict(no_rope_layer_interval=2),
    "exaone4": dict(sliding_window_pattern="LLLG", layer_types=None, rope_scaling=None),
    "olmo2": {},
    "olmo3": dict(layer_types=SLIDING),
    "phi3": {},
    "qwen2": {},
    "mistral": {},
    "starcoder2": dict(norm_epsilon=1e-5),
    "granite": dict(embedding_multiplier=1.0, attention_multiplier=0.25, residual_multiplier=1.0,
                    logits_scaling=1.0),
    "minicpm": dict(dim_model_base=64, scale_depth=1.0, scale_emb=1.0),
    "glm4": dict(partial_rotary_factor=0.5),
    "gpt_neox": dict(rotary_pct=0.25, use_parallel_residual=True, rotary_emb_base=10000),
    "stablelm": dict(partial_rotary_factor=0.25, use_qkv_bias=False),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
                      mlp_only_layers=[], norm_topk_prob=True),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "internlm2": dict(bias=False),
    "llama4_text": dict(intermediate_size_mlp=96, no_rope_layers=[1, 1, 1, 0], use_qk_norm=True,
                        attention_chunk_size=8, num_local_experts=2, num_experts_per_tok=1,
                        interleave_moe_layer_step=2, attn_temperature_tuning=False, floor_scale=8192,
                        attn_scale=0.1, moe_layers=[1, 3]),
    "ministral3": dict(rope_parameters={"rope_theta": 10000.0, "rope_type": "default", "llama_4_scaling_beta": 0.0,
                                        "original_max_position_embeddings": 1024}),
    "helium": {},
    "seed_oss": {},
    # multi-head latent attention caching full keys (24 wide: 16 + 8 RoPE) and values (16 wide)
    "deepseek_v2": dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                        n_routed_experts=None, moe_intermediate_size=32, first_k_dense_replace=4, rope_scaling=_YARN),
}
LATENT = {  # multi-head latent attention caching a compressed latent
    "deepseek_v3": dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                        n_routed_experts=None, moe_intermediate_size=32, first_k_dense_replace=4, rope_scaling=_YARN,
                        n_shared_experts=None, num_experts_per_tok=1, routed_scaling_factor=1.0, topk_method="noaux_tc",
                        scoring_func="sigmoid", norm_topk_prob=True, n_group=1, topk_group=1),
}


def pool_like(caches: list, num_pages: int = 128) -> PagePool:
    """A float32 pool of pages of 4 shaped as the K/V in mlx-lm's ``caches`` (after a
    forward): KV heads and widths (gpt_neox has no grouped heads; deepseek_v2's values
    are narrower than its keys), one layer per attention cache."""
    attention = [c for c in caches if getattr(c, "keys", None) is not None]
    _, kv_heads, _, head_dim = attention[0].keys.shape
    return PagePool(num_layers=len(attention), num_kv_heads=kv_heads, head_dim=head_dim,
                    v_head_dim=attention[0].values.shape[-1], page_size=4, num_pages=num_pages, dtype=mx.float32)


def ragged_rows(model, pool: PagePool, state_pool: StatePool | None = None) -> PagedBatch:
    """A batch of three prompts of 5, 17 and 30 tokens, each prefilled on its own."""
    rows = PagedBatch.for_model(model, pool, state_pool=state_pool)
    for seed, n in enumerate([5, 17, 30]):
        cache = make_paged_cache(model, pool, state_pool=state_pool)
        model(mx.array(prompt_of(n, seed=seed + 1))[None], cache=cache)
        rows.extend(cache)
    return rows


def family_model(family: str, extra: dict):
    return model_of_config(dict(BASE, model_type=family, **extra))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_decodes_on_pages_as_on_mlx_lms_own_caches(family):
    model = family_model(family, FAMILIES[family])
    prompt = prompt_of(30)  # longer than the sliding windows (12), so window pages drop
    ref_cache = make_prompt_cache(model)
    ref_tokens, ref_logits = greedy(model, prompt, ref_cache, 20)
    pool = pool_like(ref_cache)
    with make_paged_cache(model, pool) as cache:
        tokens, logits = greedy(model, prompt, cache, 20)
        pool.allocator.check()
    assert tokens == ref_tokens
    assert all(mx.allclose(a, b, atol=LOGITS_ATOL).item() for a, b in zip(ref_logits, logits))
    assert pool.allocator.num_in_use() == 0


# these three families' expert layers do not run in half precision on the CPU in mlx-lm itself
# ("[GatherMM::eval] Currently only supports float32"); llama4_text's do
HALF_PRECISION = [f for f in sorted(FAMILIES) if f not in ("gpt_oss", "mixtral", "qwen3_moe")]


@pytest.mark.skipif(not ON_CPU, reason=(
    "on CUDA a half-precision step rounds differently wherever its kernels do (a chunk boundary in "
    "mlx-lm's own cache moved random-weight gemma3's bf16 logits by 0.4 on an H100; bench/RESULTS.md)"))
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("family", [pytest.param(f, marks=[] if f in ("cohere2", "olmo3", "llama4_text")
                                                 else pytest.mark.slow) for f in HALF_PRECISION])
def test_each_family_in_half_precision_decodes_on_its_factory_pools_bit_for_bit_as_on_mlx_lm(family, dtype):
    """A bf16 or fp16 model on the pool ``pools_for_model`` sizes for it (pages of the
    model's dtype; the sliding-window families laid out in layer groups) gives mlx-lm's
    own caches' logits exactly, every step past the window: the pages keep the K/V as
    the model made them and the reads hand attention the same values in the same order.
    A page store or read that upcasts, rounds or reorders anything would show here."""
    model = family_model(family, FAMILIES[family])
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    ref_tokens, ref_logits = greedy(model, prompt_of(30), make_prompt_cache(model), 16)
    pool, states = pools_for_model(model, max_bytes=1 << 20, page_size=4)
    assert states is None and pool.dtype == dtype
    with make_paged_cache(model, pool) as cache:
        tokens, logits = greedy(model, prompt_of(30), cache, 16)
    assert tokens == ref_tokens
    assert all(mx.array_equal(a, b).item() for a, b in zip(ref_logits, logits))
    assert pool.allocator.num_in_use() == 0


@pytest.mark.parametrize("family", sorted(LATENT))
def test_a_family_caching_a_compressed_latent_is_refused_before_any_page_is_taken(family):
    model = family_model(family, LATENT[family])
    pool = PagePool(num_layers=4, num_kv_heads=1, head_dim=16, page_size=4, num_pages=32, dtype=mx.float32)
    with pytest.raises(NotSupportedError, match="latent attention"):
        make_paged_cache(model, pool)
    assert pool.allocator.num_in_use() == 0


# gemma2's attention reshapes its scores to [B, kv_heads, repeats, N, W], which a batch
# mask [B, 1, N, W] does not broadcast to: mlx-lm's own BatchKVCache fails there too
# (and at B == kv_heads broadcasts the rows' masks over the heads)
BATCHED = sorted(set(FAMILIES) - {"gemma2"})


@pytest.mark.slow
@pytest.mark.parametrize("family", BATCHED)
def test_each_family_decodes_ragged_rows_in_one_batch_as_each_row_alone_on_mlx_lm(family):
    """Rows of 5, 17 and 30 tokens in one ``PagedBatch`` (no padding, one step for all):
    every row's greedy tokens are those of the row alone on mlx-lm's caches."""
    model = family_model(family, FAMILIES[family])
    lengths, steps = [5, 17, 30], 12
    refs = []
    for seed, n in enumerate(lengths):
        ref_cache = make_prompt_cache(model)
        refs.append(greedy(model, prompt_of(n, seed=seed + 1), ref_cache, steps)[0])
    pool = pool_like(ref_cache)
    batch = PagedBatch.for_model(model, pool)
    first = []
    for seed, n in enumerate(lengths):
        cache = make_paged_cache(model, pool)
        first.append(int(mx.argmax(model(mx.array(prompt_of(n, seed=seed + 1))[None], cache=cache)[0, -1]).item()))
        batch.extend(cache)
    tokens = [[t] for t in first]
    for _ in range(steps - 1):
        nxt = mx.argmax(model(mx.array([t[-1:] for t in tokens]), cache=batch.caches)[:, -1], axis=-1).tolist()
        for row, t in zip(tokens, nxt):
            row.append(t)
    assert tokens == refs
    batch.release()
    pool.allocator.check()
    assert pool.allocator.num_in_use() == 0


@pytest.mark.parametrize("family", BATCHED)
def test_each_familys_compiled_decode_steps_give_the_eager_batchs_logits(family):
    """``CompiledDecode`` over the same rows as an eager ``PagedBatch``: the same logits
    at every step (gpt_oss's attention sinks included)."""
    model = family_model(family, FAMILIES[family])
    ref_cache = make_prompt_cache(model)
    model(mx.array([[1, 2]]), cache=ref_cache)

    eager, compiled = ragged_rows(model, pool_like(ref_cache)), ragged_rows(model, pool_like(ref_cache))
    step = CompiledDecode(model, compiled, bucket=2)
    tok = mx.array([[1], [2], [3]])
    for _ in range(10):  # every row crosses pages; the sliding layers drop some
        want, got = model(tok, cache=eager.caches), step(tok)
        assert mx.allclose(want, got, atol=LOGITS_ATOL).item()
        tok = mx.argmax(want[:, -1], axis=-1)[:, None]


HYBRID_BASE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   max_position_embeddings=1024, rms_norm_eps=1e-5, norm_eps=1e-5, tie_word_embeddings=False,
                   intermediate_size=96, rope_theta=10000.0)
HYBRIDS = {  # recurrent layers that call cache.advance(n), beside attention layers
    "lfm2": dict(conv_bias=False, block_dim=64, block_multiple_of=16, block_ffn_dim_multiplier=1.0,
                 block_auto_adjust_ff_dim=False, block_ff_dim=96, conv_L_cache=3, full_attn_idxs=[1, 3]),
    "granitemoehybrid": dict(attention_bias=False, embedding_multiplier=1.0, attention_multiplier=0.25,
                             logits_scaling=1.0, residual_multiplier=1.0,
                             layer_types=["mamba", "attention", "mamba", "attention"], num_local_experts=None,
                             num_experts_per_tok=None, shared_intermediate_size=96, mamba_n_heads=4, mamba_d_head=16,
                             mamba_proj_bias=False, mamba_d_state=16, mamba_d_conv=4, mamba_n_groups=1,
                             mamba_conv_bias=True, mlp_bias=False, position_embedding_type="rope",
                             time_step_limit=(0.0, float("inf")), mamba_chunk_size=8),
}
UNCOUNTED = {  # recurrent layers that set their state without cache.advance(n)
    "jamba": dict(attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=1, expert_layer_period=2,
                  mamba_d_conv=4, mamba_d_state=8, mamba_expand=2, num_experts=2, num_experts_per_tok=1,
                  mamba_dt_rank=8, mamba_proj_bias=False, mamba_conv_bias=True),
    "recurrent_gemma": dict(attention_bias=False, logits_soft_cap=30.0, attention_window_size=12,
                            embeddings_scale_by_sqrt_dim=True, block_types=["recurrent", "recurrent", "attention"],
                            num_hidden_layers=3, lru_width=64, conv1d_width=4, head_dim=16, partial_rotary_factor=0.5,
                            final_w_init_variance_scale=1.0),
}
MAMBA2 = dict(num_heads=4, head_dim=16, state_size=16, layer_norm_epsilon=1e-5, conv_kernel=4, n_groups=1,
              use_bias=False, use_conv_bias=True, time_step_limit=(0.0, float("inf")), time_step_rank=8, chunk_size=8)


def hybrid_model(family: str, extra: dict):
    return model_of_config(dict(HYBRID_BASE, model_type=family, **extra))


@pytest.mark.parametrize("family", sorted(HYBRIDS))
def test_each_hybrid_family_decodes_on_pages_and_state_slots_as_on_mlx_lms_own_caches(family):
    model = hybrid_model(family, HYBRIDS[family])
    ref_cache = make_prompt_cache(model)
    ref_tokens, ref_logits = greedy(model, prompt_of(30), ref_cache, 16)
    pool = pool_like(ref_cache)
    states = StatePool.for_model(model, num_slots=4)
    with make_paged_cache(model, pool, state_pool=states) as cache:
        tokens, logits = greedy(model, prompt_of(30), cache, 16)
    assert tokens == ref_tokens
    assert all(mx.allclose(a, b, atol=LOGITS_ATOL).item() for a, b in zip(ref_logits, logits))
    assert pool.allocator.num_in_use() == 0 and states.allocator.num_in_use() == 0


def state_in(states: StatePool, slot: int) -> list:
    """Every component of every recurrent layer in ``slot`` (copies)."""
    return [mx.array(a[slot]) for r in range(states.num_layers) for a in states.storage(r)]


@pytest.mark.parametrize("family", sorted(HYBRIDS) + ["falcon_h1", "nemotron_h", "qwen3_next"])
def test_each_hybrid_familys_compiled_decode_steps_give_the_eager_batchs_logits_and_states(family):
    """``CompiledDecode`` over a hybrid model (the recurrent layers' state slots are
    compiled state beside the pages): at every step the eager batch's logits, the same
    slots per row and the same state in every slot. A row whose slot becomes a prefix
    checkpoint moves to a fresh slot at its next step, compiled as eager, and the
    checkpoint keeps the state it had."""
    model = hybrid_model(family, HYBRIDS[family]) if family in HYBRIDS else make_model(family)

    eager, compiled = (ragged_rows(model, *pools_for_model(model, max_bytes=1 << 22, page_size=4, state_slots=12))
                       for _ in range(2))
    step = CompiledDecode(model, compiled, bucket=2)
    tok = mx.array([[1], [2], [3]])
    for i in range(8):
        if i == 3:  # row 1's state becomes a checkpoint on both sides
            kept = [b.rows.states.checkpoint(1) for b in (eager, compiled)]
            saved = state_in(compiled.rows.states.pool, kept[1])
        want, got = model(tok, cache=eager.caches), step(tok)
        assert mx.allclose(want, got, atol=LOGITS_ATOL).item()
        tok = mx.argmax(want[:, -1], axis=-1)[:, None]
        assert eager.rows.states.slots.tolist() == compiled.rows.states.slots.tolist()
        assert all(mx.allclose(a, b, atol=LOGITS_ATOL).item() for a, b in zip(
            state_in(eager.rows.states.pool, slice(None)), state_in(compiled.rows.states.pool, slice(None))))
    assert kept[0] == kept[1] is not None and kept[1] not in compiled.rows.states.slots.tolist()
    assert all(mx.array_equal(a, b).item() for a, b in zip(saved, state_in(compiled.rows.states.pool, kept[1])))
    for b in (eager, compiled):
        b.release()
        b.rows.states.pool.allocator.check()
    step.release_lookahead()
    assert compiled.pool.allocator.num_in_use() == 0


@pytest.mark.parametrize("family", sorted(UNCOUNTED))
def test_a_hybrid_family_whose_states_do_not_count_tokens_is_refused_by_its_state_pool(family):
    model = hybrid_model(family, UNCOUNTED[family])
    with pytest.raises(NotSupportedError, match="cache.advance"):
        StatePool.for_model(model, num_slots=4)
    with pytest.raises(NotSupportedError, match="cache.advance"):
        pools_for_model(model, max_bytes=1 << 20)


@pytest.mark.parametrize("family", ["cohere2", "gpt_oss", "olmo3"])
def test_pools_for_model_sizes_a_sliding_window_family_in_groups_that_then_decodes_as_mlx_lm(family):
    """The factory's pool has ``kv_pool_layers`` layers, so the model is laid out in
    groups, a table each, and decodes mlx-lm's tokens; a pool with a layer per
    attention layer puts each at its own pool layer (one table per kind) and decodes
    the same tokens."""
    from pagedkv.cache import kv_pages_for, kv_pool_layers, layout_for

    model = family_model(family, FAMILIES[family])
    pool, states = pools_for_model(model, max_bytes=1 << 20, page_size=4)
    ref_cache = make_prompt_cache(model)
    kinds = [None if type(c).__name__ == "KVCache" else c.max_size for c in ref_cache]
    assert states is None and pool.num_layers == kv_pool_layers(model) == kinds.count(None) < len(ref_cache)
    assert len(layout_for(model, pool).specs) == sum(-(-kinds.count(k) // pool.num_layers) for k in set(kinds))
    per_layer = PagePool(num_layers=len(ref_cache), num_kv_heads=pool.num_kv_heads, head_dim=pool.head_dim,
                         page_size=4, num_pages=kv_pages_for(model, 42, 4, len(ref_cache)), dtype=pool.dtype)
    assert [layer for _, layer in layout_for(model, per_layer).layers] == list(range(len(ref_cache)))
    want = greedy(model, prompt_of(30), ref_cache, 12)[0]
    with make_paged_cache(model, pool) as cache:
        assert greedy(model, prompt_of(30), cache, 12)[0] == want  # past the window (12): its pages go back
    with make_paged_cache(model, per_layer) as cache:
        assert greedy(model, prompt_of(30), cache, 12)[0] == want


@pytest.mark.parametrize("family", ["llama", "cohere2", "gpt_oss"])
def test_kv_pages_for_holds_a_sequence_of_that_many_tokens(family):
    """A pool of ``kv_pages_for(model, T, chunk=...)`` pages (grouped, and a layer per
    layer) takes a sequence to T tokens; for a model without sliding windows the count
    is exact (one page fewer runs out), and groups need fewer bytes than a layer per
    layer for a sequence past the window."""
    from pagedkv.cache import kv_pages_for

    model = family_model(family, FAMILIES[family]) if family != "llama" else make_model("llama")
    probe, _ = pools_for_model(model, max_bytes=1 << 20, page_size=4)
    all_layers = len(make_prompt_cache(model))
    for tokens in (9, 40):
        nbytes = {}
        for layers in (probe.num_layers, all_layers):
            need = kv_pages_for(model, tokens, 4, layers, chunk=tokens - 4)
            for pages in (need, need - 1):
                pool = PagePool(num_layers=layers, num_kv_heads=probe.num_kv_heads, head_dim=probe.head_dim,
                                page_size=4, num_pages=pages, dtype=probe.dtype)
                with make_paged_cache(model, pool) as cache:
                    try:
                        greedy(model, prompt_of(tokens - 4), cache, 4)  # a prefill of T - 4, then 4 steps
                        ran = True
                    except PoolExhausted:
                        ran = False
                if pages == need:
                    assert ran, (layers, tokens, pages)
                    nbytes[layers] = pool.nbytes
                elif family == "llama":
                    assert not ran, (layers, tokens, pages)
        if family != "llama" and tokens == 40:
            assert nbytes[probe.num_layers] < nbytes[all_layers]


@pytest.mark.parametrize("family", ["olmo3", "exaone4"])  # 3 sliding layers per full one
@pytest.mark.parametrize("chunk,rewind", [(16, 0), (5, 0), (16, 5)])
def test_kv_pages_for_holds_a_prompt_prefilled_in_chunks_longer_than_the_window(family, chunk, rewind):
    """A sliding table keeps the pages behind the start of its last forward until the
    next forward opens, and that forward allocates first: a pool of
    ``kv_pages_for(..., chunk=c, rewind=r)`` pages takes a prompt prefilled in several
    chunks of c (beyond the window of 12), then decode steps, and its peak stays within
    the count."""
    from pagedkv.cache import kv_pages_for
    from pagedkv.generation import prefill

    model = family_model(family, FAMILIES[family])
    probe, _ = pools_for_model(model, max_bytes=1 << 20, page_size=4)
    need = kv_pages_for(model, 60, 4, chunk=chunk, rewind=rewind)
    pool = PagePool(num_layers=probe.num_layers, num_kv_heads=probe.num_kv_heads, head_dim=probe.head_dim,
                    page_size=4, num_pages=need, dtype=probe.dtype)
    with make_paged_cache(model, pool, rewind=rewind) as cache:
        prefill(model, cache, prompt_of(56), chunk)
        for token in (1, 2, 3, 4):
            mx.eval(model(mx.array([[token]]), cache=cache))
        assert cache[0].offset == 60
        pool.allocator.check()
    assert pool.allocator.stats().peak_in_use + 1 <= need  # (+ the null page)
    assert pool.allocator.num_in_use() == 0


def test_a_model_without_attention_layers_is_refused_by_make_paged_cache():
    model = hybrid_model("mamba2", MAMBA2)
    pool = PagePool(num_layers=1, num_kv_heads=1, head_dim=16, page_size=4, num_pages=8, dtype=mx.float32)
    with pytest.raises(NotSupportedError, match="no attention layers"):
        make_paged_cache(model, pool, state_pool=StatePool.for_model(model, num_slots=4))
    assert pool.allocator.num_in_use() == 0


def test_gpt_oss_on_8_bit_pages_keeps_its_attention_sinks_where_mlx_lms_quantised_cache_refuses():
    """gpt_oss's attention has sinks: on affine 8-bit pages pagedkv's attention takes
    them (mlx-lm's ``QuantizedKVCache`` raises). Fed the same tokens, its logits stay
    within 8-bit rounding of mlx-lm's full-precision caches."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    from pagedkv import AffineQuant

    model = model_of_config(dict(BASE, hidden_size=128, head_dim=32, model_type="gpt_oss", **FAMILIES["gpt_oss"]))
    prompt, steps = prompt_of(30), [int(t) for t in prompt_of(12, seed=5)]
    quantized = [QuantizedKVCache(group_size=32, bits=8) if type(c) is KVCache else c for c in make_prompt_cache(model)]
    with pytest.raises(ValueError, match="sinks"):
        model(mx.array(prompt)[None], cache=quantized)
    ref_cache = make_prompt_cache(model)
    pool = PagePool(num_layers=len(ref_cache), num_kv_heads=2, head_dim=32, page_size=4, num_pages=64,
                    dtype=mx.float32, k_codec=AffineQuant(8, 32), v_codec=AffineQuant(8, 32))
    with make_paged_cache(model, pool) as cache:
        for tokens in [prompt] + [[t] for t in steps]:  # past the window (12): sliding pages drop
            want = model(mx.array(tokens)[None], cache=ref_cache)[0, -1]
            got = model(mx.array(tokens)[None], cache=cache)[0, -1]
            assert mx.abs(got - want).max().item() < 0.05


def test_a_trim_that_a_sliding_layer_refuses_changes_no_layer_even_when_a_full_layer_goes_first():
    """olmo3 with its full-attention layer first: mlx-lm's ``trim_prompt_cache`` trims
    layer by layer, so the full layer must refuse what the sliding layers beside it
    cannot do (their window's pages are gone), or the cache is left half trimmed. What
    they can do, every layer does, and the sequence then continues as mlx-lm's own
    caches holding the same tokens."""
    from mlx_lm.models.cache import trim_prompt_cache

    from pagedkv import TrimError

    model = family_model("olmo3", dict(FAMILIES["olmo3"], layer_types=[
        "full_attention", "sliding_attention", "sliding_attention", "full_attention"]))
    tokens, _ = greedy(model, prompt_of(30), make_prompt_cache(model), 8)
    seq = prompt_of(30) + tokens[:-1]  # the 37 tokens a cache holds after that decode
    ref_cache = make_prompt_cache(model)
    model(mx.array(seq[:37])[None], cache=ref_cache)
    pool = pool_like(ref_cache)
    with make_paged_cache(model, pool) as cache:
        model(mx.array(seq[:30])[None], cache=cache)
        for token in seq[30:]:  # decode steps: the sliding layers drop the pages behind their window
            model(mx.array([[token]]), cache=cache)
        before = (cache.rows.offsets.copy(), pool.allocator.num_in_use())
        most = {layer.max_trim() for layer in cache}
        assert len(most) == 1 and 0 < most.pop() < 5  # the windows (12) left the full layers no more
        with pytest.raises(TrimError):
            trim_prompt_cache(cache, 5)
        assert (cache.rows.offsets == before[0]).all() and pool.allocator.num_in_use() == before[1]
        assert trim_prompt_cache(cache, 2) == 2 and (cache.rows.offsets == 35).all()
        ref_cache = make_prompt_cache(model)
        model(mx.array(seq[:35])[None], cache=ref_cache)
        for token in seq[35:] + [5, 6]:
            want = model(mx.array([[token]]), cache=ref_cache)[0, -1]
            assert mx.allclose(model(mx.array([[token]]), cache=cache)[0, -1], want, atol=LOGITS_ATOL).item()


@pytest.mark.parametrize("rewind", [0, 3])
def test_a_sliding_window_cache_with_rewind_drops_drafts_made_over_several_steps(rewind):
    """A draft model proposes 4 tokens one decode step at a time, then drops the 3 the
    target rejected. Its sliding layers (window 12, pages of 4) drop pages as they step;
    with ``rewind=3`` they keep 3 tokens more, so every such trim succeeds and the next
    logits are mlx-lm's (full ``KVCache``s, windowed by the mask, trimmed the same way);
    without it some trim is refused (and changes nothing), and the draft model could not
    go on."""
    from mlx_lm.models.cache import KVCache, trim_prompt_cache

    from pagedkv import TrimError

    model = make_model("gemma3_text")
    pool = make_pool("gemma3_text", page_size=4, num_pages=64)
    for bad, error in ((-1, ValueError), (1.5, TypeError)):
        with pytest.raises(error):
            make_paged_cache(model, pool, rewind=bad)
    ref = [KVCache() for _ in model.layers]
    refused = 0
    with make_paged_cache(model, pool, rewind=rewind) as cache:
        tokens = prompt_of(14)
        for c in (ref, cache):
            model(mx.array(tokens)[None], cache=c)
        for round_ in range(10):
            for step in range(4):
                token = [(7 * round_ + step) % VOCAB]
                want = model(mx.array([token]), cache=ref)[0, -1]
                got = model(mx.array([token]), cache=cache)[0, -1]
                assert mx.allclose(got, want, atol=LOGITS_ATOL).item()
            before = (cache.rows.offsets.copy(), pool.allocator.stats())
            try:
                assert trim_prompt_cache(cache, 3) == 3
            except TrimError:
                refused += 1
                assert (cache.rows.offsets == before[0]).all() and pool.allocator.stats() == before[1]
                trim_prompt_cache(ref, 0)
                continue
            trim_prompt_cache(ref, 3)
        assert (cache.rows.offsets == ref[0].offset).all()
        held = max(t.num_pages for t in cache.tables if t.window)  # the sliding tables
    assert (refused == 0) if rewind else (refused > 0)
    assert held <= -(-(12 + rewind) // 4) + 1
    pool.allocator.check()
