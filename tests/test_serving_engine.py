"""The serving engine without HTTP: continuous batching equals solo decoding on mlx-lm's
own KVCache (with preemption and prefix hits; on quantised pages, solo decoding on the
same pages), seeded sampling gives a request its tokens in any batch, bad requests change nothing, aborts and
failing sinks free pages, a failing step ends only the requests in flight; and the
pieces: ``TextStream`` (incremental text, stop strings) and ``sample_rows``."""

from __future__ import annotations

import collections
import functools
import random
import threading
import time

import attrs
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from tiny_models import CONFIGS, VOCAB, kv_dims, make_model, model_of_config, prompt_of

from pagedkv import (
    AffineQuant,
    InvalidTypeError,
    InvalidValueError,
    PagePool,
    make_paged_cache,
    rotated,
)
from pagedkv.generation import generate
from pagedkv.serving import (
    Delta,
    Engine,
    GenerationRequest,
    RequestTooLarge,
    SamplingParams,
    TextStream,
    sample_rows,
)
from pagedkv.serving.engine_thread import EngineThread
from pagedkv.serving.sampling import keyed_gumbel, row_key


def letters(ids) -> str:
    return "".join(chr(97 + i % 26) for i in ids)


@pytest.fixture(scope="module")
def model():
    return make_model("llama")


def make_engine(model, num_pages=40, page_size=4, **kw) -> Engine:
    L, H, D = kv_dims("llama")
    pool = PagePool(num_layers=L, num_kv_heads=H, head_dim=D, page_size=page_size, num_pages=num_pages,
                    dtype=mx.float32)
    return Engine(model, pool, **{"decode": letters, **kw})


class Sink:
    def __init__(self):
        self.deltas: dict[str, list[Delta]] = {}

    def __call__(self, d: Delta) -> None:
        self.deltas.setdefault(d.rid, []).append(d)

    def ids(self, rid):
        return [t for d in self.deltas[rid] for t in d.token_ids]

    def last(self, rid) -> Delta:
        return self.deltas[rid][-1]


def metric(engine: Engine, name: str) -> float:
    """The value of counter ``pagedkv:<name>_total`` (or gauge ``pagedkv:<name>``)."""
    get = functools.partial(engine.metrics.registry.get_sample_value, labels={"model_name": "pagedkv"})
    value = get(f"pagedkv:{name}_total")
    return get(f"pagedkv:{name}") if value is None else value


def run(engine: Engine) -> int:
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
    return steps


def solo(model, prompt, n, eos=()):
    return list(generate(model, make_prompt_cache(model), prompt, max_tokens=n, eos_ids=eos))


# (the quick loop runs two of each such list; CI runs them all)
@pytest.mark.parametrize("prefix_caching, compiled_decode, overlap_decode", [
    (True, False, True), pytest.param(False, False, True, marks=pytest.mark.slow),
    pytest.param(True, True, True, marks=pytest.mark.slow), pytest.param(True, False, False, marks=pytest.mark.slow),
    (True, True, False)])
def test_batched_greedy_equals_solo_with_preemptions_and_returns_every_page(model, prefix_caching, compiled_decode,
                                                                           overlap_decode):
    engine = make_engine(model, num_pages=40, max_batch=8, prefix_caching=prefix_caching,
                         compiled_decode=compiled_decode, overlap_decode=overlap_decode)
    sink, rng = Sink(), random.Random(0)
    shared = [rng.randrange(VOCAB) for _ in range(9)]
    reqs, work = [], []
    for i in range(12):
        prompt = (shared if i % 2 else []) + [rng.randrange(VOCAB) for _ in range(rng.randrange(3, 25))]
        reqs.append((f"r{i}", prompt, rng.randrange(1, 24)))
        work.append(GenerationRequest(f"r{i}", prompt, SamplingParams(max_tokens=reqs[-1][2]), sink))
        engine.add(work[-1])
    preempt = engine._preempt_newest

    def preempt_only_live_rows():  # (a row whose request ended gives its pages back first)
        assert all(r.finish_reason is None for r in engine.running)
        preempt()

    engine._preempt_newest = preempt_only_live_rows
    run(engine)
    assert sum(w.preemptions for w in work) > 0  # 40 pages of 4 tokens are too few at once
    # each prompt is counted once, at its first admission, and so are its cached tokens
    cached = sum(sink.last(rid).usage.cached_tokens for rid, _, _ in reqs)
    assert metric(engine, "prompt_tokens") == sum(len(p) for _, p, _ in reqs)
    assert metric(engine, "prefix_cache_hits") == cached and (cached > 0) == prefix_caching
    if compiled_decode:  # the steps were traced (a batch size and table width each) and replayed
        assert engine._compiled.traces > 1
    for rid, prompt, n in reqs:
        assert sink.ids(rid) == solo(model, prompt, n), rid
        last = sink.last(rid)
        assert last.finish_reason == "length" and last.usage.completion_tokens == n
        assert "".join(d.text for d in sink.deltas[rid]) == letters(solo(model, prompt, n))
    st = engine.pool.allocator.stats()
    assert st.in_use == 0 and engine.batch.size == 0
    engine.pool.allocator.check()


@pytest.mark.parametrize("codecs, compiled_decode", [
    pytest.param(codecs, compiled, marks=[] if (codecs, compiled) in {("rotated4", False), ("affine4 K, rotated3 V", True)}
                 else pytest.mark.slow)
    for compiled in (False, True) for codecs in ("affine8", "rotated4", "affine4 K, rotated3 V")])
def test_quantised_pages_batched_with_preemptions_equal_each_request_alone_on_the_same_pages(
        model, codecs, compiled_decode):
    """``pagedkv serve --kv-bits``'s pools in the engine: every request's greedy tokens
    equal decoding it alone on a paged cache of the same codecs (the codecs' own loss is
    bench/quant_quality.py's), with rows preempted and prefix hits, and every page back."""
    L, H, D = kv_dims("llama")
    k_codec, v_codec = {"affine8": (AffineQuant(8, 32), AffineQuant(8, 32)),
                        "rotated4": (rotated(4, D, 32, seed=1), rotated(4, D, 32, seed=2)),
                        "affine4 K, rotated3 V": (AffineQuant(4, 32), rotated(3, D, 32))}[codecs]

    def pool(num_pages: int) -> PagePool:
        return PagePool(num_layers=L, num_kv_heads=H, head_dim=D, page_size=4, num_pages=num_pages,
                        dtype=mx.float32, k_codec=k_codec, v_codec=v_codec)

    rng = random.Random(0)
    shared = [rng.randrange(VOCAB) for _ in range(9)]
    prompts = [(shared if i % 2 else []) + [rng.randrange(VOCAB) for _ in range(rng.randrange(3, 16))]
               for i in range(10)]
    lengths = [rng.randrange(10, 30) for _ in prompts]
    alone = []
    for prompt, n in zip(prompts, lengths):
        with make_paged_cache(model, pool(40)) as cache:
            alone.append(list(generate(model, cache, prompt, max_tokens=n)))
    engine = Engine(model, pool(26), decode=letters, max_batch=8, compiled_decode=compiled_decode)
    sink = Sink()
    work = [GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=n), sink)
            for i, (p, n) in enumerate(zip(prompts, lengths))]
    for w in work:
        engine.add(w)
    run(engine)
    hits = engine.metrics.registry.get_sample_value("pagedkv:prefix_cache_hits_total", {"model_name": "pagedkv"})
    assert sum(w.preemptions for w in work) > 0 and hits > 0
    for i, ids in enumerate(alone):
        assert sink.ids(f"r{i}") == ids, i
    assert engine.pool.allocator.stats().in_use == 0
    engine.pool.allocator.check()


