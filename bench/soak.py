"""Seeded soak: a million mixed operations across the allocator, page tables, caches of a
model with sliding and full layers, forks, views, a batch and a prefix cache, in a small
pool that runs out often, with bad input mixed in.

Counts, and prints at the end:
- invariant violations: ``allocator.check()`` and ``PrefixCache.check()`` failures (run every ``--check-every`` ops
  and after every failed call);
- unchanged-state violations: a call that raised a pagedkv or allocator error but
  changed the allocator (states, counts, LRU, free list) or a table;
- leaked pages: pages still in use after every holder was released at the end;
- untyped errors: exceptions that are not pagedkv / allocator errors.

    python bench/soak.py                 # 10^6 operations, full precision + quantised pools
    python bench/soak.py --ops 20000     # a quick run (the test suite runs one)

There is no baseline to compare with: the figure is "0 of N".
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter

import mlx.core as mx
import numpy as np

from allocators import AllocatorError
from pagedkv import (
    AffineQuant,
    KvAttentionView,
    PagedBatch,
    PagedKvError,
    PagePool,
    PrefixCache,
    rotated,
)

H, D, PS = 1, 32, 4
TYPED = (PagedKvError, AllocatorError)


class _Mixed:
    layers = [0, 0]

    def make_cache(self):
        from mlx_lm.models.cache import KVCache, RotatingKVCache

        return [RotatingKVCache(6), KVCache()]


class _Full:
    layers = [0, 0]

    def make_cache(self):
        from mlx_lm.models.cache import KVCache

        return [KVCache(), KVCache()]


def _kv(n: int, b: int = 1, dtype=mx.float32):
    k = mx.ones((b, H, n, D), dtype=dtype)
    return k, -k


def _alloc_state(pool) -> tuple:
    a = pool.allocator
    return (a._state.tobytes(), a._refcount.tobytes(), a._cacheable.tobytes(), tuple(a.cached_pages()),
            np.asarray(a._free_ids()).tobytes())


def _tables_state(tables) -> tuple:
    return tuple((t.released, t.num_tokens, t.pages.tobytes()) for t in tables)


class Soak:
    def __init__(self, seed: int, codecs) -> None:
        self.rng = random.Random(seed)
        self.pool = PagePool(num_layers=2, num_kv_heads=H, head_dim=D, page_size=PS, num_pages=40,
                             dtype=mx.float32, cache_limit=None, k_codec=codecs[0], v_codec=codecs[1])
        self.prefix = PrefixCache(self.pool, windows=(6,))  # (_Mixed's window)
        self.seqs: list = []
        self.dead: list = []
        self.views: list = []
        self.batch = PagedBatch(self.pool, 2)
        self.counts: Counter = Counter()
        self.debug = False

    # every operation returns nothing; errors are judged by ``run``
    def op_new(self):
        if len(self.seqs) >= 6:
            return self.op_release()
        # both models start from prefix hits (a mixed one's also needs its window's pages);
        # their keys apart, as two models' must be
        model, extra = (_Full(), b"") if self.rng.random() < 0.5 else (_Mixed(), b"mixed")
        tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12][: self.rng.randint(1, 12)] + [self.rng.randint(13, 50)]
        keys = self.prefix.keys(tokens, extra_keys=extra)
        cache, rest = self.prefix.new_cache(model, keys)
        self.seqs.append(cache)
        for c in cache:
            c.update_and_fetch(*_kv(len(rest)))
        self.prefix.register(cache, keys)

    def _seq(self):
        """A live sequence whose layers are level (a per-layer trim whose catch-up write
        ran out of pages leaves them uneven; steps on those are per layer, not atomic)."""
        level = [c for c in self.seqs if len({x.offset for x in c}) == 1]
        return self.rng.choice(level) if level else None

    def op_step(self):
        cache = self._seq()
        if cache is not None:
            n = self.rng.choice([1, 1, 1, 2, 5])
            for c in cache:
                c.update_and_fetch(*_kv(n))

    def op_bad_step(self):
        cache = self._seq()
        if cache is not None:
            cache[0].update_and_fetch(*_kv(1))
            cache[1].update_and_fetch(*_kv(1, dtype=mx.float16))  # rolls the step back

    def op_trim(self):
        cache = self._seq()
        if cache is not None:
            n = self.rng.randint(0, 6)
            if self.rng.random() < 0.7:  # every layer by the same count
                n = min([n] + [c.max_trim() for c in cache])
                for c in cache:
                    c.trim(n)
            else:
                layer = self.rng.randint(0, 1)
                cache[layer].trim(n)  # may raise TrimError
                if cache[layer].offset < cache[1 - layer].offset:
                    cache[layer].update_and_fetch(*_kv(cache[1 - layer].offset - cache[layer].offset))

    def op_fork(self):
        cache = self._seq()
        if cache is not None and len(self.seqs) < 6:
            self.seqs.append(cache.fork())

    def op_release(self):
        if self.seqs:
            cache = self.seqs.pop(self.rng.randrange(len(self.seqs)))
            cache.release()
            self.dead.append(cache)
            del self.dead[:-8]

    def op_use_released(self):
        if self.dead:
            cache = self.rng.choice(self.dead)
            self.rng.choice([lambda: cache.fork(), lambda: cache.release(),
                             lambda: cache[0].update_and_fetch(*_kv(1)) if len(cache) else cache.fork()])()

    def op_view(self):
        if self.views and (len(self.views) > 6 or self.rng.random() < 0.5):
            self.views.pop(self.rng.randrange(len(self.views))).release()
        else:
            cache = self._seq()
            if cache is not None and cache[1].offset:
                self.views.append(KvAttentionView.of_cache(cache[self.rng.randint(0, 1)]))

    def op_batch(self):
        r = self.rng.random()
        if r < 0.3:
            full = [c for c in self.seqs if len(c.tables) == 1 and c[0].offset == c[1].offset]
            if full:
                cache = self.rng.choice(full)
                self.seqs.remove(cache)
                self.dead.append(cache)
                self.batch.extend(cache)
        elif r < 0.7 and self.batch.size:
            for c in self.batch.caches:
                c.update_and_fetch(*_kv(1, b=self.batch.size))
        elif r < 0.85 and self.batch.size and len(self.seqs) < 6:
            self.seqs.append(self.batch.extract(self.rng.randrange(self.batch.size)))
        elif self.batch.size:
            self.batch.filter([i for i in range(self.batch.size) if self.rng.random() < 0.7])

    def op_bad_input(self):
        a, pool, rng = self.pool.allocator, self.pool, self.rng
        free = [int(p) for p in a._free_ids()] + [0]  # free pages and the null page

        rng.choice([
            lambda: a.decref([rng.choice(free)]),  # a double free
            lambda: a.incref([rng.choice(free + [-2, pool.num_pages + 3])]),
            lambda: a.allocate(rng.choice([-1, 1.5, 10**6])),
            lambda: pool.copy_pages([1], [rng.choice(free)]),
            lambda: self.seqs[0][0].update_and_fetch(mx.ones((1, H + 1, 1, D)), mx.ones((1, H + 1, 1, D)))
            if self.seqs else a.allocate(-1),
            lambda: self.seqs[0][0].trim(-1) if self.seqs else a.allocate(-1),
            lambda: self.prefix.register(self.seqs[0], ["x"] * 99) if self.seqs else a.allocate(-1),
            # keys of another root (another adapter's): its registered pages are refused
            lambda: self.prefix.register(self.seqs[0], self.prefix.keys(list(range(1, 2000)), extra_keys=b"other"))
            if self.seqs else a.allocate(-1),
            lambda: self.batch.extract(99),
        ])()

    OPS = [("new", 8), ("step", 30), ("bad_step", 4), ("trim", 8), ("fork", 5), ("release", 6),
           ("use_released", 3), ("view", 8), ("batch", 14), ("bad_input", 14)]

    def run(self, ops: int, check_every: int) -> Counter:
        names = [n for n, _ in self.OPS]
        weights = [w for _, w in self.OPS]
        c = self.counts
        self.history: list = []
        for i in range(ops):
            name = self.rng.choices(names, weights)[0]
            self.history = (self.history + [(i, name)])[-12:]
            before = (_alloc_state(self.pool), self._tables())
            evictions = self.pool.allocator.stats().pages_evicted
            try:
                getattr(self, "op_" + name)()
            except TYPED as e:
                c["typed errors"] += 1
                c[type(e).__name__] += 1
                # "new" and the per-layer "trim" are several calls, so an error in a later
                # one legitimately follows earlier changes; every other op is one call (or
                # one step) that must leave everything as it was, bar prefix evictions.
                changed = (_alloc_state(self.pool), self._tables()) != before
                evicted = self.pool.allocator.stats().pages_evicted != evictions
                if changed and not evicted and name not in ("new", "trim"):
                    c["unchanged-state violations"] += 1
                    c[f"changed by failed {name}: {type(e).__name__}: {str(e)[:60]}"] += 1
                self._check()
            except Exception as e:  # noqa: BLE001 - counted, the soak goes on
                c["untyped errors"] += 1
                c["untyped: " + type(e).__name__ + ": " + str(e)[:80]] += 1
            if i % check_every == 0:
                self._check()
            if self.debug and (c["unchanged-state violations"] or c["invariant violations"] or c["untyped errors"]
                               or self._leaked()):
                print("first problem after", self.history, dict(c))
                raise SystemExit(1)
        return c

    def _tables(self) -> tuple:
        tables = [t for cache in self.seqs for t in cache.tables] + list(self.batch.tables())
        return _tables_state(tables)

    def _leaked(self) -> int:
        """References held beyond what live tables and views account for."""
        counts = np.zeros(self.pool.num_pages, dtype=np.int64)
        for t in [t for cache in self.seqs for t in cache.tables] + list(self.batch.tables()):
            np.add.at(counts, t.pages[t._dropped:], 1)
        for v in self.views:
            np.add.at(counts, v._held, 1)
        for rows in [c.rows for c in self.seqs] + [self.batch.rows]:  # a step some layers have
            for _, record in rows._journal:  # not finished keeps what it replaced
                np.add.at(counts, record.owed, 1)
        return int((self.pool.allocator._refcount != counts).sum())

    def _check(self) -> None:
        try:
            self.pool.allocator.check()
            self.prefix.check()
        except AssertionError:
            self.counts["invariant violations"] += 1

    def finish(self) -> int:
        for v in self.views:
            v.release()
        for cache in self.seqs:
            cache.release()
        self.batch.release()
        self._check()
        return self.pool.allocator.num_in_use()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", type=int, default=1_000_000, help="operations in all (split over the pool kinds)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check-every", type=int, default=500)
    p.add_argument("--debug", action="store_true", help="stop at the first problem and print the last ops")
    args = p.parse_args(argv)
    kinds = {"full precision": (None, None), "k8 affine + v4 rotated": (AffineQuant(8, 32), rotated(4, D, 32))}
    total = Counter()
    leaked = 0
    t0 = time.perf_counter()
    for i, (label, codecs) in enumerate(kinds.items()):
        soak = Soak(args.seed + i, codecs)
        soak.debug = args.debug
        counts = soak.run(args.ops // len(kinds), args.check_every)
        leak = soak.finish()
        leaked += leak
        total.update(counts)
        print(f"{label}: {args.ops // len(kinds):,} ops, typed errors {counts['typed errors']:,}, "
              f"invariant violations {counts['invariant violations']}, unchanged-state violations "
              f"{counts['unchanged-state violations']}, untyped errors {counts['untyped errors']}, leaked pages {leak}")
    print(f"errors seen: {dict((k, v) for k, v in total.items() if k[0].isupper() or k.startswith(('untyped:', 'changed')))}")
    bad = total["invariant violations"] + total["unchanged-state violations"] + total["untyped errors"] + leaked
    print(f"total: {args.ops:,} ops in {time.perf_counter() - t0:.0f} s; invariant violations "
          f"{total['invariant violations']}, unchanged-state violations {total['unchanged-state violations']}, "
          f"untyped errors {total['untyped errors']}, leaked pages {leaked}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
