"""Hybrid models (recurrent layers next to attention): paged KV + a StatePool, checked
against mlx-lm's own caches running mlx-lm's own model classes (random weights).

Reference: ``mlx_lm.models.cache.make_prompt_cache`` (KVCache + ArraysCache), one
sequence at a time. Every test ends with both allocators consistent and, after release,
no page or slot held.
"""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from snapshots import state_of, state_pool_of
from tiny_models import HYBRIDS, LOGITS_ATOL, VOCAB, make_model, prompt_of

from pagedkv import (
    DiskTier,
    InvalidValueError,
    KvDTypeError,
    KvShapeError,
    NotSupportedError,
    PagedBatch,
    PagePool,
    PoolExhausted,
    PrefixCache,
    StatePool,
    can_admit,
    donor_caches,
    layout_for,
    make_paged_cache,
    pools_for_model,
    preempt,
    save_cache,
)
from pagedkv.generation import prefill
from pagedkv.mlx_lm_caches import flat_caches
from pagedkv.serving import Engine, GenerationRequest, SamplingParams

PAGE = 4


@pytest.fixture(scope="module", params=HYBRIDS)
def model(request):
    return make_model(request.param)


def pools(model, pages: int = 96, slots: int = 12) -> tuple[PagePool, StatePool]:
    """A page pool for the model's attention layers (2 KV heads of 16 in both tiny
    configs) and a state pool for its recurrent layers."""
    n_attn = sum(type(c).__name__ == "KVCache" for c in flat_caches(model.make_cache()))
    pool = PagePool(num_layers=n_attn, num_kv_heads=2, head_dim=16, page_size=PAGE, num_pages=pages,
                    dtype=mx.float32)
    return pool, StatePool.for_model(model, num_slots=slots)


def prefix_cache(model, pool: PagePool, states: StatePool, **kw) -> PrefixCache:
    """A prefix cache for the model's layout (its sliding windows too, if any)."""
    return PrefixCache(pool, state_pool=states, windows=layout_for(model, pool, state_pool=states).windows, **kw)


def faces(cache, kind: str | None = None) -> list:
    """A prompt cache's per-layer caches, a ``PagedCacheList``'s members in order (only
    those of class ``kind`` if given)."""
    out = [f for c in cache for f in (c.caches if type(c).__name__ == "PagedCacheList" else [c])]
    return out if kind is None else [f for f in out if type(f).__name__ == kind]


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def greedy(model, cache, tokens: list[int], n: int) -> tuple[list[int], mx.array]:
    """Run ``tokens`` into ``cache``, then ``n`` greedy tokens; and the last step's logits."""
    logits = model(mx.array([tokens]), cache=cache)[:, -1]
    out = []
    for _ in range(n):
        out.append(int(mx.argmax(logits, -1).item()))
        logits = model(mx.array([[out[-1]]]), cache=cache)[:, -1]
    return out, logits


def reference(model, prompt: list[int], n: int) -> tuple[list[int], mx.array]:
    """``greedy`` on mlx-lm's own caches."""
    return greedy(model, make_prompt_cache(model), prompt, n)


def no_leaks(pool: PagePool, states: StatePool, cached_ok: bool = True) -> None:
    pool.allocator.check()
    states.allocator.check()
    assert pool.allocator.num_in_use() == 0 and states.allocator.num_in_use() == 0
    if not cached_ok:
        assert states.allocator.num_cached() == 0


@pytest.mark.parametrize("length", [1, 3, 4, 9, 16])
def test_paged_hybrid_decodes_what_mlx_lm_decodes(model, length):
    pool, states = pools(model)
    prompt = tokens(length, length)
    want, want_logits = reference(model, prompt, 10)
    with make_paged_cache(model, pool, state_pool=states) as cache:
        got, logits = greedy(model, cache, prompt, 10)
        assert cache.rows.states.tokens.tolist() == [[length + 10]] * states.num_layers
        assert states.allocator.num_in_use() == 1  # one slot per sequence, whatever its length
    assert got == want
    np.testing.assert_allclose(np.array(logits), np.array(want_logits), rtol=1e-4, atol=LOGITS_ATOL)
    no_leaks(pool, states, cached_ok=False)


