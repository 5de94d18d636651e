"""Prefix caching: identical outputs, reuse, LRU eviction, token verification; admission."""

import mlx.core as mx
import numpy as np
import pytest
from tiny_models import (
    CONFIGS,
    PAGE_KINDS,
    kv_dims,
    make_model,
    make_pool,
    model_of_config,
    prompt_of,
)

from allocators import InvariantViolation
from pagedkv import (
    InvalidValueError,
    NotSupportedError,
    PagePool,
    PageTable,
    PrefixCache,
    StatePool,
    can_admit,
    make_paged_cache,
    pages_for,
    preempt,
)
from pagedkv.generation import generate
from pagedkv.row_set import LayerLayout, RowSet, TableSpec

PS = 8
SYSTEM = prompt_of(43, seed=11)  # 5 full pages + 3 tokens


@pytest.fixture(scope="module")
def model():
    return make_model("llama")


def filed_state(prefix, *keys):
    """What a refused call must leave as it was: the prefix cache's maps, the nodes of
    ``keys``, its stats and its pool allocator's."""
    return (dict(prefix._by_key), dict(prefix._key_of_page), dict(prefix._window_page), dict(prefix._window_key_of),
            [list(k.nodes) for k in keys], prefix.stats(), prefix.pool.allocator.stats())


def run(model, cache, rest, n=12):
    return list(generate(model, cache, rest, max_tokens=n))


@pytest.mark.parametrize("pages", PAGE_KINDS)
def test_outputs_with_prefix_caching_equal_outputs_without(model, pages):
    pool = make_pool("llama", page_size=PS, num_pages=128, pages=pages)
    prefix = PrefixCache(pool)
    first = SYSTEM + prompt_of(6, seed=1)
    cache, rest = prefix.new_cache(model, first)
    assert rest == first  # nothing cached yet
    out_first = run(model, cache, rest)
    prefix.register(cache, first + out_first)
    cache.release()

    second = SYSTEM + prompt_of(9, seed=2)
    cache, rest = prefix.new_cache(model, second)
    assert len(rest) == len(second) - 40  # 5 pages came from the cache
    with_cache = run(model, cache, rest)
    cache.release()
    with make_paged_cache(model, pool) as plain:
        without = run(model, plain, second)
    assert with_cache == without
    st = prefix.stats()
    assert (st.hit_pages, st.hit_tokens, st.queries) == (5, 40, 2)
    assert 0 < st.token_hit_rate < 1
    pool.allocator.check()


def test_a_fully_cached_prompt_still_computes_its_last_token(model):
    pool = make_pool("llama", page_size=PS, num_pages=64)
    prefix = PrefixCache(pool)
    tokens = prompt_of(32, seed=5)  # exactly 4 pages
    cache, _ = prefix.new_cache(model, tokens)
    run(model, cache, tokens, n=1)
    prefix.register(cache, tokens)
    cache.release()
    cache, rest = prefix.new_cache(model, tokens)
    assert len(rest) == 8  # the last page is recomputed so the model yields logits
    cache.release()


@pytest.mark.parametrize("pages", PAGE_KINDS)
def test_released_pages_stay_cached_and_are_evicted_lru_only_when_needed(model, pages):
    pool = make_pool("llama", page_size=PS, num_pages=12, pages=pages)  # 11 usable pages
    prefix = PrefixCache(pool)
    old = prompt_of(24, seed=1)
    new = prompt_of(24, seed=2)
    for tokens in (old, new):
        cache, rest = prefix.new_cache(model, tokens)
        run(model, cache, rest, n=1)
        prefix.register(cache, tokens)
        cache.release()
    assert pool.allocator.num_cached() == 6 and pool.allocator.num_free() == 5
    with make_paged_cache(model, pool) as big:  # needs 7 pages, 5 free: evicts the 2 oldest
        model(mx.array(prompt_of(56, seed=3))[None], cache=big)
    assert prefix.stats().evictions == 2
    assert len(prefix.match(old + [1])) == 1  # old lost its last two pages; its first still matches
    assert len(prefix.match(new + [1])) == 3  # new's pages survived
    pool.allocator.check()


def test_a_page_hits_only_under_the_same_whole_prefix(model):
    pool = make_pool("llama", page_size=PS, num_pages=64)
    prefix = PrefixCache(pool)
    a = prompt_of(2 * PS + 1, seed=1)
    b = prompt_of(PS, seed=2) + a[PS:]  # same second page, different first page
    cache, rest = prefix.new_cache(model, a)
    run(model, cache, rest, n=1)
    prefix.register(cache, a)
    cache.release()
    assert prefix.match(b) == []
    assert len(prefix.match(a)) == 2


