"""Random prefills / steps / bad states / forks / releases / batches / prefix hits over
sequences of a hybrid model (recurrent, attention, recurrent, attention), on small page
and state pools, against a plain Python reference.

A token's K is ``id + arange(D)/D`` and its V is ``-K``; a recurrent layer's state is
(sum of the ids seen, how many) and (the last id), so the reference of a sequence is its
list of token ids. After every rule: both allocators' invariants hold; every live
sequence and batch row reads exactly its reference (K/V and state); a call that raised
left both pools and the cache byte-for-byte as they were; teardown leaves no page and no
slot held.
"""

import hypothesis.strategies as st
import mlx.core as mx
import numpy as np
import pytest
from batch_rules import FilterBatchRule
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from mlx_lm.models.cache import ArraysCache, KVCache
from snapshots import state_of, state_pool_of

from pagedkv import (
    KvShapeError,
    PagedBatch,
    PagePool,
    PoolExhausted,
    PrefixCache,
    StatePool,
)

D, PS = 32, 3
PREFIX = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # a shared start, so prefix hits happen
SHAPES = [[((2,), mx.float32)], [((2,), mx.float32), ((1,), mx.float32)]]


class Hybrid:
    """A model's cache layout: recurrent, attention, recurrent, attention."""

    layers = [0, 0, 0, 0]

    def make_cache(self):
        return [ArraysCache(1), KVCache(), ArraysCache(2), KVCache()]


def kv_of(ids):
    k = (mx.array(ids, dtype=mx.float32)[:, None] + mx.arange(D)[None] / D)[None, None]
    return k, -k


def state_after(ids: list[int], layer: int) -> list[np.ndarray]:
    total = np.array([float(sum(ids)), float(len(ids))], dtype=np.float32)
    if layer == 0:
        return [total]
    return [total, np.array([float(ids[-1]) if ids else 0.0], dtype=np.float32)]


def run_step(cache, rows_ids: list[list[int]], bad_layer: int | None = None) -> None:
    """One step of every layer for B rows: each row appends its ids (same count)."""
    n = len(rows_ids[0])
    for face in cache:
        if hasattr(face, "advance"):
            r = face.layer
            old = [face[c] for c in range(len(SHAPES[r]))]
            new = []
            for c in range(len(SHAPES[r])):
                prev = np.zeros((len(rows_ids), *SHAPES[r][c][0]), np.float32) if old[c] is None \
                    else np.array(old[c])
                for b, ids in enumerate(rows_ids):
                    if c == 0:
                        prev[b] += np.array([sum(ids), len(ids)], np.float32)
                    else:
                        prev[b] = ids[-1]
                new.append(mx.array(prev))
            for c, value in enumerate(new):
                face[c] = value[:, :1] if bad_layer == r and c == 0 else value
            face.advance(n)
        else:
            k = mx.concatenate([kv_of(ids)[0] for ids in rows_ids])
            face.update_and_fetch(k, -k)