def test_chunked_prefill_equals_one_forward(model):
    pool, states = pools(model)
    prompt = tokens(7, 23)
    want, _ = reference(model, prompt, 6)
    with make_paged_cache(model, pool, state_pool=states) as cache:
        prefill(model, cache, prompt[:-1], chunk=5)
        got, _ = greedy(model, cache, prompt[-1:], 6)
    assert got == want
    no_leaks(pool, states)


def test_batched_rows_of_different_lengths_decode_what_each_decodes_alone(model):
    pool, states = pools(model)
    prompts = [tokens(s, n) for s, n in ((1, 5), (2, 13), (3, 8))]
    want = [reference(model, p, 8)[0] for p in prompts]
    batch = PagedBatch.for_model(model, pool, state_pool=states)
    nxt = []
    for p in prompts:
        cache = make_paged_cache(model, pool, state_pool=states)
        logits = model(mx.array([p]), cache=cache)[:, -1]
        nxt.append(int(mx.argmax(logits, -1).item()))
        batch.extend(cache)
    got = [[t] for t in nxt]
    for _ in range(7):
        logits = model(mx.array(nxt)[:, None], cache=batch.caches)[:, -1]
        nxt = mx.argmax(logits, -1).tolist()
        for row, t in zip(got, nxt):
            row.append(t)
    assert got == want
    assert states.allocator.num_in_use() == 3
    # a row leaves (extract) and goes on alone; filter drops another and its slot
    alone = batch.extract(1)
    batch.filter([1])
    assert states.allocator.num_in_use() == 2
    more, _ = greedy(model, alone, [got[1][-1]], 3)
    assert more == reference(model, prompts[1] + got[1], 3)[0]
    alone.release()
    batch.release()
    no_leaks(pool, states, cached_ok=False)


def test_a_fork_shares_the_state_and_each_side_continues_exactly(model):
    pool, states = pools(model)
    prompt = tokens(11, 10)
    with make_paged_cache(model, pool, state_pool=states) as cache:
        model(mx.array([prompt]), cache=cache)
        with cache.fork() as twin:
            assert states.allocator.num_in_use() == 1  # shared until a side steps
            a, _ = greedy(model, cache, [5], 4)
            b, _ = greedy(model, twin, [9], 4)
            assert states.allocator.num_in_use() == 2
    assert a == reference(model, prompt + [5], 4)[0]
    assert b == reference(model, prompt + [9], 4)[0]
    no_leaks(pool, states, cached_ok=False)


@pytest.mark.parametrize("every", [1, 2])
def test_a_prefix_hit_restores_state_and_kv_and_decodes_what_mlx_lm_decodes(model, every):
    pool, states = pools(model)
    prefix = prefix_cache(model, pool, states, checkpoint_every=every)
    shared = tokens(21, 19)
    first, second = shared + tokens(1, 6), shared + tokens(2, 9)
    for prompt, hit in ((first, 0), (second, 16)):
        keys = prefix.keys(prompt)
        cache, rest = prefix.new_cache(model, keys)
        assert len(prompt) - len(rest) == hit
        prefill(model, cache, rest[:-1], chunk=5, prefix=prefix, keys=keys)
        got, logits = greedy(model, cache, rest[-1:], 6)
        want, want_logits = reference(model, prompt, 6)
        assert got == want
        np.testing.assert_allclose(np.array(logits), np.array(want_logits), rtol=1e-4, atol=LOGITS_ATOL)
        cache.release()
    stats = prefix.stats()
    assert stats.hit_tokens == 16 and stats.checkpoints >= 16 // (PAGE * every)
    assert stats.cached_state_bytes == states.allocator.num_cached() * states.bytes_per_slot > 0
    no_leaks(pool, states)


def test_a_hit_ends_at_the_last_checkpoint_not_the_last_cached_page(model):
    pool, states = pools(model)
    prefix = prefix_cache(model, pool, states, checkpoint_every=2)  # boundaries every 8 tokens
    prompt = tokens(5, 30)
    with make_paged_cache(model, pool, state_pool=states) as cache:
        model(mx.array([prompt[:8]]), cache=cache)  # a checkpoint at 8
        prefix.register(cache, prompt)
        model(mx.array([prompt[8:12]]), cache=cache)  # 12: a full page, no checkpoint
        prefix.register(cache, prompt)
    assert len(prefix.match(prompt)) == 2  # pages 0-1 (8 tokens), not 3
    cache, rest = prefix.new_cache(model, prompt)
    got, _ = greedy(model, cache, rest, 4)
    cache.release()
    assert len(rest) == 22 and got == reference(model, prompt, 4)[0]
    no_leaks(pool, states)


