"""In-place token writes into a page pool on CUDA: one kernel per layer, no copy.

MLX has no in-place update: ``a[idx] = v`` makes a new array, and reuses ``a``'s buffer
("donation") only when nothing else holds ``a`` when the scatter runs. On a GPU a kernel
still in flight that reads ``a`` holds it, so when one forward writes the same pool array
twice (layer groups: several attention layers share one pool layer, each with its own
pages) the second write copies the whole array (measured on an H100: +150-210 MiB peak,
decode 0.82-0.86x; bench/RESULTS.md).

``write_tokens`` sidesteps this. Its kernel takes the pool arrays as *inputs* and writes
the tokens through their pointers, so MLX allocates nothing for them; its only output is
a one-element ``done`` array (value 0). The pool arrays keep their identity.

Ordering. MLX orders work by array inputs: on CUDA it records a step's kernels in a CUDA
graph whose edges run from the kernel that last *wrote* (output) a buffer to those that
read it, and a write through an input makes no such edge (measured: a read in the same
graph saw the array as before the write). So every reader of a pool layer takes the
layer's latest ``done`` (``PagePool.write_order``) as an input: the paged kernels as
their ``after`` input (unread), a gather by adding it (0) to its indices. Each write
takes the previous ``done`` of its layer as ``after`` too, so writes of one array run in
the order they were made and a reader waits for all of them. Bulk page copies, loads
and reads evaluate the pending writes first.

Contract (what makes writing through an input safe here):

- The pool owns its arrays and hands out no reference to them (``PagePool``); reads are
  new arrays, and the pool evaluates the pending ones before it writes a layer
  (``InPlaceWrites.settle``), so no read made before a write sees it.
- The tokens written go to slots no read in flight covers: a step writes new positions
  of pages its rows hold, and an earlier step's reads ran in an earlier graph (MLX
  launches a stream's graphs in order).

Costs: one launch per layer for K and V together, ``tokens * (K width + V width)``
threads, each moving one element. ``rows``/``slots``/values that are not row-contiguous
are copied first (``ensure_row_contiguous``): the step's tokens, not the pool.
"""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx

from pagedkv.kernels.cuda_source import sections
from pagedkv.kernels.paged_decode import available, dims_array

_CUDA = sections(Path(__file__).with_suffix(".cu"))
_THREADS = 256
_KERNEL: list[object] = []

__all__ = ["available", "write_tokens"]


def _kernel() -> object:
    if not _KERNEL:
        _KERNEL.append(mx.fast.cuda_kernel(
            name="pagedkv_page_write",
            input_names=["kpool", "vpool", "rows", "slots", "kvals", "vvals", "count", "after"],
            output_names=["done"], source=_CUDA["body"],
        ))
    return _KERNEL[0]


def _flat_index(x: mx.array, lead: tuple[int, ...], n: int) -> mx.array:
    if x.shape != (n,):  # (flat already: the form ``PagePool.write_index`` makes for a step)
        if x.shape != lead:
            x = mx.broadcast_to(x, lead)
        x = x.reshape(n)
    return x if x.dtype == mx.int32 else x.astype(mx.int32)


def write_tokens(k_pool: mx.array, v_pool: mx.array, rows: mx.array, slots: mx.array,
                 k_vals: mx.array, v_vals: mx.array, after: mx.array) -> mx.array:
    """Write token t's ``k_vals[..., :]`` into ``k_pool[rows[t], slots[t]]`` and its
    ``v_vals`` into ``v_pool`` likewise, in place, after the write whose ``done`` is
    ``after``; returns this write's ``done`` (int32 [1], value 0).

    ``k_pool``/``v_pool``: [pool rows, page_size, width] arrays, row-contiguous;
    ``rows``/``slots``: int indices of any shape, broadcast to the values' leading shape,
    or flat [tokens] in its order; ``k_vals``/``v_vals``: [..., width] of the pools'
    dtypes with the same leading shape (read in row-major order, as the kernel copies
    non-contiguous inputs first: no reshape is built for them).
    The caller checks shapes and indices (out-of-range indices write out of bounds).
    """
    lead = k_vals.shape[:-1]
    n = math.prod(lead)
    wk, wv = k_pool.shape[-1], v_pool.shape[-1]
    r, s = (_flat_index(x, lead, n) for x in (rows, slots))
    total = n * (wk + wv)
    (done,) = _kernel()(
        inputs=[k_pool, v_pool, r, s, k_vals, v_vals, dims_array(n), after],
        template=[("TK", k_pool.dtype), ("TV", v_pool.dtype), ("WK", wk), ("WV", wv),
                  ("PS", k_pool.shape[1])],
        grid=(-(-total // _THREADS) * _THREADS, 1, 1), threadgroup=(_THREADS, 1, 1),
        output_shapes=[(1,)], output_dtypes=[mx.int32],
    )
    return done