def test_pages_below_an_evicted_page_are_never_reached_through_its_reused_id(model):
    pool = make_pool("llama", page_size=PS, num_pages=4)  # 3 usable pages
    prefix = PrefixCache(pool)
    a = prompt_of(2 * PS + 1, seed=1)
    keys = prefix.keys(a)
    pages = pool.allocator.allocate(2)
    prefix.register_pages(pages, keys)
    pool.allocator.decref(pages[::-1].copy())  # both cached; the tail is the LRU
    pool.allocator.touch(pages[1:])  # keep the second page; evict the first
    taken = pool.allocator.allocate(2)  # the free page, then page 0 of the chain
    assert prefix.match(a) == []
    other = prefix.keys(prompt_of(PS, seed=3) + a[PS:])  # the evicted id reused for another prefix
    prefix.register_pages(taken[1:], other)
    assert prefix.match(other.token_ids() + [0]) == taken[1:].tolist()
    assert prefix.match(prompt_of(PS, seed=3) + a[PS:]) == taken[1:].tolist()  # only the first page
    pool.allocator.decref(pages[1:])
    pool.allocator.decref(taken)
    pool.allocator.check()


def test_carried_keys_cut_each_page_once_from_match_to_the_last_register(model):
    pool = make_pool("llama", page_size=PS, num_pages=64)
    prefix = PrefixCache(pool)
    lookups = []

    class CountingDict(dict):
        def get(self, key, default=None):
            lookups.append(key)
            return super().get(key, default)

    prefix._by_key = CountingDict()
    first = SYSTEM + prompt_of(6, seed=1)  # 6 full pages + 1 token
    cache, rest = prefix.new_cache(model, first)
    prefix.register(cache, first)  # nothing cached yet: registers nothing before the prefill
    run(model, cache, rest, n=1)
    prefix.register(cache, first)
    cache.release()
    lookups.clear()
    keys = prefix.keys(SYSTEM + prompt_of(9, seed=2))  # 6 full pages, 5 of them cached
    cache, rest = prefix.new_cache(model, keys)
    assert len(rest) == keys.num_tokens - 5 * PS and len(lookups) == 6  # 5 hits, 1 miss
    out = run(model, cache, rest, n=12)
    keys.extend(out)
    prefix.register(cache, keys)
    prefix.register(cache, keys)  # nothing new: no lookup at all
    full = cache.tables[0].num_tokens // PS
    # register looks the page that missed up again (someone may have added it since); the
    # pages after it hang below the node just made for it, so they need no lookup
    assert full > 6 and len(lookups) == 6 + 1
    cut = {id(chunk) for chunk in keys.pages}
    assert all(id(chunk) in cut for _, chunk in lookups)  # every key's bytes were cut once
    cache.release()
    pool.allocator.check()


def test_prefix_keys_cut_pages_once_and_truncate_back(model):
    pool = make_pool("llama", page_size=PS, num_pages=8)
    prefix = PrefixCache(pool)
    tokens = prompt_of(3 * PS + 3, seed=4)
    keys = prefix.keys(tokens[:5])
    for t in tokens[5:]:
        keys.extend([t])
    assert keys.num_tokens == len(tokens) and keys.num_full_pages == 3
    assert keys.token_ids() == tokens and keys.token_ids(PS + 1) == tokens[PS + 1 :]
    keys.truncate(PS + 2)
    assert keys.num_full_pages == 1 and keys.token_ids() == tokens[: PS + 2]
    keys.extend(tokens[PS + 2 :])
    assert keys.pages == prefix.keys(tokens).pages
    for bad in (["x"], [1.5], "abc", [[1, 2]]):
        with pytest.raises(TypeError):
            keys.extend(bad)
    assert keys.token_ids() == tokens  # refused input changed nothing
    with pytest.raises(ValueError):
        prefix.register_pages([1, 1], prefix.keys(tokens))
    with pytest.raises(ValueError):
        PrefixCache(pool).match(keys)  # keys of another cache


@pytest.mark.parametrize("pages", PAGE_KINDS)
def test_a_registered_page_is_never_overwritten(model, pages):
    pool = make_pool("llama", page_size=PS, num_pages=64, pages=pages)
    prefix = PrefixCache(pool)
    tokens = prompt_of(20, seed=4)
    cache, rest = prefix.new_cache(model, tokens)
    run(model, cache, rest, n=1)
    prefix.register(cache, tokens)
    registered = cache.tables[0].pages[:2].tolist()
    for c in cache:
        c.trim(6)  # back into the second registered page
    model(mx.array([prompt_of(3, seed=9)]), cache=cache)
    assert cache.tables[0].pages[1] != registered[1]  # written into a copy
    cache.release()
    again, rest = prefix.new_cache(model, tokens)
    with make_paged_cache(model, pool) as plain:
        assert run(model, again, rest) == run(model, plain, tokens)
    again.release()