def test_evicted_checkpoints_fall_back_to_a_shorter_hit_and_stay_exact(model):
    pool, states = pools(model, slots=3)  # two usable slots: a running row and one checkpoint
    prefix = prefix_cache(model, pool, states)
    base = tokens(8, 17)
    for seed in range(3):
        prompt = base + tokens(100 + seed, 5)
        keys = prefix.keys(prompt)
        cache, rest = prefix.new_cache(model, keys)
        prefill(model, cache, rest[:-1], chunk=4, prefix=prefix, keys=keys)
        got, _ = greedy(model, cache, rest[-1:], 3)
        assert got == reference(model, prompt, 3)[0]
        cache.release()
        states.allocator.check()
    assert prefix.stats().checkpoints <= 2
    no_leaks(pool, states)


def test_a_step_without_a_free_slot_raises_and_changes_nothing(model):
    pool, states = pools(model, slots=3)
    a = make_paged_cache(model, pool, state_pool=states)
    b = make_paged_cache(model, pool, state_pool=states)
    c = make_paged_cache(model, pool, state_pool=states)
    model(mx.array([[1, 2, 3]]), cache=a)
    model(mx.array([[4, 5, 6]]), cache=b)
    assert not can_admit(pool, 3, 4, state_pool=states, watermark=0)
    before = (state_of(pool, c), state_pool_of(states))
    with pytest.raises(PoolExhausted):
        model(mx.array([[7, 8, 9]]), cache=c)
    assert (state_of(pool, c), state_pool_of(states)) == before
    assert preempt(a) == 1 + 1  # one page and one slot
    assert can_admit(pool, 3, 4, state_pool=states, watermark=0)
    assert not can_admit(pool, 3, 4, state_pool=states)  # the watermark keeps a slot for running rows
    got, _ = greedy(model, c, [7, 8, 9], 4)
    assert got == reference(model, [7, 8, 9], 4)[0]
    b.release()
    c.release()
    no_leaks(pool, states, cached_ok=False)


@pytest.mark.parametrize("bad", ["shape", "dtype", "type", "component"])
def test_a_bad_state_rolls_the_step_back(model, bad):
    pool, states = pools(model)
    cache = make_paged_cache(model, pool, state_pool=states)
    model(mx.array([[1, 2, 3, 4, 5]]), cache=cache)
    before = (state_of(pool, cache), state_pool_of(states))
    face = faces(cache, "PagedStateCache")[0]
    good = face[0]
    value = {"shape": good[:, :1], "dtype": good.astype(mx.float16), "type": np.array(good), "component": good}[bad]
    index = len(states.shapes[face.layer]) if bad == "component" else 0  # one past the layer's components
    with pytest.raises((KvShapeError, KvDTypeError)):
        face[index] = value
    assert (state_of(pool, cache), state_pool_of(states)) == before
    got, _ = greedy(model, cache, [6], 3)  # and it goes on exactly
    assert got == reference(model, [1, 2, 3, 4, 5, 6], 3)[0]
    cache.release()
    no_leaks(pool, states, cached_ok=False)


def test_states_a_failed_forward_handed_in_are_never_read(model):
    pool, states = pools(model)
    cache = make_paged_cache(model, pool, state_pool=states)
    model(mx.array([[1, 2, 3]]), cache=cache)
    face = faces(cache, "PagedStateCache")[0]
    face[0] = face[0] + 100  # a forward that raised after this layer handed its state in
    got, _ = greedy(model, cache, [4], 3)
    assert got == reference(model, [1, 2, 3, 4], 3)[0]
    cache.release()
    no_leaks(pool, states, cached_ok=False)


