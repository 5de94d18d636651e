"""Paged decode attention on CUDA: reads K/V straight from the page pool, no gather.

Two kernels through ``mx.fast.cuda_kernel`` (flash-decoding style split-K):

  pass 1  one thread block per (row b, KV head h, split s). The split covers pages
          [s * PPS, (s + 1) * PPS) of row b's page table; the block first copies those
          page ids to shared memory. Each warp walks its share of the split's tokens;
          D/8 lanes load one token (one 16-byte piece of K and one of V per lane), and
          the pieces travel global -> shared by cp.async, ``Pipeline.stages - 1``
          iterations ahead of the math. Scores of the whole GQA group (REP query heads
          share KV head h, so each K byte is read once for all of them):
            tensor cores (default, REP <= 16): 8 tokens per warp iteration; ldmatrix +
              m16n8k16 MMA give S = Q . K^T in f32 for all REP heads at once; the online
              softmax runs in the MMA fragment layout and hands p to the V side through
              a small per-warp buffer;
            CUDA cores (``Pipeline(tensor_cores=False)``, or REP > 16): every lane keeps
              its 8 query elements per head, dot products end in shuffle sums.
          V accumulates on the CUDA cores in f32: each lane owns 8 output columns of
          every head of the group. Online softmax (exp2, scores scaled by scale * log2 e)
          keeps a running max, sum and accumulator per head, rescaled once per warp
          iteration; warps merge through shared memory, and the block writes
          (acc[D], m, l) per query head.
  pass 2  one block per (row, query head): merges the splits' partials and writes the
          output in the query's dtype. Attention sinks (gpt_oss) join here: a sink is
          one more logit in the head's max and sum, so pass 1 is the same with or
          without them.

Pool layout (see PagePool): per layer, [kv_heads * R, page_size, D], row h * R + page (R: the
pool's ``rows_per_head``, its pages or one more).
Rows may be ragged; tokens outside [start_b, length_b) are skipped. Query length 1.
Costs: every valid K/V byte is read once; partials are B * Hq * S * (D + 2) floats;
shared memory per block is ``Pipeline.shared_bytes``.
"""

from __future__ import annotations

import math
from pathlib import Path

import attrs
import mlx.core as mx

from pagedkv.kernels.cuda_source import sections

_CUDA = sections(Path(__file__).with_suffix(".cu"))


@attrs.frozen
class Pipeline:
    """How pass 1 walks a split.

    ``warps`` per block; ``stages`` iterations of K/V in flight per warp (``stages - 1``
    prefetched by cp.async); ``tensor_cores``: scores of the GQA group by m16n8k16 MMA
    (8 tokens per warp iteration; needs REP <= 16, else the CUDA-core path runs), or on
    the CUDA cores with ``groups`` token groups per warp iteration.
    """

    warps: int = attrs.field(default=4, validator=attrs.validators.in_((1, 2, 4, 8)))
    groups: int = attrs.field(default=4, validator=attrs.validators.in_((1, 2, 4, 8)))
    stages: int = attrs.field(default=2, validator=attrs.validators.in_((2, 3, 4)))
    tensor_cores: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))

    def uses_tensor_cores(self, rep: int) -> bool:
        return self.tensor_cores and rep <= 16

    def shared_bytes(self, d: int, rep: int, pages_per_split: int) -> int:
        """Dynamic shared memory of one pass-1 block: staging (plus, with tensor cores,
        the per-warp hand-over of p) plus page ids, or the warps' partials for the final
        merge, whichever is larger (they reuse the bytes)."""
        if self.uses_tensor_cores(rep):
            staging = self.warps * self.stages * 8 * d * 2 * 2 + self.warps * 2 * rep * 9 * 4
        else:
            staging = self.warps * self.stages * self.groups * 2 * 32 * 16
        return max(staging + 4 * pages_per_split, self.warps * rep * (d + 2) * 4)


DEFAULT_PIPELINE = Pipeline()
MAX_PAGES_PER_SPLIT = 2048   # page ids a block keeps in shared memory (8 KiB)
MAX_SHARED_BYTES = 232448    # dynamic shared memory one block may use on sm_80/sm_90 (227 KiB)

