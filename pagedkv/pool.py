"""``PagePool``: the physical K/V pages of every layer, and the only code that writes them.

Layout (chosen by measurement, see bench/RESULTS.md): per layer, one K and one V array,
head-major::

    K[layer]: [kv_heads * R, page_size, head_dim]      row = head * R + page
    V[layer]: [kv_heads * R, page_size, v_head_dim]

    page p of head h is the contiguous [page_size, head_dim] block K[layer][h * R + p].

R (``rows_per_head``) is ``num_pages``, or one more where ``num_pages * page_size`` is a
multiple of 256 tokens (``head_rows_for``): MLX's CUDA attention misreads a view that
starts inside rows of such a length (``paged_decode.mlx_attention_misreads``), so a
pool of a round size would have to gather what it can lend. The extra row belongs to no
page id; it is never written or read, and ``nbytes`` counts it.

A page id names the same slot in every layer (one allocator for the whole pool, as in
vLLM), so one page table serves all layers of a sequence. Gathering n pages is one
``take`` along axis 0 with indices ``h * R + pages`` → [kv_heads * n, page_size, D],
which reshapes to [1, kv_heads, n * page_size, D] with no transpose.

Ownership: the pool owns its arrays for its whole life and never hands them out; reads
return new (lazy) arrays, except ``borrow_run``'s views for a layer's own step. Writes
are in place: MLX reuses ("donates") an array's buffer for ``a[idx] = v`` only when
nothing else references the old array; a second Python reference or a still-pending
lazy read of it turns every token write into a copy of the whole layer. Therefore (1)
the arrays are private; (2) views (``KvAttentionView``) hold the *pool*, never an
array, and read the current array when they attend; (3) before writing a layer, the pool
evaluates reads of that layer that are still alive (tracked by weak reference), so a
caller holding an unevaluated read cannot silently make the write O(pool); (4) on a CUDA
GPU, MLX's command encoder keeps the buffers of in-flight kernels alive, which blocks
donation when one forward writes an array twice (layer groups). There the pool writes
tokens with its own kernel (``write_kernel``, on by default for a pool written in
groups on a CUDA GPU: :mod:`pagedkv.kernels.page_write`), which writes through the
array's buffer and never copies; the scatter stays for the CPU, for a pool with a layer
per attention layer (measured 5% faster there) and for pages copied or loaded whole.
(3) and ``sync_before_rewrite`` are :class:`~pagedkv.in_place_writes.InPlaceWrites`,
shared with the recurrent-state pool.

Costs: ``write`` is O(tokens written) (per layer, one kernel, or one scatter per K and V
array); ``gather`` is O(pages read); ``copy_pages`` is O(pages * layers).
"""

from __future__ import annotations

import os
from typing import Sequence

import mlx.core as mx
import numpy as np

from allocators import BlockAllocator, FreeListAllocator, implements_block_allocator
from pagedkv.codec import AffineQuant, FullPrecision, PageCodec
from pagedkv.errors import (
    InvalidTypeError,
    InvalidValueError,
    KvDTypeError,
    KvShapeError,
    check_index,
    check_int,
)
from pagedkv.in_place_writes import InPlaceWrites
from pagedkv.kernels import page_write, paged_decode
from pagedkv.page_kind import PageKind, Parts

DEFAULT_CACHE_LIMIT = 1 << 30
"""Bytes of freed buffers MLX may keep for reuse, set when a pool is created (see
``PagePool(cache_limit=...)``). MLX's CPU default keeps ~32 MiB, so every gather larger
than that maps fresh OS memory; bench/RESULTS.md has the measurement."""


def device_memory_bytes() -> int:
    """Bytes of memory the default device can hold: MLX's memory limit, which defaults
    to the device's recommended working set (physical memory on a CPU)."""
    limit = mx.get_memory_limit()
    if limit <= 0:  # pragma: no cover - a backend that reports no limit
        limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(limit)


def _check_codec(name: str, codec: object, dtype: mx.Dtype) -> PageCodec:
    if codec is None:
        return FullPrecision(dtype)
    if not isinstance(codec, (FullPrecision, AffineQuant)):
        raise InvalidTypeError(f"{name} must be a page codec (FullPrecision, AffineQuant, rotated(...)), "
                               f"got {type(codec).__name__} {codec!r}")
    return codec.for_dtype(dtype)