@pytest.mark.parametrize("compiled_decode", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_overlapped_decode_delivers_what_reading_every_step_delivers(model, compiled_decode):
    """The same requests, with overlap_decode on and off: an EOS id and a stop string
    that end rows early, requests arriving mid-run, a pool so small that rows are
    preempted (with tokens in flight when overlapped), an abort. Every request gets the
    same ids, text and finish reason (solo decoding's tokens), and every page comes back."""
    with pytest.raises(InvalidTypeError):
        make_engine(model, overlap_decode=1)
    rng = random.Random(5)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(3, 20))] for _ in range(12)]
    refs = [solo(model, p, 20) for p in prompts]
    eos = collections.Counter(t for r in refs for t in r[2:]).most_common(1)[0][0]  # ends some rows early
    stop = letters(refs[3][4:6])

    def serve(overlap: bool) -> tuple[Sink, int]:
        engine = make_engine(model, num_pages=26, max_batch=6, eos_token_ids=[eos], compiled_decode=compiled_decode,
                             overlap_decode=overlap)
        sink = Sink()
        reqs = [GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=20 - i % 5, stop=[stop] if i == 3 else None),
                                  sink) for i, p in enumerate(prompts)]
        for req in reqs[:8]:
            engine.add(req)
        steps = 0
        while engine.has_work:
            engine.step()
            steps += 1
            if steps == 4:  # arrivals while rows decode (and, overlapped, have tokens in flight)
                for req in reqs[8:]:
                    engine.add(req)
            if steps == 6:
                engine.abort("r1")
        assert engine.pool.allocator.stats().in_use == 0 and engine.batch.size == 0
        engine.pool.allocator.check()
        return sink, sum(r.preemptions for r in reqs)

    (plain, _), (overlapped, preempted) = serve(False), serve(True)
    assert preempted > 0
    reasons = set()
    for i, p in enumerate(prompts):
        rid, got = f"r{i}", overlapped.ids(f"r{i}")
        reasons.add(overlapped.last(rid).finish_reason)
        assert got == solo(model, p, 20 - i % 5, eos=[eos])[: len(got)], rid
        if rid == "r1":  # aborted at another token (tokens arrive a step later), then nothing more
            assert overlapped.last(rid).finish_reason == plain.last(rid).finish_reason == "abort"
            continue
        assert [(d.token_ids, d.text, d.finish_reason) for d in overlapped.deltas[rid]] == [
            (d.token_ids, d.text, d.finish_reason) for d in plain.deltas[rid]], rid
    assert reasons == {"stop", "length", "abort"}


@pytest.mark.parametrize("overlap_decode, pattern", [(True, "FFTFTFT"), (False, "FTFTFT")])
def test_an_overlapped_step_is_queued_before_the_tokens_of_the_step_before_are_read(model, overlap_decode, pattern):
    """Decode forwards (F) and decode tokens reaching the sink (T) of one request of
    four tokens (its first comes from the prefill). Overlapped, step n + 1 is built
    before step n's token is read, and the row that ends has one more step computed
    (its token dropped); otherwise each token is read before the next step."""
    events = []

    class Recording:  # the model, noting its decode forwards
        def __init__(self, m):
            self.m, self.args, self.layers = m, m.args, m.layers

        def __call__(self, tokens, cache=None):
            if cache is engine.batch.caches:
                events.append("F")
            return self.m(tokens, cache=cache)

    engine = make_engine(Recording(model), compiled_decode=False, overlap_decode=overlap_decode)
    deltas = []

    def sink(d):
        deltas.append(d)
        if len(deltas) > 1:  # (the first token is the prefill's)
            events.append("T")

    engine.add(GenerationRequest("a", [1, 2, 3], SamplingParams(max_tokens=4), sink))
    run(engine)
    assert "".join(events) == pattern
    assert [t for d in deltas for t in d.token_ids] == solo(model, [1, 2, 3], 4)
    assert deltas[-1].finish_reason == "length" and engine.pool.allocator.stats().in_use == 0


def test_a_repeated_prompt_is_served_from_the_prefix_cache(model):
    engine, sink = make_engine(model), Sink()
    prompt = list(range(1, 30))
    engine.add(GenerationRequest("a", prompt, SamplingParams(max_tokens=3), sink))
    run(engine)
    engine.add(GenerationRequest("b", prompt + [5, 6], SamplingParams(max_tokens=3), sink))
    run(engine)
    assert sink.last("a").usage.cached_tokens == 0
    assert sink.last("b").usage.cached_tokens == 28  # 7 full pages of 4; the last token is computed
    assert sink.ids("b") == solo(model, prompt + [5, 6], 3)


def test_eos_and_stop_strings_finish_with_stop(model):
    def first_new(ref):  # a token that first comes after the first one, if any
        return next((i for i in range(1, len(ref)) if ref[i] not in ref[:i]), None)

    prompt, ref, k = next((p, r, first_new(r)) for p in ([s, 7 * s % VOCAB, 5] for s in range(VOCAB))
                          for r in [solo(model, p, 8)] if first_new(r) and len(set(r)) > 2)
    engine, sink = make_engine(model, eos_token_ids=[ref[k]]), Sink()
    engine.add(GenerationRequest("eos", prompt, SamplingParams(max_tokens=8), sink))
    stop = letters(ref[3:5])
    engine2, sink2 = make_engine(model), Sink()
    engine2.add(GenerationRequest("stop", prompt, SamplingParams(max_tokens=8, stop=[stop]), sink2))
    run(engine), run(engine2)
    assert sink.ids("eos") == ref[: k + 1] and sink.last("eos").finish_reason == "stop"
    text = "".join(d.text for d in sink2.deltas["stop"])
    full = letters(ref)
    assert text == full[: full.index(stop)] and sink2.last("stop").finish_reason == "stop"
    assert engine.pool.allocator.stats().in_use == engine2.pool.allocator.stats().in_use == 0