def test_extra_keys_separate_sequences_in_one_cache(model):
    pool = make_pool("llama", page_size=PS, num_pages=64)
    prefix = PrefixCache(pool, extra_keys="adapter-a")
    tokens = prompt_of(2 * PS + 1, seed=6)
    pages = pool.allocator.allocate(2)
    prefix.register_pages(pages, prefix.keys(tokens))
    assert len(prefix.match(tokens)) == 2
    assert prefix.match(prefix.keys(tokens, extra_keys="adapter-b")) == []
    assert len(prefix.match(prefix.keys(tokens, extra_keys=b"adapter-a"))) == 2
    pool.allocator.decref(pages)


@pytest.mark.parametrize("how", ["register_pages", "register_next", "register"])
@pytest.mark.parametrize("other", ["extra_keys", "tokens"])
def test_registered_pages_are_refused_under_another_root_or_other_tokens(model, how, other):
    """Pages filed under one ``extra_keys`` root (an adapter, a tenant's salt) hold K/V
    that another root must never find, and a page's key is the content it holds. So
    registering held pages under another root, or for other token ids at their
    position, is refused with nothing changed, and the first root still hits them."""
    pool = make_pool("llama", page_size=PS, num_pages=64)
    prefix = PrefixCache(pool, extra_keys="adapter-a")
    tokens = prompt_of(2 * PS + 1, seed=6)
    pages = pool.allocator.allocate(2).tolist()
    assert prefix.register_pages(pages, prefix.keys(tokens)) == 2
    if other == "extra_keys":
        keys = prefix.keys(tokens, extra_keys="adapter-b")
    else:
        keys = prefix.keys(tokens[:PS] + prompt_of(PS + 1, seed=7))  # the second page's tokens differ
    table = PageTable(pool)
    if how == "register":
        pool.allocator.incref(pages)
        table.adopt(pages, 2 * PS)
    before = filed_state(prefix, keys)
    with pytest.raises(InvalidValueError, match="registered"):
        if how == "register_pages":
            prefix.register_pages(pages, keys)
        elif how == "register_next":
            if other == "tokens":
                prefix.register_pages(pages[:1], keys)  # the first page is the same content
                before = filed_state(prefix, keys)  # (its nodes moved on; nothing else changed)
            else:
                prefix.register_next(pages[:1], [keys])
            prefix.register_next(pages[len(keys.nodes):][:1], [keys])
        else:
            prefix.register(table, keys)
    assert filed_state(prefix, keys) == before
    assert prefix.match(tokens) == pages
    table.release()
    pool.allocator.decref(pages)
    pool.allocator.check()


@pytest.mark.parametrize("break_it", ["a key forgotten", "a key to no filed page", "a page not cacheable",
                                      "a page filed twice", "a page given back"])
def test_check_finds_each_kind_of_broken_map(break_it):
    pool = make_pool("llama", page_size=PS, num_pages=64)
    prefix = PrefixCache(pool)
    pages = pool.allocator.allocate(3).tolist()
    prefix.register_pages(pages, prefix.keys(prompt_of(3 * PS + 1, seed=4)))
    prefix.check()
    if break_it == "a key forgotten":
        del prefix._by_key[prefix._key_of_page[pages[1]]]
    elif break_it == "a key to no filed page":
        prefix._by_key[(prefix.keys([]).root, b"x" * 8 * PS)] = pages[0]
    elif break_it == "a page not cacheable":
        pool.allocator.set_cacheable(pages[:1], False)
    elif break_it == "a page filed twice":
        prefix._window_key_of[pages[2]] = ((4, 0), 1)
        prefix._window_page[((4, 0), 1)] = pages[2]
    else:  # its count dropped to 0 without it being cacheable: FREE, yet filed
        pool.allocator.set_cacheable(pages[1:2], False)
        pool.allocator.decref(pages[1:2])
    with pytest.raises(InvariantViolation):
        prefix.check()