_KERNELS: dict[tuple[str, int], object] = {}
_SCALES: dict[float, mx.array] = {}
_DIMS: dict[tuple[int, ...], mx.array] = {}


def available() -> bool:
    """True when MLX runs on a CUDA GPU here (the kernel's only backend)."""
    try:
        return mx.cuda.is_available() and mx.default_device() == mx.gpu
    except AttributeError:
        return False


def supports(dtype: mx.Dtype, head_dim: int, v_head_dim: int) -> bool:
    """Whether full-precision pages of this dtype and head size fit the kernel."""
    return dtype in (mx.float16, mx.bfloat16) and head_dim == v_head_dim and head_dim in (64, 128, 256)


MLX_VECTOR_HEAD_DIMS = (64, 96, 128)
"""Head sizes for which MLX's own CUDA ``scaled_dot_product_attention`` runs its fused
one-query kernel (MLX 0.32; others fall back to separate matmul and softmax ops)."""


MLX_DECODE_SLICE_TOKENS = 256
"""MLX's CUDA attention (0.32) takes one query's K/V for a slice of a fixed-size cache
when the K/V hold at least this many tokens and their buffer's rows are a multiple of
it (``mlx_attention_misreads``)."""


def mlx_attention_misreads(row_tokens: int, start: int, length: int) -> bool:
    """Whether MLX's own ``scaled_dot_product_attention`` would misread K/V that are a
    view of tokens [start, start + length) of arrays whose buffer holds ``row_tokens``
    tokens per (row, head): a pool's lent run of pages, or a cut of a gather.

    True only on a CUDA GPU, for a view that starts past its buffer's first token
    (``start > 0``), holds at least ``MLX_DECODE_SLICE_TOKENS`` tokens and lies in rows
    a multiple of that long. MLX 0.32's CUDA attention takes a one-query call whose K/V
    look like that for mlx-lm's cache (``keys[..., :offset, :]`` of a buffer grown in
    steps of 256) and hands its cuDNN path the buffer from its first token, with the
    view's length: so a view that starts later is read from the wrong place (wrong
    values, NaN, or an illegal memory access that aborts the process; half precision,
    where cuDNN runs). Views that start at the first token (mlx-lm's own), copies, and
    views in rows of other lengths (MLX's vector kernel reads them) read right
    (bench/RESULTS.md, twenty-second and twenty-third sessions). So where this is True
    a pool lends no view and cuts a read by index, not by slice (``PagePool``). False on
    the CPU and on Metal, where no such path is known (Metal not measured here)."""
    return (start > 0 and length >= MLX_DECODE_SLICE_TOKENS and row_tokens % MLX_DECODE_SLICE_TOKENS == 0
            and available())


MLX_SHORT_GATHER_BYTES = 4 << 20
"""The most bytes of one layer's K/V a single sequence's decode step hands MLX's own
attention as a copy gathered from the pages (``PageRead.attend``) instead of running
the paged kernel: a window of a sliding layer, or a short sequence whose pages are not
one run. Copying that much costs an H100 or H200 a few microseconds; the kernel's two
launches cost the host more (bench/RESULTS.md)."""


def fits(q: mx.array, num_kv_heads: int, dtype: mx.Dtype) -> bool:
    """Whether this query (one token per row, the pool's dtype, a GQA group whose
    staging fits shared memory) can run on a GPU here."""
    n_heads = q.shape[1]
    return (
        q.shape[2] == 1 and q.dtype == dtype and n_heads % num_kv_heads == 0 and available()
        and DEFAULT_PIPELINE.shared_bytes(q.shape[3], n_heads // num_kv_heads,
                                          MAX_PAGES_PER_SPLIT) <= MAX_SHARED_BYTES
    )