@pytest.mark.parametrize("bad, error", [
    (dict(rid="x", prompt=[]), InvalidValueError),
    (dict(rid="x", prompt=[1, VOCAB]), InvalidValueError),
    (dict(rid="x", prompt=[1, -1]), InvalidValueError),
    (dict(rid="x", prompt=[1, 2.0]), InvalidValueError),
    (dict(rid="x", prompt=(1, 2)), InvalidValueError),
    (dict(rid="x", prompt=[1] * 100, max_tokens=100), RequestTooLarge),
    (dict(rid="dup", prompt=[1, 2]), InvalidValueError),
    (dict(rid=["x"], prompt=[1, 2]), InvalidTypeError), (dict(rid=7, prompt=[1, 2]), InvalidTypeError),
    (dict(rid="x", prompt=[1, 2], sink="not callable"), InvalidTypeError),
])
def test_a_bad_request_is_refused_with_a_typed_error_and_changes_nothing(model, bad, error):
    engine, sink = make_engine(model, num_pages=40), Sink()
    engine.add(GenerationRequest("dup", [1, 2, 3], SamplingParams(max_tokens=2), sink))
    before = (list(engine.waiting), engine.pool.allocator.stats())
    with pytest.raises(error):
        engine.add(GenerationRequest(bad["rid"], bad["prompt"], SamplingParams(max_tokens=bad.get("max_tokens", 2)),
                                     bad.get("sink", sink)))
    assert (list(engine.waiting), engine.pool.allocator.stats()) == before
    run(engine)
    assert sink.ids("dup") == solo(model, [1, 2, 3], 2)


def test_request_too_large_names_the_pool_or_the_context(model):
    engine = make_engine(model, num_pages=10, max_model_len=30)  # 9 pages of 4 = 36 tokens
    with pytest.raises(RequestTooLarge, match="context of 30"):
        engine.limits.check(20, 11)
    engine = make_engine(model, num_pages=10)
    with pytest.raises(RequestTooLarge, match="whole KV pool holds .36."):
        engine.limits.check(20, 17)
    engine.limits.check(20, 16)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_sliding_window_model_admits_only_what_its_tables_hold_and_each_admitted_request_finishes_alone(
        prefix_caching):
    """gemma3_text (window 12) on 24 pages of 4 (23 usable), prefilled 8 tokens per
    forward: a sequence holds its full-attention pages plus its sliding table's at their
    peak (the window, and two chunks: ``peak_pages``), so the pool holds 60 tokens, not
    the 92 that 23 pages hold in one table. A request of 60 finishes alone however its
    tokens split between prompt and max_tokens; one of 61 is refused up front. (The
    one-table limit admitted 88 tokens, and the engine then looped forever: the prefill
    ran out, went back to the queue and started again.)"""
    from pagedkv import kv_pages_for

    model = make_model("gemma3_text")
    L, H, D = kv_dims("gemma3_text")
    pool = PagePool(num_layers=L, num_kv_heads=H, head_dim=D, page_size=4, num_pages=24, dtype=mx.float32)
    engine, sink = Engine(model, pool, decode=letters, prefill_chunk=8, prefix_caching=prefix_caching), Sink()
    assert engine.limits.max_pool_tokens == 60
    assert kv_pages_for(model, 60, 4, L, chunk=8) <= 24 < kv_pages_for(model, 61, 4, L, chunk=8)
    for prompt, n in ((50, 10), (59, 1), (9, 51)):
        rid = f"{prompt}+{n}"
        engine.add(GenerationRequest(rid, prompt_of(prompt), SamplingParams(max_tokens=n), sink))
        steps = 0
        while engine.has_work:
            engine.step()
            steps += 1
            assert steps < 200, "the request never finished"
        assert sink.ids(rid) == solo(model, prompt_of(prompt), n)
    with pytest.raises(RequestTooLarge, match="whole KV pool holds .60."):
        engine.add(GenerationRequest("61", prompt_of(51), SamplingParams(max_tokens=10), sink))
    engine.close()
    pool.allocator.check()
    assert pool.allocator.num_in_use() == 0


def test_a_pool_with_fewer_layers_than_the_model_counts_every_layer_groups_pages(model):
    """The 3-layer llama on a pool of 1 layer: three full-attention groups, each a table
    of the sequence's pages. The limit is what 39 usable pages hold three times over (52
    tokens), and admission counts all three tables, so requests still run as they do
    alone and every page comes back (prefix caching needs one full-attention table)."""
    _, H, D = kv_dims("llama")
    pool = PagePool(num_layers=1, num_kv_heads=H, head_dim=D, page_size=4, num_pages=40, dtype=mx.float32)
    engine, sink = Engine(model, pool, decode=letters, max_batch=4, prefix_caching=False), Sink()
    assert engine.limits.max_pool_tokens == 52 and len(engine._layout.specs) == 3
    assert engine._extra_pages(20) == 10  # the second and third tables' 5 pages each
    prompts = {f"r{i}": prompt_of(12 + 3 * i) for i in range(4)}
    for rid, prompt in prompts.items():
        engine.add(GenerationRequest(rid, prompt, SamplingParams(max_tokens=8), sink))
    run(engine)
    for rid, prompt in prompts.items():
        assert sink.ids(rid) == solo(model, prompt, 8)
    pool.allocator.check()
    assert pool.allocator.num_in_use() == 0


@pytest.mark.parametrize("kw, error", [
    (dict(prefill_chunk=0), InvalidValueError), (dict(prefill_budget=0), InvalidValueError),
    (dict(max_batch=0), InvalidValueError), (dict(max_batch=2.0), InvalidTypeError),
    (dict(max_model_len=1), InvalidValueError), (dict(watermark=1.0), InvalidValueError),
    (dict(watermark=True), InvalidValueError), (dict(decode="abc"), InvalidTypeError),
    (dict(eos_token_ids="ab"), InvalidTypeError), (dict(eos_token_ids=5), InvalidTypeError),  # (taken apart; raised)
    (dict(eos_token_ids=[1.5]), InvalidValueError), (dict(eos_token_ids=[-1]), InvalidValueError)])
def test_engine_settings_that_could_never_serve_are_refused_up_front(model, kw, error):
    """Settings under which the engine would admit or prefill nothing, forever (a batch
    of 0, chunks of 0 tokens), or fail later inside a step, raise a typed error when the
    engine is made, naming the setting, and leave the pool untouched."""
    L, H, D = kv_dims("llama")
    pool = PagePool(num_layers=L, num_kv_heads=H, head_dim=D, page_size=4, num_pages=40, dtype=mx.float32)
    before = pool.allocator.stats()
    with pytest.raises(error, match=next(iter(kw))):
        Engine(model, pool, **{"decode": letters, **kw})
    assert pool.allocator.stats() == before


