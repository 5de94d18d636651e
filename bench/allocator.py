"""Allocator throughput vs a plain deque free list with per-page refcount objects.

    python bench/allocator.py [--quick]

Both run in this process. Measured, per strategy:
  single    allocate(1) + free of that page, ops/s
  batched   allocate(n) + free of those n pages, pages/s (n = --batch, default 1024)
  decode    a decode loop: 64 sequences each append a token per step (a page every 16
            tokens); every step one reader increfs and decrefs every page of every
            sequence (what a KV view does); a sequence that reaches its length is freed
            and a new prompt is admitted. Steps/s.
Last line: batched allocate+free per page, FreeListAllocator / baseline.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from allocators import FreeListAllocator, SortedAllocator  # noqa: E402


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

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_ids):
            raise MemoryError
        out = []
        for _ in range(n):
            b = self.blocks[self.free_ids.popleft()]
            b.ref_count = 1
            out.append(b.page_id)
        return out

    def incref(self, ids) -> None:
        for i in ids:
            self.blocks[i].ref_count += 1

    def decref(self, ids) -> None:
        for i in ids:
            b = self.blocks[i]
            if b.ref_count <= 0:
                raise ValueError("double free")
            b.ref_count -= 1
            if b.ref_count == 0:
                self.free_ids.append(i)


def _as_list(ids) -> list[int]:
    return ids if isinstance(ids, list) else ids.tolist()


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def bench_single(make, iters: int, repeats: int) -> float:
    a = make(4096)

    def run():
        for _ in range(iters):
            a.decref(a.allocate(1))

    return iters / _best(run, repeats)


def bench_batched(make, n: int, iters: int, repeats: int) -> float:
    a = make(4 * n)

    def run():
        for _ in range(iters):
            a.decref(a.allocate(n))

    return n * iters / _best(run, repeats)


def bench_decode(make, steps: int, repeats: int, batch: int = 64, page: int = 16) -> float:
    def run():
        rng = random.Random(0)
        a = make(batch * 4096 // page)
        tables, lengths, limits = [], [], []

        def admit():
            prompt = rng.randint(16, 512)
            tables.append(_as_list(a.allocate(-(-prompt // page))))
            lengths.append(prompt)
            limits.append(prompt + rng.randint(64, 1024))

        for _ in range(batch):
            admit()
        for _ in range(steps):
            for i in range(batch):
                if lengths[i] % page == 0:
                    tables[i].extend(_as_list(a.allocate(1)))
                lengths[i] += 1
            every = [p for t in tables for p in t]
            a.incref(every)
            a.decref(every)
            for i in range(batch - 1, -1, -1):
                if lengths[i] >= limits[i]:
                    a.decref(tables.pop(i))
                    lengths.pop(i)
                    limits.pop(i)
                    admit()

    return steps / _best(run, repeats)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="fewer repetitions (< 60 s)")
    p.add_argument("--batch", type=int, default=1024)
    args = p.parse_args()
    reps = 3 if args.quick else 7
    single_iters = 20_000 if args.quick else 100_000
    batched_iters = 200 if args.quick else 1000
    steps = 100 if args.quick else 400
    makers = {
        "deque baseline": DequeBaseline,
        "FreeListAllocator": FreeListAllocator,
        "SortedAllocator": SortedAllocator,
    }
    rows = {}
    for name, make in makers.items():
        rows[name] = (
            bench_single(make, single_iters, reps),
            bench_batched(make, args.batch, batched_iters, reps),
            bench_decode(make, steps, reps),
        )
    base = rows["deque baseline"]
    print(f"{'allocator':<20}{'single ops/s':>14}{'x':>7}{f'batched({args.batch}) pages/s':>26}{'x':>7}"
          f"{'decode steps/s':>16}{'x':>7}")
    for name, (s, b, d) in rows.items():
        print(f"{name:<20}{s:>14,.0f}{s / base[0]:>7.2f}{b:>26,.0f}{b / base[1]:>7.2f}{d:>16,.1f}{d / base[2]:>7.2f}")
    ratio = rows["FreeListAllocator"][1] / base[1]
    print(f"batched allocate+free per page, FreeListAllocator/deque baseline: {ratio:.2f}x")


if __name__ == "__main__":
    main()
