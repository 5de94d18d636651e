"""CompiledDecode: a PagedBatch's decode step under mx.compile gives the eager step's
logits and leaves the rows exactly where the eager step does (CPU here; the GPU run
takes the decode kernel inside the trace)."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from tiny_models import (
    CONFIGS,
    LOGITS_ATOL,
    PAGE_KINDS,
    kv_dims,
    make_model,
    make_pool,
    model_of_config,
    prompt_of,
)

from pagedkv import (
    CompiledDecode,
    InvalidTypeError,
    KvShapeError,
    NotSupportedError,
    PagedBatch,
    PagePool,
    PoolExhausted,
    ReleasedError,
    kv_pool_layers,
    make_paged_cache,
)


def batch_of(model, pool, lengths):
    batch = PagedBatch.for_model(model, pool)
    for seed, n in enumerate(lengths):
        c = make_paged_cache(model, pool)
        model(mx.array(prompt_of(n, seed=seed + 1))[None], cache=c)
        batch.extend(c)
    return batch


def snapshot(batch):
    rows = batch.rows
    return (rows.offsets.copy(), rows.step_starts.copy(), [t.page_ids(0, t.num_pages).tolist() for t in rows.tables(0)],
            batch.pool.allocator.num_available())


def step_both(model, eager, step, tok):
    """One eager step of ``eager`` and one compiled ``step``, fed the same tokens: the
    same logits (float rounding) and greedy tokens; returns those tokens."""
    le = model(tok, cache=eager.caches)
    lc = step(tok)
    assert mx.allclose(le, lc, atol=LOGITS_ATOL).item()
    tok = mx.argmax(le[:, -1], axis=-1)[:, None]
    assert tok.tolist() == mx.argmax(lc[:, -1], axis=-1)[:, None].tolist()
    return tok


@pytest.mark.parametrize("lookahead", [True, False])
@pytest.mark.parametrize("pages", PAGE_KINDS)
def test_compiled_steps_match_the_eager_batch_and_leave_the_same_rows(pages, lookahead):
    model = make_model("llama")
    lengths = [5, 13, 30]
    eager_pool = make_pool("llama", page_size=4, num_pages=96, pages=pages)
    comp_pool = make_pool("llama", page_size=4, num_pages=96, pages=pages)
    eager, compiled = batch_of(model, eager_pool, lengths), batch_of(model, comp_pool, lengths)
    step = CompiledDecode(model, compiled, bucket=2, lookahead=lookahead)  # small buckets: retraces
    tok = mx.array([[1], [2], [3]])
    for _ in range(12):  # crosses page boundaries of every row
        tok = step_both(model, eager, step, tok)
        e, c = snapshot(eager), snapshot(compiled)
        held = step.lookahead_pages  # at most one per row (a row that took its page has none until the next copy)
        assert held <= (len(lengths) if lookahead else 0)
        assert (e[0] == c[0]).all() and (e[1] == c[1]).all() and len(e[2]) == len(c[2]) and e[3] == c[3] + held
        assert [len(p) for p in e[2]] == [len(p) for p in c[2]]
    assert 2 <= step.traces < 12
    # with lookahead, the state goes to the device once a row has spent its lookahead
    # page (every 4 steps here); without, whenever a row grows a page (its table changed)
    assert step.uploads <= (5 if lookahead else 12)
    assert step.release_lookahead() == held and step.lookahead_pages == 0
    # the compiled batch carries on eagerly, against mlx-lm's own cache per row
    last = model(tok, cache=compiled.caches)
    for row, n in enumerate(lengths):
        ref = make_prompt_cache(model)
        model(mx.array(prompt_of(n, seed=row + 1))[None], cache=ref)
        tok = mx.array([[row + 1]])
        for _ in range(12):
            tok = mx.argmax(model(tok, cache=ref)[:, -1], axis=-1)[:, None]
        if pages == "fp":
            assert mx.allclose(model(tok, cache=ref)[0], last[row], atol=LOGITS_ATOL).item()
    eager.release()
    compiled.release()
    assert comp_pool.allocator.num_available() == eager_pool.allocator.num_available()


@pytest.mark.parametrize("kind, lookahead", [("gemma3_text", True), ("gemma3_text", False), ("gemma3n", True),
                                           ("gemma3_text groups", True)])
def test_compiled_steps_of_a_sliding_window_model_match_the_eager_batch_and_its_dropped_pages(kind, lookahead):
    """gemma3_text and gemma3n (window 12 on most layers, pages of 4; gemma3n's last two
    layers read the K/V of earlier layers' caches): rows longer than the window and rows
    that grow past it. Each step gives the eager step's logits and tokens and leaves
    every table kind's pages, dropped ones included, as the eager step does; a drop
    alone copies no table, so with lookahead the state goes to the device about once
    per page of steps; every page comes back. "groups": 4 sliding layers and 2 full on
    a two-layer pool (``kv_pool_layers``), so two sliding tables per row."""
    if kind.endswith("groups"):
        model = model_of_config(dict(CONFIGS["gemma3_text"], num_hidden_layers=6, sliding_window_pattern=3))
        _, heads, head_dim = kv_dims("gemma3_text")
        eager_pool, comp_pool = (PagePool(num_layers=kv_pool_layers(model), num_kv_heads=heads, head_dim=head_dim,
                                          page_size=4, num_pages=96, dtype=mx.float32) for _ in range(2))
    else:
        model = make_model(kind)
        eager_pool = make_pool(kind, page_size=4, num_pages=96)
        comp_pool = make_pool(kind, page_size=4, num_pages=96)
    lengths = [5, 13, 30]
    eager, compiled = batch_of(model, eager_pool, lengths), batch_of(model, comp_pool, lengths)
    layout = compiled.rows.layout
    assert layout.has_windows and (len(layout.specs) == 3) == kind.endswith("groups")
    step = CompiledDecode(model, compiled, bucket=2, lookahead=lookahead)

    def tables(batch):
        return [[(t.first_visible(), t.page_ids(0, t.num_pages).tolist()) for t in batch.rows.tables(s)]
                for s in range(len(layout.specs))]

    def windowed(batch):
        return [t for s, spec in enumerate(layout.specs) if spec.window is not None for t in batch.rows.tables(s)]

    tok = mx.array([[1], [2], [3]])
    steps = 24
    for _ in range(steps):  # every row drops pages; each crosses six page boundaries
        tok = step_both(model, eager, step, tok)
        assert (eager.rows.offsets == compiled.rows.offsets).all()
        # the same first visible page and the same number of listed pages (ids differ:
        # lookahead pages are taken from the pool ahead of time)
        assert [[(f, len(p)) for f, p in spec] for spec in tables(eager)] == \
            [[(f, len(p)) for f, p in spec] for spec in tables(compiled)]
        assert max(t.num_pages - t.first_visible() // 4 for t in windowed(compiled)) <= 4  # ceil(12 / 4) + 1
        assert eager_pool.allocator.num_available() == comp_pool.allocator.num_available() + step.lookahead_pages
    assert all(t.first_visible() > 0 for t in windowed(compiled))
    assert step.uploads <= (steps // 4 + 2 if lookahead else steps)
    eager.release()
    compiled.release()
    del step  # its lookahead pages go back
    assert comp_pool.allocator.num_in_use() == eager_pool.allocator.num_in_use() == 0


def test_a_step_that_cannot_get_pages_changes_nothing():
    model = make_model("llama")
    pool = make_pool("llama", page_size=4, num_pages=12)
    batch = batch_of(model, pool, [8, 12])  # 5 pages used, every row ends on a page boundary
    while pool.allocator.num_available() > 1:
        pool.allocator.allocate(1)   # someone else holds the rest: one page for two rows
    step = CompiledDecode(model, batch)
    before = snapshot(batch)
    with pytest.raises(PoolExhausted):
        step(mx.array([1, 2]))
    after = snapshot(batch)
    assert (before[0] == after[0]).all() and before[2:] == after[2:]


@pytest.mark.parametrize("tokens, error", [
    ([1, 2], InvalidTypeError),                                # not an array
    (mx.array([1.0, 2.0]), InvalidTypeError),                  # not integers
    (mx.array([1, 2, 3]), KvShapeError),                       # three tokens for two rows
    (mx.array([[1, 2], [3, 4]]), KvShapeError),                # two tokens per row
])
def test_bad_tokens_are_refused_and_change_nothing(tokens, error):
    model = make_model("llama")
    batch = batch_of(model, make_pool("llama", page_size=4, num_pages=32), [3, 9])
    step = CompiledDecode(model, batch)
    before = snapshot(batch)
    with pytest.raises(error):
        step(tokens)
    after = snapshot(batch)
    assert (before[0] == after[0]).all() and before[2:] == after[2:]
    assert step.traces == 0


def test_layers_at_different_positions_are_not_compiled():
    model = make_model("llama")
    batch = batch_of(model, make_pool("llama", page_size=4, num_pages=32), [6, 9])
    batch.caches[0].trim(1)   # one layer alone
    with pytest.raises((KvShapeError, NotSupportedError)):
        CompiledDecode(model, batch)(mx.array([1, 2]))
    with pytest.raises(InvalidTypeError):
        CompiledDecode(model, object())


def test_an_error_inside_the_step_undoes_its_reservation(monkeypatch):
    import pagedkv.compiled_decode as compiled_decode

    model = make_model("llama")
    pool = make_pool("llama", page_size=4, num_pages=32)
    batch = batch_of(model, pool, [8, 5])  # row 0 needs a new page for its next token
    step = CompiledDecode(model, batch)
    before = snapshot(batch)

    def broken(*args, **kwargs):
        raise RuntimeError("attention failed")

    monkeypatch.setattr(compiled_decode, "attend_parts", broken)
    with pytest.raises(RuntimeError):
        step(mx.array([1, 2]))
    after = snapshot(batch)
    assert (before[0] == after[0]).all() and (before[1] == after[1]).all() and before[2:] == after[2:]
    monkeypatch.undo()
    # the pool's arrays are its own again (not the trace's placeholders): the rows work
    logits = model(mx.array([[1], [2]]), cache=batch.caches)
    ref = make_prompt_cache(model)
    model(mx.array(prompt_of(8, seed=1))[None], cache=ref)
    assert mx.allclose(logits[0], model(mx.array([[1]]), cache=ref)[0], atol=LOGITS_ATOL).item()
    out = step(mx.array([3, 4]))  # and the compiled step traces afresh
    ref_next = model(mx.array([[3]]), cache=ref)
    assert mx.allclose(out[0], ref_next[0], atol=LOGITS_ATOL).item() and batch.lengths == [10, 7]


def _twins(lengths, num_pages=96, lookahead=True):
    """An eager batch and a compiled one over the same prompts, in pools of their own."""
    model = make_model("llama")
    eager = batch_of(model, make_pool("llama", page_size=4, num_pages=num_pages), lengths)
    compiled = batch_of(model, make_pool("llama", page_size=4, num_pages=num_pages), lengths)
    return model, eager, compiled, CompiledDecode(model, compiled, bucket=4, lookahead=lookahead)


def _step_both(model, eager, step, tokens):
    le = model(mx.array(tokens)[:, None], cache=eager.caches)
    lc = step(mx.array(tokens))
    assert mx.allclose(le, lc, atol=LOGITS_ATOL).item()
    assert eager.lengths == step.batch.lengths
    return mx.argmax(le[:, -1], axis=-1).tolist()


def test_rows_that_change_between_steps_give_their_lookahead_back_and_still_match():
    model, eager, compiled, step = _twins([5, 13, 30])
    tok = [1, 2, 3]
    for _ in range(2):
        tok = _step_both(model, eager, step, tok)
    assert step.lookahead_pages == 3  # (none of the rows crossed a page boundary yet)
    for batch in (eager, compiled):  # a row leaves, another one joins
        batch.filter([0, 2])
        batch.extend(_prompt_row(model, batch.pool, 9))
    tok = tok[0:1] + tok[2:3] + [4]
    for _ in range(6):
        tok = _step_both(model, eager, step, tok)
    held = step.lookahead_pages
    assert held <= 3 and step.uploads < 12
    for batch in (eager, compiled):  # the user trims a token off every row between steps
        for cache in batch.caches:
            cache.trim(1)
    for _ in range(3):
        tok = _step_both(model, eager, step, tok)
    eager.release()
    compiled.release()
    step.release_lookahead()
    assert compiled.pool.allocator.num_available() == eager.pool.allocator.num_available()


def test_a_step_rebound_to_another_batch_gives_the_old_ones_lookahead_back_and_keeps_its_traces():
    """``rebind`` mid-way: the old batch's lookahead pages go back (its rows stay as they
    are), and the step decodes the new batch of the same layout as an eager twin of it
    does, with the traces it has where the batch size and table width are the same."""
    model, eager, compiled, step = _twins([5, 13, 30])
    tok = [1, 2, 3]
    for _ in range(2):
        tok = _step_both(model, eager, step, tok)
    assert step.lookahead_pages == 3
    rows_of = lambda b: [x.tolist() if isinstance(x, np.ndarray) else x for x in snapshot(b)[:3]]  # noqa: E731
    before = (rows_of(compiled), step.traces)
    in_use = compiled.pool.allocator.num_in_use()
    twin = batch_of(model, make_pool("llama", page_size=4, num_pages=96), [6, 14, 29])
    other = batch_of(model, compiled.pool, [6, 14, 29])
    other_pages = sum(t.num_pages for t in other.rows.tables(0))
    step.rebind(other)
    assert step.lookahead_pages == 0 and step.batch is other
    assert compiled.pool.allocator.num_in_use() == in_use - 3 + other_pages
    tok = [4, 5, 6]
    for _ in range(5):
        tok = _step_both(model, twin, step, tok)
    assert rows_of(compiled) == before[0] and step.traces == before[1]
    for b in (eager, compiled, twin, other):
        b.release()
    step.release_lookahead()
    assert compiled.pool.allocator.num_in_use() == 0


def _prompt_row(model, pool, n):
    c = make_paged_cache(model, pool)
    model(mx.array(prompt_of(n, seed=7))[None], cache=c)
    return c


def test_a_step_short_of_pages_gives_its_lookahead_back_instead_of_failing():
    model, eager, compiled, step = _twins([7, 6], num_pages=12)
    tok = _step_both(model, eager, step, [1, 2])  # both rows get a lookahead page
    assert step.lookahead_pages == 2
    for batch in (eager, compiled):  # a row leaves; someone else takes every free page
        batch.filter([0])
        while batch.pool.allocator.num_available() > (step.lookahead_pages if batch is eager else 0):
            batch.pool.allocator.allocate(1)
    # row 0 needs a page now: the pool has none but the two the compiled step holds
    tok = _step_both(model, eager, step, tok[:1])
    assert step.lookahead_pages == 0  # given back to serve the step, none taken again
    assert compiled.pool.allocator.num_available() == eager.pool.allocator.num_available() == 1
    for _ in range(7):  # positions 9..15: the last free page at 12
        tok = _step_both(model, eager, step, tok)
    with pytest.raises(PoolExhausted):  # and out of pages for real at 16, both sides alike
        step(mx.array(tok))
    with pytest.raises(PoolExhausted):
        model(mx.array(tok)[:, None], cache=eager.caches)
    assert compiled.lengths == eager.lengths == [16]


def test_a_nearly_full_pool_holds_lookahead_pages_for_the_rows_that_cross_soonest():
    # page size 4: the rows cross into a new page at steps 1 (row 3), 2 (row 2), 3 (rows
    # 1 and 5), 4 (rows 0 and 4) and 5 (row 3)
    model, eager, compiled, step = _twins([5, 6, 7, 8, 9, 10], num_pages=22)
    assert compiled.pool.allocator.num_available() == 7  # (14 pages listed, and the null page)
    tok = _step_both(model, eager, step, [1] * 6)  # row 3 grows a page: 6 stay available
    assert step.uploads == 1 and step.lookahead_pages == 3  # too few for all six: half of them
    for _ in range(2):  # rows 2, 1 and 5 cross, each into the page it holds ahead
        tok = _step_both(model, eager, step, tok)
    assert step.uploads == 1 and step.lookahead_pages == 0  # no table copied
    for _ in range(2):  # rows 0 and 4 cross without one, then row 3 (one page left: none ahead)
        tok = _step_both(model, eager, step, tok)
    assert step.uploads == 3
    assert compiled.pool.allocator.num_available() == eager.pool.allocator.num_available() == 0
    eager.release()
    compiled.release()
    assert compiled.pool.allocator.num_available() == 21


@pytest.mark.parametrize("seed", range(12))
def test_lookahead_never_makes_a_step_run_out_of_pages_before_the_eager_one(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 24, 7).tolist()
    spare = int(rng.integers(3, 12))  # pages beyond what the prompts hold
    model, eager, compiled, step = _twins(lengths, num_pages=1 + sum(-(-n // 4) for n in lengths) + spare)
    # a step short of pages gives its lookahead back and retries. In a pool short from the
    # first copy on, the pages go to the rows that cross soonest, and each row holding one
    # crosses before (or with) the first row that lacks one: so no step needs them back
    # before the eager step itself runs out
    given_back = []
    step.release_lookahead = lambda release=step.release_lookahead: given_back.append(release())
    tok = [1] * len(lengths)
    for _ in range(4 * spare + 8):  # past the point where the pool runs dry
        try:
            le = model(mx.array(tok)[:, None], cache=eager.caches)
        except PoolExhausted:
            with pytest.raises(PoolExhausted):  # the compiled step runs out at the same step
                step(mx.array(tok))
            break
        lc = step(mx.array(tok))  # (PoolExhausted here: it ran out before the eager step)
        assert not given_back  # nor did it need its lookahead back to get this step's pages
        assert mx.allclose(le, lc, atol=LOGITS_ATOL).item()
        tok = mx.argmax(le[:, -1], axis=-1).tolist()
    else:
        pytest.fail("the pool never ran out")
    assert compiled.lengths == eager.lengths


def test_dropping_the_step_gives_its_lookahead_pages_back_at_once():
    import gc

    model = make_model("llama")
    pool = make_pool("llama", page_size=4, num_pages=32)
    batch = batch_of(model, pool, [4, 9])
    free = pool.allocator.num_available()
    step = CompiledDecode(model, batch)
    step(mx.array([1, 2]))
    assert step.lookahead_pages == 2 and pool.allocator.num_available() == free - 1 - 2  # row 0 grew a page
    gc.disable()  # no collection may run in between: the step is in no reference cycle
    try:
        del step
        assert pool.allocator.num_available() == free - 1
    finally:
        gc.enable()
    with pytest.raises(InvalidTypeError):
        CompiledDecode(model, batch, lookahead=1)


def test_a_step_on_a_released_batch_raises_and_gives_the_lookahead_back():
    model = make_model("llama")
    pool = make_pool("llama", page_size=4, num_pages=32)
    batch = batch_of(model, pool, [4, 9])
    step = CompiledDecode(model, batch)
    step(mx.array([1, 2]))
    assert step.lookahead_pages == 2
    batch.release()
    with pytest.raises(ReleasedError):
        step(mx.array([1, 2]))
    assert step.lookahead_pages == 0 and pool.allocator.num_available() == 31  # every page but the null one


def test_a_generation_closed_early_gives_the_compiled_steps_lookahead_back():
    """A caller that stops reading (closes the generator) leaves the cache as the eager
    loop would: every token but the last yielded, and no page held past its tables."""
    from pagedkv.generation import generate

    model = make_model("llama")
    pool = make_pool("llama", page_size=4, num_pages=64)
    prompt = prompt_of(10)
    with make_paged_cache(model, pool) as cache:
        tokens = generate(model, cache, prompt, max_tokens=40, compiled=True)
        yielded = 0
        for _ in range(30):  # until the step holds a page ahead (it spends it as the row crosses)
            next(tokens)
            yielded += 1
            pages = [t.num_pages for t in cache.tables]
            if pool.allocator.num_in_use() > sum(pages):
                break
        else:
            pytest.fail("the compiled step never held a page ahead")
        tokens.close()
        assert cache.num_tokens == len(prompt) + yielded - 1
        assert pool.allocator.num_in_use() == sum(t.num_pages for t in cache.tables)


def test_generate_compiles_by_default_only_on_cuda_for_kernel_pages_and_refuses_other_caches(monkeypatch):
    """``compiled=None`` takes the compiled step only where MLX runs on CUDA (made to look
    so here), every pool holds pages the CUDA decode kernel reads (plain fp16/bf16) and
    ``max_tokens`` is at least ``COMPILE_FROM_TOKENS`` (a shorter generation does not pay
    the trace back): not on the CPU, not for float32 or quantised pages, not for 31
    tokens, never for mlx-lm's cache.
    ``compiled=True`` on mlx-lm's own cache, or a value that is neither a bool nor None,
    is a typed error before anything is written."""
    import types

    from pagedkv import InvalidValueError, generation

    class Chosen(Exception):
        pass

    class Spy(CompiledDecode):
        def __init__(self, *a):
            raise Chosen  # (the compiled step itself would call the CUDA kernel: not run here)

    monkeypatch.setattr(generation, "CompiledDecode", Spy)
    assert generation.COMPILE_FROM_TOKENS == 32
    for on_cuda, pages, dtype, n, chosen in ((True, "fp", mx.float16, 32, True), (True, "fp", mx.float16, 31, False),
                                             (False, "fp", mx.float16, 32, False), (True, "fp", mx.float32, 32, False),
                                             (True, "affine8", mx.float16, 32, False)):
        model = make_model("llama")
        model.set_dtype(dtype)
        # (only generate's view of the device: the model's own steps stay on the CPU's path)
        monkeypatch.setattr(generation, "paged_decode", types.SimpleNamespace(available=lambda on_cuda=on_cuda: on_cuda))
        with make_paged_cache(model, make_pool("llama", page_size=4, pages=pages, dtype=dtype)) as cache:
            try:
                got = len(list(generation.generate(model, cache, prompt_of(6), max_tokens=n)))
            except Chosen:
                got = "compiled"
            assert got == ("compiled" if chosen else n), (on_cuda, pages, dtype, n)
        ref = make_prompt_cache(model)  # (mlx-lm's cache: eager whatever the device)
        assert len(list(generation.generate(model, ref, prompt_of(6), max_tokens=4))) == 4
    ref = make_prompt_cache(model)
    with pytest.raises(InvalidValueError):
        list(generation.generate(model, ref, prompt_of(6), max_tokens=4, compiled=True))
    assert ref[0].offset == 0
    with make_paged_cache(model, make_pool("llama", page_size=4)) as cache:
        with pytest.raises(InvalidTypeError):
            list(generation.generate(model, cache, prompt_of(6), max_tokens=4, compiled="yes"))
        assert cache.num_tokens == 0


@pytest.mark.parametrize("kind", ["llama", "gemma3_text", "qwen3_next"])
def test_a_step_passed_to_generate_keeps_its_traces_from_request_to_request_and_each_gives_mlx_lms_tokens(kind):
    """One ``CompiledDecode`` passed as ``generate``'s ``compiled``: three requests, each
    on a new cache of the same pools, and a second turn on the last cache. Each gives the
    tokens of the same loop over mlx-lm's own caches (the second turn continuing the
    first's cache), the step is traced by the first request only, and after each call
    no page is held past the caches' tables (the lookahead went back). Full attention
    (pipelined), sliding windows and a hybrid's recurrent state (serial)."""
    from pagedkv import pools_for_model
    from pagedkv.generation import generate

    model = make_model(kind)
    pool, states = pools_for_model(model, max_bytes=4 << 20, page_size=4,
                                   state_slots=16 if kind == "qwen3_next" else None)
    step = CompiledDecode(model, make_paged_cache(model, pool, state_pool=states))
    traces, caches = [], []
    for seed in range(3):
        prompt = prompt_of(9 + 4 * seed, seed=seed + 1)
        want = list(generate(model, make_prompt_cache(model), prompt, max_tokens=14))
        caches.append(make_paged_cache(model, pool, state_pool=states))
        assert list(generate(model, caches[-1], prompt, max_tokens=14, compiled=step)) == want
        assert step.batch is caches[-1] and not step.busy and step.lookahead_pages == 0
        assert pool.allocator.num_in_use() == sum(t.num_pages for c in caches for t in c.tables)
        traces.append(step.traces)
    assert traces[0] >= 1 and traces == [traces[0]] * 3
    ref = make_prompt_cache(model)
    first, second = prompt_of(9 + 8, seed=3), prompt_of(5, seed=9)
    want = [list(generate(model, ref, p, max_tokens=14)) for p in (first, second)]
    assert list(generate(model, caches[-1], second, max_tokens=14, compiled=step)) == want[1]
    assert caches[-1].num_tokens == next(c.offset for c in ref if hasattr(c, "offset"))
    assert step.traces == traces[0]
    for c in caches:
        c.release()
    assert pool.allocator.num_in_use() == 0 and (states is None or states.allocator.num_in_use() == 0)