def test_abort_of_a_running_or_waiting_request_frees_its_pages_by_the_next_step(model):
    engine, sink = make_engine(model, max_batch=1), Sink()
    engine.add(GenerationRequest("run", list(range(20)), SamplingParams(max_tokens=30), sink))
    engine.add(GenerationRequest("wait", list(range(20)), SamplingParams(max_tokens=30), sink))
    engine.step()
    assert engine.pool.allocator.stats().in_use > 0 and len(engine.waiting) == 1
    assert engine.abort("wait") and engine.abort("run")
    assert not engine.abort("run") and not engine.abort("never")
    assert sink.last("run").finish_reason == sink.last("wait").finish_reason == "abort"
    engine.step()
    assert engine.pool.allocator.stats().in_use == 0 and not engine.has_work
    # the aborted waiting request was never run: its one delta is the abort
    assert len(sink.deltas["wait"]) == 1 and sink.last("wait").usage.completion_tokens == 0


def test_close_aborts_running_prefilling_and_waiting_requests_and_returns_every_page(model):
    engine, sink = make_engine(model, max_batch=2, prefill_budget=8), Sink()
    engine.add(GenerationRequest("run", list(range(1, 6)), SamplingParams(max_tokens=30), sink))
    engine.step()
    engine.add(GenerationRequest("fill", list(range(40)), SamplingParams(max_tokens=30), sink))
    engine.add(GenerationRequest("wait", list(range(9)), SamplingParams(max_tokens=30), sink))
    engine.step()
    assert engine.running and engine.prefilling and engine.waiting
    engine.close()
    for rid in ("run", "fill", "wait"):
        assert sink.last(rid).finish_reason == "abort"
        assert [d.finish_reason for d in sink.deltas[rid]].count("abort") == 1
    engine.pool.allocator.check()
    assert engine.pool.allocator.stats().in_use == 0 and not engine.has_work
    with pytest.raises(InvalidValueError, match="closed"):
        engine.add(GenerationRequest("late", [1, 2], SamplingParams(max_tokens=2), sink))


def test_a_finished_requests_generated_tokens_serve_the_next_requests_prefix(model):
    # a chat's next turn: the first answer's pages are found, not only the first prompt's
    for overlap in (True, False):
        engine, sink = make_engine(model, overlap_decode=overlap), Sink()
        prompt = list(range(1, 10))  # 9 tokens: 2 full pages of 4
        engine.add(GenerationRequest("a", prompt, SamplingParams(max_tokens=12), sink))
        run(engine)
        turn = prompt + sink.ids("a") + [7]
        engine.add(GenerationRequest("b", turn, SamplingParams(max_tokens=3), sink))
        run(engine)
        assert sink.last("b").usage.cached_tokens == 20, overlap  # 21 tokens written: 5 full pages
        assert sink.ids("b") == solo(model, turn, 3)


def test_a_long_prompt_is_prefilled_over_several_steps_while_running_rows_decode(model):
    engine, sink = make_engine(model, prefill_budget=8, prefill_chunk=4), Sink()
    engine.add(GenerationRequest("short", [1, 2, 3], SamplingParams(max_tokens=12), sink))
    engine.step()
    long_prompt = [(7 * i) % VOCAB for i in range(41)]
    engine.add(GenerationRequest("long", long_prompt, SamplingParams(max_tokens=3), sink))
    steps_to_first = 0
    while "long" not in sink.deltas:
        before = len(sink.ids("short"))
        engine.step()
        steps_to_first += 1
        assert len(sink.ids("short")) == before + 1  # the running row got its token every step
    assert steps_to_first == 6  # 41 prompt tokens at 8 per step (the last one gives the logits)
    run(engine)
    assert sink.ids("long") == solo(model, long_prompt, 3)
    assert sink.ids("short") == solo(model, [1, 2, 3], 12)


def test_abort_while_prefilling_releases_the_pages_and_keeps_the_full_ones_findable(model):
    engine, sink = make_engine(model, prefill_budget=8), Sink()
    prompt = list(range(1, 41))
    engine.add(GenerationRequest("a", prompt, SamplingParams(max_tokens=3), sink))
    engine.step()
    assert engine.prefilling and engine.pool.allocator.stats().in_use == 2
    engine.abort("a")
    engine.step()
    assert not engine.has_work and engine.pool.allocator.stats().in_use == 0
    assert sink.last("a").finish_reason == "abort"
    engine.add(GenerationRequest("b", prompt, SamplingParams(max_tokens=3), sink))
    run(engine)
    assert sink.last("b").usage.cached_tokens == 8 and sink.ids("b") == solo(model, prompt, 3)


def test_a_sink_that_raises_ends_only_its_own_request(model):
    engine, sink = make_engine(model), Sink()

    def broken(d):
        raise ConnectionError("client gone")

    engine.add(GenerationRequest("gone", [1, 2, 3], SamplingParams(max_tokens=20), broken))
    engine.add(GenerationRequest("ok", [4, 5, 6], SamplingParams(max_tokens=20), sink))
    run(engine)
    assert sink.ids("ok") == solo(model, [4, 5, 6], 20)
    assert engine.pool.allocator.stats().in_use == 0


@pytest.mark.parametrize("failing_call", [1, 5, 9])
def test_a_decode_that_fails_on_one_requests_ids_ends_only_that_request(model, failing_call):
    """The caller's ``decode`` raising (a tokenizer's bad byte) used to escape the step
    half-way through its rows: the rows after it kept the previous step's token, and
    every request in the batch went on with tokens that were not its own."""
    calls = 0

    def decode(ids):
        nonlocal calls
        calls += 1
        if calls == failing_call:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return letters(ids)

    engine, sink = make_engine(model, decode=decode), Sink()
    prompts = {"a": [1, 2, 3], "b": [4, 5, 6, 7], "c": [8, 9]}
    for rid, prompt in prompts.items():
        engine.add(GenerationRequest(rid, prompt, SamplingParams(max_tokens=6), sink))
    run(engine)
    failed = [rid for rid in prompts if sink.last(rid).finish_reason == "error"]
    assert len(failed) == 1 and "UnicodeDecodeError" in sink.last(failed[0]).error
    for rid, prompt in prompts.items():
        want = solo(model, prompt, 6)
        assert sink.ids(rid) == (want[: len(sink.ids(rid))] if rid in failed else want), rid
    assert engine.pool.allocator.stats().in_use == 0


