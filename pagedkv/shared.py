"""``SharedKv``: fetched K/V that a donor layer hands to its sharers and the drafter.

A tagged union of three immutable attrs classes, discriminated by ``kind``:

    PlainKv  kind="plain"  full-precision keys/values [B, kv_heads, L, D], optionally with
                           values in a rotated domain (``v_rotated``) and the function that
                           un-rotates an attention output (``restore_values``)
    QuantKv  kind="quant"  affine-quantised (packed, scales, biases) keys and values
    ViewKv   kind="view"   a ``KvAttentionView`` over the page pool

Every kind has ``offset`` (the cache position *before* this step's write: the RoPE
start of this step's queries), an optional ``offset_arr`` (per-row int32 positions,
an owned copy taken before the write, so a cache that later rebinds its own position
array cannot change it under a sharer), ``attend(q, scale, mask)`` and ``release()``.

Ownership: whoever creates a SharedKv releases it exactly once (normally the
``ForwardPass`` that registered it; sharers never release). A view-backed SharedKv holds
page references until then. ``attend`` after release and a second release raise
``ReleasedError``. The objects are frozen; the release state lives in a private lease.
"""

from __future__ import annotations

from typing import Callable, Literal, Optional, Union

import attrs
import mlx.core as mx

from pagedkv.attention import quantized_attention
from pagedkv.codec import GROUP_SIZES, QUANT_BITS, one_of
from pagedkv.errors import InvalidValueError, KvShapeError, ReleasedError
from pagedkv.forward_pass import ForwardPass
from pagedkv.view import KvAttentionView


@attrs.define(slots=True)
class _Lease:
    """The one mutable part of a SharedKv: whether it was released, and by whom first."""

    released: bool = False

    def check(self) -> None:
        if self.released:
            raise ReleasedError("SharedKv used after release()")

    def end(self) -> None:
        self.check()
        self.released = True


def _owned_positions(value: Optional[mx.array]) -> Optional[mx.array]:
    """An owned int32 copy of per-row positions (a new array object, evaluated now)."""
    if value is None:
        return None
    if not isinstance(value, mx.array) or value.ndim != 1:
        raise KvShapeError(f"offset_arr must be a 1-d mx.array of per-row positions, got {value!r}")
    owned = mx.array(value, dtype=mx.int32)
    mx.eval(owned)
    return owned


def _note_created(kv) -> None:
    active = ForwardPass.current()
    if active is not None:
        active.note_created(kv)