def _kernel(name: str, shared_bytes: int = 0):
    """One kernel object per (kernel, dynamic shared size); MLX compiles and caches a
    module per template arguments."""
    k = _KERNELS.get((name, shared_bytes))
    if k is None:
        if name in ("mma", "fma"):
            body = _CUDA["pass1_mma" if name == "mma" else "pass1_fma"]
            k = mx.fast.cuda_kernel(
                name=f"pagedkv_decode_{name}",
                input_names=["queries", "kpool", "vpool", "table", "lengths", "starts", "scale", "dims", "after"],
                output_names=["part_acc", "part_ml"], source=_CUDA["block"] + body + _CUDA["write_partials"], header=_CUDA["header"],
                shared_memory=shared_bytes,
            )
        else:
            k = mx.fast.cuda_kernel(
                name="pagedkv_decode_merge", input_names=["part_acc", "part_ml", "dims", "sinks"],
                output_names=["out"], source=_CUDA["pass2"], header=_CUDA["header"],
            )
        _KERNELS[(name, shared_bytes)] = k
    return k


# Constant inputs, made from values (not lazy ops such as mx.zeros, which another
# thread, a serving engine's, could not evaluate):
_NO_SINKS = mx.array([0.0], mx.float32)  # the merge's sinks input when a layer has none (unread)
NO_WRITES = mx.array([0], mx.int32)
"""The ``after`` input of a kernel reading a pool that has no token writes pending
(unread; see ``pagedkv.kernels.page_write``)."""


def scale_array(scale: float) -> mx.array:
    """The softmax scale as a one-element device array, made once per value."""
    a = _SCALES.get(scale)
    if a is None:
        a = _SCALES[scale] = mx.array([scale], dtype=mx.float32)
    return a


def dims_array(*dims: int) -> mx.array:
    """The kernels' runtime sizes as a device array, made once per value."""
    a = _DIMS.get(dims)
    if a is None:
        if len(_DIMS) > 4096:
            _DIMS.clear()
        a = _DIMS[dims] = mx.array(dims, dtype=mx.int32)
    return a


