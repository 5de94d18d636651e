"""Random steps / trims / rewrites / forks / views / batches / prefix hits / releases over
sequences of a model with a sliding-window layer and a full-attention layer, on full
precision and quantised pools, against a plain Python reference.

A token's K is ``id + arange(D)/D`` and its V is ``-K``, so the reference is a list of
token ids per layer, and prefix-cache pages (keyed by token ids) hold the same values.
After every rule: the allocator's invariant holds; every live sequence, batch row and
view reads exactly its reference; a call that raised left everything byte-for-byte as it
was (or, for a failed step, as before the step); every released or moved cache raises
``ReleasedError``. A variant puts a disk tier under the prefix cache.
"""

import shutil
import tempfile

import hypothesis.strategies as st
import mlx.core as mx
import numpy as np
import pytest
from batch_rules import FilterBatchRule
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from mlx_lm.models.cache import KVCache, RotatingKVCache
from snapshots import state_of

from pagedkv import (
    AffineQuant,
    KvAttentionView,
    KvDTypeError,
    PagedBatch,
    PagePool,
    PoolExhausted,
    PrefixCache,
    ReleasedError,
    TrimError,
    rotated,
)
from pagedkv.disk_tier import DiskTier

D, PS, W = 32, 3, 5
PREFIX = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # shared prompt start, so prefix hits happen


class Mixed:
    layers = [0, 0]

    def make_cache(self):
        return [RotatingKVCache(W), KVCache()]


class FullOnly:
    layers = [0, 0]

    def make_cache(self):
        return [KVCache(), KVCache()]


def kv_of(ids, dtype=mx.float32):
    k = mx.array(ids, dtype=mx.float32)[:, None] + mx.arange(D)[None] / D
    k = k[None, None].astype(dtype)
    return k, -k


def ids_in(k) -> list[int]:
    return [round(x) for x in np.array(k[0, 0, :, 0].astype(mx.float32)).tolist()]