def test_can_admit_counts_free_and_evictable_pages_and_a_watermark(model):
    pool = make_pool("llama", page_size=PS, num_pages=11)  # 10 usable
    assert pages_for(17, PS) == 3
    assert can_admit(pool, 40, 40, watermark=0.0)
    assert not can_admit(pool, 40, 41, watermark=0.0)
    assert not can_admit(pool, 40, 30, watermark=0.2)
    assert can_admit(pool, 40, 41, cached_tokens=16, watermark=0.0)
    # a cached part of a page saves no page: its page is written again
    assert not can_admit(pool, 80, 8, cached_tokens=6, watermark=0.0)  # 11 pages, none cached
    assert can_admit(pool, 80, 8, cached_tokens=8, watermark=0.0)
    # the watermark's pages are rounded up: 1% of 10 pages keeps one free
    assert can_admit(pool, 72, 0, watermark=0.01) and not can_admit(pool, 73, 0, watermark=0.01)
    cache = make_paged_cache(model, pool)
    model(mx.array([prompt_of(30)]), cache=cache)
    assert not can_admit(pool, 40, 20, watermark=0.0)
    assert can_admit(pool, 40, 20, watermark=0.0, releasable=2)  # pages the caller holds ahead, given back
    assert not can_admit(pool, 40, 20, watermark=0.0, releasable=1)
    assert preempt(cache) == 4
    assert can_admit(pool, 40, 20, watermark=0.0)
    with pytest.raises(ValueError):
        can_admit(pool, 0, 1)
    with pytest.raises(ValueError):
        can_admit(pool, 1, 1, releasable=-1)
    with pytest.raises(ValueError):  # a hit covers prompt tokens only (more admitted what cannot fit)
        can_admit(pool, 40, 200, cached_tokens=400, watermark=0.0)


def test_can_admit_counts_a_hits_cached_pages_as_taken_and_a_sliding_tables_pages_as_needed():
    """A hit's pages that are CACHED now stop being evictable once taken: a request
    whose hit is the pool's only cached pages, with no page free, has no room for its one
    new page (counting them as available would admit it, and its prefill would run out).
    ``extra_pages`` (a sliding-window model's sliding tables) add to what it needs."""
    pool = make_pool("llama", page_size=PS, num_pages=11)  # 10 usable
    prefix = PrefixCache(pool)
    tokens = prompt_of(4 * PS + 3, seed=9)
    held = pool.allocator.allocate(10)
    prefix.register_pages(held[:4].tolist(), prefix.keys(tokens))
    pool.allocator.decref(held[3::-1].copy())  # the prefix's 4 pages become CACHED; 6 stay in use
    hit = prefix.match(tokens)
    assert len(hit) == 4 and pool.allocator.num_available() == 4
    revived = sum(pool.allocator.refcount(p) == 0 for p in hit)
    assert can_admit(pool, len(tokens), 0, cached_tokens=4 * PS, watermark=0.0)  # (the overcount)
    assert not can_admit(pool, len(tokens), 0, cached_tokens=4 * PS, revived=revived, watermark=0.0)
    pool.allocator.decref(held[4:5].copy())  # one page free: now it fits
    assert can_admit(pool, len(tokens), 0, cached_tokens=4 * PS, revived=revived, watermark=0.0)
    assert not can_admit(pool, len(tokens), 0, cached_tokens=4 * PS, revived=revived, watermark=0.0, extra_pages=1)
    with pytest.raises(ValueError):
        can_admit(pool, 1, 1, revived=-1)
    pool.allocator.decref(held[5:].copy())
    pool.allocator.check()


@pytest.mark.parametrize("evicted", [1, 3, 5])
def test_the_cached_pages_left_of_a_released_sequence_still_match_a_prefix(model, evicted):
    pool = make_pool("llama", page_size=PS, num_pages=8)  # 7 usable pages
    prefix = PrefixCache(pool)
    tokens = prompt_of(6 * PS + 1, seed=7)
    cache, rest = prefix.new_cache(model, tokens)
    model(mx.array(rest)[None], cache=cache)
    prefix.register(cache, tokens)
    cache.release()  # 6 full pages become cached
    taken = pool.allocator.allocate(1 + evicted)  # the free page, then the LRU cached pages
    assert len(prefix.match(tokens)) == 6 - evicted  # the chain lost its tail, not its head
    pool.allocator.decref(taken)


def _decoded(prefix, pool, seqs):
    """Each sequence's prompt pages registered; returns (keys, pages) per sequence."""
    out = []
    for tokens in seqs:
        keys = prefix.keys(tokens)
        pages = pool.allocator.allocate(keys.num_full_pages).tolist()
        prefix.register_pages(pages[:1], keys)  # the prompt: one page; the rest fill later
        out.append((keys, pages))
    return out


