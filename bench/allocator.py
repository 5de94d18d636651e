"""Allocator and prefix-cache hot paths against a model of vLLM's block pool, one process.

    python bench/allocator.py [--quick]

Sides: ``pagedkv`` (``FreeListAllocator``, and ``PrefixCache`` where pages are cached),
``vLLM model`` (bench/vllm_block_pool.py: vLLM v1's free-block queue, block map and
block hashing, written from its documented behaviour), and, for the plain scenarios, a
``deque`` free list with one object per page (how small block managers are written) and
``SortedAllocator``. Every scenario replays the same operations on each side; the sides
take turns round by round (``--rounds``), and each figure is the median round. The audit
columns are read back from each side's own state after the rounds, so both sides did
the same work: pages handed out, cached-page evictions, prefix-hit pages.

Scenarios (P = pages in the pool, page size 16):
  get+free n=1 / n=256      allocate n pages, free them (caching off / on: on means the
                            pool has a prefix cache, but these pages are not registered)
  cache churn n=1 / n=256   allocate n pages, register them under new keys, free them: the
                            pool is full of cached pages, so each page handed out evicts
                            the least recently used one and its key. n=1 also runs
                            ``floor``: the same per-page work (LRU log, count, flags, two
                            map entries per key) behind the same three calls, in bare
                            Python with no input checks, counters or listeners; and
                            ``checked floor``: that floor with the input checks and
                            counters a public API needs put back, and the evicted key
                            dropped in place: what a checked implementation of this API
                            cannot beat in CPython
  decode churn off / on     64 sequences decode from a running start (the pool and the
                            first prompts are set up before the clock); a page per
                            sequence every 16 steps; finished sequences free their pages
                            (last page first) and a new prompt takes their place; "on"
                            registers each page as it fills (vLLM: per request; pagedkv:
                            the step's pages in one call). Keys and hashes are computed
                            before the clock starts, as they are when tokens arrive.
                            "at release": pagedkv registers a sequence's pages when it
                            leaves (what its engine does; the audit's cached count then
                            leaves out the running sequences' pages); vLLM as "on"
  prefix hits + hashing     requests = one of 8 shared 1024-token system prompts + 256
                            own tokens: hash/cut the keys of the prompt, find the longest
                            cached prefix, take it, allocate the rest, register, free

Figures are per operation (an op = one allocate+free, one request, or one decode step).
The last column is vLLM model time / pagedkv time (> 1: pagedkv is faster).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from array import array
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_block_pool as vllm  # noqa: E402

from allocators import FreeListAllocator, SortedAllocator  # noqa: E402
from pagedkv import PagePool, PrefixCache, PrefixKeys  # noqa: E402

PAGE = 16


class _Block:
    __slots__ = ("page_id", "ref_count")

    def __init__(self, page_id: int) -> None:
        self.page_id = page_id
        self.ref_count = 0


class DequeBaseline:
    """How simple block managers are written: a deque of ids, one object per page."""

    def __init__(self, num_pages: int) -> None:
        self.free_ids = deque(range(num_pages))
        self.blocks = [_Block(i) for i in range(num_pages)]
        self.allocated = 0

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_ids):
            raise MemoryError
        out = []
        for _ in range(n):
            b = self.blocks[self.free_ids.popleft()]
            b.ref_count = 1
            out.append(b.page_id)
        self.allocated += n
        return out

    def decref(self, ids) -> None:
        for i in ids:
            b = self.blocks[i]
            if b.ref_count <= 0:
                raise ValueError("double free")
            b.ref_count -= 1
            if b.ref_count == 0:
                self.free_ids.append(i)


def _pool(num_pages: int) -> PagePool:
    """A pagedkv pool whose K/V arrays are tiny: only its page ids are exercised."""
    return PagePool(num_layers=1, num_kv_heads=1, head_dim=1, page_size=PAGE, num_pages=num_pages + 1)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(50_000) for _ in range(n)]


# ---------------------------------------------------------------------------- sides
class Side:
    """One side of a scenario: ``run()`` does one round of operations; ``audit()``."""

    def setup(self) -> None:
        """Untimed work before each round (building a fresh pool, say)."""

    def run(self) -> None: ...

    def audit(self) -> str:
        return ""


class GetFree(Side):
    def __init__(self, kind: str, n: int, iters: int, caching: bool) -> None:
        self.kind, self.n, self.iters = kind, n, iters
        pages = max(4096, 4 * n)
        if kind == "vllm":
            self.pool = vllm.BlockPool(pages + 1, enable_caching=caching)
            self.handed = 0
        elif kind == "deque":
            self.d = DequeBaseline(pages)
        else:
            self.a = (FreeListAllocator if kind == "pagedkv" else SortedAllocator)(pages + 1, null_page=True)
            if caching:  # a prefix cache is on: one page somewhere is registered
                keep = self.a.allocate(1)
                self.a.set_cacheable(keep)
            self.before = self.a.stats().pages_allocated

    def run(self) -> None:
        n, iters = self.n, self.iters
        if self.kind == "vllm":
            get, free = self.pool.get_new_blocks, self.pool.free_blocks
            for _ in range(iters):
                free(get(n))
            self.handed += n * iters
        elif self.kind == "deque":
            get, free = self.d.allocate, self.d.decref
            for _ in range(iters):
                free(get(n))
        elif n == 1:
            get, free = self.a.allocate_page, self.a.decref_page
            for _ in range(iters):
                free(get())
        else:
            get, free = self.a.allocate, self.a.decref
            for _ in range(iters):
                free(get(n))

    def audit(self) -> str:
        if self.kind == "vllm":
            return f"handed out {self.handed}"
        if self.kind == "deque":
            return f"handed out {self.d.allocated}"
        return f"handed out {self.a.stats().pages_allocated - self.before}"


class UncheckedFloor(Side):
    """Cache churn n=1 as bare Python: pagedkv's data layout (an LRU log with live
    positions, counts and flags in arrays, key -> page and page -> key maps) behind the
    same three calls (allocate, register, free), with every check, counter and listener
    taken out. Not an allocator: the floor of this API in CPython."""

    def __init__(self, iters: int, rounds: int) -> None:
        self.iters = iters
        rng = random.Random(1)
        self.cutter = PrefixCache(_pool(1))
        self.keys = [self._key(self.cutter.keys(_tokens(rng, PAGE + 1))) for _ in range(iters * (rounds + 1))]
        self.calls, self.by_key = self._calls(2048)
        self.round = 0
        self._run(slice(0, iters))  # untimed: fill the pool with cached pages
        self.round = 1

    @staticmethod
    def _key(keys: PrefixKeys):
        return (1, keys.pages[0])

    def _calls(self, n: int) -> tuple:
        rc, flags = array("i", bytes(4 * n)), bytearray(n)
        free, log, log_pos = array("q", range(n - 1, -1, -1)), array("q"), array("q", bytes(8 * n))
        by_key: dict = {}
        key_of: list = [None] * n
        head = [0]

        def get() -> int:
            if free:
                page = free.pop()
            else:  # evict the least recently used cached page and its key
                h = head[0]
                while log_pos[log[h]] != h:
                    h += 1
                page = log[h]
                head[0] = h + 1
                flags[page] = 0
                del by_key[key_of[page]]
            rc[page] = 1
            return page

        def register(page: int, key) -> None:
            if key not in by_key:
                flags[page] = 1
                by_key[key] = page
                key_of[page] = key

        def release(page: int) -> None:
            count = rc[page] - 1
            rc[page] = count
            if not count:
                if flags[page]:
                    log_pos[page] = len(log)
                    log.append(page)
                else:
                    free.append(page)

        return (get, register, release), by_key

    def _run(self, which: slice) -> None:
        get, register, release = self.calls
        for key in self.keys[which]:
            page = get()
            register(page, key)
            release(page)

    def run(self) -> None:
        start = self.round * self.iters
        self._run(slice(start, start + self.iters))
        self.round += 1

    def audit(self) -> str:
        return f"cached {len(self.by_key)}"


class CheckedFloor(UncheckedFloor):
    """The floor with what a public API of these three calls must do put back, in as few
    bytecodes as we could write it: the caller's ids, keys and position checked (a typed
    error, nothing changed, on bad input), a double free refused, the counters that
    ``stats`` reports kept (cached, evicted, the peak), keys taken as ``PrefixKeys``
    (their nodes carried on, as ``register_pages`` does), and the evicted page's key
    dropped in place (no listener call). No log compaction, no second listener, no disk
    tier, no numpy ids: so a checked allocator of this API cannot be faster than this."""

    @staticmethod
    def _key(keys: PrefixKeys) -> PrefixKeys:
        return keys

    def _calls(self, n: int) -> tuple:
        rc, flags, state = array("i", bytes(4 * n)), bytearray(n), bytearray(n)
        free, log, log_pos = array("q", range(n - 1, -1, -1)), array("q"), array("q", bytes(8 * n))
        by_key: dict = {}
        key_of: dict = {}
        owner = self.cutter
        counts = [0, 0, 0, n, 1]  # log head, cached, evicted, fewest available, next node

        def get() -> int:
            if free:
                page = free.pop()
            elif counts[1]:  # evict the least recently used cached page, and its key
                h = counts[0]
                while log_pos[log[h]] != h:
                    h += 1
                page = log[h]
                counts[0] = h + 1
                counts[1] -= 1
                counts[2] += 1
                state[page] = flags[page] = 0
                key = key_of.pop(page, None)
                if key is not None:
                    del by_key[key]
            else:
                raise MemoryError("no page available")
            rc[page] = 1
            available = len(free) + counts[1]
            if available < counts[3]:
                counts[3] = available
            return page

        def register(page: int, keys: PrefixKeys, first: int = 0) -> int:
            if (page.__class__ is not int or not 0 <= page < n or keys.__class__ is not PrefixKeys
                    or keys.owner is not owner or first.__class__ is not int):
                raise TypeError("bad page id or keys")
            nodes, chunks = keys.nodes, keys.pages
            if not 0 <= first <= len(nodes) or first >= len(chunks) or rc[page] < 1:
                raise ValueError("no such page of the sequence, or a page not held")
            key = (nodes[first - 1] if first else keys.root, chunks[first])
            if key in by_key or page in key_of:
                return 0
            flags[page] = 1
            node = counts[4]
            counts[4] = node + 1
            by_key[key] = page
            key_of[page] = key
            del nodes[first:]
            nodes.append(node)
            return 1

        def release(page: int) -> None:
            if page.__class__ is not int or not 0 <= page < n:
                raise TypeError("bad page id")
            count = rc[page]
            if count != 1:
                if count < 1:
                    raise ValueError("double free")
                rc[page] = count - 1
                return
            rc[page] = 0
            if flags[page]:
                state[page] = 2
                log_pos[page] = len(log)
                log.append(page)
                counts[1] += 1
            else:
                free.append(page)

        return (get, register, release), by_key


class CacheChurn(Side):
    """Allocate n pages, register them under fresh keys, free them; pool full of cache."""

    def __init__(self, kind: str, n: int, iters: int, rounds: int) -> None:
        self.kind, self.n, self.iters = kind, n, iters
        num_pages = 2048 if n == 1 else 4 * n
        rng = random.Random(1)
        seqs = [_tokens(rng, n * PAGE + 1) for _ in range(iters * (rounds + 1))]
        self.round = 0
        if kind == "vllm":
            self.pool = vllm.BlockPool(num_pages + 1, enable_caching=True)
            self.reqs = []
            for t in seqs:
                r = vllm.Request(t, [])
                r.block_hashes.extend(vllm.request_block_hashes(r, PAGE))
                self.reqs.append(r)
        else:
            self.pool = _pool(num_pages)
            self.a = self.pool.allocator
            self.prefix = PrefixCache(self.pool)
            self.keys = [self.prefix.keys(t) for t in seqs]
        self._fill()

    def _fill(self) -> None:
        """Untimed: fill the pool with cached pages (the first round's worth of work)."""
        self._once(slice(0, self.iters))
        self.round = 1

    def _once(self, which: slice) -> None:
        n = self.n
        if self.kind == "vllm":
            pool = self.pool
            get, cache, free = pool.get_new_blocks, pool.cache_full_blocks, pool.free_blocks
            for req in self.reqs[which]:
                blocks = get(n)
                cache(req, blocks, 0, n, PAGE, 0)
                free(reversed(blocks))
        elif n == 1:
            get, register, free = self.a.allocate_page, self.prefix.register_pages, self.a.decref_page
            for keys in self.keys[which]:
                page = get()
                register([page], keys)
                free(page)
        else:
            get, register, free = self.a.allocate, self.prefix.register_pages, self.a.decref
            for keys in self.keys[which]:
                pages = get(n)
                register(pages, keys)
                free(pages[::-1])

    def run(self) -> None:
        start = self.round * self.iters
        self._once(slice(start, start + self.iters))
        self.round += 1

    def audit(self) -> str:
        if self.kind == "vllm":
            return f"evicted {self.pool.evictions}, cached {len(self.pool.cached_block_hash_to_block)}"
        st = self.a.stats()
        return f"evicted {st.pages_evicted}, cached {self.prefix.stats().registered_pages}"


def _decode_trace(steps: int, batch: int, seed: int = 0):
    """The same decode schedule for both sides. Per step: ``fill``, the (sequence, page
    index) of each page that just filled (registered when caching is on); ``grow``, the
    sequences that need a new page; ``new``, (sequence, tokens, prompt length, full pages
    of the sequence it replaces) of the prompts that replace the sequences that finished
    (their tokens known ahead)."""
    rng = random.Random(seed)
    lengths, limits, tokens = [], [], []

    def prompt() -> tuple[list[int], int]:
        t = _tokens(rng, rng.randint(16, 512))
        return t + _tokens(rng, rng.randint(64, 1024)), len(t)

    for _ in range(batch):
        t, plen = prompt()
        tokens.append(t)
        lengths.append(plen)
        limits.append(len(t))
    initial = [(tokens[i], lengths[i]) for i in range(batch)]
    cached = [n // PAGE for n in lengths]
    events = []
    for _ in range(steps):
        fill, grow, new = [], [], []
        for i in range(batch):
            if lengths[i] % PAGE == 0:
                if lengths[i] // PAGE > cached[i]:
                    fill.append((i, cached[i]))
                    cached[i] += 1
                grow.append(i)
            lengths[i] += 1
        for i in range(batch - 1, -1, -1):
            if lengths[i] >= limits[i]:
                done = lengths[i] // PAGE  # the finished sequence's full pages
                t, plen = prompt()
                tokens[i], lengths[i], limits[i] = t, plen, len(t)
                cached[i] = plen // PAGE
                new.append((i, t, plen, done))
        events.append((fill, grow, new))
    return initial, events


class DecodeChurn(Side):
    """64 sequences decode from a running start (``setup``, untimed: a fresh pool with
    the first prompts admitted); ``run`` replays the steps. A step registers the pages
    that filled (pagedkv: ``register_next``, one call for the step; vLLM:
    ``cache_full_blocks`` per request, as its scheduler does), gives the growing
    sequences a page each, and replaces the finished ones: free (last page first),
    allocate and register the new prompt's pages."""

    def __init__(self, kind: str, caching: bool | str, steps: int, batch: int = 64) -> None:
        # caching "at release": pagedkv registers a sequence's pages when it leaves, in
        # one call, as its serving engine does (vLLM has no such mode: per block as on)
        self.at_release = caching == "at release" and kind != "vllm"
        caching = bool(caching)
        self.kind, self.caching, self.steps, self.batch = kind, caching, steps, batch
        self.initial, self.events = _decode_trace(steps, batch)
        self.num_pages = batch * 1600 // PAGE
        seqs = [t for t, _ in self.initial] + [t for _, _, new in self.events for _, t, _, _ in new]
        if kind == "vllm":  # hashes / keys of every sequence, as they would be computed when tokens arrive
            self.hashes = {id(t): vllm.request_block_hashes(vllm.Request(t, []), PAGE) for t in seqs}
        else:
            cutter = PrefixCache(_pool(1))
            self.cut = {id(t): cutter.keys(t).pages for t in seqs}

    def setup(self) -> None:
        ps, caching = PAGE, self.caching
        if self.kind == "vllm":
            pool = self.pool = vllm.BlockPool(self.num_pages + 1, enable_caching=caching)
            get, cache = pool.get_new_blocks, pool.cache_full_blocks

            def admit(t, plen):
                blocks = get(-(-plen // ps))
                req = vllm.Request(t[:plen], self.hashes[id(t)])
                if caching:
                    cache(req, blocks, 0, plen // ps, ps, 0)
                return blocks, req
        else:
            pool = self.pool = _pool(self.num_pages)
            a = pool.allocator
            prefix = PrefixCache(pool) if caching else None

            def admit(t, plen):
                pages = a.allocate(-(-plen // ps)).tolist()
                keys = None
                if caching:
                    keys = prefix.keys()
                    keys.pages, keys.num_tokens = self.cut[id(t)], plen  # cut as tokens arrived
                    prefix.register_pages(pages[: plen // ps], keys)
                return pages, keys

            self.prefix = prefix
        self.admit = admit
        self.tables, self.seqs = map(list, zip(*(admit(t, plen) for t, plen in self.initial)))

    def run(self) -> None:
        tables, seqs, admit, caching = self.tables, self.seqs, self.admit, self.caching
        if self.kind == "vllm":
            pool = self.pool
            get, cache, free = pool.get_new_blocks, pool.cache_full_blocks, pool.free_blocks
            for fill, grow, new in self.events:
                if caching:
                    for i, first in fill:
                        cache(seqs[i], tables[i], first, first + 1, PAGE, 0)
                for i in grow:
                    tables[i].extend(get(1))
                for i, t, plen, _ in new:
                    free(reversed(tables[i]))
                    tables[i], seqs[i] = admit(t, plen)
        else:
            a = self.pool.allocator
            get_one, free = a.allocate_page, a.decref
            per_step = caching and not self.at_release
            register_next = self.prefix.register_next if caching else None
            register = self.prefix.register_pages if caching else None
            for fill, grow, new in self.events:
                if fill and per_step:
                    register_next([tables[i][first] for i, first in fill], [seqs[i] for i, _ in fill])
                for i in grow:
                    tables[i].append(get_one())
                for i, t, plen, done in new:
                    if self.at_release:
                        first = len(seqs[i].nodes)
                        register(tables[i][first:done], seqs[i], first)
                    free(tables[i][::-1])
                    tables[i], seqs[i] = admit(t, plen)

    def audit(self) -> str:
        if self.kind == "vllm":
            pool = self.pool
            return (f"in use {self.num_pages - pool.get_num_free_blocks()}, evicted {pool.evictions}, "
                    f"cached {len(pool.cached_block_hash_to_block)}")
        st = self.pool.allocator.stats()
        cached = self.prefix.stats().registered_pages if self.caching else 0
        return f"in use {st.in_use}, evicted {st.pages_evicted}, cached {cached}"


class PrefixHits(Side):
    """Requests sharing 8 system prompts: hash/cut keys, match, take, allocate, register, free."""

    def __init__(self, kind: str, requests: int, rounds: int) -> None:
        self.kind = kind
        rng = random.Random(2)
        systems = [_tokens(rng, 1024) for _ in range(8)]
        self.prompts = [systems[rng.randrange(8)] + _tokens(rng, 256) for _ in range(requests)]
        num_pages = 8 * 64 + 40 * 17  # the systems stay cached; request tails churn
        if kind == "vllm":
            self.pool = vllm.BlockPool(num_pages + 1, enable_caching=True)
            self.hit_pages = 0
        else:
            self.ppool = _pool(num_pages)
            self.prefix = PrefixCache(self.ppool)

    def run(self) -> None:
        ps = PAGE
        if self.kind == "vllm":
            pool = self.pool
            for tokens in self.prompts:
                req = vllm.Request(tokens, [])
                req.block_hashes.extend(vllm.request_block_hashes(req, ps))
                (hit,) = find = vllm.find_longest_cache_hit(req.block_hashes, len(tokens) - 1, pool, ps, [0])
                pool.touch(find)
                blocks = hit + pool.get_new_blocks(-(-len(tokens) // ps) - len(hit))
                pool.cache_full_blocks(req, blocks, len(hit), len(tokens) // ps, ps, 0)
                pool.free_blocks(reversed(blocks))
                self.hit_pages += len(hit)
        else:
            prefix, a = self.prefix, self.ppool.allocator
            for tokens in self.prompts:
                keys = prefix.keys(tokens)
                hit = prefix.match(keys)
                a.touch(hit)
                pages = hit + a.allocate(-(-len(tokens) // ps) - len(hit)).tolist()
                prefix.register_pages(pages[len(hit) : len(tokens) // ps], keys, len(hit))
                a.decref(pages[::-1])
                prefix._hit_pages += len(hit)

    def audit(self) -> str:
        if self.kind == "vllm":
            return f"hit pages {self.hit_pages}, evicted {self.pool.evictions}"
        st = self.ppool.allocator.stats()
        return f"hit pages {self.prefix.stats().hit_pages}, evicted {st.pages_evicted}"


# ---------------------------------------------------------------------------- driver
def measure(sides: dict[str, Side], rounds: int, per_round: int) -> dict[str, float]:
    """Median seconds per operation of each side, the sides taking turns each round.

    The objects built before the clock starts (pools, keys, hashes) are moved out of the
    garbage collector's reach first (``gc.freeze``, as vLLM does after start-up), so
    neither side pays for traversing the other's set-up."""
    gc.collect()
    gc.freeze()
    times: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(rounds):
        for name, side in sides.items():
            side.setup()
            t = time.perf_counter()
            side.run()
            times[name].append((time.perf_counter() - t) / per_round)
    gc.unfreeze()
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="fewer operations and rounds (< 1 min)")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--only", default="", help="run the scenarios whose name contains this")
    args = p.parse_args()
    rounds = args.rounds or (5 if args.quick else 9)
    scale = 1 if args.quick else 2
    rows = []

    def scenario(name: str, sides: dict[str, Side], per_round: int, unit: str) -> None:
        if args.only not in name:
            return
        med = measure(sides, rounds, per_round)
        ratio = med["vLLM model"] / med["pagedkv"]
        rows.append((name, med, ratio, unit, {k: s.audit() for k, s in sides.items()}))
        bound = (f"  vLLM/checked floor {med['vLLM model'] / med['checked floor']:5.2f}x"
                 if "checked floor" in med else "")
        print(f"{name:<34}" + "".join(f"{k} {v * 1e6:9.2f} us  " for k, v in med.items())
              + f"vLLM/pagedkv {ratio:5.2f}x" + bound, flush=True)

    for n, iters in ((1, 5000 * scale), (4, 2000 * scale), (16, 1000 * scale), (64, 300 * scale), (256, 40 * scale)):
        for caching in (False, True):
            sides = {"pagedkv": GetFree("pagedkv", n, iters, caching),
                     "vLLM model": GetFree("vllm", n, iters, caching)}
            if not caching:
                sides["deque"] = GetFree("deque", n, iters, False)
                sides["sorted"] = GetFree("sorted", n, iters, False)
            scenario(f"get+free n={n} caching {'on' if caching else 'off'}", sides, iters, "op")
    for n, iters in ((1, 3000 * scale), (256, 10 * scale)):
        sides = {"pagedkv": CacheChurn("pagedkv", n, iters, rounds), "vLLM model": CacheChurn("vllm", n, iters, rounds)}
        if n == 1:
            sides["floor"] = UncheckedFloor(iters, rounds)
            sides["checked floor"] = CheckedFloor(iters, rounds)
        scenario(f"cache churn n={n}", sides, iters, "op")
    steps = 100 * scale
    for caching in (False, True, "at release"):
        scenario(f"decode churn caching {({False: 'off', True: 'on'}).get(caching, caching)}",
                 {"pagedkv": DecodeChurn("pagedkv", caching, steps), "vLLM model": DecodeChurn("vllm", caching, steps)},
                 steps, "step")
    requests = 50 * scale
    scenario("prefix hits + hashing", {"pagedkv": PrefixHits("pagedkv", requests, rounds),
                                       "vLLM model": PrefixHits("vllm", requests, rounds)}, requests, "request")
    print()
    print(f"{'scenario':<36}{'pagedkv':>12}{'vLLM model':>12}{'vLLM/pagedkv':>14}   audit (pagedkv | vLLM model)")
    for name, med, ratio, unit, audit in rows:
        print(f"{name:<36}{med['pagedkv'] * 1e6:>9.2f} us{med['vLLM model'] * 1e6:>9.2f} us{ratio:>13.2f}x"
              f"   {audit['pagedkv']} | {audit['vLLM model']}  (per {unit})")
    worst = min((r[2] for r in rows), default=float("nan"))
    print(f"\nslowest scenario: pagedkv {worst:.2f}x the vLLM model's speed (goal: >= 2x everywhere)")


if __name__ == "__main__":
    main()