def test_sampled_rows_do_not_change_greedy_rows(model):
    engine, sink = make_engine(model), Sink()
    mx.random.seed(1)
    engine.add(GenerationRequest("g", [1, 2, 3], SamplingParams(max_tokens=12), sink))
    engine.add(GenerationRequest("s", [1, 2, 3], SamplingParams(max_tokens=12, temperature=1.5, top_p=0.9), sink))
    run(engine)
    assert sink.ids("g") == solo(model, [1, 2, 3], 12)
    assert len(sink.ids("s")) == 12 and sink.ids("s") != sink.ids("g")


def test_the_engine_thread_survives_a_failing_step_and_keeps_serving(model):
    class Flaky:  # the model, failing on one call
        def __init__(self, m):
            self.m, self.args, self.layers, self.fail = m, m.args, m.layers, False

        def __call__(self, *a, **k):
            if self.fail:
                self.fail = False
                raise RuntimeError("device lost")
            return self.m(*a, **k)

    flaky = Flaky(model)
    thread = EngineThread(lambda: make_engine(flaky))
    engine = thread.start(timeout=60)
    done = threading.Event()
    sink = Sink()

    def record(d):
        sink(d)
        if d.finish_reason:
            done.set()

    flaky.fail = True
    thread.submit(GenerationRequest("a", [1, 2, 3], SamplingParams(max_tokens=4), record))
    assert done.wait(30)
    assert sink.last("a").finish_reason == "error" and "device lost" in sink.last("a").error
    done.clear()
    thread.submit(GenerationRequest("b", [1, 2, 3], SamplingParams(max_tokens=4), record))
    thread.submit(GenerationRequest("b", [1, 2, 3], SamplingParams(max_tokens=4), sink))  # a duplicate id
    assert done.wait(30)
    assert sink.ids("b")[:4] == solo(model, [1, 2, 3], 4)
    thread.stop()
    assert thread.errors == 1 and engine.pool.allocator.stats().in_use == 0
    assert any(d.finish_reason == "error" and "already" in d.error for d in sink.deltas["b"])


def test_every_request_submitted_to_the_engine_thread_gets_a_final_delta_also_around_a_stop(model):
    """Queued behind the stop, or submitted after it, a request used to wait in a queue
    no one read (or be dropped from the batch of commands the stop was in): its client
    waited for good. The model holds the engine thread in a step while the stop and the
    requests are queued, so all of them are read together."""
    class Held:  # the model, holding its caller while ``gate`` is closed
        def __init__(self, m):
            self.m, self.args, self.layers = m, m.args, m.layers
            self.inside, self.gate = threading.Event(), threading.Event()

        def __call__(self, *a, **k):
            self.inside.set()
            self.gate.wait(60)
            return self.m(*a, **k)

    held = Held(model)
    thread = EngineThread(lambda: make_engine(held))
    engine = thread.start(timeout=60)
    finals: dict[str, list[Delta]] = {}

    def sink(d: Delta) -> None:
        if d.finish_reason:
            finals.setdefault(d.rid, []).append(d)

    thread.submit(GenerationRequest("long", list(range(1, 9)), SamplingParams(max_tokens=60), sink))
    assert held.inside.wait(30)  # the engine thread is in a step
    stopper = threading.Thread(target=thread.stop)
    stopper.start()
    while thread._commands.empty():  # (the stop is queued)
        time.sleep(0.001)
    rids = [f"r{i}" for i in range(5)]
    for rid in rids:
        thread.submit(GenerationRequest(rid, [1, 2, 3], SamplingParams(max_tokens=2), sink))
    held.gate.set()
    stopper.join(60)
    thread.submit(GenerationRequest("late", [1, 2, 3], SamplingParams(max_tokens=2), sink))
    assert sorted(finals) == sorted(rids + ["long", "late"])
    assert all(len(f) == 1 for f in finals.values()) and finals["long"][0].finish_reason == "abort"
    assert all(finals[rid][0].finish_reason == "error" and "stopped" in finals[rid][0].error
               for rid in rids + ["late"])
    assert engine.pool.allocator.stats().in_use == 0


def test_a_sink_that_raises_on_its_refusal_does_not_end_the_engine_thread(model):
    thread = EngineThread(lambda: make_engine(model))
    thread.start(timeout=60)

    def broken(d: Delta) -> None:
        raise RuntimeError("client gone")

    thread.submit(GenerationRequest("x", [], SamplingParams(max_tokens=2), broken))  # refused: an empty prompt
    done = threading.Event()
    thread.submit(GenerationRequest("y", [1, 2], SamplingParams(max_tokens=2), lambda d: d.finish_reason and done.set()))
    assert done.wait(30) and thread.alive
    thread.stop()


# ---------------------------------------------------------------------- TextStream
def test_text_stream_holds_back_half_characters():
    data = "né😀x".encode()
    # one byte per token: decoding a cut multi-byte character gives U+FFFD
    stream = TextStream(lambda ids: bytes(ids).decode("utf-8", errors="replace"))
    out = [stream.push(b) for b in data]
    assert "".join(out) == "né😀x"
    assert all("\ufffd" not in piece for piece in out)
    assert out[-1] == "x"


def test_text_stream_gives_a_cut_character_at_the_end_as_a_replacement_character():
    stream = TextStream(lambda ids: bytes(ids).decode("utf-8", errors="replace"))
    data = "ab😀".encode()[:-1]  # the generation ended inside the emoji
    assert "".join(stream.push(b) for b in data) == "ab"
    assert stream.finish() == "\ufffd" and stream.text == "ab\ufffd"


def test_text_stream_stops_before_a_stop_string_split_over_tokens():
    stream = TextStream(lambda ids: "".join(chr(i) for i in ids), stop=["END", "zz"])
    out = [stream.push(ord(c)) for c in "abcENabENDxyz"]
    assert "".join(out) == "abcENab" and stream.stopped
    assert stream.push(ord("q")) == "" and stream.finish() == ""
    stream = TextStream(lambda ids: "".join(chr(i) for i in ids), stop=["END"])
    out = [stream.push(ord(c)) for c in "abEN"]
    assert "".join(out) == "ab"  # "EN" may become "END"
    assert stream.finish() == "EN" and stream.text == "abEN"