def test_a_step_for_another_model_or_layout_or_in_use_is_refused_before_anything_is_written():
    """``generate`` refuses a ``CompiledDecode`` made for another model, or for a cache of
    another layout (another pool), with ``InvalidValueError`` before the prompt is
    written; so does a step another ``generate`` loop is still decoding through, until
    that loop is closed. ``rebind`` refuses the same with nothing changed, and anything
    but a batch or a one-sequence cache with ``InvalidTypeError``."""
    from pagedkv import InvalidValueError
    from pagedkv.generation import generate

    model, other = make_model("llama"), make_model("llama")
    pool = make_pool("llama", page_size=4, num_pages=64)
    step = CompiledDecode(model, make_paged_cache(model, pool))
    cases = [(other, make_paged_cache(other, pool), "another model"),
             (model, make_paged_cache(model, make_pool("llama", page_size=4, num_pages=64)), "another layout")]
    for m, cache, what in cases:
        with pytest.raises(InvalidValueError, match=what):
            next(generate(m, cache, prompt_of(6), max_tokens=4, compiled=step))
        assert cache.num_tokens == 0, what
    bound = step.batch
    with pytest.raises(InvalidValueError):
        step.rebind(cases[1][1])
    with pytest.raises(InvalidTypeError):
        step.rebind(make_prompt_cache(model))
    assert step.batch is bound
    busy = make_paged_cache(model, pool)
    running = generate(model, busy, prompt_of(6), max_tokens=20, compiled=step)
    next(running), next(running)
    assert step.busy
    idle = make_paged_cache(model, pool)
    with pytest.raises(InvalidValueError, match="another generate loop"):
        next(generate(model, idle, prompt_of(6), max_tokens=4, compiled=step))
    with pytest.raises(InvalidValueError, match="generate loop"):
        step.rebind(idle)
    assert idle.num_tokens == 0 and step.batch is busy
    running.close()
    assert not step.busy and step.lookahead_pages == 0
    assert len(list(generate(model, idle, prompt_of(6), max_tokens=4, compiled=step))) == 4
    busy.release(), idle.release()
