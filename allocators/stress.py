"""Seeded stress harness for any :class:`~allocators.protocol.BlockAllocator`.

Run it against the built-in strategies or your own class::

    python -m allocators.stress --allocator free_list --workload decode --ops 100000
    python -m allocators.stress --allocator mypkg.alloc:MyAllocator --pages 4096

A user class is constructed as ``cls(num_pages)`` and must implement the protocol
(``allocate``, ``incref``, ``decref``, ``fork``, ``num_free``, ``num_available``,
``check``, ``stats``). The harness keeps its own model of who owns which reference,
checks the allocator's invariant as it goes, checks that a failed ``allocate`` changed
nothing, releases everything at the end and fails if any page leaked.

Workloads:
  uniform  random allocate / append / fork / free of 1-16 pages
  bursty   phases that fill the pool with large requests, then free most of them
  decode   a decode loop: sequences arrive with a prompt, append a page every
           ``page_size`` tokens, fork for parallel sampling, and finish
"""

from __future__ import annotations

import argparse
import importlib
import random
import sys
import time
from collections import defaultdict
from typing import Callable

import attrs

from allocators.errors import PoolExhausted
from allocators.free_list import FreeListAllocator
from allocators.protocol import BlockAllocator, implements_block_allocator
from allocators.sorted import SortedAllocator

WORKLOADS = ("uniform", "bursty", "decode")
BUILTIN = {"free_list": FreeListAllocator, "sorted": SortedAllocator}


class LeakDetected(AssertionError):
    """Pages were still in use after the harness released every reference it held."""


@attrs.frozen
class Sample:
    op: int
    in_use: int
    free: int
    free_runs: int
    largest_free_run: int


@attrs.frozen
class StressReport:
    workload: str
    ops: int
    seed: int
    num_pages: int
    latencies_ns: dict[str, list[int]]
    exhausted: int  # allocate calls that raised PoolExhausted (and changed nothing)
    peak_in_use: int
    samples: list[Sample]
    leaked: int

    def percentiles(self) -> dict[str, tuple[int, float, float, float, float]]:
        """op -> (count, p50, p90, p99, max) in microseconds."""
        out = {}
        for op, xs in sorted(self.latencies_ns.items()):
            s = sorted(xs)

            def q(p: float, s: list[int] = s) -> float:
                return s[min(len(s) - 1, int(p * len(s)))] / 1e3

            out[op] = (len(s), q(0.5), q(0.9), q(0.99), s[-1] / 1e3)
        return out

    def format(self) -> str:
        lines = [
            f"workload={self.workload} ops={self.ops} seed={self.seed} pages={self.num_pages}",
            f"{'op':<10}{'count':>9}{'p50 us':>10}{'p90 us':>10}{'p99 us':>10}{'max us':>10}",
        ]
        for op, (n, p50, p90, p99, mx) in self.percentiles().items():
            lines.append(f"{op:<10}{n:>9}{p50:>10.2f}{p90:>10.2f}{p99:>10.2f}{mx:>10.1f}")
        lines.append(f"peak in use: {self.peak_in_use} / {self.num_pages} pages; "
                     f"allocations refused (atomic, nothing changed): {self.exhausted}")
        lines.append("fragmentation over time (op, in use, free, free runs, largest free run):")
        for s in self.samples:
            lines.append(f"  {s.op:>9} {s.in_use:>7} {s.free:>7} {s.free_runs:>7} {s.largest_free_run:>7}")
        lines.append(f"leaked pages after releasing everything: {self.leaked}")
        return "\n".join(lines)


class _Driver:
    """Owns references on behalf of simulated sequences and times every call."""

    def __init__(self, alloc: BlockAllocator, rng: random.Random, check_every: int) -> None:
        self.a = alloc
        self.rng = rng
        self.owners: list[list[int]] = []
        self.lat: dict[str, list[int]] = defaultdict(list)
        self.exhausted = 0
        self.check_every = check_every
        self.ops = 0
        self.lengths: list[int] = []  # decode workload: tokens per owner, parallel to owners

    def _timed(self, name: str, fn: Callable, *args):
        t = time.perf_counter_ns()
        out = fn(*args)
        self.lat[name].append(time.perf_counter_ns() - t)
        self.ops += 1
        if self.check_every and self.ops % self.check_every == 0:
            self.a.check()
        return out

    def allocate(self, n: int) -> list[int] | None:
        before = self.a.num_free(), self.a.num_available()
        try:
            return list(self._timed("allocate", self.a.allocate, n))
        except PoolExhausted:
            self.ops += 1
            self.exhausted += 1
            if (self.a.num_free(), self.a.num_available()) != before:
                raise AssertionError("a refused allocate changed the allocator") from None
            return None

    def new_owner(self, n: int) -> bool:
        ids = self.allocate(n)
        if ids is None:
            return False
        self.owners.append(ids)
        return True

    def append(self, i: int, n: int = 1) -> bool:
        ids = self.allocate(n)
        if ids is None:
            return False
        self.owners[i].extend(ids)
        return True

    def fork(self, i: int) -> None:
        self.owners.append(list(self._timed("fork", self.a.fork, self.owners[i])))

    def view(self, i: int) -> None:
        """A short-lived reader: incref every page of an owner, then decref them."""
        pages = self.owners[i]
        self._timed("incref", self.a.incref, pages)
        self._timed("decref", self.a.decref, pages)

    def release(self, i: int) -> None:
        pages = self.owners.pop(i)
        self._timed("free", self.a.decref, pages)

    def release_all(self) -> None:
        while self.owners:
            self.release(len(self.owners) - 1)