@pytest.mark.parametrize("repeated", [False, True])
def test_register_next_files_a_steps_pages_as_one_page_at_a_time_would(repeated):
    """A decode step's filled pages, one per sequence, in one call: the same nodes,
    matches and stats as register_pages page by page; ``repeated``: two sequences with
    equal content, so the call also meets content cached already or repeated inside it.
    Ids as a numpy array take the general path, which must file the same."""
    shared = prompt_of(4 * PS, seed=1)
    seqs = [prompt_of(4 * PS, seed=s) for s in (2, 3)] + ([shared, list(shared)] if repeated else [shared])
    results = []
    for batched in (False, True, "numpy"):
        pool = make_pool("llama", page_size=PS, num_pages=64)
        prefix = PrefixCache(pool)
        rows = _decoded(prefix, pool, seqs)
        for page in range(1, 4):
            if batched:
                ids = [p[page] for _, p in rows]
                added = prefix.register_next(np.array(ids) if batched == "numpy" else ids, [k for k, _ in rows])
            else:
                added = sum(prefix.register_pages([p[page]], k, page) for k, p in rows)
            assert added == 3  # (a repeated sequence's page is not filed twice)
        results.append(([k.nodes for k, _ in rows], [prefix.match(k.token_ids() + [0]) for k, _ in rows],
                        prefix.stats(), sorted(pool.allocator.cached_pages())))
        for _, pages in rows:
            pool.allocator.decref(pages[::-1])
        pool.allocator.check()
    assert results[0] == results[1] == results[2]
    nodes, matches = results[1][0], results[1][1]
    assert all(len(m) == 4 for m in matches)
    if repeated:
        assert nodes[2] == nodes[3] and matches[2] == matches[3]


def test_a_refused_register_next_files_nothing():
    pool = make_pool("llama", page_size=PS, num_pages=32)
    prefix = PrefixCache(pool)
    rows = _decoded(prefix, pool, [prompt_of(2 * PS + 1, seed=s) for s in (1, 2)])
    (k1, p1), (k2, p2) = rows
    other = PrefixCache(make_pool("llama", page_size=PS, num_pages=8)).keys(prompt_of(2 * PS, seed=3))
    short = prefix.keys(prompt_of(PS + 2, seed=4))
    prefix.register_pages(pool.allocator.allocate(1).tolist(), short)
    freed = pool.allocator.allocate(1).tolist()
    pool.allocator.decref(freed)
    def state():
        return filed_state(prefix, k1, k2), [pool.allocator.is_cacheable(p) for p in p1 + p2]

    before = state()
    for pages, keys, error in (
        ([p1[1]], [k1, k2], ValueError),  # one page for two sequences
        ([p1[1], p1[1]], [k1, k2], ValueError),  # a page twice
        ([p1[1], p2[1]], [k1, k1], ValueError),  # a sequence twice
        ([p1[1], p2[1]], [k1, other], ValueError),  # another cache's keys
        ([p1[1], p2[1]], [k1, k1.token_ids()], TypeError),  # not PrefixKeys
        ([p1[1], 10**6], [k1, k2], ValueError),  # a page out of the pool
        ([p1[1], 1.0], [k1, k2], TypeError),
        ([p1[1], freed[0]], [k1, k2], ValueError),  # a page nobody holds (RefCountError)
        ([p1[1], -1], [k1, k2], ValueError),  # (negative ids must not wrap to the pool's end)
    ):
        with pytest.raises(error):
            prefix.register_next(pages, keys)
        assert state() == before
    with pytest.raises(ValueError):
        prefix.register_next([p1[1], p2[1]], [k1, short])  # short has no full page after its first
    assert state() == before
    assert prefix.register_next([p1[1], p2[1]], [k1, k2]) == 2


def test_register_next_refuses_a_sequence_listed_twice_though_it_has_pages_to_file():
    """Listed twice, a sequence with two more full pages could take both in one call;
    the call refuses instead (one page per sequence and step) and files nothing."""
    pool = make_pool("llama", page_size=PS, num_pages=32)
    prefix = PrefixCache(pool)
    ((keys, pages),) = _decoded(prefix, pool, [prompt_of(4 * PS, seed=7)])
    before = filed_state(prefix, keys)
    with pytest.raises(ValueError):
        prefix.register_next([pages[1], pages[2]], [keys, keys])
    assert filed_state(prefix, keys) == before
    assert [prefix.register_next([p], [keys]) for p in pages[1:]] == [1, 1, 1]