# ---------------------------------------------------------------------- sampling
@pytest.mark.parametrize("kw, error", [
    (dict(max_tokens=0), InvalidValueError), (dict(max_tokens=True), InvalidTypeError),
    (dict(max_tokens=2, temperature=-1), InvalidValueError), (dict(max_tokens=2, temperature="1"), InvalidTypeError),
    (dict(max_tokens=2, top_p=0), InvalidValueError), (dict(max_tokens=2, top_p=1.5), InvalidValueError),
    (dict(max_tokens=2, stop=[""]), InvalidValueError), (dict(max_tokens=2, stop=["a"] * 5), InvalidValueError),
    (dict(max_tokens=2, stop=3), InvalidTypeError), (dict(max_tokens=2, seed=True), InvalidTypeError),
    (dict(max_tokens=2, seed="7"), InvalidTypeError), (dict(max_tokens=2, seed=1 << 64), InvalidValueError),
    (dict(max_tokens=2, seed=-(1 << 63) - 1), InvalidValueError),
])
def test_sampling_params_refuse_bad_values(kw, error):
    with pytest.raises(error):
        SamplingParams(**kw)


def test_sample_rows_greedy_nucleus_and_temperature():
    logits = mx.array([[0.0, 3.0, 1.0, 2.9], [5.0, 0.0, 0.0, 0.0]])
    greedy = SamplingParams(max_tokens=1)
    assert sample_rows(logits, [greedy, greedy]).tolist() == [1, 0]
    tight = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.01)  # only the top token is left
    mx.random.seed(0)
    assert all(sample_rows(logits, [tight, tight]).tolist() == [1, 0] for _ in range(20))
    hot = SamplingParams(max_tokens=1, temperature=1.0)
    draws = [sample_rows(logits, [hot, greedy]).tolist() for _ in range(400)]
    firsts = [d[0] for d in draws]
    assert all(d[1] == 0 for d in draws)
    assert 0.3 < firsts.count(3) / firsts.count(1) < 1.5  # e^-0.1 ≈ 0.9
    half = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.6)  # tokens 1 and 3 only
    assert set(sample_rows(logits, [half, half]).tolist()[0] for _ in range(100)) <= {1, 3}


@pytest.mark.parametrize("temperature, top_p", [(0.5, 1.0), (1.0, 1.0), (2.0, 1.0), (0.7, 0.8)])
def test_sampled_and_seeded_rows_draw_from_the_tempered_nucleus_distribution(temperature, top_p):
    logits = np.array([0.0, 1.0, 2.0, 2.5, -1.0])
    p = np.exp(logits / temperature)
    p /= p.sum()
    order = np.argsort(-p)
    keep = np.cumsum(p[order]) - p[order] < top_p  # the nucleus: tokens whose mass above is below top_p
    p[order[~keep]] = 0
    p /= p.sum()
    n = 6000
    rows = mx.array(np.broadcast_to(logits, (n, logits.size)).astype(np.float32))
    mx.random.seed(3)
    unseeded = [SamplingParams(max_tokens=1, temperature=temperature, top_p=top_p)] * n
    seeded = [SamplingParams(max_tokens=1, temperature=temperature, top_p=top_p, seed=s) for s in range(n)]
    for params in (unseeded, seeded):
        drawn = np.array(sample_rows(rows, params, [5] * n))
        freq = np.bincount(drawn, minlength=logits.size) / n
        assert np.all(np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / n) + 1e-9), (freq, p)


def test_a_seeded_row_draws_by_its_seed_and_position_alone_whatever_else_is_sampled():
    logits = mx.array([[0.0, 1.0, 0.5, 1.2, -1.0], [2.0, 0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    seeded = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.8, seed=12345)
    other = SamplingParams(max_tokens=1, temperature=0.7, seed=None)
    greedy = SamplingParams(max_tokens=1)
    for position in (0, 1, 37, 10_000):
        alone = sample_rows(logits[:1], [seeded], [position]).item()
        mx.random.seed(position)  # the global generator's state does not matter to it
        in_batch = sample_rows(logits[[2, 0, 1]], [other, seeded, greedy], [5, position, 9]).tolist()
        assert in_batch[1] == alone and in_batch[2] == 0
    with pytest.raises(InvalidValueError):  # its key needs a position
        sample_rows(logits[:1], [seeded])
    # over positions, one seed's draws follow the nucleus distribution, and other seeds differ
    probs = mx.softmax(logits[0], axis=-1).tolist()  # top_p 0.8 leaves tokens 3, 1 and 2
    draws = [sample_rows(logits[:1], [seeded], [p]).item() for p in range(3000)]
    kept = sum(probs[t] for t in (1, 2, 3))
    assert set(draws) == {1, 2, 3}
    for t in (1, 2, 3):
        assert abs(draws.count(t) / 3000 - probs[t] / kept) < 0.04, t
    runs = {tuple(sample_rows(logits[:1], [attrs.evolve(seeded, seed=s)], [p]).item() for p in range(20))
            for s in range(6)}
    assert len(runs) == 6


@pytest.mark.parametrize("keys", ["one seed, 64 positions", "64 seeds, one position"])
def test_keyed_gumbel_noise_is_standard_gumbel_and_uncorrelated_between_keys_and_tokens(keys):
    keys = [row_key(7, p) for p in range(64)] if keys.startswith("one") else [row_key(s, 5) for s in range(64)]
    g = np.array(keyed_gumbel(keys, 4096))
    assert abs(g.mean() - 0.5772) < 0.015 and abs(g.std() - np.pi / 6 ** 0.5) < 0.015  # (262,144 draws)
    assert abs(np.corrcoef(g[:-1].ravel(), g[1:].ravel())[0, 1]) < 0.01  # neighbouring keys
    assert abs(np.corrcoef(g[:, :-1].ravel(), g[:, 1:].ravel())[0, 1]) < 0.01  # neighbouring tokens
    assert np.array_equal(g[3], np.array(keyed_gumbel([keys[3]], 4096))[0])  # a row is its key's alone


@pytest.mark.parametrize("compiled_decode, overlap_decode", [(False, True), (False, False), (True, True)])
def test_a_seeded_request_gives_the_same_tokens_alone_and_in_a_crowded_batch_with_preemptions(
        model, compiled_decode, overlap_decode):
    rng = random.Random(11)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(3, 20))] for _ in range(8)]
    seeds = [None if i % 3 == 2 else 1000 + i for i in range(8)]
    params = [SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95 if i % 2 else 1.0, seed=s)
              for i, s in enumerate(seeds)]

    def serve(which: list[int], num_pages: int, mode: tuple[bool, bool]) -> tuple[Sink, list[GenerationRequest]]:
        engine = make_engine(model, num_pages=num_pages, max_batch=8, compiled_decode=mode[0], overlap_decode=mode[1])
        sink = Sink()
        work = [GenerationRequest(f"r{i}", prompts[i], params[i], sink) for i in which]
        for w in work:
            engine.add(w)
        run(engine)
        assert engine.pool.allocator.stats().in_use == 0
        return sink, work

    alone = {i: serve([i], 40, (False, False))[0].ids(f"r{i}") for i in range(8) if seeds[i] is not None}
    crowded, work = serve(list(range(8)), 24, (compiled_decode, overlap_decode))
    assert sum(w.preemptions for w in work) > 0  # 24 pages of 4 tokens are too few at once
    for i, ids in alone.items():
        assert crowded.ids(f"r{i}") == ids, i
    assert len({tuple(ids) for ids in alone.values()}) == len(alone)  # the seeds draw differently


