"""Shared timing for benchmarks: interleaved repeats, median per candidate."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import mlx.core as mx


def time_interleaved(fns: dict[str, Callable[[], object]], repeats: int, inner: int = 1,
                     warmup: int = 2) -> dict[str, float]:
    """Median seconds per call of each fn, alternating candidates so drift hits all alike.

    Each fn must return what needs evaluating; it is passed to ``mx.eval``.
    """
    for fn in fns.values():
        for _ in range(warmup):
            mx.eval(fn())
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            for _ in range(inner):
                mx.eval(fn())
            samples[name].append((time.perf_counter() - t) / inner)
    return {k: statistics.median(v) for k, v in samples.items()}


def fixed_context_step(model, token: mx.array, cache) -> mx.array:
    """One decode step, then the token is trimmed away again so repeats see the same context."""
    out = model(token, cache=cache)
    for c in cache:
        c.trim(1)
    return out
