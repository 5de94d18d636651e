"""Attention over paged K/V: the one entry point that chooses how to compute it.

``attend_parts(q, k_parts, v_parts, scale, mask, kind)`` serves every reader (the
caches' routed attention, batches, ``KvAttentionView``, ``DonorCache`` sharers) from
the gathered page components:

- plain pages: ``mx.fast.scaled_dot_product_attention`` (exact).
- affine-quantised K and/or V: quantised matmuls on the packed pages (the context is
  never dequantised as a whole); mlx-lm's ``quantized_scaled_dot_product_attention`` is
  the numerical reference, but unlike it this never scales the caller's query in place.
- rotated K (TurboQuant): the query is rotated to match (R is orthogonal, so q·k is kept).
- rotated V: attention runs on rotated values; the *output* is un-rotated once per query
  row (deferred-V), which equals un-rotating every cached value (attention is linear in V).
- attention sinks (gpt_oss): one learned logit per query head that joins every row's
  softmax and takes weight from the keys without adding a value, on every page kind
  (mlx-lm's own quantised attention refuses them).

The CUDA decode kernel reads the pool without a gather; ``PageRead.attend``
(:mod:`pagedkv.page_read`), which holds the page table, tries it first.
"""

from __future__ import annotations

import mlx.core as mx

from pagedkv.errors import InvalidValueError
from pagedkv.kernels import paged_decode
from pagedkv.page_kind import PageKind


def _mask_scores(scores: mx.array, mask, n_repeats: int) -> mx.array:
    if mask is None:
        return scores
    if isinstance(mask, str):
        if mask != "causal":
            raise InvalidValueError(f"unknown mask {mask!r}")
        q_len, k_len = scores.shape[-2:]
        mask = mx.arange(k_len - q_len, k_len)[:, None] >= mx.arange(k_len)[None]
    elif n_repeats > 1 and mask.ndim > 3:
        mask = mx.expand_dims(mask, -3)
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, mx.finfo(scores.dtype).min)
    return scores + mask


def _softmax_with_sinks(scores: mx.array, sinks: mx.array | None) -> mx.array:
    """Softmax over the last axis of ``scores`` [B, n_heads, L, K] (or [B, n_kv, rep, L,
    K] in grouped form), with ``sinks`` [n_heads] as one more logit per head that no
    value goes with (as ``mx.fast.scaled_dot_product_attention(..., sinks=)``)."""
    if sinks is None:
        return mx.softmax(scores, axis=-1, precise=True)
    heads = scores.shape[1:-2]  # (n_heads,) or (n_kv, rep)
    column = mx.broadcast_to(sinks.astype(scores.dtype).reshape(1, *heads, 1, 1), (*scores.shape[:-1], 1))
    return mx.softmax(mx.concatenate([column, scores], axis=-1), axis=-1, precise=True)[..., 1:]


def quantized_attention(q: mx.array, k_parts, v_parts, scale: float, mask, *, k_bits: int,
                        k_group: int, v_bits: int, v_group: int, sinks: mx.array | None = None) -> mx.array:
    """Attention of ``q`` [B, n_heads, L, D] over quantised (packed, scales, biases) K/V
    (``sinks``: [n_heads] attention-sink logits, or None).

    MLX's CUDA backend (0.32) has no ``quantized_matmul`` for these shapes ("No
    implementation for problem shape"), so on CUDA the K/V are dequantised and SDPA runs.
    """
    if paged_decode.available():
        k = mx.dequantize(*k_parts, group_size=k_group, bits=k_bits).astype(q.dtype)
        v = mx.dequantize(*v_parts, group_size=v_group, bits=v_bits).astype(q.dtype)
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)
    b, n_heads, n_q, d = q.shape
    n_kv = k_parts[0].shape[-3]
    # quantized_matmul computes in the scales' dtype: promote fp16 scales to the query's
    k_parts = (k_parts[0], k_parts[1].astype(q.dtype), k_parts[2].astype(q.dtype))
    v_parts = (v_parts[0], v_parts[1].astype(q.dtype), v_parts[2].astype(q.dtype))
    rep = n_heads // n_kv
    queries = q * scale  # a new array: the caller's q is left alone
    if rep > 1:
        queries = queries.reshape(b, n_kv, rep, n_q, d)
        k_parts = tuple(mx.expand_dims(x, -3) for x in k_parts)
        v_parts = tuple(mx.expand_dims(x, -3) for x in v_parts)
    scores = mx.quantized_matmul(queries, *k_parts, transpose=True, group_size=k_group, bits=k_bits)
    scores = _softmax_with_sinks(_mask_scores(scores, mask, rep), sinks)
    out = mx.quantized_matmul(scores, *v_parts, transpose=False, group_size=v_group, bits=v_bits)
    if rep > 1:
        out = out.reshape(b, n_heads, n_q, -1)
    return out


def attend_parts(q: mx.array, k_parts, v_parts, scale: float, mask, kind: PageKind,
                 sinks: mx.array | None = None) -> mx.array:
    """Attention over one page kind's gathered components (see module doc); ``sinks``:
    [n_heads] attention-sink logits, or None."""
    kc, vc = kind.k_codec, kind.v_codec
    if kind.plain and q.dtype == kind.dtype:
        return mx.fast.scaled_dot_product_attention(q, k_parts[0], v_parts[0], scale=scale, mask=mask, sinks=sinks)
    if kc.rotated:
        q = kc.rotate(q)
    if kc.quantized and vc.quantized:
        out = quantized_attention(q, k_parts, v_parts, scale, mask, k_bits=kc.bits,
                                  k_group=kc.group_size, v_bits=vc.bits, v_group=vc.group_size, sinks=sinks)
    else:
        k = kc.decode(k_parts, q.dtype)
        v = vc.decode(v_parts, q.dtype)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)
    if vc.rotated:
        out = vc.unrotate(out)
    return out.astype(q.dtype)