def test_a_refused_one_page_register_pages_files_nothing():
    """The one-page path of register_pages (a decode step's page) refuses what the
    general path refuses, before any change."""
    pool = make_pool("llama", page_size=PS, num_pages=16)
    prefix = PrefixCache(pool)
    keys = prefix.keys(prompt_of(2 * PS + 1, seed=5))
    held = pool.allocator.allocate(1).tolist()
    freed = pool.allocator.allocate(1).tolist()
    pool.allocator.decref(freed)
    other = PrefixCache(make_pool("llama", page_size=PS, num_pages=8)).keys(prompt_of(2 * PS, seed=3))
    before = filed_state(prefix, keys)
    for pages, k, first, error in (
        (freed, keys, 0, ValueError),  # a page nobody holds (RefCountError)
        ([10**6], keys, 0, ValueError),  # out of the pool
        ([held[0], 16], keys, 0, ValueError),  # one past the last page
        ([-1], keys, 0, ValueError),
        ([1.0], keys, 0, TypeError),
        (held, keys, 1, ValueError),  # past the pages whose nodes keys knows
        (held, keys, -1, ValueError),
        (held, keys, 0.0, TypeError),
        (held, other, 0, ValueError),  # another cache's keys
        (held, prefix.keys(prompt_of(PS - 1)), 0, ValueError),  # no full page to file
    ):
        with pytest.raises(error):
            prefix.register_pages(pages, k, first)
    assert filed_state(prefix, keys) == before
    assert prefix.register_pages(np.array(held), keys) == 1  # numpy ids take the general path
    assert prefix.register_pages(held, prefix.keys(prompt_of(2 * PS + 1, seed=5))) == 0  # known content
    assert len(prefix.match(keys)) == 1


@pytest.mark.parametrize("how", ["register_pages", "register_next"])
def test_pages_filed_below_an_evicted_twin_are_filed_again_below_their_own_chain(how):
    """Sequence b computed its first page although a had the same one cached, so b's own
    first page was not filed and b's next pages hang below a's. Once a's page is evicted,
    registering b again from fresh keys (a fork does this) files b's first page and moves
    b's next pages below it, so all of b matches again; a refusal on the way changes
    nothing."""
    pool = make_pool("llama", page_size=PS, num_pages=16)  # 15 usable pages
    prefix = PrefixCache(pool)
    a = prompt_of(3 * PS + 1, seed=1)
    b = a[:PS] + prompt_of(2 * PS + 1, seed=2)
    a_pages = pool.allocator.allocate(3).tolist()
    b_pages = pool.allocator.allocate(3).tolist()
    assert prefix.register_pages(a_pages, prefix.keys(a)) == 3
    assert prefix.register_pages(b_pages, prefix.keys(b)) == 2  # b's first page: a's content
    pool.allocator.decref(a_pages[::-1])
    pool.allocator.decref(pool.allocator.allocate(9 + 3))  # the 9 free pages, then a's 3 cached ones
    assert prefix.match(a) == [] and prefix.match(b) == []  # b's pages are cached but unreachable

    first = pool.allocator.allocate(1).tolist()  # a page nobody will hold: the register refuses
    pool.allocator.decref(first)
    before = filed_state(prefix)
    with pytest.raises(ValueError):
        prefix.register_pages(first + b_pages[1:], prefix.keys(b))
    assert filed_state(prefix) == before

    keys = prefix.keys(b)
    if how == "register_pages":
        assert prefix.register_pages(b_pages, keys) == 1
    else:
        prefix.register_pages(b_pages[:1], keys)
        assert prefix.register_next(np.array(b_pages[1:2]), [keys]) == 0  # (the general path)
        assert prefix.register_next(b_pages[2:], [keys]) == 0
    assert prefix.match(b) == b_pages
    assert keys.nodes == [prefix._node_of_page[p] for p in b_pages]
    pool.allocator.decref(b_pages)
    pool.allocator.check()


def _prefilled(model, prefix, tokens):
    """A cache from ``prefix`` holding ``tokens`` but the last, registered right after
    the prefill (as the serving engine does after each prefill chunk), so the sliding
    tables still hold every page; returns (cache, the last token)."""
    cache, rest = prefix.new_cache(model, tokens)
    if len(rest) > 1:
        model(mx.array(rest[:-1])[None], cache=cache)
    prefix.register(cache, tokens)
    return cache, tokens[-1:]


def _second_prompt_of_a_shared_system_prompt(model, prefix):
    """A first prompt (a 30-token system prompt + 6) runs and leaves its pages; returns
    (the cache ``new_cache`` gives a second prompt with the same system prompt, the
    tokens it still has to run, the second prompt)."""
    system = prompt_of(30, seed=3)
    cache, last = _prefilled(model, prefix, system + prompt_of(6, seed=1))
    run(model, cache, last)
    cache.release()
    second = system + prompt_of(9, seed=2)
    cache, rest = prefix.new_cache(model, second)
    return cache, rest, second