def test_a_failing_attention_write_rolls_back_the_recurrent_layers_before_it(model):
    pool, states = pools(model)
    cache = make_paged_cache(model, pool, state_pool=states)
    model(mx.array([[1, 2, 3]]), cache=cache)
    before = (state_of(pool, cache), state_pool_of(states))
    layers = faces(cache)
    kinds = [type(c).__name__ for c in layers]
    first_state, first_kv = kinds.index("PagedStateCache"), kinds.index("PagedKVCache")
    assert first_state < first_kv  # every architecture here starts with a recurrent layer
    state_face, kv_face = layers[first_state], layers[first_kv]
    for c in range(len(states.shapes[state_face.layer])):
        state_face[c] = state_face[c] + 1
    state_face.advance(1)  # the step is open: a recurrent layer wrote it
    with pytest.raises(KvShapeError):
        kv_face.update_and_fetch(mx.zeros((1, 2, 1, 8)), mx.zeros((1, 2, 1, 8)))
    assert (state_of(pool, cache), state_pool_of(states)) == before
    cache.release()
    no_leaks(pool, states, cached_ok=False)


def test_a_recurrent_layers_cache_reports_what_mlx_lms_arrays_cache_holds(model):
    pool, states = pools(model)
    prompt = tokens(7, 6)
    mine = make_paged_cache(model, pool, state_pool=states)
    recurrent = faces(mine, "PagedStateCache")
    assert all(f.empty() and f.offset == 0 and f.batch_size == 1 for f in recurrent)
    with pytest.raises(KvShapeError, match="empty"):
        _ = recurrent[0].state
    theirs = make_prompt_cache(model)
    model(mx.array([prompt]), cache=mine)
    model(mx.array([prompt]), cache=theirs)
    want = [c for c in flat_caches(theirs) if type(c).__name__ == "ArraysCache"]
    assert len(want) == len(recurrent) == states.num_layers
    for face, ref in zip(recurrent, want):
        assert not face.empty() and face.offset == len(prompt) and face.batch_size == 1
        got = face.state
        assert len(got) == len(ref.cache)
        for g, w in zip(got, ref.cache):
            assert g.shape == w.shape and g.dtype == w.dtype
            np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-4, atol=1e-5)
    mine.release()
    no_leaks(pool, states, cached_ok=False)


def test_hybrid_caches_refuse_what_recurrent_state_cannot_do(model, tmp_path):
    pool, states = pools(model)
    with pytest.raises(NotSupportedError, match="state_pool"):
        make_paged_cache(model, pool)
    with make_paged_cache(model, pool, state_pool=states) as cache:
        model(mx.array([[1, 2, 3, 4, 5]]), cache=cache)
        assert not any(c.is_trimmable() for c in cache)
        with pytest.raises(NotSupportedError):
            cache[-1].trim(1)
        kv = faces(cache, "PagedKVCache")[0]
        with pytest.raises(NotSupportedError):
            kv.trim(1)
        assert sum(c.nbytes for c in cache) == (
            pool.bytes_per_page_per_layer * pool.num_layers * 2 + states.bytes_per_slot)
    with pytest.raises(NotSupportedError):
        PrefixCache(pool, state_pool=states, disk=DiskTier(tmp_path, pool, max_bytes=1 << 20, model_id="m"))
    with make_paged_cache(model, pool, state_pool=states) as cache:
        model(mx.array([[1, 2, 3]]), cache=cache)
        with pytest.raises(NotSupportedError, match="recurrent state"):
            save_cache(tmp_path / "c.safetensors", cache, tokens=[1, 2, 3])
        donors = donor_caches(cache)  # recurrent slots share nothing: passed through
        assert [type(d).__name__ for d in donors] == [
            "DonorCache" if type(c).__name__ == "PagedKVCache" else type(c).__name__ for c in cache]
    no_leaks(pool, states, cached_ok=False)


def test_a_non_hybrid_prefix_cache_refuses_a_hybrid_model(model):
    pool, states = pools(model)
    with pytest.raises(NotSupportedError, match="state_pool"):
        PrefixCache(pool).new_cache(model, [1, 2, 3])
    no_leaks(pool, states)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("slots,pages", [(4, 40), pytest.param(24, 60, marks=pytest.mark.slow)], ids=["tight", "roomy"])
