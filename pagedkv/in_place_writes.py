"""``InPlaceWrites``: what a pool does before it overwrites one of its arrays, so that
MLX reuses the array's buffer instead of copying it.

MLX writes ``a[idx] = v`` in place ("donates" ``a``'s buffer) only when nothing else
references the old array when the scatter runs. Two things do, in practice:

- a read of the array that is still lazy (a gather the caller has not evaluated): the
  pool records every read it hands out by weak reference, and evaluates the live ones
  before the next write of that array group (``settle``);
- on a GPU, kernels still in flight (MLX's command encoder keeps their buffers alive).
  With ``sync_before_rewrite`` the pool synchronises once per step, before the first
  group it writes a second time. It is off by default: on MLX 0.32.4 on an H200, whole
  models (1B, 16 layers; serial and pipelined with ``mx.async_eval``, pools 16x the rows'
  need) and 1-16 layer write loops wrote in place without it (no peak growth), and the
  synchronise stalled the host while the previous step ran, so a pipelined generation
  loop lost its overlap (bench/RESULTS.md, issue 15). Back-to-back scatters into one
  array with nothing in between did copy in an earlier micro-benchmark; turn it on if a
  profile shows a layer-sized jump in peak memory per write.

  A one-layer pool written every ~100 us (write, fetch, evaluate, 200 times; nothing
  else in between) still copies now and then on that GPU: its whole array, in 9 of 12
  runs 2-3 times per 200 writes, and with a synchronise after every step in 1 of 12
  runs once. MLX's CUDA backend lets go of a finished step's buffers on a worker thread,
  so a write that follows the evaluation that closely can find its array still
  referenced. A model's layer is written once per step, a whole forward pass apart.

A page pool written in layer groups on a CUDA GPU writes tokens with its own kernel
instead (:mod:`pagedkv.kernels.page_write`), which writes through the array's buffer,
so no in-flight kernel can make it copy; ``settle`` still runs before it.

One instance per pool; a *group* is whatever the pool writes together (a layer's K/V
arrays, a recurrent layer's state arrays). O(live reads) per write.
"""

from __future__ import annotations

import weakref

import mlx.core as mx


class InPlaceWrites:
    def __init__(self, num_groups: int, sync_before_rewrite: bool = False) -> None:
        """``sync_before_rewrite``: see the module doc (off by default)."""
        self._reads: list[list[weakref.ref]] = [[] for _ in range(num_groups)]
        self._sync = bool(sync_before_rewrite)
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

    def settle_all(self) -> None:
        """``settle`` for every group, in one evaluation (before a step that writes them
        all, such as a compiled decode step)."""
        alive = []
        for reads in self._reads:
            if reads:
                alive += [a for a in (r() for r in reads) if a is not None]
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