def test_a_sliding_window_models_outputs_with_prefix_caching_equal_outputs_without():
    """gemma3_text (window 12, pages of 4): a second prompt sharing a 30-token system
    prompt takes its 7 full pages in the full-attention table and only the window's last
    pages in the sliding one (the pages before are listed as dropped), and decodes what a
    cache without prefix caching decodes."""
    model = make_model("gemma3_text")
    pool = make_pool("gemma3_text", page_size=4, num_pages=128)
    prefix = PrefixCache(pool, windows=[12])
    cache, rest, second = _second_prompt_of_a_shared_system_prompt(model, prefix)
    assert len(rest) == len(second) - 28  # 7 full pages came from the cache
    full, sliding = sorted(cache.tables, key=lambda t: t.window is not None)
    assert full.num_pages == 7 and sliding.first_visible() == 16 and sliding.num_pages == 3
    with_cache = run(model, cache, rest)
    cache.release()
    with make_paged_cache(model, pool) as plain:
        without = run(model, plain, second)
    assert with_cache == without
    assert pool.allocator.num_in_use() == 0
    pool.allocator.check()


@pytest.mark.parametrize("how", ["register_pages", "register_next", "register"])
def test_a_sliding_tables_registered_page_is_refused_as_a_full_page_and_changes_nothing(how):
    """A page filed for a sliding window holds a sliding layer's K/V: filing it as a full
    page too would hand those to a full-attention hit (and leave its window key behind
    once evicted). It is refused with nothing changed."""
    model = make_model("gemma3_text")
    pool = make_pool("gemma3_text", page_size=4, num_pages=128)
    prefix = PrefixCache(pool, windows=[12])
    cache, _ = _prefilled(model, prefix, prompt_of(30, seed=3) + prompt_of(6, seed=1))
    sliding = next(t for t in cache.tables if t.window is not None)
    full_pages = sliding.num_tokens // 4
    page = int(sliding.page_ids(full_pages - 1, full_pages)[0])  # its last full page
    assert page in prefix._window_key_of
    keys = prefix.keys(prompt_of(9, seed=9))  # fresh content, not cached anywhere
    table = PageTable(pool)
    if how == "register":
        pool.allocator.incref([page])
        table.adopt([page])
    before = filed_state(prefix, keys)
    with pytest.raises(InvalidValueError, match="sliding"):
        if how == "register_pages":
            prefix.register_pages([page], keys)
        elif how == "register_next":
            prefix.register_next([page], [keys])
        else:
            prefix.register(table, keys)
    assert filed_state(prefix, keys) == before
    assert keys.nodes == []
    table.release()
    cache.release()
    pool.allocator.check()


def test_a_sliding_window_hit_ends_where_every_window_page_it_needs_is_cached():
    """With a sliding layer's page 5 evicted, a hit cannot end after page 6 or 7 (a query
    there sees page 5), so it ends after page 5, whose window needs pages 2-4; the
    sequence then decodes as without the cache. Refusals: a model with a window the
    cache was not made for, a hybrid or disk tier beside windows."""
    model = make_model("gemma3_text")
    pool = make_pool("gemma3_text", page_size=4, num_pages=64)
    prefix = PrefixCache(pool, windows=(12,))
    tokens = prompt_of(29, seed=4)  # 7 full pages + 1 token
    cache, _ = _prefilled(model, prefix, tokens)
    sliding = next(t for t in cache.tables if t.window is not None)
    victim = sliding.page_at(5)
    cache.release()
    cached = [p for p in pool.allocator.cached_pages() if p != victim]
    pool.allocator.touch(cached)  # every cached page but the victim in use: it is the one evicted
    assert pool.allocator.evict(1) == [victim]
    pool.allocator.decref(cached)
    assert len(prefix.match(tokens)) == 5
    cache, rest = prefix.new_cache(model, tokens + [9])
    assert len(rest) == 30 - 20
    assert next(t for t in cache.tables if t.window is not None).first_visible() == 8
    got = run(model, cache, rest, n=6)
    cache.release()
    with make_paged_cache(model, pool) as plain:
        assert got == run(model, plain, tokens + [9], n=6)

    all_sliding = model_of_config(dict(CONFIGS["gemma3_text"], sliding_window_pattern=5))  # 4 layers
    with make_paged_cache(all_sliding, pool) as c:
        with pytest.raises(NotSupportedError):
            prefix.register(c, tokens)
        with pytest.raises(NotSupportedError):
            prefix.register_row(c.rows, 0, tokens)
    with pytest.raises(NotSupportedError):
        prefix.new_cache(all_sliding, tokens)
    other = PrefixCache(make_pool("gemma3_text", page_size=4, num_pages=16))  # made without windows
    with pytest.raises(NotSupportedError, match="windows"):
        other.new_cache(model, tokens)
    with make_paged_cache(model, other.pool) as c:  # its row set's windows are not the cache's
        model(mx.array([tokens[:9]]), cache=c)
        with pytest.raises(NotSupportedError, match="windows"):
            other.register_row(c.rows, 0, tokens[:9])
        assert other.match(tokens[:9]) == []
    # a full-attention table first, then a sliding one the cache was not made for
    layout = LayerLayout((TableSpec(other.pool, None), TableSpec(other.pool, 8)), ((0, 0), (1, 1)))
    rows = RowSet(layout, [[PageTable(other.pool), PageTable(other.pool, window=8)]])
    with pytest.raises(NotSupportedError, match="windows"):
        other.register_row(rows, 0, tokens[:9])
    rows.release()
    assert other.pool.allocator.num_in_use() == 0
    with pytest.raises(NotSupportedError):
        PrefixCache(pool, windows=(12,), state_pool=StatePool.for_model(make_model("qwen3_next"), num_slots=2))
    with pytest.raises(ValueError):
        PrefixCache(pool, windows=(0,))
    pool.allocator.check()


