"""``generate``'s pipelined loop on a pagedkv cache of one sequence: step n + 1 is queued
on the device, fed token n still lazy, before token n is read (as mlx-lm's
``generate_step``), eager and compiled alike. Wherever the loop ends (its last token,
an EOS id, the caller closing it, a pool that runs out) it must have yielded the serial
loop's tokens and leave the cache where the serial loop leaves it: the same tokens
written, the same pages in use, the same next logits. A step queued past the end is
trimmed off; a step that would drop a page behind a sliding window runs serially, as a
trim would not bring the page back. The serial loop (nothing queued) is the reference,
with mlx-lm's own cache for the tokens."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from tiny_models import LOGITS_ATOL, greedy, make_model, make_pool, prompt_of

from pagedkv import PoolExhausted, generation, make_paged_cache

MODES = ["serial", "eager", "compiled"]  # (serial: eager with nothing queued, the reference)


@pytest.fixture
def counted(monkeypatch):
    """Counts of the steps the loop queued (``mx.async_eval`` calls) and of the steps it
    asked about dropping pages (True where one would), cleared by each ``run``."""
    queued, drops = [], []
    real_async_eval, real_drops = mx.async_eval, generation._next_step_drops_pages
    monkeypatch.setattr(mx, "async_eval", lambda *a: (queued.append(1), real_async_eval(*a))[1])
    monkeypatch.setattr(generation, "_next_step_drops_pages",
                        lambda c: (drops.append(real_drops(c)), drops[-1])[1])
    return queued, drops


def run(model, pool, prompt, mode, monkeypatch, counted=None, rewind=0, close_after=None, **kw):
    """``generate`` in ``mode`` on a fresh cache of ``pool``: (tokens, the error it raised
    or None, tokens the cache holds, pages in use, the next eager step's logits); the
    cache is released after. ``close_after``: the caller closes the loop after that many
    tokens."""
    for c in counted or ():
        c.clear()
    cache = make_paged_cache(model, pool, rewind=rewind)
    got, error = [], None
    with monkeypatch.context() as m:
        if mode == "serial":
            m.setattr(generation, "_can_trim_a_queued_step", lambda cache: False)
        loop = generation.generate(model, cache, prompt, compiled=mode == "compiled", **kw)
        try:
            for tok in loop:
                got.append(tok)
                if len(got) == close_after:
                    loop.close()
                    break
        except PoolExhausted as e:
            error = type(e)
    held, in_use = cache.num_tokens, pool.allocator.num_in_use()
    logits = model(mx.array([[got[-1]]]), cache=cache) if error is None else None
    cache.release()
    return got, error, held, in_use, logits


def assert_same_end(ref, got):
    assert got[:4] == ref[:4]
    if ref[4] is not None:
        assert mx.allclose(ref[4], got[4], atol=LOGITS_ATOL).item()


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("kind, pages", [("llama", "fp"), ("llama", "affine8"), ("gemma3_text", "fp")])
def test_a_pipelined_loop_gives_mlx_lms_tokens_and_ends_where_the_serial_loop_does(kind, pages, mode, counted,
                                                                                  monkeypatch):
    """To its last token and stopped by an EOS id (the step queued past it is trimmed
    off): mlx-lm's greedy tokens (a sliding-window model's too, across its window;
    quantised pages: the serial loop's), and the serial loop's cache. Every step is
    queued but the last and, for gemma3 (window of 3 pages of 4), the ones that drop a
    page behind the window. Quantised pages are read by gathers, not views of the pool."""
    queued, drops = counted
    model = make_model(kind)
    prompt = prompt_of(21)
    want = greedy(model, prompt, make_prompt_cache(model), 24)[0]
    pool = make_pool(kind, page_size=4, pages=pages)
    if pages != "fp":
        want = run(model, pool, prompt, "serial", monkeypatch, max_tokens=24)[0]
    stop = next(t for t in want[8:] if want.index(t) >= 8)  # (an id first seen past the 8th token)
    for kw, tokens in ((dict(max_tokens=24), want), (dict(max_tokens=24, eos_ids=[stop]), want[: want.index(stop) + 1])):
        serial = run(model, pool, prompt, "serial", monkeypatch, counted, **kw)
        assert not queued
        piped = run(model, pool, prompt, mode, monkeypatch, counted, **kw)
        assert len(drops) == len(tokens) - ("eos_ids" not in kw)
        assert len(queued) == len(drops) - sum(drops)
        assert (sum(drops) > 0) == (kind == "gemma3_text")
        assert piped[0] == serial[0] == tokens and piped[1:4] == serial[1:4] == (None, len(prompt) + len(tokens) - 1, serial[3])
        assert mx.allclose(serial[4], piped[4], atol=LOGITS_ATOL).item()


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("page_size,rewind", [(4, 0), (3, 2)])
def test_a_sliding_window_generation_closed_at_any_step_ends_where_the_serial_one_does(page_size, rewind, mode,
                                                                                      counted, monkeypatch):
    """gemma3 (window 12; pages of 4, or of 3 with ``rewind`` 2 tokens kept behind the
    window): the pipelined loop closed after k tokens, for k across more than a page's
    worth of steps, leaves the cache as the serial loop closed at the same token: the
    same length, pages in use and next logits. (A step queued past the close that
    dropped a page behind the window would leave the cache a page short, as trimming it
    does not bring the page back: with pages of 4, at k = 11 it did. So such steps run
    serially, and the others are queued.)"""
    queued, _ = counted
    model = make_model("gemma3_text")
    pool = make_pool("gemma3_text", page_size=page_size)
    prompt = prompt_of(21)
    total = 0
    for k in range(10, 15):
        serial = run(model, pool, prompt, "serial", monkeypatch, rewind=rewind, close_after=k, max_tokens=40)
        piped = run(model, pool, prompt, mode, monkeypatch, counted, rewind=rewind, close_after=k, max_tokens=40)
        assert serial[2] == len(prompt) + k - 1
        assert_same_end(serial, piped)
        total += len(queued)
    assert total > 5 * 6  # (most of the 5 runs' 10-14 steps were queued)


def test_seeded_sampling_draws_the_same_tokens_through_the_pipelined_loop(monkeypatch):
    """The pipelined loop samples each token from the same logits with the same draw of
    MLX's generator as the serial loop, so a seed gives the same tokens."""
    model = make_model("llama")
    pool = make_pool("llama", page_size=4)
    outs = []
    for mode in MODES:
        mx.random.seed(5)
        outs.append(run(model, pool, prompt_of(12), mode, monkeypatch, max_tokens=30, temperature=1.0)[0])
    assert outs[0] == outs[1] == outs[2] and len(set(outs[0])) > 5


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("kind, pages", [("llama", 8), ("gemma3_text", 12)])
def test_a_pool_that_runs_out_mid_generation_stops_the_pipelined_loop_where_it_stops_the_serial_one(kind, pages, mode,
                                                                                                   monkeypatch):
    """A pool too small for the whole generation: the pipelined loop yields the tokens
    the serial loop yields, then raises ``PoolExhausted`` after the same token (the
    queued step's error waits for it), with the cache holding the same tokens and pages.
    (gemma3: its sliding and full-attention tables both take pages from the pool.)"""
    model = make_model(kind)
    prompt = prompt_of(10)
    pool = make_pool(kind, page_size=4, num_pages=pages)  # (llama: 7 usable pages, 28 tokens)
    serial = run(model, pool, prompt, "serial", monkeypatch, max_tokens=40)
    piped = run(model, pool, prompt, mode, monkeypatch, max_tokens=40)
    assert serial[1] is PoolExhausted and len(serial[0]) > 1
    assert piped[:4] == serial[:4]


def test_caches_whose_queued_step_cannot_be_taken_back_run_serially(counted, monkeypatch):
    """mlx-lm's own cache and a hybrid model's (recurrent state cannot go back a token)
    queue nothing, and give their tokens."""
    from pagedkv import pools_for_model

    queued, _ = counted
    for kind, paged in (("llama", False), ("qwen3_next", True)):
        model = make_model(kind)
        prompt = prompt_of(9)
        want = greedy(model, prompt, make_prompt_cache(model), 12)[0]
        if paged:
            pool, states = pools_for_model(model, max_bytes=4 << 20, page_size=4, state_slots=16)
            cache = make_paged_cache(model, pool, state_pool=states)
        else:
            cache = make_prompt_cache(model)
        queued.clear()
        assert list(generation.generate(model, cache, prompt, max_tokens=12)) == want, kind
        assert not queued, kind
