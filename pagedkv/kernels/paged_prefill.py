"""Paged prefill attention on CUDA: many queries per row, K/V read straight from the pool.

The multi-query sibling of :mod:`pagedkv.kernels.paged_decode` (same pool layout, page
table and [start, length) ranges), for prefill and chunked prefill: the L queries of
row b are its last L positions, query i at key position ``length_b - L + i``, and see
keys ``start_b <= t <= length_b - L + i`` (and, with a window W, ``t > pos - W``).

  pass 1  one thread block (4 warps) per (row b, KV head h, query tile, split). A tile
          is 64 or 128 query rows of the KV head's GQA group (``Tiling``: 16 or 32 rows
          per warp), row m = (query i, head r) = divmod(tile * rows + m, REP), so each
          K/V byte a block reads serves all REP heads and every warp's rows. The block
          walks the keys its last query sees (cut into ``splits`` equal chunks), 32 or
          64 tokens at a time; the K and V tiles go global -> shared by cp.async, one
          tile ahead of the math, looked up token by token in the page table.
          Flash-attention 2 on tensor cores: S = Q . K^T by m16n8k16 MMA (ldmatrix),
          mask (only on tiles some row cannot wholly see; tiles no row of a warp sees
          are skipped) and online softmax (exp2) in the fragment layout, P packed to
          the query's dtype in registers as the A operand of O += P . V (V through
          ldmatrix.trans). Each warp writes its rows' (acc, m, l).
  pass 2  ``paged_decode.merge_splits``: merges the splits into the output [B, Hq, L, D].

A query that sees no key gets zeros (it cannot happen in a cache: a query sees itself).
Costs: a block reads its keys once for all its query rows; partials are
B * Hq * L * splits * (D + 2) floats; shared memory ``Tiling.shared_bytes``. On an
H200 it runs at 120-190 TFLOP/s, 2.5-3.5x slower than MLX's fused causal SDPA on
contiguous K/V but 3-5x faster than SDPA with an array mask (ragged rows), and, with
few new tokens, faster than gathering the pages (``preferred``; bench/RESULTS.md).
"""

from __future__ import annotations

from pathlib import Path

import attrs
import mlx.core as mx

from pagedkv.kernels import paged_decode
from pagedkv.kernels.cuda_source import sections

_CUDA = sections(Path(__file__).with_suffix(".cu"))
_DECODE = sections(Path(paged_decode.__file__).with_suffix(".cu"))
WARPS = 4            # warps per block
HEAD_DIMS = (64, 128)
DTYPES = (mx.float16, mx.bfloat16)


@attrs.frozen
class Tiling:
    """How pass 1 cuts the work: ``m_tiles`` m16 tiles of query rows per warp (a block
    holds 4 * 16 * m_tiles rows; more rows per warp reuse each K/V fragment more, at the
    cost of registers), ``keys`` tokens of K and V per pipeline stage."""

    m_tiles: int = attrs.field(default=1, validator=attrs.validators.in_((1, 2)))
    keys: int = attrs.field(default=32, validator=attrs.validators.in_((16, 32, 64)))

    def rows(self) -> int:
        return WARPS * 16 * self.m_tiles

    def shared_bytes(self, d: int) -> int:
        """Dynamic shared memory of one block: two stages of a K and a V tile."""
        return 2 * 2 * self.keys * d * 2


SMALL_TILING = Tiling(1, 32)   # bench/gpu_attention.py --tilings: best below 512 query rows
LARGE_TILING = Tiling(2, 64)   # ... and from 512 rows (10-20% faster there)
FUSED_SDPA_FROM = 257          # new tokens of one row from which gather + fused causal SDPA wins


def choose_tiling(query_rows: int) -> Tiling:
    """The tiling for ``query_rows`` (L * REP) rows per (row, KV head)."""
    return LARGE_TILING if query_rows >= 512 else SMALL_TILING


def preferred(q: mx.array, mask) -> bool:
    """Whether the kernel beats gathering the pages for SDPA here (bench/gpu_attention.py,
    H200): always when SDPA would need an array mask (several rows, or a window), which
    MLX runs unfused; for one row with a plain causal mask, up to 256 new tokens (the
    gather is paid per call, the kernel's slower math per query)."""
    return isinstance(mask, mx.array) or q.shape[2] < FUSED_SDPA_FROM