def test_a_pool_with_a_layer_per_layer_of_the_smallest_kind_serves_hits_as_mlx_lm_in_fewer_bytes():
    """gemma3_text with 4 sliding layers and 2 full ones on a two-layer pool
    (``kv_pool_layers``): the sliding layers form two groups of two, each its own table,
    so a row has three tables and every page's two layers are written. A second prompt
    sharing a system prompt hits in every table and decodes as mlx-lm's own caches; the
    pages a long sequence holds take under half the bytes they take on a pool with a
    layer per model layer, where a full-attention page keeps room for the sliding layers."""
    from mlx_lm.models.cache import make_prompt_cache

    from pagedkv.cache import kv_pool_layers, layout_for

    model = model_of_config(dict(CONFIGS["gemma3_text"], num_hidden_layers=6, sliding_window_pattern=3))
    assert kv_pool_layers(model) == 2
    _, heads, head_dim = kv_dims("gemma3_text")
    pool = PagePool(num_layers=2, num_kv_heads=heads, head_dim=head_dim, page_size=4, num_pages=160,
                    dtype=mx.float32)
    layout = layout_for(model, pool)
    assert [(s.window, s.group) for s in layout.specs] == [(12, 0), (None, 0), (12, 1)]
    assert [layer for _, layer in layout.layers] == [0, 1, 0, 0, 1, 1]
    prefix = PrefixCache(pool, windows=layout.windows)
    cache, rest, second = _second_prompt_of_a_shared_system_prompt(model, prefix)
    assert len(rest) == len(second) - 28 and len(cache.tables) == 3
    assert sorted(t.num_pages for t in cache.tables) == [3, 3, 7]  # each group's window pages, the full ones
    assert run(model, cache, rest) == run(model, make_prompt_cache(model), second)
    used = pool.allocator.num_in_use() * pool.bytes_per_page
    cache.release()

    wide = PagePool(num_layers=6, num_kv_heads=heads, head_dim=head_dim, page_size=4, num_pages=160,
                    dtype=mx.float32)
    with make_paged_cache(model, wide) as plain:
        run(model, plain, second)
        assert len(plain.tables) == 2
        assert used * 2 < wide.allocator.num_in_use() * wide.bytes_per_page
    assert pool.allocator.num_in_use() == 0
    pool.allocator.check()


def test_a_sliding_table_registered_after_its_window_moved_on_files_its_last_windows_pages():
    """A finished request is registered once at its end (the serving engine's retire),
    when its sliding tables have dropped their first pages: the pages they still hold
    are filed, so a next turn hits up to the end and decodes as without the cache."""
    model = make_model("gemma3_text")
    pool = make_pool("gemma3_text", page_size=4, num_pages=64)
    prefix = PrefixCache(pool, windows=(12,))
    tokens = prompt_of(29, seed=7)
    cache, rest = prefix.new_cache(model, tokens)
    out = run(model, cache, rest, n=12)  # the prompt in one forward, then 11 steps past the window
    sliding = next(t for t in cache.tables if t.window is not None)
    assert sliding.first_visible() > 0
    seen = tokens + out[:-1]  # (the last token is not written)
    assert prefix.register(cache, seen) > 0
    cache.release()
    turn = seen + [5, 6]
    assert len(prefix.match(turn)) == len(seen) // 4  # every full page, the window's last pages included
    cache, rest = prefix.new_cache(model, turn)
    got = run(model, cache, rest, n=4)
    cache.release()
    with make_paged_cache(model, pool) as plain:
        assert got == run(model, plain, turn, n=4)
    pool.allocator.check()