class HybridSequences(FilterBatchRule, RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = PagePool(num_layers=2, num_kv_heads=1, head_dim=D, page_size=PS, num_pages=16,
                             dtype=mx.float32, cache_limit=None)
        self.states = StatePool(SHAPES, num_slots=6)
        self.prefix = PrefixCache(self.pool, state_pool=self.states, checkpoint_every=1)
        self.seqs = []  # (prompt cache, ids, prefix keys)
        self.batch = self._batch()
        self.rows = []  # ids of each batch row
        self.next_id = 20

    def _batch(self):
        from pagedkv.cache import layout_for

        return PagedBatch(layout_for(Hybrid(), self.pool, state_pool=self.states))

    def _snapshot(self, owner):
        return state_of(self.pool, owner), state_pool_of(self.states)

    def _fresh(self, n):
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        return ids

    def _step(self, cache, rows_ids, owner=None) -> bool:
        owner = cache if owner is None else owner
        before = self._snapshot(owner)
        try:
            run_step(cache, rows_ids)
        except PoolExhausted:
            assert self._snapshot(owner) == before
            return False
        return True

    # ------------------------------------------------------------------ sequences
    @precondition(lambda self: len(self.seqs) < 4)
    @rule(n=st.integers(1, 14), chunk=st.integers(1, 5))
    def new_sequence(self, n, chunk):
        ids = PREFIX[:n] if n <= len(PREFIX) else PREFIX + self._fresh(n - len(PREFIX))
        keys = self.prefix.keys(ids)
        try:
            cache, rest = self.prefix.new_cache(Hybrid(), keys)
        except PoolExhausted:
            return
        done = ids[: len(ids) - len(rest)]
        while rest:
            take = self.prefix.aligned_take(len(done), min(chunk, len(rest)))
            if not self._step(cache, [rest[:take]]):
                cache.release()
                return
            done, rest = done + rest[:take], rest[take:]
            self.prefix.register(cache, keys)
        self.seqs.append((cache, done, keys))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), n=st.integers(1, 4))
    def step(self, data, n):
        i = data.draw(st.integers(0, len(self.seqs) - 1))
        cache, ids, keys = self.seqs[i]
        new = self._fresh(n)
        if self._step(cache, [new]):
            ids.extend(new)
            keys.extend(new)
            self.prefix.register(cache, keys)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), layer=st.integers(0, 1))
    def step_with_a_bad_state(self, data, layer):
        """The step rolls back: tables, positions and slots as before; the allocators too,
        unless the step's reservation evicted cached pages or slots (their keys are gone
        for good). Bytes an earlier layer wrote past the sequence's end stay (unseen)."""
        cache, _, _ = data.draw(st.sampled_from(self.seqs))
        pages, slots = state_of(self.pool, cache, arrays=False), state_pool_of(self.states)
        try:
            run_step(cache, [self._fresh(1)], bad_layer=layer)
            raise AssertionError("a bad state was accepted")
        except (KvShapeError, PoolExhausted):
            pass
        pages_after, slots_after = state_of(self.pool, cache, arrays=False), state_pool_of(self.states)
        assert pages_after[2] == pages[2]  # tables, positions, the rows' slots and state tokens
        if pages_after[0][0].pages_evicted == pages[0][0].pages_evicted:
            assert pages_after[0][1:] == pages[0][1:]
        if slots_after[0][0].pages_evicted == slots[0][0].pages_evicted:
            assert slots_after[0][1:] == slots[0][1:]  # slot states, counts, LRU, free list
        assert slots_after[1] == slots[1]  # every slot's bytes

    @precondition(lambda self: self.seqs and len(self.seqs) < 4)
    @rule(data=st.data())
    def fork(self, data):
        cache, ids, keys = data.draw(st.sampled_from(self.seqs))
        twin_keys = self.prefix.keys(ids)
        self.seqs.append((cache.fork(), list(ids), twin_keys))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def release(self, data):
        cache, _, _ = self.seqs.pop(data.draw(st.integers(0, len(self.seqs) - 1)))
        cache.release()

    # ------------------------------------------------------------------ a batch
    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def join_batch(self, data):
        cache, ids, _ = self.seqs.pop(data.draw(st.integers(0, len(self.seqs) - 1)))
        self.batch.extend(cache)
        self.rows.append(ids)

    @precondition(lambda self: self.rows)
    @rule()
    def batch_step(self):
        new = [self._fresh(1) for _ in self.rows]
        if self._step(self.batch.caches, new, owner=self.batch):
            for row, ids in zip(self.rows, new):
                row.extend(ids)

    @precondition(lambda self: self.rows and len(self.seqs) < 4)
    @rule(data=st.data())
    def leave_batch(self, data):
        i = data.draw(st.integers(0, len(self.rows) - 1))
        ids = self.rows.pop(i)
        self.seqs.append((self.batch.extract(i), ids, self.prefix.keys(ids)))

    # ------------------------------------------------------------------ invariants
    def _expect(self, faces, ids_per_row):
        for face in faces:
            if hasattr(face, "advance"):
                for c in range(len(SHAPES[face.layer])):
                    got = face[c]
                    want = np.stack([state_after(ids, face.layer)[c] for ids in ids_per_row])
                    np.testing.assert_array_equal(np.zeros_like(want) if got is None else np.array(got), want)
            else:
                k = face.keys_and_values()[0]
                for b, ids in enumerate(ids_per_row):
                    got = [round(x) for x in np.array(k[b, 0, :, 0]).tolist()][: len(ids)]
                    assert got == ids

    @invariant()
    def everything_reads_its_reference(self):
        self.pool.allocator.check()
        self.states.allocator.check()
        self.prefix.check()
        for cache, ids, _ in self.seqs:
            if ids:
                self._expect(cache, [ids])
        if self.rows and all(self.rows):
            self._expect(self.batch.caches, self.rows)

    def teardown(self):
        for cache, _, _ in self.seqs:
            cache.release()
        self.batch.release()
        for alloc in (self.pool.allocator, self.states.allocator):
            alloc.check()
            assert alloc.num_in_use() == 0


TestHybridSequences = HybridSequences.TestCase  # a quarter of the examples in the quick loop
TestHybridSequences.settings = settings(max_examples=20, stateful_step_count=30, deadline=None)


@pytest.mark.slow
class TestHybridSequencesThorough(HybridSequences.TestCase):
    settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