def _check_offset(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise KvShapeError(f"offset must be a non-negative int, got {value!r}")


def _check_array(instance, attribute, value) -> None:
    if not isinstance(value, mx.array) or value.ndim != 4:
        raise KvShapeError(f"{attribute.name} must be a [B, kv_heads, L, D] mx.array")


def _check_triple(instance, attribute, value) -> None:
    if not (isinstance(value, tuple) and len(value) == 3 and all(isinstance(x, mx.array) for x in value)):
        raise KvShapeError(f"{attribute.name} must be a (packed, scales, biases) tuple of mx.arrays")
    packed, scales, biases = value
    if packed.ndim != 4 or packed.dtype != mx.uint32 or scales.shape != biases.shape \
            or scales.shape[:3] != packed.shape[:3]:
        raise KvShapeError(f"{attribute.name}: packed must be uint32 [B, kv_heads, L, D*bits/32] and scales/biases "
                           f"[B, kv_heads, L, D/group_size], got {[tuple(x.shape) for x in value]}")


def _same_tokens(keys_shape: tuple, values_shape: tuple) -> None:
    if keys_shape[:3] != values_shape[:3]:
        raise KvShapeError(f"keys {keys_shape} and values {values_shape} differ in batch, kv heads or length")


class _SharedKvBase:
    """What every kind shares: it reports its creation to the active ForwardPass (debug
    leak detection) and is released exactly once through its ``_lease`` field."""

    __slots__ = ()

    def __attrs_post_init__(self) -> None:
        _note_created(self)

    @property
    def released(self) -> bool:
        return self._lease.released

    def release(self) -> None:
        self._lease.end()


@attrs.frozen
class PlainKv(_SharedKvBase):
    keys: mx.array = attrs.field(validator=_check_array)
    values: mx.array = attrs.field(validator=_check_array)
    offset: int = attrs.field(validator=_check_offset)
    offset_arr: Optional[mx.array] = attrs.field(default=None, converter=_owned_positions)
    restore_values: Optional[Callable[[mx.array], mx.array]] = None
    v_rotated: bool = False
    _lease: _Lease = attrs.field(factory=_Lease, init=False, repr=False, eq=False)
    kind: Literal["plain"] = attrs.field(default="plain", init=False)

    def __attrs_post_init__(self) -> None:
        _same_tokens(tuple(self.keys.shape), tuple(self.values.shape))
        if self.v_rotated and self.restore_values is None:
            raise InvalidValueError("v_rotated=True needs restore_values to un-rotate attention outputs")
        super().__attrs_post_init__()

    def attend(self, q: mx.array, scale: float, mask=None) -> mx.array:
        self._lease.check()
        out = mx.fast.scaled_dot_product_attention(q, self.keys, self.values, scale=scale, mask=mask)
        return self.restore_values(out) if self.v_rotated else out

    def keys_values(self) -> tuple[mx.array, mx.array]:
        self._lease.check()
        return self.keys, self.values


@attrs.frozen
class QuantKv(_SharedKvBase):
    keys: tuple[mx.array, mx.array, mx.array] = attrs.field(validator=_check_triple)
    values: tuple[mx.array, mx.array, mx.array] = attrs.field(validator=_check_triple)
    bits: int = attrs.field(validator=one_of(QUANT_BITS, InvalidValueError))
    group_size: int = attrs.field(validator=one_of(GROUP_SIZES, InvalidValueError))
    offset: int = attrs.field(validator=_check_offset)
    offset_arr: Optional[mx.array] = attrs.field(default=None, converter=_owned_positions)
    v_bits: Optional[int] = attrs.field(  # values' bits when they differ (k8v4)
        default=None, validator=attrs.validators.optional(one_of(QUANT_BITS, InvalidValueError)))
    v_group_size: Optional[int] = attrs.field(
        default=None, validator=attrs.validators.optional(one_of(GROUP_SIZES, InvalidValueError)))
    _lease: _Lease = attrs.field(factory=_Lease, init=False, repr=False, eq=False)
    kind: Literal["quant"] = attrs.field(default="quant", init=False)

    def __attrs_post_init__(self) -> None:
        _same_tokens(tuple(self.keys[0].shape), tuple(self.values[0].shape))
        super().__attrs_post_init__()

    def attend(self, q: mx.array, scale: float, mask=None) -> mx.array:
        """Quantised attention on the packed K/V; ``q`` itself is never modified."""
        self._lease.check()
        out = quantized_attention(
            q, self.keys, self.values, scale, mask, k_bits=self.bits, k_group=self.group_size,
            v_bits=self.v_bits or self.bits, v_group=self.v_group_size or self.group_size,
        )
        return out.astype(q.dtype)


@attrs.frozen
class ViewKv(_SharedKvBase):
    attention: KvAttentionView = attrs.field(validator=attrs.validators.instance_of(KvAttentionView))
    offset: int = attrs.field(validator=_check_offset)
    offset_arr: Optional[mx.array] = attrs.field(default=None, converter=_owned_positions)
    _lease: _Lease = attrs.field(factory=_Lease, init=False, repr=False, eq=False)
    kind: Literal["view"] = attrs.field(default="view", init=False)

    def attend(self, q: mx.array, scale: float, mask=None) -> mx.array:
        self._lease.check()
        return self.attention.attend(q, scale, mask)

    def keys_values(self) -> tuple[mx.array, mx.array]:
        self._lease.check()
        return self.attention.keys_values()

    def release(self) -> None:
        super().release()
        self.attention.release()


SharedKv = Union[PlainKv, QuantKv, ViewKv]
"""Fetched KV handed from a donor layer to its sharers and the drafter (see module doc)."""
