"""``InPlaceWrites``: what a pool does before it overwrites one of its arrays, so that
MLX reuses the array's buffer instead of copying it.

MLX writes ``a[idx] = v`` in place ("donates" ``a``'s buffer) only when nothing else
references the old array when the scatter runs. Two things do, in practice:

- a read of the array that is still lazy (a gather the caller has not evaluated): the
  pool records every read it hands out by weak reference, and evaluates the live ones
  before the next write of that array group (``settle``);
- on a GPU, kernels still in flight (MLX's command encoder keeps their buffers alive):
  the pool synchronises once per step, before the first group it writes a second time
  (measured on an H200 in bench/RESULTS.md: without it every write copied the layer).

One instance per pool; a *group* is whatever the pool writes together (a layer's K/V
arrays, a recurrent layer's state arrays). O(live reads) per write.
"""

from __future__ import annotations

import weakref

import mlx.core as mx


class InPlaceWrites:
    def __init__(self, num_groups: int, sync_before_rewrite: bool | None = None) -> None:
        """``sync_before_rewrite`` defaults to True on a GPU."""
        self._reads: list[list[weakref.ref]] = [[] for _ in range(num_groups)]
        if sync_before_rewrite is None:
            sync_before_rewrite = mx.default_device() == mx.gpu
        self._sync = sync_before_rewrite
        self._written: set[int] = set()  # groups written since the last synchronize

    def track(self, group: int, read: mx.array) -> mx.array:
        """Remember ``read`` (a lazy read of ``group``'s arrays); returns it."""
        reads = self._reads[group]
        if len(reads) > 64:
            reads[:] = [r for r in reads if r() is not None]
        reads.append(weakref.ref(read))
        return read

    def settle(self, group: int) -> None:
        """Evaluate the live reads of ``group`` (before writing it without a write)."""
        reads = self._reads[group]
        if reads:
            alive = [a for a in (r() for r in reads) if a is not None]
            reads.clear()
            if alive:
                mx.eval(alive)

    def before_write(self, group: int) -> None:
        """Call right before scattering into ``group``'s arrays."""
        self.settle(group)
        if self._sync:
            if group in self._written:
                mx.synchronize()
                self._written.clear()
            self._written.add(group)