def test_the_pool_gauges_read_the_empty_pool_before_the_first_request(model):
    engine = make_engine(model, num_pages=40)
    assert metric(engine, "kv_pages_free") == 39  # (less the null page)
    assert metric(engine, "kv_pages_in_use") == 0
    assert metric(engine, "kv_cache_usage_perc") == 0


def engine_holding_lookahead_pages(model) -> tuple[Engine, Sink]:
    """A compiled engine of 24 pages running two rows, its step holding 2 lookahead
    pages, 18 pages free."""
    engine = make_engine(model, num_pages=24, compiled_decode=True, prefix_caching=False)
    sink = Sink()
    engine.add(GenerationRequest("a", [1, 2, 3], SamplingParams(max_tokens=30), sink))
    engine.add(GenerationRequest("b", [4, 5, 6, 7, 8, 9], SamplingParams(max_tokens=30), sink))
    engine.step()
    assert engine._compiled.lookahead_pages == 2 and engine.pool.allocator.num_available() == 18
    return engine, sink


def test_a_request_that_fits_only_with_the_compiled_steps_lookahead_pages_is_admitted(model):
    engine, sink = engine_holding_lookahead_pages(model)
    # 60 prompt tokens and 16 of decode: 19 pages, against 18 available less a 1-page watermark
    prompt = [(7 * i) % 100 + 1 for i in range(60)]
    engine.add(GenerationRequest("c", prompt, SamplingParams(max_tokens=16), sink))
    engine.step()
    assert not engine.waiting  # the pages held ahead of need made way for it
    run(engine)
    assert sink.ids("c") == solo(model, prompt, 16)
    assert sink.ids("a") == solo(model, [1, 2, 3], 30)
    assert engine.pool.allocator.stats().in_use == 0


def test_a_prompt_whose_prefill_needs_the_lookahead_pages_gets_them_before_it_starts(model):
    engine, sink = engine_holding_lookahead_pages(model)
    # its prompt alone takes 19 pages: one more than is free while the lookahead is held
    prompt = [(7 * i) % 100 + 1 for i in range(75)]
    engine.add(GenerationRequest("c", prompt, SamplingParams(max_tokens=1), sink))
    engine.step()
    assert sink.ids("c") == solo(model, prompt, 1)  # prefilled in this step, not run out and put back
    run(engine)
    assert sink.ids("a") == solo(model, [1, 2, 3], 30) and sink.ids("b") == solo(model, [4, 5, 6, 7, 8, 9], 30)
    assert engine.pool.allocator.stats().in_use == 0 and metric(engine, "num_preemptions") == 0


def test_compiled_decode_is_the_default_with_cuda_refused_where_it_cannot_serve_and_rebuilt_by_fail_all(model):

    from pagedkv.kernels import paged_decode

    with pytest.raises(InvalidTypeError):
        make_engine(model, compiled_decode="yes")
    assert make_engine(model).compiled_decode == paged_decode.available()  # the default: on with CUDA
    assert make_engine(model, compiled_decode=False).compiled_decode is False
    engine = make_engine(model, compiled_decode=True)
    sink = Sink()
    engine.add(GenerationRequest("a", [1, 2, 3], SamplingParams(max_tokens=6), sink))
    engine.step()
    engine.step()
    engine.fail_all("device lost")  # a new batch, and a compiled step for it
    assert engine._compiled.batch is engine.batch and engine.pool.allocator.stats().in_use == 0
    engine.add(GenerationRequest("b", [1, 2, 3], SamplingParams(max_tokens=6), sink))
    engine.add(GenerationRequest("c", [4, 5, 6, 7, 8], SamplingParams(max_tokens=5), sink))
    run(engine)
    assert sink.ids("b") == solo(model, [1, 2, 3], 6) and sink.ids("c") == solo(model, [4, 5, 6, 7, 8], 5)
    assert engine.pool.allocator.stats().in_use == 0


def test_the_engine_refuses_prefix_caching_for_a_model_whose_layers_all_slide_up_front():
    """Prefix caching of a sliding-window model files each window's pages under the
    nodes of the full-attention pages beside them: a model with no full-attention layer
    has none, and the engine says so when it is made, not at a request."""
    from pagedkv import NotSupportedError

    L, H, D = kv_dims("gemma3_text")
    pool = PagePool(num_layers=L, num_kv_heads=H, head_dim=D, page_size=4, num_pages=64, dtype=mx.float32)
    all_sliding = model_of_config(dict(CONFIGS["gemma3_text"], sliding_window_pattern=L + 1))
    with pytest.raises(NotSupportedError, match="prefix_caching=False"):
        Engine(all_sliding, pool, decode=letters)
    assert pool.allocator.num_in_use() == 0 and not pool.allocator.evict_listeners  # (no prefix cache left on it)
    Engine(all_sliding, pool, decode=letters, prefix_caching=False).close()


@pytest.mark.parametrize("kind, compiled, num_pages", [
    pytest.param("gemma3_text", False, 160, marks=pytest.mark.slow), ("gemma3_text", True, 160),
    pytest.param("gemma3n", False, 160, marks=pytest.mark.slow), ("gemma3_text", False, 24),
    pytest.param("gemma3_text", True, 64, marks=pytest.mark.slow)])
