"""Page codecs: how the bytes of a page map to K or V values.

Page kinds differ only here. Tables, views, reference counts and tests are shared.

    FullPrecision(dtype)                   one component: the values      [.., D]
    AffineQuant(bits, group_size)          packed uint32 [.., D*bits/32], scales and
                                           biases [.., D/group_size]; groups run along
                                           head_dim, never along tokens, so any token
                                           slice of a page is byte-safe
    RotatedAffineQuant(bits, group, seed)  AffineQuant of R·x, with R = H·diag(s): random
                                           ±1 signs s, then the normalised Walsh–Hadamard
                                           transform H (TurboQuant). R is orthogonal and
                                           its own inverse's transpose: R⁻¹y = s ⊙ H y.

A codec encodes tokens [kv_heads, T, D] into its components when they are written, and
decodes gathered components back into values. ``RotatedAffineQuant.decode`` leaves the
values rotated; ``unrotate`` applies R⁻¹ along the last axis (for attention outputs
as well as for values, since attention is linear in V).
"""

from __future__ import annotations

import math

import attrs
import mlx.core as mx

from pagedkv.errors import NotSupportedError

QUANT_BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)


@attrs.frozen
class FullPrecision:
    dtype: mx.Dtype

    quantized = False
    rotated = False

    def component_dims(self, dim: int) -> list[tuple[int, mx.Dtype]]:
        return [(dim, self.dtype)]

    def for_dtype(self, dtype: mx.Dtype) -> FullPrecision:
        """This codec for a pool of ``dtype`` K/V (its own dtype is kept)."""
        return self

    def encode(self, x: mx.array) -> tuple[mx.array, ...]:
        return (x.astype(self.dtype),)

    def decode(self, parts: tuple[mx.array, ...], dtype: mx.Dtype | None = None) -> mx.array:
        return parts[0] if dtype is None else parts[0].astype(dtype)

    def bytes_per_value_row(self, dim: int) -> int:
        """Bytes one token of one head takes."""
        return dim * self.dtype.size

    def check_dim(self, dim: int) -> None:
        pass

    def label(self) -> str:
        return str(self.dtype).split(".")[-1]


def one_of(allowed: tuple, error: type[Exception] = NotSupportedError):
    """An attrs validator: the value must be one of ``allowed`` (bools never are)."""

    def check(instance, attribute, value) -> None:
        if isinstance(value, bool) or value not in allowed:
            raise error(f"{attribute.name} must be one of {allowed}, got {value!r}")

    return check


def _scale_dtype(instance, attribute, value) -> None:
    if value is not None and (not isinstance(value, mx.Dtype) or not mx.issubdtype(value, mx.floating)):
        raise NotSupportedError(f"scale_dtype must be None or an MLX floating dtype, got {value!r}")


@attrs.frozen
class AffineQuant:
    """Affine quantisation; ``scale_dtype`` None (the default) means the pool's dtype,
    which is what mlx-lm's ``QuantizedKVCache`` stores (``mx.quantize`` of the model's
    K/V), so outputs match it and a quantised step returns the model's dtype."""

    bits: int = attrs.field(validator=one_of(QUANT_BITS))
    group_size: int = attrs.field(default=64, validator=one_of(GROUP_SIZES))
    scale_dtype: mx.Dtype | None = attrs.field(default=None, validator=_scale_dtype)

    quantized = True
    rotated = False

    def for_dtype(self, dtype: mx.Dtype) -> AffineQuant:
        """This codec for a pool of ``dtype`` K/V: scales in ``dtype`` unless set."""
        return self if self.scale_dtype is not None else attrs.evolve(self, scale_dtype=dtype)

    def check_dim(self, dim: int) -> None:
        if dim % self.group_size or (dim * self.bits) % 32:
            raise NotSupportedError(
                f"head_dim {dim} is not a multiple of group_size {self.group_size} "
                f"(and of 32 / gcd(32, bits))"
            )

    def component_dims(self, dim: int) -> list[tuple[int, mx.Dtype]]:
        self.check_dim(dim)
        groups = dim // self.group_size
        return [(dim * self.bits // 32, mx.uint32), (groups, self.scale_dtype), (groups, self.scale_dtype)]

    def encode(self, x: mx.array) -> tuple[mx.array, ...]:
        return tuple(mx.quantize(x.astype(self.scale_dtype), group_size=self.group_size, bits=self.bits))

    def decode(self, parts: tuple[mx.array, ...], dtype: mx.Dtype | None = None) -> mx.array:
        """Dequantise; with ``dtype`` the arithmetic (and result) is in that dtype."""
        w, scales, biases = parts
        if dtype is not None:
            scales, biases = scales.astype(dtype), biases.astype(dtype)
        return mx.dequantize(w, scales, biases, group_size=self.group_size, bits=self.bits)

    def bytes_per_value_row(self, dim: int) -> int:
        groups = dim // self.group_size
        return dim * self.bits // 8 + 2 * groups * self.scale_dtype.size

    def label(self) -> str:
        return f"{self.bits}-bit/g{self.group_size}"


def hadamard_self_inverse(dim: int) -> bool:
    """``mx.hadamard_transform`` with scale 1/sqrt(d) is its own inverse for d = 2^k and
    12·2^k; for sizes with a factor 20 or 28 (80, 112, 160 ...) it is not."""
    m = dim
    while m % 2 == 0 and m > 1:
        m //= 2
    return m in (1, 3)  # 2^k, or 3·2^k (= 12·2^(k-2))


@attrs.frozen
class RotatedAffineQuant(AffineQuant):
    """TurboQuant-style: random signs + normalised Hadamard, then affine quantisation."""

    seed: int = 0
    dim: int = attrs.field(default=0, kw_only=True)
    _signs: mx.array = attrs.field(init=False, repr=False, eq=False)

    rotated = True

    def __attrs_post_init__(self) -> None:
        if self.dim:
            self.check_dim(self.dim)
            key = mx.random.key(self.seed)
            signs = mx.where(mx.random.bernoulli(0.5, (self.dim,), key=key), 1.0, -1.0)
            mx.eval(signs)
            object.__setattr__(self, "_signs", signs)

    def check_dim(self, dim: int) -> None:
        if not hadamard_self_inverse(dim):
            raise NotSupportedError(
                f"head_dim {dim}: mx.hadamard_transform is not its own inverse for this size "
                "(only 2^k and 12·2^k are supported for rotated values)"
            )
        if self.dim and dim != self.dim:
            raise NotSupportedError(f"this rotation was built for head_dim {self.dim}, not {dim}")
        super().check_dim(dim)

    def rotate(self, x: mx.array) -> mx.array:
        return mx.hadamard_transform(x * self._signs.astype(x.dtype), scale=1 / math.sqrt(self.dim))

    def unrotate(self, y: mx.array) -> mx.array:
        """R⁻¹ along the last axis: s ⊙ H y."""
        return mx.hadamard_transform(y, scale=1 / math.sqrt(self.dim)) * self._signs.astype(y.dtype)

    def encode(self, x: mx.array) -> tuple[mx.array, ...]:
        return super().encode(self.rotate(x.astype(mx.float32)))

    def label(self) -> str:
        return f"{self.bits}-bit/g{self.group_size} rotated"


PageCodec = FullPrecision | AffineQuant | RotatedAffineQuant


def rotated(bits: int, dim: int, group_size: int = 64, seed: int = 0,
            scale_dtype: mx.Dtype | None = None) -> RotatedAffineQuant:
    """A TurboQuant codec for ``dim``-wide heads."""
    return RotatedAffineQuant(bits, group_size, scale_dtype, seed, dim=dim)