def _uniform(d: _Driver, ops: int) -> None:
    rng = d.rng
    while d.ops < ops:
        r = rng.random()
        if not d.owners or r < 0.30:
            if not d.new_owner(rng.randint(1, 16)) and d.owners:
                d.release(rng.randrange(len(d.owners)))
        elif r < 0.50:
            if not d.append(rng.randrange(len(d.owners)), rng.randint(1, 4)):
                d.release(rng.randrange(len(d.owners)))
        elif r < 0.60:
            d.fork(rng.randrange(len(d.owners)))
        elif r < 0.70:
            d.view(rng.randrange(len(d.owners)))
        else:
            d.release(rng.randrange(len(d.owners)))


def _bursty(d: _Driver, ops: int) -> None:
    rng = d.rng
    while d.ops < ops:
        # Fill: large requests until one is refused.
        while d.ops < ops and d.new_owner(rng.randint(8, 64)):
            if rng.random() < 0.2:
                d.fork(rng.randrange(len(d.owners)))
        # Drain: free most owners in random order.
        for _ in range(int(len(d.owners) * rng.uniform(0.6, 0.95))):
            if d.ops >= ops:
                break
            d.release(rng.randrange(len(d.owners)))


def _decode(d: _Driver, ops: int, page_size: int = 16, batch: int = 64) -> None:
    rng = d.rng
    lengths = d.lengths
    while d.ops < ops:
        while len(d.owners) < batch and d.ops < ops:  # admit new requests
            prompt = int(rng.paretovariate(1.2) * 32)
            if not d.new_owner(-(-prompt // page_size)):
                break
            lengths.append(prompt)
        for i in range(len(d.owners) - 1, -1, -1):  # one decode step
            if d.ops >= ops:
                break
            if lengths[i] % page_size == 0 and not d.append(i):
                d.release(i)  # preempted: pool exhausted
                lengths.pop(i)
                continue
            lengths[i] += 1
            r = rng.random()
            if r < 0.002:
                d.fork(i)
                lengths.append(lengths[i])
            elif r < 0.01:
                d.release(i)
                lengths.pop(i)
        if d.owners and rng.random() < 0.05:
            d.view(rng.randrange(len(d.owners)))


def run_stress(
    alloc: BlockAllocator,
    workload: str = "decode",
    ops: int = 100_000,
    seed: int = 0,
    check_every: int = 100,
    samples: int = 20,
) -> StressReport:
    """Drive ``alloc`` through ``ops`` seeded operations of ``workload``.

    Raises ``LeakDetected`` if pages remain in use after the harness releases every
    reference it holds, and whatever ``alloc.check()`` raises on a broken invariant.
    """
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    d = _Driver(alloc, random.Random(seed), check_every)
    body = {"uniform": _uniform, "bursty": _bursty, "decode": _decode}[workload]
    taken: list[Sample] = []
    step = max(1, ops // max(1, samples))
    target = 0
    peak = 0
    while d.ops < ops:
        target = min(ops, target + step)
        body(d, target)
        st = alloc.stats()
        peak = max(peak, st.in_use)
        taken.append(Sample(d.ops, st.in_use, st.free, st.free_runs, st.largest_free_run))
    d.release_all()
    alloc.check()
    st = alloc.stats()
    report = StressReport(
        workload=workload, ops=d.ops, seed=seed, num_pages=alloc.num_pages,
        latencies_ns=dict(d.lat), exhausted=d.exhausted,
        peak_in_use=max(peak, st.peak_in_use), samples=taken, leaked=st.in_use,
    )
    if report.leaked:
        raise LeakDetected(f"{report.leaked} pages still in use after releasing everything")
    return report


def load_allocator(spec: str, num_pages: int) -> BlockAllocator:
    """``free_list``, ``sorted`` or ``package.module:ClassName`` -> an allocator instance."""
    if spec in BUILTIN:
        return BUILTIN[spec](num_pages)
    mod, sep, name = spec.partition(":")
    if not sep:
        raise SystemExit(f"--allocator must be one of {sorted(BUILTIN)} or module:Class, got {spec!r}")
    alloc = getattr(importlib.import_module(mod), name)(num_pages)
    if not implements_block_allocator(alloc):
        raise SystemExit(f"{spec} does not implement allocators.BlockAllocator")
    return alloc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m allocators.stress", description=__doc__.split("\n")[0])
    p.add_argument("--allocator", default="free_list", help="free_list, sorted, or module:Class")
    p.add_argument("--workload", default="all", choices=(*WORKLOADS, "all"))
    p.add_argument("--ops", type=int, default=100_000)
    p.add_argument("--pages", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check-every", type=int, default=100, help="run check() every N ops (0: only at the end)")
    args = p.parse_args(argv)
    for wl in WORKLOADS if args.workload == "all" else (args.workload,):
        alloc = load_allocator(args.allocator, args.pages)
        t = time.perf_counter()
        report = run_stress(alloc, wl, args.ops, args.seed, args.check_every)
        print(report.format())
        print(f"({time.perf_counter() - t:.1f} s)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