def choose_splits(batch: int, kv_heads: int, width_pages: int, sms: int = 132) -> int:
    """Splits per (row, KV head), as bench/gpu_kernel_tuning.py measured best on an H200:

    - when the batch fills the GPU that way (at least 4 blocks per SM), blocks of at
      least 64 pages and about 16 blocks per SM in all (several waves, so the scheduler
      evens out the SMs; long blocks keep per-block costs and the partials small);
    - else about 8 blocks per SM of at least 8 pages each (small batches, short rows);
    - always enough splits that a block's page ids fit in shared memory
      (MAX_PAGES_PER_SPLIT).
    """
    pairs = max(1, batch * kv_heads)
    s = min(round(16 * sms / pairs), width_pages // 64)
    if pairs * s < 4 * sms:
        s = min(round(8 * sms / pairs), width_pages // 8)
    return max(1, s, -(-width_pages // MAX_PAGES_PER_SPLIT))


def shared_pages(pages_per_split: int) -> int:
    """Page ids the block's shared memory is sized for: the next power of two, at least
    64. The shared size picks the kernel object (MLX compiles one per object and template),
    so a handful of sizes bound the compiles; everything else that varies per step
    (batch, table width, splits, pages per split, pool size) is a runtime argument. When
    the table width and the splits were template arguments, every new width or batch size
    compiled a kernel (~2.5 s on the H200) in the middle of generation (issue 15)."""
    return max(64, 1 << max(0, pages_per_split - 1).bit_length())


def paged_decode(q: mx.array, k_pool: mx.array, v_pool: mx.array, table: mx.array, lengths: mx.array,
                 starts: mx.array, scale: float, *, rows_per_head: int, page_size: int,
                 splits: int | None = None, pipeline: Pipeline = DEFAULT_PIPELINE,
                 poison: bool = False, sinks: mx.array | None = None, after: mx.array | None = None) -> mx.array:
    """Attention of ``q`` [B, Hq, 1, D] over paged K/V; returns [B, Hq, 1, D].

    ``k_pool``/``v_pool``: one layer's pool arrays [kv_heads * rows_per_head, page_size, D]
    (``PagePool.rows_per_head``: head h's page p is row h * rows_per_head + p);
    ``table``: int32 [B, W] page ids; ``lengths``/``starts``: int32 [B] visible token range.
    ``splits`` (default: ``choose_splits``) cuts each row's pages into that many blocks.
    ``poison`` fills the outputs with NaN before the kernels run (tests: every element
    must be written). ``sinks``: [Hq] attention-sink logits, or None (see ``merge_splits``).
    ``after``: ``PagePool.write_order(layer)``, so the kernel runs after the layer's
    pending in-place token writes (unread).
    """
    init = {"init_value": float("nan")} if poison else {}
    b, hq, lq, d = q.shape
    if lq != 1:
        raise ValueError("the paged decode kernel takes one query per row")
    hkv = k_pool.shape[0] // rows_per_head
    if hq % hkv or d not in (64, 128, 256) or k_pool.dtype not in (mx.float16, mx.bfloat16):
        raise ValueError(f"unsupported shape/dtype: Hq={hq}, Hkv={hkv}, D={d}, {k_pool.dtype}")
    w = table.shape[1]
    s = max(splits or choose_splits(b, hkv, w), -(-w // MAX_PAGES_PER_SPLIT))
    pps = -(-w // s)
    s = -(-w // pps)
    rep = hq // hkv
    warps = pipeline.warps
    mma = pipeline.uses_tensor_cores(rep)
    template = [("T", q.dtype), ("D", d), ("PS", page_size), ("HKV", hkv), ("REP", rep), ("WARPS", warps),
                ("STAGES", pipeline.stages)]
    if not mma:
        template.append(("U", pipeline.groups))
    dims = dims_array(s, pps, w, rows_per_head)
    shared = pipeline.shared_bytes(d, rep, shared_pages(pps))
    if shared > MAX_SHARED_BYTES:
        raise ValueError(f"{pipeline} needs {shared} bytes of shared memory per block at D={d}, "
                         f"REP={rep}; a block may use {MAX_SHARED_BYTES}")
    part_acc, part_ml = _kernel("mma" if mma else "fma", shared)(
        inputs=[q, k_pool, v_pool, table, lengths, starts,  # (q as it is: the kernel reads it flat)
                scale_array(scale), dims, NO_WRITES if after is None else after],
        template=template, grid=(b * hkv * s * warps * 32, 1, 1), threadgroup=(warps * 32, 1, 1),
        output_shapes=[(b * hq * s * d,), (b * hq * s * 2,)], output_dtypes=[mx.float32, mx.float32],
        **init,
    )
    return merge_splits(part_acc, part_ml, dims, q.dtype, q.shape, poison, sinks)


def merge_splits(part_acc: mx.array, part_ml: mx.array, dims: mx.array, dtype: mx.Dtype,
                 shape: tuple[int, ...], poison: bool = False, sinks: mx.array | None = None) -> mx.array:
    """Pass 2: merge ``dims[0]`` splits' partials of the query rows (row-major
    [rows, splits, D] accumulators and [rows, splits, 2] (max, sum), exp2 domain) into
    the output of ``dtype`` and ``shape`` ([B, Hq, L, D], rows = B * Hq * L; it is the
    queries' shape, written flat, so no reshape follows). The prefill kernel writes the
    same partials. ``sinks``: [Hq] attention-sink logits (gpt_oss; as
    ``mx.fast.scaled_dot_product_attention(..., sinks=)``: unscaled, one more softmax
    column per head with a zero value), or None."""
    init = {"init_value": float("nan")} if poison else {}
    d = shape[-1]
    rows = math.prod(shape[:-1])
    if sinks is None:
        sink_args, sink_template = _NO_SINKS, [("SINKS", 0), ("HQ", 1), ("LQ", 1)]
    else:
        sink_args, sink_template = sinks.astype(mx.float32), [("SINKS", 1), ("HQ", shape[1]), ("LQ", shape[2])]
    (out,) = _kernel("merge")(
        inputs=[part_acc, part_ml, dims, sink_args], template=[("T", dtype), ("D", d), *sink_template],
        grid=(rows * min(d, 128), 1, 1), threadgroup=(min(d, 128), 1, 1),
        output_shapes=[tuple(shape)], output_dtypes=[dtype], **init,
    )
    return out