def test_a_sliding_window_model_with_prefix_caching_hits_shared_prompts_and_decodes_as_mlx_lm(kind, compiled,
                                                                                               num_pages):
    """gemma3_text and gemma3n (window 12, pages of 4) with prefix caching: requests
    share three system prompts longer than the window, so a hit needs the pages of the
    full layers from the start and those of the sliding layers at its end. Every
    request's greedy tokens are mlx-lm's own (one request alone, its rotating caches),
    hits happen, the sliding tables of a hit list their early pages as dropped, and
    every page comes back (some stay cached). With 160 pages nothing is evicted; with 64,
    cached pages of both kinds are evicted as requests need room (hits get fewer); with
    24, requests also go back to the queue (preempted, or a prefill stopped for room:
    their pages registered, then resumed from hits)."""
    model = make_model(kind)
    L, H, D = kv_dims(kind)
    pool = PagePool(num_layers=L, num_kv_heads=H, head_dim=D, page_size=4, num_pages=num_pages, dtype=mx.float32)
    engine = Engine(model, pool, decode=letters, max_batch=4, compiled_decode=compiled, prefill_chunk=8)
    assert engine.prefix is not None and engine.prefix.windows == (12,)
    sink, rng = Sink(), random.Random(1)
    systems = [[rng.randrange(VOCAB) for _ in range(rng.randrange(20, 27))] for _ in range(3)]
    reqs = []
    for i in range(12):
        prompt = systems[i % 3] + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 8))]
        reqs.append((f"r{i}", prompt, rng.randrange(1, 10)))
    work = []
    for rid, prompt, n in reqs:  # a few at a time, so later ones find the earlier ones' pages
        work.append(GenerationRequest(rid, prompt, SamplingParams(max_tokens=n), sink))
        engine.add(work[-1])
        engine.step()
    while engine.has_work:
        engine.step()
    for rid, prompt, n in reqs:
        assert sink.ids(rid) == solo(model, prompt, n), rid
    st = engine.prefix.stats()
    if num_pages == 160:  # each system prompt: 5 or more full pages, hit by 3 of its 4 requests
        assert st.hit_pages >= 9 * 4 and st.evictions == 0
        cache, _ = engine.prefix.new_cache(model, systems[0] + [1])  # a hit, as the engine's are
        with cache:
            full, sliding = sorted(cache.tables, key=lambda t: t.window is not None)
            assert full.num_pages == len(systems[0]) // 4 and sliding.first_visible() > 0
    else:
        assert st.hit_pages > 0 and st.evictions > 0
        if num_pages == 24:  # requests went back to the queue
            assert sum(w.preemptions for w in work) + st.queries - len(reqs) > 0
    assert pool.allocator.stats().in_use == 0 and pool.allocator.num_cached() > 0
    pool.allocator.check()
    engine.close()


@pytest.mark.parametrize("kind, overlap_decode, compiled", [
    pytest.param("gemma3_text", True, False, marks=pytest.mark.slow),
    pytest.param("gemma3_text", False, False, marks=pytest.mark.slow), ("gemma3_text", True, True),
    pytest.param("gemma3n", False, False, marks=pytest.mark.slow), ("gemma3n", True, True)])
def test_a_sliding_window_model_without_prefix_caching_decodes_as_mlx_lm_with_window_pages_only(kind, overlap_decode,
                                                                                                compiled):
    """gemma3_text and gemma3n (window 12; gemma3n's last layers share earlier layers'
    K/V) through the engine, eager or with ``CompiledDecode``: each request's greedy
    tokens are mlx-lm's own (its rotating caches, one request alone), through
    preemptions; a sliding layer's table never holds more than its window's pages;
    every page comes back."""
    model = make_model(kind)
    L, H, D = kv_dims(kind)
    ps, window = 4, 12
    pool = PagePool(num_layers=L, num_kv_heads=H, head_dim=D, page_size=ps, num_pages=40, dtype=mx.float32)
    engine = Engine(model, pool, decode=letters, max_batch=8, prefix_caching=False, overlap_decode=overlap_decode,
                    compiled_decode=compiled)
    assert engine.compiled_decode is compiled
    sink, rng = Sink(), random.Random(0)
    reqs, work = [], []
    for i in range(12):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(3, 30))]
        reqs.append((f"r{i}", prompt, rng.randrange(1, 30)))
        work.append(GenerationRequest(f"r{i}", prompt, SamplingParams(max_tokens=reqs[-1][2]), sink))
        engine.add(work[-1])
    most = 0
    while engine.has_work:
        engine.step()
        for spec, _ in engine.batch.rows.layout.layers:
            for table in engine.batch.rows.tables(spec):
                if table.window is not None:
                    most = max(most, table.num_pages)
    assert sum(w.preemptions for w in work) > 0  # 40 pages of 4 tokens are too few at once
    assert 0 < most <= -(-window // ps) + 1  # the window's pages (and the one being written)
    for rid, prompt, n in reqs:
        assert sink.ids(rid) == solo(model, prompt, n), rid
    assert pool.allocator.stats().in_use == 0


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kind, pool_layers, prefix_caching, compiled", [
    ("gemma3_text", None, True, False), ("gemma3_text", None, False, False), ("gemma3_text", None, True, True),
    ("gemma3_text", 1, False, False), ("llama", 1, False, False)])
def test_random_requests_up_to_the_limit_in_a_tight_pool_all_finish_as_they_do_alone(kind, pool_layers,
                                                                                   prefix_caching, compiled, seed):
    """Random requests, each up to the engine's limit (some at it), in pools of 16-40
    pages: a sliding-window model, and models on pools with fewer layers than they have
    (layer groups); eager and compiled decode steps. Every request ends with the tokens
    it gives alone within a bounded number of steps (no request admitted that cannot
    finish, no stall), aborts included, and every page comes back."""
    rng = random.Random(seed)
    model = make_model(kind)
    L, H, D = kv_dims(kind)
    pool = PagePool(num_layers=pool_layers or L, num_kv_heads=H, head_dim=D, page_size=4,
                    num_pages=rng.randrange(16, 41), dtype=mx.float32)
    engine = Engine(model, pool, decode=letters, max_batch=rng.choice([2, 4]), prefill_chunk=rng.choice([4, 8]),
                    prefill_budget=rng.choice([8, 16]), prefix_caching=prefix_caching, compiled_decode=compiled)
    limit, sink, reqs = engine.limits.max_pool_tokens, Sink(), {}
    assert limit >= 8
    shared = prompt_of(limit)
    for i in range(8):
        total = limit if i % 3 == 0 else rng.randrange(4, limit + 1)
        n = rng.randrange(1, total - 1)
        prompt = shared[: total - n] if rng.random() < 0.5 else [rng.randrange(1, VOCAB) for _ in range(total - n)]
        reqs[f"r{i}"] = (prompt, n)
    pending, steps, aborted = list(reqs), 0, None
    while pending or engine.has_work:
        if pending and rng.random() < 0.5:
            rid = pending.pop(0)
            engine.add(GenerationRequest(rid, reqs[rid][0], SamplingParams(max_tokens=reqs[rid][1]), sink))
        if aborted is None and steps == 5:  # (a request that has not finished yet, if any)
            aborted = next((rid for rid in sink.deltas if engine.abort(rid)), None)
        engine.step()
        steps += 1
        assert steps < 1500, "the engine stalled"
    for rid, (prompt, n) in reqs.items():
        if rid == aborted:
            assert sink.last(rid).finish_reason == "abort"
            continue
        assert sink.last(rid).finish_reason == "length"
        assert sink.ids(rid) == solo(model, prompt, n), rid
    engine.close()
    pool.allocator.check()
    assert pool.allocator.num_in_use() == 0