class Sequences(FilterBatchRule, RuleBasedStateMachine):
    codecs = (None, None)

    def __init__(self):
        super().__init__()
        self.pool = PagePool(num_layers=2, num_kv_heads=1, head_dim=D, page_size=PS, num_pages=14,
                             dtype=mx.float32, cache_limit=None, k_codec=self.codecs[0],
                             v_codec=self.codecs[1])
        self.disk = self.make_disk()
        self.prefix = PrefixCache(self.pool, windows=(W,), disk=self.disk)
        self.seqs = []  # (prompt cache, [ids per layer], full_only)
        self.dead = []  # released or moved prompt caches
        self.views = []  # (view, ids it must show)
        self.batch = PagedBatch(self.pool, 2)
        self.rows = []  # ids of each batch row
        self.next_id = 20

    def make_disk(self) -> DiskTier | None:
        return None

    # ------------------------------------------------------------------ helpers
    def _fresh(self, n):
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        return ids

    def _step(self, cache, ids_per_layer, ids):
        """One step of every layer; on PoolExhausted nothing may change."""
        before = state_of(self.pool, cache)
        try:
            for c in cache:
                c.update_and_fetch(*kv_of(ids))
        except PoolExhausted:
            assert state_of(self.pool, cache) == before
            return False
        for lst in ids_per_layer:
            lst.extend(ids)
        return True

    def _expect(self, cache_layer, ids):
        got = ids_in(cache_layer.state[0])
        first = cache_layer.table.first_visible()
        assert got == ids[first:], (got, ids)

    def _keys(self, ids, full_only):
        """Keys of each model apart: a full-only page holds both layers, a mixed
        sequence's full page only its full layer (the other is its sliding table's)."""
        return self.prefix.keys(ids, extra_keys=b"" if full_only else b"mixed")

    # ------------------------------------------------------------------ sequences
    @precondition(lambda self: len(self.seqs) < 4)
    @rule(n=st.integers(1, 14), full_only=st.booleans())
    def new_sequence(self, n, full_only):
        """Both models start from prefix hits: the mixed one's hit also needs the
        sliding layer's last pages (its table lists the earlier ones as dropped)."""
        ids = PREFIX[:n] if n < len(PREFIX) else PREFIX + self._fresh(n - len(PREFIX))
        try:
            cache, rest = self.prefix.new_cache(FullOnly() if full_only else Mixed(), self._keys(ids, full_only))
        except PoolExhausted:
            return
        done = ids[: len(ids) - len(rest)]
        per_layer = [list(done), list(done)]
        if not self._step(cache, per_layer, rest):
            cache.release()
            return
        self.prefix.register(cache, self._keys(per_layer[0], full_only))
        self.seqs.append((cache, per_layer, full_only))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def register(self, data):
        """Any sequence whose layers are level files its full pages (a mixed one also
        the pages its sliding table holds); later writes copy them first."""
        cache, per_layer, full_only = data.draw(st.sampled_from(self.seqs))
        if per_layer[0] == per_layer[1]:
            self.prefix.register(cache, self._keys(per_layer[0], full_only))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), n=st.integers(1, 4))
    def step(self, data, n):
        cache, per_layer, _ = data.draw(st.sampled_from(self.seqs))
        if per_layer[0] == per_layer[1]:  # layers in step (not mid-rewrite)
            self._step(cache, per_layer, self._fresh(n))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), n=st.integers(1, 3))
    def step_with_bad_last_layer(self, data, n):
        cache, per_layer, _ = data.draw(st.sampled_from(self.seqs))
        if per_layer[0] != per_layer[1]:
            return
        before = state_of(self.pool, cache, arrays=False)
        ids = self._fresh(n)
        try:
            cache[0].update_and_fetch(*kv_of(ids))
        except PoolExhausted:
            return
        try:
            cache[1].update_and_fetch(*kv_of(ids, mx.float16))
            raise AssertionError("a float16 step into a float32 pool was accepted")
        except KvDTypeError:
            pass
        after = state_of(self.pool, cache, arrays=False)
        assert after[2] == before[2]  # tables (page ids included) and every layer's position
        if after[0][0].pages_evicted == before[0][0].pages_evicted:  # no prefix page evicted
            assert after[0][1:] == before[0][1:]  # states, counts, flags, LRU, free list

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), n=st.integers(0, 6))
    def trim_all_layers(self, data, n):
        cache, per_layer, _ = data.draw(st.sampled_from(self.seqs))
        if per_layer[0] != per_layer[1]:
            return
        before = state_of(self.pool, cache)
        try:
            for c in cache:
                c.trim(n)
        except TrimError:
            assert state_of(self.pool, cache) == before
            return
        for lst in per_layer:
            del lst[max(0, len(lst) - n):]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), layer=st.integers(0, 1), n=st.integers(1, 4))
    def trim_one_layer_and_rewrite(self, data, layer, n):
        cache, per_layer, _ = data.draw(st.sampled_from(self.seqs))
        if per_layer[0] != per_layer[1] or len(per_layer[layer]) <= n:
            return
        before = state_of(self.pool, cache)
        try:
            cache[layer].trim(n)
        except TrimError:
            assert state_of(self.pool, cache) == before
            return
        del per_layer[layer][-n:]
        ids = self._fresh(n)
        try:
            cache[layer].update_and_fetch(*kv_of(ids))  # a rewrite: copy-on-write if shared
            per_layer[layer].extend(ids)
        except PoolExhausted:
            ids = []
        other = 1 - layer  # bring the other layer level again where the window allows
        try:
            cache[other].trim(n)
            del per_layer[other][-n:]
            if ids:
                cache[other].update_and_fetch(*kv_of(ids))
                per_layer[other].extend(ids)
        except (TrimError, PoolExhausted):
            pass  # layers stay uneven; the rules that need them level skip this sequence

    @precondition(lambda self: any(s[2] for s in self.seqs))
    @rule()
    def register_filled_pages(self):
        """What a decode step that registers eagerly does: each full-only sequence's next
        full page, in one ``register_next``; later hits read the ids back (``_expect``)."""
        pages, keys = [], []
        for cache, per_layer, full_only in self.seqs:
            if not full_only or per_layer[0] != per_layer[1]:
                continue
            k = self._keys(per_layer[0], True)
            self.prefix.match(k)  # the nodes of the pages cached so far
            i = len(k.nodes)
            if (i + 1) * PS > len(per_layer[0]):
                continue
            page = int(cache.tables[0].page_ids(i, i + 1)[0])
            if page not in pages:  # (forks share pages)
                pages.append(page)
                keys.append(k)
        if pages:
            self.prefix.register_next(pages, keys)

    @precondition(lambda self: self.seqs and len(self.seqs) < 4)
    @rule(data=st.data())
    def fork(self, data):
        cache, per_layer, full_only = data.draw(st.sampled_from(self.seqs))
        self.seqs.append((cache.fork(), [list(x) for x in per_layer], full_only))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def release(self, data):
        i = data.draw(st.integers(0, len(self.seqs) - 1))
        cache, _, _ = self.seqs.pop(i)
        cache.release()
        self.dead.append(cache)

    @precondition(lambda self: self.dead)
    @rule(data=st.data(), op=st.sampled_from(["write", "state", "trim", "view", "release", "fork"]))
    def use_after_release(self, data, op):
        cache = data.draw(st.sampled_from(self.dead))
        before = state_of(self.pool, *(s[0] for s in self.seqs))
        call = {"write": lambda: cache[0].update_and_fetch(*kv_of([1])), "state": lambda: cache[0].state,
                "trim": lambda: cache[0].trim(1), "view": lambda: cache[0].fetch_shared("view"),
                "release": cache.release, "fork": cache.fork}[op]
        try:
            call()
            raise AssertionError(f"{op} on a released cache was accepted")
        except (ReleasedError, IndexError):  # IndexError: a moved cache's list is empty
            pass
        assert state_of(self.pool, *(s[0] for s in self.seqs)) == before

    # ------------------------------------------------------------------ views
    @precondition(lambda self: self.seqs and len(self.views) < 4)
    @rule(data=st.data(), layer=st.integers(0, 1))
    def take_view(self, data, layer):
        cache, per_layer, _ = data.draw(st.sampled_from(self.seqs))
        c = cache[layer]
        if c.offset == 0:
            return
        view = KvAttentionView.of_cache(c, start=c.table.first_visible())
        self.views.append((view, per_layer[layer][c.table.first_visible() : c.offset]))

    @precondition(lambda self: self.views)
    @rule(data=st.data())
    def release_view(self, data):
        self.views.pop(data.draw(st.integers(0, len(self.views) - 1)))[0].release()

    # ------------------------------------------------------------------ batch
    @precondition(lambda self: any(s[2] and s[1][0] == s[1][1] for s in self.seqs))
    @rule(data=st.data())
    def join_batch(self, data):
        i = data.draw(st.sampled_from([i for i, s in enumerate(self.seqs) if s[2] and s[1][0] == s[1][1]]))
        cache, per_layer, _ = self.seqs.pop(i)
        self.batch.extend(cache)
        self.rows.append(per_layer[0])
        self.dead.append(cache)

    @precondition(lambda self: self.rows)
    @rule()
    def batch_step(self):
        ids = self._fresh(len(self.rows))
        k = mx.concatenate([kv_of([i])[0] for i in ids])
        before = state_of(self.pool, self.batch)
        try:
            for c in self.batch.caches:
                c.update_and_fetch(k, -k)
        except PoolExhausted:
            assert state_of(self.pool, self.batch) == before
            return
        for row, i in zip(self.rows, ids):
            row.append(i)

    @precondition(lambda self: self.rows and len(self.seqs) < 4)
    @rule(data=st.data())
    def leave_batch(self, data):
        i = data.draw(st.integers(0, len(self.rows) - 1))
        cache = self.batch.extract(i)
        ids = self.rows.pop(i)
        self.seqs.append((cache, [list(ids), list(ids)], True))

    # ------------------------------------------------------------------ invariants
    @invariant()
    def everything_reads_its_reference(self):
        self.pool.allocator.check()
        self.prefix.check()
        for cache, per_layer, _ in self.seqs:
            for layer in range(2):
                if cache[layer].offset:
                    self._expect(cache[layer], per_layer[layer])
        for view, ids in self.views:
            assert ids_in(view.keys_values()[0]) == ids
        for table, ids in zip(self.batch.tables(), self.rows):
            if not ids:
                continue
            with KvAttentionView(self.pool, 1, [table]) as v:
                assert ids_in(v.keys_values()[0]) == ids

    def teardown(self):
        for view, _ in self.views:
            view.release()
        for cache, _, _ in self.seqs:
            cache.release()
        self.batch.release()
        self.pool.allocator.check()
        assert self.pool.allocator.num_in_use() == 0