def test_the_engine_serves_a_hybrid_with_prefix_hits_and_preemption(model, slots, pages, compiled):
    """Four requests share a system prompt, then a fifth continues the first one's
    prompt. Tight: 3 usable state slots for 4 requests (a preemption). Roomy: every
    request after the first hits the system prompt's checkpoint, the fifth the first
    prompt's end. Compiled: the decode steps run through ``CompiledDecode`` (rows leave
    checkpoints as they decode, so they move to fresh slots inside compiled steps)."""
    pool, states = pools(model, pages=pages, slots=slots)
    engine = Engine(model, pool, decode=lambda ids: " ".join(map(str, ids)), state_pool=states,
                    checkpoint_every=1, prefill_chunk=6, prefill_budget=12, max_batch=4,
                    compiled_decode=compiled)
    assert engine.compiled_decode is compiled
    system = tokens(50, 13)
    prompts = [system + tokens(60 + i, 3 + i) for i in range(4)] + [system + tokens(60, 3) + [7]]
    out: dict[str, list[int]] = {}
    cached: dict[str, int] = {}

    def sink(delta):
        out.setdefault(delta.rid, []).extend(delta.token_ids)
        if delta.usage is not None:
            cached[delta.rid] = delta.usage.cached_tokens

    for i, p in enumerate(prompts[:4]):
        engine.add(GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=9, temperature=0.0), sink))
    while engine.has_work:
        engine.step()
    engine.add(GenerationRequest("r4", prompts[4], SamplingParams(max_tokens=5, temperature=0.0), sink))
    while engine.has_work:
        engine.step()
    for i, p in enumerate(prompts):
        assert out[f"r{i}"] == reference(model, p, 9 if i < 4 else 5)[0], i
    if slots == 4:
        assert engine.metrics.preemptions._value.get() >= 1
    else:
        assert cached == {"r0": 0, "r1": 12, "r2": 12, "r3": 12, "r4": 16}
    assert engine.metrics.state_in_use._value.get() == 0
    engine.close()
    no_leaks(pool, states)


def test_one_byte_budget_covers_pages_and_state_slots(model):
    pool, states = pools_for_model(model, max_bytes=1 << 20, page_size=8, state_slots=10)
    assert states.num_slots == 10 and states.num_layers == sum(
        type(c).__name__ == "ArraysCache" for c in flat_caches(model.make_cache()))
    assert pool.nbytes + states.nbytes <= 1 << 20 < pool.nbytes + states.nbytes + pool.bytes_per_page
    with make_paged_cache(model, pool, state_pool=states) as cache:
        got, _ = greedy(model, cache, [1, 2, 3], 3)
    assert got == reference(model, [1, 2, 3], 3)[0]
    with pytest.raises(InvalidValueError):
        pools_for_model(model, max_bytes=states.nbytes, state_slots=10)
    plain, none = pools_for_model(make_model("llama"), max_bytes=1 << 20)
    assert none is None and plain.num_layers == 3
    with pytest.raises(InvalidValueError):
        pools_for_model(make_model("llama"), max_bytes=1 << 20, state_slots=4)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
