"""``StatePool``: fixed-size slots for the recurrent state of hybrid models.

A hybrid model (attention next to gated-delta or Mamba layers; mlx-lm gives the latter
an ``ArraysCache``) keeps, per recurrent layer, a few fixed-shape arrays per sequence (a
convolution window, an SSM state) that are replaced at every step instead of growing.
A *slot* holds all of them for one sequence at one position::

    layer r, component c:  [num_slots, *shape_rc]     e.g. conv [S, 3, 8192], ssm [S, 32, 128, 128]
    slot s = row s of every component array            (the whole state of one sequence)

Slots come from a reference-counting allocator, exactly as pages do (the same
``FreeListAllocator``): a sequence holds its live slot; a prefix-cache checkpoint is a
slot marked cacheable, which becomes CACHED (evictable, least recently used first)
when no sequence holds it. Slot 0 is the null slot: all zeros, never handed out, the
state of a sequence that has seen no token.

Ownership: the pool owns its arrays and never hands them out; reads return new lazy
arrays, tracked by weak reference so that writes stay in place
(:class:`~pagedkv.in_place_writes.InPlaceWrites`, as ``PagePool``). The only writers are
``write`` and ``copy_slots``; ``RowStates`` (:mod:`pagedkv.row_states`) decides what is
written where. Costs: ``read``/``write`` O(rows × the component's bytes);
``copy_slots`` O(slots × slot bytes).
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np

from allocators import BlockAllocator, FreeListAllocator, implements_block_allocator
from pagedkv.errors import (
    InvalidTypeError,
    InvalidValueError,
    KvDTypeError,
    KvShapeError,
    NotSupportedError,
    check_index,
    check_int,
)
from pagedkv.in_place_writes import InPlaceWrites
from pagedkv.mlx_lm_caches import flat_caches
from pagedkv.pool import checked_copy

StateShapes = Sequence[Sequence[tuple[tuple[int, ...], mx.Dtype]]]
"""Per recurrent layer, per component: (the shape for one sequence, dtype)."""


class StatePool:
    def __init__(self, shapes: StateShapes, *, num_slots: int | None = None, max_bytes: int | None = None,
                 allocator: BlockAllocator | None = None, sync_before_rewrite: bool = False) -> None:
        """Slots for ``shapes`` (see ``StateShapes``): give ``num_slots`` (the null slot
        included) or a byte budget ``max_bytes``."""
        if not isinstance(shapes, (list, tuple)) or not shapes:
            raise InvalidValueError("shapes must list at least one recurrent layer")
        self.shapes: tuple[tuple[tuple[tuple[int, ...], mx.Dtype], ...], ...] = tuple(
            tuple(_component(c) for c in layer) for layer in shapes)
        if any(not layer for layer in self.shapes):
            raise InvalidValueError("every recurrent layer needs at least one state component")
        if (num_slots is None) == (max_bytes is None):
            raise InvalidValueError("give exactly one of num_slots and max_bytes")
        if num_slots is None:
            num_slots = int(check_int("max_bytes", max_bytes, minimum=1) // self.bytes_per_slot)
            if num_slots < 2:
                raise InvalidValueError(f"max_bytes={max_bytes} holds fewer than 2 state slots of "
                                        f"{self.bytes_per_slot} bytes")
        self.num_slots = check_int("num_slots", num_slots, minimum=2)  # the null slot + one usable
        if allocator is None:
            allocator = FreeListAllocator(self.num_slots, null_page=True)
        elif not implements_block_allocator(allocator):
            raise InvalidTypeError(f"allocator must implement allocators.BlockAllocator, got {type(allocator).__name__}")
        elif allocator.num_pages != self.num_slots or allocator.null_page is None:
            raise InvalidValueError(f"the allocator must have {self.num_slots} pages and reserve the null page")
        self.allocator = allocator
        self.null_slot = allocator.null_page
        self._arrays = [[mx.zeros((self.num_slots, *shape), dtype) for shape, dtype in layer]
                        for layer in self.shapes]
        mx.eval(self._arrays)
        self._writes = InPlaceWrites(self.num_layers, sync_before_rewrite)

    @classmethod
    def for_model(cls, model, *, num_slots: int | None = None, max_bytes: int | None = None) -> StatePool:
        """A pool for the recurrent layers of an mlx-lm ``model`` (the ``ArraysCache``
        slots of ``model.make_cache()``), shapes and dtypes found by a one-token forward
        on mlx-lm's own caches. A model whose recurrent layers set their state without
        calling ``cache.advance(n)`` (mlx-lm's jamba, mamba, recurrent_gemma, rwkv7...)
        gets ``NotSupportedError``: pagedkv counts the tokens a state covers by that call."""
        if not hasattr(model, "make_cache"):
            raise NotSupportedError("the model has no make_cache(); it has no recurrent layers to hold")
        caches = model.make_cache()
        advanced = []
        for c in flat_caches(caches):
            if type(c).__name__ == "ArraysCache":
                c.advance = lambda n, c=c: advanced.append(c)  # (this instance only, which is then dropped)
        model(mx.array([[0]]), cache=caches)
        shapes = state_shapes(caches)
        if not advanced:
            raise NotSupportedError(f"{type(model).__module__.rsplit('.', 1)[-1]}: its recurrent layers never call "
                                    "cache.advance(n), which is how pagedkv counts the tokens a state covers")
        return cls(shapes, num_slots=num_slots, max_bytes=max_bytes)

    # ------------------------------------------------------------------ sizes
    @property
    def num_layers(self) -> int:
        return len(self.shapes)

    def check_layer(self, layer: object) -> int:
        """``layer`` as an index of one of the pool's recurrent layers; ``InvalidTypeError``
        or ``InvalidValueError`` otherwise (-1 too: it would name the last layer). Every
        method that takes a layer checks it so."""
        return check_index("layer", layer, len(self.shapes))

    def layer_bytes(self, layer: int) -> int:
        """Bytes of one sequence's state in recurrent layer ``layer`` (all its components)."""
        return sum(int(np.prod(shape)) * dtype.size for shape, dtype in self.shapes[self.check_layer(layer)])

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of one sequence's whole state (every recurrent layer and component)."""
        return sum(self.layer_bytes(r) for r in range(self.num_layers))

    @property
    def usable_slots(self) -> int:
        return self.num_slots - 1

    @property
    def nbytes(self) -> int:
        return self.bytes_per_slot * self.num_slots

    # ------------------------------------------------------------------ read / write
    def check_state(self, layer: int, component: int, value: object, rows: int) -> None:
        """``KvShapeError``/``KvDTypeError`` unless ``component`` is one of the layer's
        and ``value`` is [rows, *shape] of that component's dtype."""
        layer = self.check_layer(layer)
        if not isinstance(component, int) or not 0 <= component < len(self.shapes[layer]):
            raise KvShapeError(f"recurrent layer {layer} has {len(self.shapes[layer])} state components, "
                               f"not index {component!r}")
        shape, dtype = self.shapes[layer][component]
        if not isinstance(value, mx.array):
            raise KvShapeError(f"state {component} of recurrent layer {layer} must be an mx.array, "
                               f"got {type(value).__name__}")
        if tuple(value.shape) != (rows, *shape):
            raise KvShapeError(f"state {component} of recurrent layer {layer} must be {(rows, *shape)}, "
                               f"got {tuple(value.shape)}")
        if value.dtype != dtype:
            raise KvDTypeError(f"state {component} of recurrent layer {layer} must be {dtype}, got {value.dtype}")

    def read(self, layer: int, component: int, slots: mx.array, track: bool = True) -> mx.array:
        """A new lazy [len(slots), *shape] array: the component in ``slots`` (int32).
        ``track=False`` inside a compiled step (which settles every layer's reads before
        it runs, and whose reads are not arrays yet)."""
        arrays = self._arrays[self.check_layer(layer)]
        read = mx.take(arrays[check_index("component", component, len(arrays))], slots, axis=0)
        return self._writes.track(layer, read) if track else read

    def write(self, layer: int, values: Sequence[mx.array | None], slots: mx.array) -> None:
        """Write ``values[c]`` ([len(slots), *shape], checked by the caller) into
        component c of ``slots`` (distinct, held); None leaves a component as it is."""
        self._writes.before_write(self.check_layer(layer))
        self.step_write(layer, values, slots)

    def step_write(self, layer: int, values: Sequence[mx.array | None], slots: mx.array) -> None:
        """``write`` without settling the layer's reads first: for a compiled step, which
        settles them (``settle_reads``) before it runs."""
        for arr, value in zip(self._arrays[self.check_layer(layer)], values):
            if value is not None:
                arr[slots] = value

    def settle_reads(self) -> None:
        """Evaluate every layer's reads that are still pending, so that the writes that
        follow can be in place (as ``PagePool.settle_reads``)."""
        self._writes.settle_all()

    def compile_state(self) -> list[list[list[mx.array]]]:
        """The pool's own arrays, ``[per layer: per component]`` in a one-item list (the
        nesting of ``PagePool.compile_state``), for ``mx.compile(..., inputs=state,
        outputs=state)``: a compiled step reads and writes them there (``read`` untracked,
        ``step_write``) and MLX puts the written arrays back into these very lists.
        Nothing else may hold them."""
        return [self._arrays]

    def copy_slots(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy every component of slots ``src`` onto slots ``dst`` (distinct, held);
        ``src`` any valid slot ids. Checked before anything is written."""
        src, dst = checked_copy(self.allocator, src, dst, "copy_slots", "slots")
        if src.size == 0:
            return
        s, d = mx.array(src.astype(np.int32)), mx.array(dst.astype(np.int32))
        for layer, arrays in enumerate(self._arrays):
            self._writes.settle(layer)
            blocks = [mx.take(a, s, axis=0) for a in arrays]
            mx.eval(blocks)  # detached from the arrays, so the writes donate
            for a, blk in zip(arrays, blocks):
                a[d] = blk

    def storage(self, layer: int) -> list[mx.array]:
        """The arrays of recurrent layer ``layer`` (evaluating them settles its pending
        writes). Do not keep them: a kept reference makes the next write a copy."""
        return self._arrays[self.check_layer(layer)]

    def __repr__(self) -> str:
        return (f"StatePool(layers={self.num_layers}, slots={self.num_slots}, "
                f"{self.bytes_per_slot / 2**10:.1f} KiB/slot, {self.nbytes / 2**20:.1f} MiB)")


def state_shapes(caches: list) -> StateShapes:
    """The ``StateShapes`` of the recurrent (``ArraysCache``) layers of mlx-lm caches that
    have run a step."""
    shapes = []
    for c in flat_caches(caches):
        if type(c).__name__ != "ArraysCache":
            continue
        if any(a is None for a in c.cache):
            raise NotSupportedError("a recurrent layer left a state component unset after a step")
        shapes.append([(tuple(a.shape[1:]), a.dtype) for a in c.cache])
    if not shapes:
        raise NotSupportedError("the model has no recurrent (ArraysCache) layers")
    return shapes


def _component(c: object) -> tuple[tuple[int, ...], mx.Dtype]:
    if not (isinstance(c, (tuple, list)) and len(c) == 2 and isinstance(c[1], mx.Dtype)):
        raise InvalidTypeError(f"a state component is (shape, mlx dtype), got {c!r}")
    shape = tuple(check_int("state dimension", d, minimum=1) for d in c[0])
    return shape, c[1]
