"""A file of KV pages: the one on-disk format of saved caches and the disk tier.

A safetensors file (:mod:`pagedkv.safetensors_file`) with one tensor per entry of
``PagePool.page_arrays()``, page-major ([n, kv_heads, page_size, width]), and string
metadata::

    format     "pagedkv.pages"
    version    "2"
    layout     JSON of PagePool.layout_description(): layers, heads, head dims,
               page size, dtype, K and V codecs
    model      the caller's model fingerprint (any string; "" if none)
    pages      n
    checksums  JSON list of n CRC-32s, page i over its bytes in every tensor, in order
    + whatever the caller adds (token ids, chain digests, lengths)
    meta_checksum  CRC-32 of every other entry above (sorted-key JSON), so that a flipped
               bit in the metadata (a token id of a saved cache, say) is caught too

Version 1 files (before the metadata checksum) are still read, without that check.

``read_pages_file`` validates in this order and raises before anything is loaded:
bytes and header (``CorruptKvFileError``), format and version (``KvFileVersionError``),
the metadata's checksum (``CorruptKvFileError``), layout and model
(``KvFileMismatchError``), tensor names, dtypes and shapes against the pool, then every
page's checksum (``CorruptKvFileError``). A ``PageFileSpec`` is made
from the pool on its owner thread; reading and writing files then touch no MLX array,
so a background writer thread may call ``write_pages_file``.
"""

from __future__ import annotations

import json
import os
import zlib

import mlx.core as mx
import numpy as np

from pagedkv import safetensors_file
from pagedkv.errors import CorruptKvFileError, KvFileMismatchError, KvFileVersionError
from pagedkv.pool import host_dtype

FORMAT = "pagedkv.pages"
VERSION = 2
_READS = ("1", "2")  # versions this module reads (1: no metadata checksum)


class PageFileSpec:
    """What a pool's page files must look like; plain data, safe to share with threads."""

    def __init__(self, pool, model: str = "") -> None:
        self.layout = pool.layout_description()
        self.layout_json = json.dumps(self.layout, sort_keys=True)
        self.model = model
        self.arrays = [(name, shape[1:], host_dtype(dtype), "BF16" if dtype == mx.bfloat16 else None)
                       for name, shape, dtype in pool.page_arrays()]
        self.bytes_per_page = sum(int(np.prod(s)) * d.itemsize for _, s, d, _ in self.arrays)


def page_checksums(data: dict[str, np.ndarray], spec: PageFileSpec, n: int) -> list[str]:
    sums = [0] * n
    for name, _, _, _ in spec.arrays:
        arr = data[name]
        for i in range(n):
            sums[i] = zlib.crc32(memoryview(arr[i]).cast("B"), sums[i])
    return [f"{c:08x}" for c in sums]


def meta_checksum(meta: dict[str, str]) -> str:
    """CRC-32 of every metadata entry but ``meta_checksum`` itself (sorted-key JSON)."""
    rest = {k: v for k, v in meta.items() if k != "meta_checksum"}
    return f"{zlib.crc32(json.dumps(rest, sort_keys=True).encode()):08x}"


def write_pages_file(path: str | os.PathLike, data: dict[str, np.ndarray], spec: PageFileSpec,
                     extra: dict[str, str]) -> int:
    """Write pages (``PagePool.read_pages`` output) crash-safely; returns the file size."""
    n = next(iter(data.values())).shape[0] if data else 0
    meta = {"format": FORMAT, "version": str(VERSION), "layout": spec.layout_json, "model": spec.model,
            "pages": str(n), "checksums": json.dumps(page_checksums(data, spec, n)), **extra}
    meta["meta_checksum"] = meta_checksum(meta)
    ordered = {name: data[name] for name, _, _, _ in spec.arrays}
    dtypes = {name: kind for name, _, _, kind in spec.arrays if kind}
    return safetensors_file.write(path, ordered, meta, dtypes)


def read_pages_file(path: str | os.PathLike, spec: PageFileSpec) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(page arrays for ``PagePool.write_pages``, metadata), fully validated (module doc)."""
    tensors, meta, kinds = safetensors_file.read(path)
    return check_pages(tensors, meta, kinds, spec, str(path))


def check_pages(tensors: dict, meta: dict, kinds: dict, spec: PageFileSpec, where: str):
    if meta.get("format") != FORMAT:
        raise KvFileVersionError(f"{where}: not a pagedkv page file (format {meta.get('format')!r})")
    if meta.get("version") not in _READS:
        raise KvFileVersionError(f"{where}: format version {meta.get('version')!r}; this pagedkv reads "
                                 f"{', '.join(_READS)}")
    if meta.get("version") != "1" and meta.get("meta_checksum") != meta_checksum(meta):
        raise CorruptKvFileError(f"{where}: the metadata does not match its checksum")
    try:
        layout = json.loads(meta.get("layout", ""))
    except json.JSONDecodeError:
        raise CorruptKvFileError(f"{where}: the layout record is not JSON") from None
    if layout != spec.layout:
        diff = {k: (layout.get(k) if isinstance(layout, dict) else None, v) for k, v in spec.layout.items()
                if not isinstance(layout, dict) or layout.get(k) != v}
        raise KvFileMismatchError(f"{where}: written for another pool layout; (file, pool) differ in {diff}")
    if meta.get("model") != spec.model:
        raise KvFileMismatchError(f"{where}: written for model {meta.get('model')!r}, not {spec.model!r}")
    try:
        n = int(meta["pages"])
        sums = json.loads(meta["checksums"])
    except (KeyError, ValueError):
        raise CorruptKvFileError(f"{where}: missing or malformed page count or checksums") from None
    if set(tensors) != {name for name, _, _, _ in spec.arrays} or not isinstance(sums, list) or len(sums) != n:
        raise CorruptKvFileError(f"{where}: the tensors or checksums do not match {n} pages of this layout")
    for name, shape, dtype, kind in spec.arrays:
        arr = tensors[name]
        if arr.dtype != dtype or tuple(arr.shape) != (n, *shape) or (kind or None) != (kinds[name] if kind else None):
            raise KvFileMismatchError(f"{where}: {name} is {kinds[name]}{list(arr.shape)}, "
                                      f"the pool stores {dtype}{[n, *shape]}")
    got = page_checksums(tensors, spec, n)
    bad = [i for i, (a, b) in enumerate(zip(got, sums)) if a != b]
    if bad:
        raise CorruptKvFileError(f"{where}: checksum mismatch in page(s) {bad[:8]} of {n}")
    return tensors, meta
