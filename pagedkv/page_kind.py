"""``PageKind``: what a pool's pages can be read as, decided once per pool.

The codecs say what they are (:mod:`pagedkv.codec`: ``quantized``, ``rotated``, their
bits and dtype); this class turns a pool's (K codec, V codec, dtype, head sizes) into
the few facts every reader needs, so no other module inspects codecs::

    plain          pages hold exactly the values attention wants (full precision in
                   the pool's dtype): no decoding, SDPA straight on the gathered pages
    mlx_quantized  one unrotated affine codec for K and V: mlx-lm's QuantizedKVCache
                   protocol (packed triples, ``bits``/``group_size`` on the cache)
    packed_pair    K and V both unrotated affine (bits may differ): a ``QuantKv``
    decode_kernel  plain fp16/bf16 pages with a head size the CUDA decode kernel takes

Reading: ``model_inputs`` gives what mlx-lm's attention expects from ``update_and_fetch``
for this kind; ``decode`` gives float K/V. Attention itself dispatches in
:func:`pagedkv.attention.attend_parts`.
"""

from __future__ import annotations

import attrs
import mlx.core as mx

from pagedkv.codec import AffineQuant, FullPrecision, PageCodec
from pagedkv.kernels import paged_decode

Parts = tuple  # the gathered components of K or V: (values,) or (packed, scales, biases)


def _unrotated_affine(codec: PageCodec) -> bool:
    return isinstance(codec, AffineQuant) and not codec.rotated


@attrs.frozen
class PageKind:
    k_codec: PageCodec
    v_codec: PageCodec
    dtype: mx.Dtype
    plain: bool
    mlx_quantized: bool
    packed_pair: bool
    decode_kernel: bool

    @classmethod
    def of(cls, k_codec: PageCodec, v_codec: PageCodec, dtype: mx.Dtype, head_dim: int,
           v_head_dim: int) -> PageKind:
        plain = all(isinstance(c, FullPrecision) and c.dtype == dtype for c in (k_codec, v_codec))
        packed_pair = _unrotated_affine(k_codec) and _unrotated_affine(v_codec)
        return cls(
            k_codec, v_codec, dtype, plain=plain,
            mlx_quantized=packed_pair and k_codec == v_codec,
            packed_pair=packed_pair,
            decode_kernel=plain and paged_decode.supports(dtype, head_dim, v_head_dim),
        )

    def decode(self, k_parts: Parts, v_parts: Parts, unrotate_values: bool = True) -> tuple[mx.array, mx.array]:
        """Float K/V in the pool's dtype; keys always un-rotated, values if asked."""
        if self.plain:
            return k_parts[0], v_parts[0]
        k = self.k_codec.decode(k_parts, self.dtype)
        if self.k_codec.rotated:
            k = self.k_codec.unrotate(k)
        v = self.v_codec.decode(v_parts, self.dtype)
        if self.v_codec.rotated and unrotate_values:
            v = self.v_codec.unrotate(v)
        return k, v

    def model_inputs(self, k_parts: Parts, v_parts: Parts):
        """What ``update_and_fetch`` returns to an mlx-lm model: the packed triples for
        ``mlx_quantized`` pages (mlx-lm's quantised attention reads them), else float K/V."""
        if self.mlx_quantized:
            return k_parts, v_parts
        return self.decode(k_parts, v_parts)
