"""Random compiled decode steps, eager steps, row changes, trims, tight pools and
lookahead releases on a ``CompiledDecode``'s batch, against a twin batch that only ever
steps eagerly (same model, same prompts, a pool of its own).

After every rule: both batches hold the same rows at the same lengths; every step gave
the same logits (float rounding) on both sides or raised ``PoolExhausted`` on both; each
pool's allocator invariant holds; and the compiled side's free pages plus its lookahead
pages equal the eager side's free pages (a lookahead page is never lost, leaked or
counted twice, and never makes a step fail that would succeed without it).
"""

import hypothesis.strategies as st
import mlx.core as mx
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from tiny_models import LOGITS_ATOL, make_model, make_pool, prompt_of

from pagedkv import CompiledDecode, PagedBatch, PoolExhausted, make_paged_cache

MODEL = make_model("llama")
PS, PAGES = 4, 40


class CompiledTwins(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.eager = PagedBatch.for_model(MODEL, make_pool("llama", page_size=PS, num_pages=PAGES))
        self.compiled = PagedBatch.for_model(MODEL, make_pool("llama", page_size=PS, num_pages=PAGES))
        self.step = CompiledDecode(MODEL, self.compiled, bucket=2)
        self.grabbed: list[tuple[list, list]] = []  # pages someone else took from each pool
        self.seed = 0

    def _sides(self):
        return (self.eager, self.compiled)

    @precondition(lambda self: self.eager.size < 4)
    @rule(n=st.integers(1, 14))
    def add_row(self, n):
        self.seed += 1
        added = []
        for batch in self._sides():
            cache = make_paged_cache(MODEL, batch.pool)
            try:
                MODEL(mx.array(prompt_of(n, seed=self.seed))[None], cache=cache)
            except PoolExhausted:
                cache.release()
                added.append(False)
                continue
            batch.extend(cache)
            added.append(True)
        if added[0] != added[1]:  # only the compiled pool's lookahead can make this differ
            assert not added[1] and self.step.lookahead_pages
            self.step.release_lookahead()  # what the serving engine does, then it retries
            if added[0]:
                self.eager.filter(list(range(self.eager.size - 1)))

    @precondition(lambda self: self.eager.size)
    @rule(data=st.data())
    def keep_some_rows(self, data):
        keep = data.draw(st.lists(st.integers(0, self.eager.size - 1), unique=True))
        for batch in self._sides():
            batch.filter(keep)

    @precondition(lambda self: self.eager.size)
    @rule(steps=st.integers(1, 9), token=st.integers(0, 127))
    def decode_compiled(self, steps, token):
        """Several compiled steps in a row: rows cross pages and spend their lookahead."""
        for i in range(steps):
            self.decode(True, token + i)

    @precondition(lambda self: self.eager.size)
    @rule(compiled_path=st.booleans(), token=st.integers(0, 127))
    def decode(self, compiled_path, token):
        tokens = [(token + i) % 128 for i in range(self.eager.size)]
        try:
            expect = MODEL(mx.array(tokens)[:, None], cache=self.eager.caches)
        except PoolExhausted:
            expect = None
        run = self.step if compiled_path else (lambda t: MODEL(t[:, None], cache=self.compiled.caches))
        try:
            got = run(mx.array(tokens))
        except PoolExhausted:
            got = None
        if not compiled_path and got is None and expect is not None and self.step.lookahead_pages:
            self.step.release_lookahead()  # an eager step knows nothing of them: give them back, retry
            got = run(mx.array(tokens))
        assert (expect is None) == (got is None)
        if got is not None:
            assert mx.allclose(expect, got, atol=LOGITS_ATOL).item()

    @precondition(lambda self: self.eager.size and min(self.eager.lengths) > 1)
    @rule(data=st.data())
    def trim(self, data):
        n = data.draw(st.integers(1, min(self.eager.lengths) - 1))
        for batch in self._sides():
            for cache in batch.caches:
                cache.trim(n)

    @rule(leave=st.integers(0, 6))
    def someone_takes_pages(self, leave):
        """Another user of each pool takes pages until ``leave`` are free on the compiled
        side, and as many on the eager side as the compiled step holds ahead more."""
        alloc_e, alloc_c = self.eager.pool.allocator, self.compiled.pool.allocator
        take = max(0, alloc_c.num_available() - leave)
        self.grabbed.append(([int(p) for p in alloc_e.allocate(take)] if take else [],
                             [int(p) for p in alloc_c.allocate(take)] if take else []))

    @precondition(lambda self: self.grabbed)
    @rule()
    def someone_gives_pages_back(self):
        pe, pc = self.grabbed.pop()
        if pe:
            self.eager.pool.allocator.decref(pe)
            self.compiled.pool.allocator.decref(pc)

    @rule()
    def release_lookahead(self):
        self.step.release_lookahead()
        assert self.step.lookahead_pages == 0

    @invariant()
    def same_rows_and_pages(self):
        assert self.eager.lengths == self.compiled.lengths
        for batch in self._sides():
            batch.pool.allocator.check()
        free_e = self.eager.pool.allocator.num_available()
        free_c = self.compiled.pool.allocator.num_available()
        assert free_c + self.step.lookahead_pages == free_e

    def teardown(self) -> None:
        for batch in self._sides():
            batch.release()
        self.step.release_lookahead()
        assert self.compiled.pool.allocator.num_available() == self.eager.pool.allocator.num_available()


TestCompiledTwins = CompiledTwins.TestCase
TestCompiledTwins.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
pytestmark = pytest.mark.slow