def test_random_hybrid_requests_up_to_the_limit_in_tight_pools_all_finish_as_they_do_alone(model, seed):
    """Random requests up to the engine's limit (some at it) in pools of 16-40 pages and
    3-7 state slots, prefix caching on or off, checkpoints every 1 or 2 pages: every
    request ends with the tokens it gives alone within a bounded number of steps, and
    every page and slot comes back."""
    from pagedkv.generation import generate

    rng = random.Random(seed)
    pool, states = pools(model, pages=rng.randrange(16, 41), slots=rng.randrange(3, 8))
    engine = Engine(model, pool, decode=lambda ids: "", state_pool=states, max_batch=rng.choice([2, 4]),
                    prefill_chunk=rng.choice([4, 8]), prefill_budget=rng.choice([8, 16]),
                    prefix_caching=rng.random() < 0.6, checkpoint_every=rng.choice([1, 2]))
    limit, out, reqs = engine.limits.max_pool_tokens, {}, {}
    shared = prompt_of(limit)
    for i in range(6):
        total = limit if i % 3 == 0 else rng.randrange(4, limit + 1)
        n = rng.randrange(1, min(total - 1, 20))
        prompt = shared[: total - n] if rng.random() < 0.5 else [rng.randrange(1, VOCAB) for _ in range(total - n)]
        reqs[f"r{i}"] = (prompt, n)

    def sink(delta):
        out.setdefault(delta.rid, []).extend(delta.token_ids)

    pending, steps = list(reqs), 0
    while pending or engine.has_work:
        if pending and rng.random() < 0.5:
            rid = pending.pop(0)
            engine.add(GenerationRequest(rid, reqs[rid][0], SamplingParams(max_tokens=reqs[rid][1]), sink))
        engine.step()
        steps += 1
        assert steps < 1500, "the engine stalled"
    for rid, (prompt, n) in reqs.items():
        assert out[rid] == list(generate(model, make_prompt_cache(model), prompt, max_tokens=n)), rid
    engine.close()
    no_leaks(pool, states)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_hybrid_with_sliding_layers_decodes_what_mlx_lm_decodes_alone_and_batched_with_preemption(compiled):
    """mlx-lm's gear: short convolutions (recurrent state) beside sliding-window and
    full-attention layers, in layer groups of a pool of ``kv_pool_layers`` layers. Alone
    past the window, and in an engine whose pool makes it preempt (no prefix caching:
    it does not serve sliding hybrids), every request gives mlx-lm's tokens."""
    from pagedkv.generation import generate

    model = make_model("gear")
    prompt = prompt_of(23)  # the window is 12
    want, want_logits = reference(model, prompt, 30)
    pool, states = pools_for_model(model, max_bytes=1 << 20, page_size=PAGE, state_slots=8)
    with make_paged_cache(model, pool, state_pool=states) as cache:
        got, logits = greedy(model, cache, prompt, 30)
        assert sorted(t.window is not None for t in cache.tables) == [False, True]
    assert got == want
    np.testing.assert_allclose(np.array(logits), np.array(want_logits), rtol=1e-4, atol=LOGITS_ATOL)
    no_leaks(pool, states, cached_ok=False)
    pool = PagePool(num_layers=pool.num_layers, num_kv_heads=2, head_dim=16, page_size=PAGE, num_pages=40,
                    dtype=mx.float32)
    engine = Engine(model, pool, decode=lambda ids: "", state_pool=states, max_batch=3, prefill_chunk=8,
                    prefix_caching=False, compiled_decode=compiled)
    reqs = {f"r{i}": (prompt_of(n, seed=i), 24) for i, n in enumerate((5, 17, 30))}
    out: dict[str, list[int]] = {}
    for rid, (p, n) in reqs.items():
        engine.add(GenerationRequest(rid, p, SamplingParams(max_tokens=n),
                                     lambda d: out.setdefault(d.rid, []).extend(d.token_ids)))
    while engine.has_work:
        engine.step()
    assert engine.metrics.registry.get_sample_value("pagedkv:num_preemptions_total",
                                                    {"model_name": "pagedkv"}) > 0
    for rid, (p, n) in reqs.items():
        assert out[rid] == list(generate(model, make_prompt_cache(model), p, max_tokens=n)), rid
    engine.close()
    no_leaks(pool, states)


def test_copy_slots_checks_sources_and_targets_before_it_writes():
    """Sources used to go unchecked: -1 copied the last slot, and a count that differs
    from the targets' reached MLX."""
    states = StatePool([[((2,), mx.float32)]], num_slots=6)
    held = states.allocator.allocate(2)
    states.write(0, [mx.array([[1.0, 2.0], [3.0, 4.0]])], mx.array(held.astype(np.int32)))
    before = state_pool_of(states)
    for src, dst, error in (([-1], held[:1], ValueError), ([7], held[:1], ValueError),
                            (held, held[:1], InvalidValueError), (held[:1], [4], InvalidValueError),
                            (held[:1], [0], InvalidValueError), (held, [held[1], held[1]], InvalidValueError)):
        with pytest.raises(error):
            states.copy_slots(np.asarray(src), np.asarray(dst))
    assert state_pool_of(states) == before
    states.copy_slots(held[:1], held[1:])
    assert np.array(states.read(0, 0, mx.array(held.astype(np.int32)))).tolist() == [[1.0, 2.0], [1.0, 2.0]]