class PagePool:
    """Fixed-size K/V pages for ``num_layers`` layers, one page-id space, one allocator.

    Give ``num_pages`` directly or a byte budget ``max_bytes`` (K + V of all layers:
    as many pages as fit, the layout's extra row included; ``rows_per_head``).
    ``dtype`` is the dtype of the K/V written in; ``k_codec``/``v_codec`` say how pages
    store them (default: full precision ``dtype``; see :mod:`pagedkv.codec`). A codec's
    components each get their own page-indexed array with the same row layout.
    Page 0 is the allocator's reserved null page: never handed out, it stands in for
    pages that left a sliding window. ``cache_limit`` raises MLX's buffer-cache limit to
    at least this many bytes (``None`` leaves it alone). ``write_kernel``: token writes by
    the in-place CUDA kernel (:mod:`pagedkv.kernels.page_write`; ``True`` without a CUDA
    GPU raises ``InvalidValueError``), or ``False`` by MLX's scatter; ``None`` (default):
    the scatter until a layout writes the pool in groups on a CUDA GPU
    (``written_in_groups``), the kernel from then on. ``sync_before_rewrite``: see
    :mod:`pagedkv.in_place_writes`.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        v_head_dim: int | None = None,
        page_size: int = 16,
        num_pages: int | None = None,
        max_bytes: int | None = None,
        dtype: mx.Dtype = mx.float16,
        allocator: BlockAllocator | None = None,
        cache_limit: int | None = DEFAULT_CACHE_LIMIT,
        k_codec: PageCodec | None = None,
        v_codec: PageCodec | None = None,
        sync_before_rewrite: bool = False,
        write_kernel: bool | None = None,
    ) -> None:
        self.num_layers = check_int("num_layers", num_layers, minimum=1)
        self.num_kv_heads = check_int("num_kv_heads", num_kv_heads, minimum=1)
        self.head_dim = check_int("head_dim", head_dim, minimum=1)
        self.v_head_dim = check_int("v_head_dim", head_dim if v_head_dim is None else v_head_dim, minimum=1)
        self.page_size = check_int("page_size", page_size, minimum=1)
        if not isinstance(dtype, mx.Dtype) or not mx.issubdtype(dtype, mx.floating):
            raise KvDTypeError(f"dtype must be an MLX floating dtype, got {dtype!r}")
        self.dtype = dtype
        self.k_codec = _check_codec("k_codec", k_codec, dtype)
        self.v_codec = _check_codec("v_codec", v_codec, dtype)
        self.k_codec.check_dim(self.head_dim)
        self.v_codec.check_dim(self.v_head_dim)
        self.kind = PageKind.of(self.k_codec, self.v_codec, dtype, self.head_dim, self.v_head_dim)
        self._write_kernel_auto = write_kernel is None
        if write_kernel is None:
            write_kernel = False  # (until a layout writes the pool in groups: written_in_groups)
        elif not isinstance(write_kernel, bool):
            raise InvalidTypeError(f"write_kernel must be a bool or None, got {write_kernel!r}")
        elif write_kernel and not page_write.available():
            raise InvalidValueError("write_kernel=True needs MLX on a CUDA GPU (the default device)")
        self.write_kernel = write_kernel
        self._in_groups = False  # several attention layers write each layer array (written_in_groups)
        per_page = self.bytes_per_page
        if (num_pages is None) == (max_bytes is None):
            raise InvalidValueError("give exactly one of num_pages and max_bytes")
        if num_pages is None:
            num_pages = int(check_int("max_bytes", max_bytes, minimum=1) // per_page)
            if head_rows_for(num_pages, self.page_size) > num_pages:
                num_pages -= 1  # (a round size's extra row would not fit the budget; one page fewer needs none)
            if num_pages < 2:
                raise InvalidValueError(f"max_bytes={max_bytes} holds fewer than 2 pages of {per_page} bytes "
                                        "(and the layout's extra row: head_rows_for)")
        self.num_pages = check_int("num_pages", num_pages, minimum=2)  # the null page + one usable
        self.rows_per_head = head_rows_for(self.num_pages, self.page_size)
        if self.nbytes > device_memory_bytes():
            raise InvalidValueError(
                f"a pool of {self.num_pages} pages x {per_page:,} bytes ({self.nbytes / 2**30:.1f} GiB) "
                f"does not fit the device's {device_memory_bytes() / 2**30:.1f} GiB"
            )
        if allocator is None:
            allocator = FreeListAllocator(self.num_pages, null_page=True)
        elif not implements_block_allocator(allocator):
            raise InvalidTypeError(f"allocator must implement allocators.BlockAllocator, got {type(allocator).__name__}")
        elif allocator.num_pages != self.num_pages:
            raise InvalidValueError(f"allocator has {allocator.num_pages} pages, pool has {self.num_pages}")
        elif allocator.null_page is None:
            raise InvalidValueError("the pool's allocator must reserve the null page (null_page=True)")
        self.allocator = allocator
        self.null_page = allocator.null_page
        rows = self.num_kv_heads * self.rows_per_head

        def arrays(codec: PageCodec, dim: int) -> list[mx.array]:
            return [mx.zeros((rows, self.page_size, d), dt) for d, dt in codec.component_dims(dim)]

        self._k = [arrays(self.k_codec, self.head_dim) for _ in range(self.num_layers)]
        self._v = [arrays(self.v_codec, self.v_head_dim) for _ in range(self.num_layers)]
        mx.eval(self._k, self._v)
        self._head_base = np.arange(self.num_kv_heads, dtype=np.int64)[:, None] * self.rows_per_head
        self._head_base_rows = mx.array(self._head_base.astype(np.int32))  # (as gather_index adds it)
        self._writes = InPlaceWrites(self.num_layers, sync_before_rewrite)  # one group per layer
        self._kv_seen: dict[tuple, int] = {}  # (keys shape, values shape, rows) check_kv passed -> T
        # per layer: the ``done`` of its latest in-place token write (write_order)
        self._after = [paged_decode.NO_WRITES] * self.num_layers
        if cache_limit is not None:
            raise_cache_limit(cache_limit)

    # ------------------------------------------------------------------ sizes
    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page id across all layers, K and V."""
        per_token = self.num_kv_heads * (
            self.k_codec.bytes_per_value_row(self.head_dim) + self.v_codec.bytes_per_value_row(self.v_head_dim)
        )
        return per_token * self.page_size * self.num_layers

    @property
    def bytes_per_page_per_layer(self) -> int:
        return self.bytes_per_page // self.num_layers

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies across all layers, K and V."""
        return self.bytes_per_page // self.page_size

    @property
    def usable_pages(self) -> int:
        """Pages sequences can hold: all but the reserved null page."""
        return self.num_pages - (0 if self.null_page is None else 1)

    @property
    def nbytes(self) -> int:
        """Bytes of the pool's arrays: its pages and the extra rows of ``rows_per_head``."""
        return self.bytes_per_page * self.rows_per_head

    # ------------------------------------------------------------------ index helpers
    def array_rows(self, pages: np.ndarray) -> np.ndarray:
        """Row indices [kv_heads, n] of ``pages`` (int64 [n]) in a layer array."""
        return self._head_base + pages[None, :]

    def write_index(self, rows: np.ndarray, slots: np.ndarray) -> tuple[mx.array, mx.array]:
        """The device form of a write's index for ``write_checked``: ``rows``/``slots``
        (ints broadcasting together to the values' leading shape [B, kv_heads, T]) as
        int32 arrays of those shapes, or, where the pool writes with its kernel, broadcast
        and flattened to [B * kv_heads * T] already, the form the kernel takes
        (``page_write.write_tokens``): the layers of a step share one index, so none of
        them reshapes it again. O(B * kv_heads * T) on the host."""
        if self.write_kernel:
            rows, slots = (np.broadcast_to(x, np.broadcast_shapes(rows.shape, slots.shape)).reshape(-1)
                           for x in (rows, slots))
        return mx.array(rows.astype(np.int32)), mx.array(slots.astype(np.int32))

    def page_slices(self, page: int, slot: int, count: int) -> tuple[slice, slice] | None:
        """Where tokens [slot, slot + count) of page ``page`` lie in a layer array (one
        row's tokens within one page), as slices for ``write_checked``: every head's row
        of the page (``page``, ``page + R``, ...; R = ``rows_per_head``) and the slots. A write
        through slices is a strided slice update, which needs no index arrays and takes
        less host time than a scatter (about 2.4 against 5.8 us per array on a CPU).
        None where the pool writes with its kernel, which takes index arrays. O(1)."""
        if self.write_kernel:
            return None
        return slice(page, None, self.rows_per_head), slice(slot, slot + count)

    def device_rows(self, pages: mx.array) -> mx.array:
        """``array_rows`` on the device: int32 [B, kv_heads, n] rows of ``pages`` (int32
        [B, n]) in a layer array. Lazy: inside a compiled step it is part of the trace."""
        return self._head_base_rows[None] + pages[:, None, :]

    def gather_index(self, table: mx.array) -> mx.array:
        """Flat int32 take-indices [B * kv_heads * width] into a layer array for
        ``gather``, from ``table`` (int32 [B, width] page ids, ``PageRead.table``). Lazy, on
        the device: no host work, and inside a compiled step it is part of the trace."""
        return self.device_rows(table).reshape(-1)

    # ------------------------------------------------------------------ read / write
    def check_kv(self, keys: mx.array, values: mx.array, rows: int | None = None) -> int:
        """Raise ``KvShapeError``/``KvDTypeError`` unless ``keys``/``values`` are
        [rows, kv_heads, T, D] mx.arrays (without ``rows``: [kv_heads, T, D]) of the pool's
        dtype with the same T >= 1; returns T. O(1); a step's layers repeat one check, so
        the shapes that passed are remembered (a few: prefill chunks, decode)."""
        if type(keys) is mx.array and type(values) is mx.array and keys.dtype == self.dtype \
                and values.dtype == self.dtype:
            seen = self._kv_seen.get((keys.shape, values.shape, rows))
            if seen is not None:
                return seen
        lead = () if rows is None else (rows,)
        for name, x, d in (("keys", keys, self.head_dim), ("values", values, self.v_head_dim)):
            if not isinstance(x, mx.array):
                raise KvShapeError(f"{name} must be an mx.array, got {type(x).__name__}")
            if x.shape[:-2] != (*lead, self.num_kv_heads) or x.shape[-1] != d or x.shape[-2] == 0:
                raise KvShapeError(f"{name} must be [{'rows=%d, ' % rows if lead else ''}kv_heads="
                                   f"{self.num_kv_heads}, T >= 1, {d}], got {tuple(x.shape)}")
            if x.dtype != self.dtype:
                raise KvDTypeError(f"{name} dtype {x.dtype} != pool dtype {self.dtype}")
        if keys.shape[-2] != values.shape[-2]:
            raise KvShapeError(f"keys have {keys.shape[-2]} tokens, values {values.shape[-2]}")
        if len(self._kv_seen) >= 16:
            self._kv_seen.clear()
        self._kv_seen[(keys.shape, values.shape, rows)] = keys.shape[-2]
        return keys.shape[-2]

    def write(self, layer: int, rows: mx.array | slice, slots: mx.array | slice, keys: mx.array,
              values: mx.array) -> None:
        """Write tokens into ``layer``: ``keys`` [kv_heads, T, D] go to (rows, slots),
        int index arrays of ``keys``' leading shape [kv_heads, T] (or broadcasting to it),
        or the slices ``page_slices`` gives.

        The single write path of pagedkv. In place (buffer donation) unless a caller
        keeps a pending read of this layer, which is evaluated first.
        """
        layer = self.check_layer(layer)
        self.check_kv(keys, values)
        self.write_checked(layer, rows, slots, keys, values)

    def write_checked(self, layer: int, rows: mx.array | slice, slots: mx.array | slice, keys: mx.array,
                      values: mx.array) -> None:
        """``write`` for a caller that has validated ``layer`` and ``keys``/``values``
        (``check_kv``) itself: the row set, once per layer of a step. ``keys`` may have
        any leading shape that ``rows`` and ``slots`` share (the row set's: [B, kv_heads,
        T]); element (..., d) goes to layer row ``rows[...]``, slot ``slots[...]``. Or
        ``rows`` and ``slots`` are ``page_slices``: keys [1, kv_heads, T, D] of one row."""
        self._writes.before_write(layer)  # (in place: see the module doc)
        self.scatter(layer, rows, slots, keys, values)

    def scatter(self, layer: int, rows: mx.array | slice, slots: mx.array | slice, keys: mx.array,
                values: mx.array) -> None:
        """The scatter of ``write_checked`` without settling the layer's pending reads
        first: for a compiled step (:mod:`pagedkv.compiled_decode`), which settles every
        layer (``settle_reads``) before it runs and may not evaluate inside."""
        k_parts = self.k_codec.encode(keys)  # quantised pages: a token is encoded when written
        v_parts = self.v_codec.encode(values)
        ks, vs = self._k[layer], self._v[layer]
        paired = min(len(ks), len(vs)) if self.write_kernel else 0
        for c in range(paired):  # K and V components in one in-place kernel each
            self._after[layer] = page_write.write_tokens(ks[c], vs[c], rows, slots, k_parts[c], v_parts[c],
                                                         self._after[layer])
        for arrays, parts in ((ks, k_parts), (vs, v_parts)):
            for c in range(paired, len(arrays)):
                arrays[c][rows, slots] = parts[c]

    def settle_reads(self) -> None:
        """Evaluate every layer's reads that are still pending (see the module doc), so
        that the writes that follow can be in place."""
        self._writes.settle_all()

    def compile_state(self) -> list[list[list[mx.array]]]:
        """The pool's own lists of layer arrays, ``[K lists, V lists, [write orders]]``,
        for ``mx.compile(..., inputs=state, outputs=state)``: a compiled function that
        writes the pool reads them as inputs, and MLX puts the written arrays back into
        these very lists after each call. Nothing else may hold them."""
        return [self._k, self._v, [self._after]]

    def written_in_groups(self) -> None:
        """Called by ``layout_for`` when several attention layers write each of this
        pool's layers (layer groups). One forward then writes each array several times,
        and on a CUDA GPU MLX's scatter copies an array a kernel still in flight reads
        (bench/RESULTS.md: peak +144 MiB on a 2-layer gemma3 pool at 16k), so a pool made
        with ``write_kernel=None`` turns the in-place write kernel on there. O(1)."""
        self._in_groups = True  # (no borrowed views: borrow_run)
        if self._write_kernel_auto and page_write.available():
            self.write_kernel = True

    def write_order(self, layer: int) -> mx.array:
        """What a reader of ``layer``'s arrays takes as an input so that it runs after
        the layer's pending in-place token writes (``write_kernel``; see
        :mod:`pagedkv.kernels.page_write`): int32 [1], value 0. Lazy; do not keep it."""
        return self._after[layer]

    def _finish_writes(self) -> None:
        """Run every pending in-place token write (before a bulk read or write of pages
        that does not take ``write_order``)."""
        if self.write_kernel:
            mx.eval(self._after)

    def gather(self, layer: int, index: mx.array, start: int, stop: int,
               rows: int = 1, track: bool = True) -> tuple[Parts, Parts]:
        """Read tokens [start, stop) of every row of pages named by ``index``.

        ``index`` comes from ``gather_index`` (``rows`` rows of equal width); positions
        count from each row's first listed page. Returns the K and V components as new
        lazy arrays [rows, kv_heads, stop - start, c]: a cut of the gathered pages, or,
        where MLX's attention would misread that cut (``paged_decode.mlx_attention_misreads``:
        a long cut past the first gathered token, on CUDA), a gather of those tokens
        alone, which starts at its buffer's first element. The pool keeps weak
        references to them so a later write of this layer can settle them first (module
        doc); not with ``track=False`` (inside a compiled step, whose reads are not arrays
        yet).
        """
        h, ps = self.num_kv_heads, self.page_size
        n = index.shape[0] // (h * rows)  # pages per row
        if self.write_kernel:
            index = index + self._after[layer]  # (0: the take runs after the layer's token writes)
        tokens = None  # a cut that MLX's attention would misread as a slice: by index
        if paged_decode.mlx_attention_misreads(n * ps, start, stop - start):
            tokens = (index.reshape(rows * h, n, 1) * ps + mx.arange(ps, dtype=mx.int32))
            tokens = tokens.reshape(rows * h, n * ps)[:, start:stop].reshape(-1)

        def read(arrays: list[mx.array]) -> Parts:
            out = []
            for arr in arrays:
                if tokens is not None:  # token rows of the array seen as [kv_heads * P * page_size, c]
                    c = arr.shape[-1]
                    x = mx.take(arr.reshape(-1, c), tokens, axis=0).reshape(rows, h, stop - start, c)
                else:
                    x = mx.take(arr, index, axis=0).reshape(rows, h, n * ps, arr.shape[-1])
                    if start or stop != n * ps:
                        x = x[:, :, start:stop]
                out.append(self._writes.track(layer, x) if track else x)
            return tuple(out)

        return read(self._k[layer]), read(self._v[layer])

    def borrow_run(self, layer: int, first_page: int, start: int, stop: int) -> tuple[Parts, Parts] | None:
        """Tokens [start, stop) of the pages ``first_page, first_page + 1, ...`` (one row
        whose pages are one run of ids), as *views* of the layer's arrays, [1, kv_heads,
        stop - start, c] per component: a slice, no gather, so no copy of the context.

        Head-major layout makes this possible: head h's pages p.. p+n are the rows
        h * R + p.. of the array, so [kv_heads, R * page_size, c] is the array itself.

        The views share the arrays' buffers, which is why they are only for a reader that
        is done with them before the layer's next write: a write while a view is still
        referenced cannot reuse the buffer and copies the layer array (the values stay
        right; the cost is O(pool layer)). O(1). None where a view would make a write of
        the same forward copy: a pool written in layer groups (one forward writes each
        array several times), or by the in-place write kernel (a slice would not wait
        for it: ``write_order``), or where MLX's attention would misread the views
        (``paged_decode.mlx_attention_misreads``: a long run, on CUDA, in rows of a
        multiple of 256 tokens, which only a page size of 256 or more leaves:
        ``rows_per_head``)."""
        lo = first_page * self.page_size + start
        hi = lo + (stop - start)
        width = self.rows_per_head * self.page_size
        if self._in_groups or self.write_kernel or paged_decode.mlx_attention_misreads(width, lo, hi - lo):
            return None

        def view(arrays: list[mx.array]) -> Parts:
            return tuple(arr.reshape(1, self.num_kv_heads, width, arr.shape[-1])[:, :, lo:hi] for arr in arrays)

        return view(self._k[layer]), view(self._v[layer])

    def check_layer(self, layer: object) -> int:
        """``layer`` as an index of one of the pool's layers; ``InvalidTypeError`` or
        ``InvalidValueError`` otherwise (-1 too: it would name the last layer)."""
        return check_index("layer", layer, self.num_layers)

    def layer_arrays(self, layer: int) -> tuple[mx.array, mx.array]:
        """The current K and V arrays of a full-precision layer, for a kernel that reads
        the pool directly. Use them within one expression; never keep them (a kept
        reference turns the next write of this layer into a copy of the whole layer)."""
        layer = self.check_layer(layer)
        return self._k[layer][0], self._v[layer][0]

    def storage(self, layer: int) -> list[mx.array]:
        """Every array holding ``layer``'s pages (K's codec components, then V's). Do
        not keep them (see ``layer_arrays``)."""
        layer = self.check_layer(layer)
        return self._k[layer] + self._v[layer]

    def written(self, layer: int) -> list[mx.array]:
        """What to evaluate to settle ``layer``'s pending writes and nothing downstream
        (a prefill chunk then computes K/V but no logits): ``storage`` and
        ``write_order``. Do not keep them."""
        return [*self.storage(layer), self._after[layer]]

    # ------------------------------------------------------------------ pages as bytes
    def layout_description(self) -> dict[str, str]:
        """What page bytes mean in this pool: a file of pages loads only into a pool
        with the same description (``KvFileMismatchError`` otherwise)."""
        return {"num_layers": str(self.num_layers), "num_kv_heads": str(self.num_kv_heads),
                "head_dim": str(self.head_dim), "v_head_dim": str(self.v_head_dim),
                "page_size": str(self.page_size), "dtype": str(self.dtype),
                "k_codec": repr(self.k_codec), "v_codec": repr(self.v_codec)}

    def page_arrays(self) -> list[tuple[str, tuple[int, ...], mx.Dtype]]:
        """(name, shape of one page [1, kv_heads, page_size, width], dtype) of every array a
        page is stored in: each layer's K codec components, then its V components (names
        ``L3.K0``, ``L3.V1``), the order of ``storage``."""
        out = []
        for layer in range(self.num_layers):
            for side, arrays in (("K", self._k[layer]), ("V", self._v[layer])):
                for c, a in enumerate(arrays):
                    out.append((f"L{layer}.{side}{c}", (1, self.num_kv_heads, *a.shape[1:]), a.dtype))
        return out

    def read_pages(self, pages: Sequence[int]) -> dict[str, np.ndarray]:
        """A host copy of ``pages`` (valid ids), one array per ``page_arrays`` entry, shaped
        [n, kv_heads, page_size, width] (page-major: page i is ``a[i]``, contiguous);
        bfloat16 comes as its uint16 bit patterns. O(bytes)."""
        ids = self.allocator.checked_ids(pages)
        self._finish_writes()
        take = mx.array(self.array_rows(ids).T.reshape(-1).astype(np.int32))  # page-major rows
        parts = []
        for layer in range(self.num_layers):
            for a in self.storage(layer):
                part = mx.take(a, take, axis=0)
                parts.append(part.view(mx.uint16) if part.dtype == mx.bfloat16 else part)
        mx.eval(parts)  # now, so no read of the pool outlives this call
        out = {}
        for (name, shape, _), part in zip(self.page_arrays(), parts):
            out[name] = np.array(part, copy=True).reshape(ids.size, self.num_kv_heads, *shape[2:])
        return out

    def write_pages(self, pages: Sequence[int], data: dict[str, np.ndarray]) -> None:
        """Write ``data`` (as ``read_pages`` returns it) into ``pages``, which the caller
        holds (IN_USE). Every array is checked against ``page_arrays`` first; a refusal
        (``KvShapeError``, ``InvalidValueError``) writes nothing. O(bytes)."""
        ids = self.allocator.checked_ids(pages)
        check_held_pages(self.allocator, ids, "write_pages")
        specs = self.page_arrays()
        if set(data) != {name for name, _, _ in specs}:
            raise KvShapeError(f"write_pages needs exactly the arrays {[n for n, _, _ in specs[:4]]}...")
        blocks = []
        for name, shape, dtype in specs:
            arr = data[name]
            want = (ids.size, self.num_kv_heads, *shape[2:])
            if tuple(arr.shape) != want or arr.dtype != host_dtype(dtype):
                raise KvShapeError(f"{name}: expected {dtype} {want}, got {arr.dtype} {tuple(arr.shape)}")
            block = mx.array(np.ascontiguousarray(arr).reshape(-1, *shape[2:]))
            blocks.append(block.view(mx.bfloat16) if dtype == mx.bfloat16 else block)
        rows = mx.array(self.array_rows(ids).T.reshape(-1).astype(np.int32))  # page-major, as the data
        self._finish_writes()
        it = iter(blocks)
        for layer in range(self.num_layers):
            self._writes.settle(layer)
            for a in self.storage(layer):
                a[rows] = next(it)
        mx.eval(self._k, self._v)

    def copy_pages(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy pages ``src`` onto pages ``dst`` in every layer (copy-on-write).

        ``dst`` must be distinct pages the caller holds (IN_USE), never the null page;
        ``src`` any valid page ids. Checked before anything is written.
        """
        src, dst = checked_copy(self.allocator, src, dst, "copy_pages", "pages")
        if src.size == 0:
            return
        self._finish_writes()
        s = mx.array(self.array_rows(src).reshape(-1).astype(np.int32))
        d = mx.array(self.array_rows(dst).reshape(-1).astype(np.int32))
        for layer in range(self.num_layers):
            self._writes.settle(layer)
            arrays = self.storage(layer)
            blocks = [mx.take(a, s, axis=0) for a in arrays]
            mx.eval(blocks)  # detach the reads from the layer arrays so the writes donate
            for a, blk in zip(arrays, blocks):
                a[d] = blk
        mx.eval(self._k, self._v)

    def __repr__(self) -> str:
        return (
            f"PagePool(layers={self.num_layers}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"page_size={self.page_size}, pages={self.num_pages}, dtype={self.dtype}, "
            f"k={self.k_codec.label()}, v={self.v_codec.label()}, "
            f"{self.nbytes / 2**20:.1f} MiB)"
        )


def head_rows_for(num_pages: int, page_size: int) -> int:
    """Rows each head takes in a layer array of ``num_pages`` pages (``PagePool``'s
    ``rows_per_head``): ``num_pages``, or one more where ``num_pages * page_size`` is a
    multiple of ``paged_decode.MLX_DECODE_SLICE_TOKENS`` (256), so that a view into the
    rows is never one MLX's CUDA attention misreads (``mlx_attention_misreads``). One
    more is always enough: the two counts' tokens differ by ``page_size``, not a
    multiple of 256. ``num_pages`` where ``page_size`` is a multiple of 256, as no
    count helps there."""
    tokens = paged_decode.MLX_DECODE_SLICE_TOKENS
    if num_pages * page_size % tokens or page_size % tokens == 0:
        return num_pages
    return num_pages + 1


def check_held_pages(allocator: BlockAllocator, ids: np.ndarray, what: str) -> None:
    """Pages (or state slots) that a write may target or a table may adopt: distinct,
    and held by the caller (IN_USE: a reference count of at least 1);
    ``InvalidValueError`` otherwise. O(n): one vectorised read where the allocator
    offers ``refcounts`` (``RefCountingAllocator``), else ``refcount`` page by page."""
    ordered = np.sort(ids)  # (np.unique costs 10x this sort for a long prefix's pages)
    if (ordered[1:] == ordered[:-1]).any():
        raise InvalidValueError(f"{what} lists a page twice")
    refcounts = getattr(allocator, "refcounts", None)
    if refcounts is not None:
        held = bool((refcounts(ids) > 0).all())
    else:
        held = all(allocator.refcount(int(p)) > 0 for p in ids)
    if not held:
        raise InvalidValueError(f"{what} takes only pages the caller holds (IN_USE), "
                                "never the null page or a free or cached page")


def checked_copy(allocator: BlockAllocator, src, dst, what: str, unit: str) -> tuple[np.ndarray, np.ndarray]:
    """(``src``, ``dst``) of a copy validated as int64 arrays: ids in range, as many of
    each, and ``dst`` distinct ids the caller holds (``check_held_pages``); typed errors
    otherwise. ``unit`` names the ids in the message ("pages", "slots")."""
    src, dst = allocator.checked_ids(src), allocator.checked_ids(dst)
    if src.size != dst.size:
        raise InvalidValueError(f"{what} got {src.size} source and {dst.size} target {unit}")
    if src.size:
        check_held_pages(allocator, dst, what)
    return src, dst


def host_dtype(dtype: mx.Dtype) -> np.dtype:
    """The numpy dtype ``read_pages`` gives an MLX dtype as: the same type, except
    bfloat16 (which numpy lacks), given as its uint16 bit patterns."""
    return np.dtype(np.uint16) if dtype == mx.bfloat16 else np.dtype(str(dtype).split(".")[-1])


def raise_cache_limit(nbytes: int) -> int:
    """Raise MLX's buffer-cache limit to at least ``nbytes``; returns the limit in force."""
    nbytes = check_int("nbytes", nbytes, minimum=0)  # (True set a limit of one byte for a moment)
    previous = mx.set_cache_limit(nbytes)
    if previous > nbytes:
        mx.set_cache_limit(previous)
        return previous
    return nbytes