_KERNELS: dict[tuple[int, Tiling], object] = {}


def fits(q: mx.array, num_kv_heads: int, dtype: mx.Dtype) -> bool:
    """Whether these queries (several per row, the pool's dtype, a supported head size)
    can run on the prefill kernel here."""
    return (q.shape[2] > 1 and q.dtype == dtype and dtype in DTYPES and q.shape[3] in HEAD_DIMS
            and q.shape[1] % num_kv_heads == 0 and paged_decode.available())


def _kernel(d: int, tiling: Tiling):
    k = _KERNELS.get((d, tiling))
    if k is None:
        k = _KERNELS[(d, tiling)] = mx.fast.cuda_kernel(
            name="pagedkv_prefill",
            input_names=["queries", "kpool", "vpool", "table", "lengths", "starts", "scale", "dims", "after"],
            output_names=["part_acc", "part_ml"], source=_CUDA["prefill"],
            header=_DECODE["header"] + _CUDA["header"], shared_memory=tiling.shared_bytes(d),
        )
    return k


def choose_splits(blocks: int, keys: int, sms: int = 132) -> int:
    """Splits of each tile's keys: enough blocks for about 4 per SM, each split at least
    512 keys (fewer, longer blocks once the tiles alone fill the GPU)."""
    return max(1, min(-(-4 * sms // max(1, blocks)), keys // 512))


def paged_prefill(q: mx.array, k_pool: mx.array, v_pool: mx.array, table: mx.array, lengths: mx.array,
                  starts: mx.array, scale: float, *, rows_per_head: int, page_size: int,
                  window: int | None = None, splits: int | None = None,
                  tiling: Tiling | None = None, poison: bool = False,
                  sinks: mx.array | None = None, after: mx.array | None = None) -> mx.array:
    """Causal attention of ``q`` [B, Hq, L, D] (each row's last L positions) over paged
    K/V; returns [B, Hq, L, D] in ``q``'s dtype.

    ``k_pool``/``v_pool``: one layer's pool arrays [kv_heads * rows_per_head, page_size, D]
    (``PagePool.rows_per_head``: head h's page p is row h * rows_per_head + p);
    ``table``: int32 [B, W] page ids from each row's first needed page; ``lengths`` /
    ``starts``: int32 [B] the visible key range in those columns; ``window``: a sliding
    window per query (None: none). ``splits`` (default ``choose_splits``) cuts each
    tile's keys; ``tiling`` (default ``choose_tiling``); ``poison`` fills the outputs with NaN first (tests: all are written).
    ``sinks``: [Hq] attention-sink logits, or None (``paged_decode.merge_splits``).
    ``after``: as ``paged_decode``'s (the layer's pending token writes run first).
    """
    b, hq, lq, d = q.shape
    hkv = k_pool.shape[0] // rows_per_head
    if hq % hkv or d not in HEAD_DIMS or k_pool.dtype not in DTYPES or q.dtype != k_pool.dtype:
        raise ValueError(f"unsupported shape/dtype: Hq={hq}, Hkv={hkv}, D={d}, {q.dtype} over {k_pool.dtype}")
    if window is not None and window < 1:
        raise ValueError(f"window must be positive, got {window}")
    rep = hq // hkv
    w = table.shape[1]
    tiling = tiling or choose_tiling(lq * rep)
    tiles = -(-lq * rep // tiling.rows())
    s = splits or choose_splits(b * hkv * tiles, w * page_size)
    dims = paged_decode.dims_array(s, lq, w, rows_per_head, window or 0)
    init = {"init_value": float("nan")} if poison else {}
    part_acc, part_ml = _kernel(d, tiling)(
        inputs=[q, k_pool, v_pool, table, lengths, starts,
                paged_decode.scale_array(scale), dims, paged_decode.NO_WRITES if after is None else after],
        template=[("T", q.dtype), ("D", d), ("PS", page_size), ("HKV", hkv), ("REP", rep),
                  ("WARPS", WARPS), ("MT", tiling.m_tiles), ("BN", tiling.keys)],
        grid=(b * hkv * tiles * s * WARPS * 32, 1, 1), threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(b * hq * lq * s * d,), (b * hq * lq * s * 2,)],
        output_dtypes=[mx.float32, mx.float32], **init,
    )
    return paged_decode.merge_splits(part_acc, part_ml, dims, q.dtype, q.shape, poison, sinks)