class QuantizedSequences(Sequences):
    codecs = (AffineQuant(8, 32), rotated(4, D, 32))  # K read back to +-0.01; V rotated


class DiskSequences(Sequences):
    """The same with a disk tier under the prefix cache: evicted full and window pages
    are spilled, and a later hit that runs out of RAM pages reads them back (from the
    write queue or from their files), so they must read the ids they were written with."""

    def make_disk(self) -> DiskTier:
        self.directory = tempfile.mkdtemp(prefix="pagedkv-disk-")
        return DiskTier(self.directory, self.pool, max_bytes=1 << 24)

    @rule()
    def evict_every_cached_page(self):
        self.pool.allocator.evict(self.pool.allocator.num_cached())

    def teardown(self):
        try:
            super().teardown()
            assert self.disk.flush(30) and self.disk._writer.is_alive()  # (it died on a digest queued twice)
        finally:
            self.disk.close()
            shutil.rmtree(self.directory, ignore_errors=True)


TestSequences = Sequences.TestCase  # a quarter of the examples in the quick loop
TestSequences.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)


@pytest.mark.slow
class TestSequencesThorough(Sequences.TestCase):
    settings = settings(max_examples=90, stateful_step_count=30, deadline=None)


TestDiskSequences = pytest.mark.slow(DiskSequences.TestCase)
TestDiskSequences.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestQuantizedSequences = pytest.mark.slow(QuantizedSequences.TestCase)
TestQuantizedSequences.settings = settings(max_examples=50, stateful_step_count=30, deadline=None)
