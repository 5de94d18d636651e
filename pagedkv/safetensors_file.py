"""Safetensors files with numpy alone: crash-safe writes and strict reads.

The format (https://huggingface.co/docs/safetensors) is an 8-byte little-endian header
length, a JSON header ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, ...,
"__metadata__": {str: str}}``, then the tensors' bytes back to back. Files written here
open in ``safetensors``, ``mx.load`` and ``torch``; bfloat16 arrays travel as their raw
16-bit patterns (numpy has no bfloat16; ``read`` gives them as uint16 with dtype "BF16").

``write`` never leaves a partial file under the final name: it writes ``.NAME.tmp-PID``
in the same directory, fsyncs it, renames it over ``path`` (atomic on POSIX) and fsyncs
the directory. A crash at any point leaves either the old file or the new one, plus at
most a temp file that ``remove_stale_temps`` deletes.

``read`` checks everything before returning: the header length against the file size,
the JSON, every tensor's dtype, shape × item size against its byte range, ranges that
tile the data exactly with no gap, overlap or trailing byte. Any failure is a
``CorruptKvFileError``. No MLX here, so a background thread may call it.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import numpy as np

from pagedkv.errors import CorruptKvFileError

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U64": np.uint64,
           "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items() if k != "BF16"}
_NP = {k: np.dtype(v) for k, v in _DTYPES.items()}
MAX_HEADER = 100 << 20


def encode(tensors: dict[str, np.ndarray], metadata: dict[str, str],
           dtypes: dict[str, str] | None = None) -> list[bytes | memoryview]:
    """The file's bytes as pieces (no copy of the tensors). ``dtypes`` overrides the
    stored dtype name of some tensors (e.g. "BF16" for uint16 patterns)."""
    header: dict = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}}
    offset = 0
    pieces: list = []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        kind = (dtypes or {}).get(name) or _NAMES.get(arr.dtype)
        if kind is None:
            raise TypeError(f"tensor {name!r}: dtype {arr.dtype} has no safetensors name")
        header[name] = {"dtype": kind, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        pieces.append(memoryview(arr).cast("B") if arr.nbytes else b"")
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # align the data to 8 bytes, as the reference writer does
    return [struct.pack("<Q", len(text)), text, *pieces]


def write(path: str | os.PathLike, tensors: dict[str, np.ndarray], metadata: dict[str, str],
          dtypes: dict[str, str] | None = None) -> int:
    """Write atomically (temp file, fsync, rename, fsync of the directory); returns the size."""
    return write_atomic(path, encode(tensors, metadata, dtypes))


def write_atomic(path: str | os.PathLike, pieces: list[bytes | memoryview]) -> int:
    """Write ``pieces`` to ``path`` so that a crash leaves the old file or the new one:
    a temp file in the same directory, fsync, rename, fsync of the directory."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    size = 0
    try:
        with open(tmp, "wb") as f:
            for piece in pieces:
                f.write(piece)
                size += len(piece)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return size


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_temps(directory: str | os.PathLike) -> int:
    """Delete the temp files of writes that never finished (a crash); returns how many."""
    n = 0
    for p in Path(directory).glob(".*.tmp-*"):
        p.unlink(missing_ok=True)
        n += 1
    return n


def read(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, str], dict[str, str]]:
    """(tensors, metadata, stored dtype names) of a file, all validated; the arrays are
    read-only views of the file's bytes. ``CorruptKvFileError`` on any defect."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise
    except OSError as e:
        raise CorruptKvFileError(f"{path}: cannot read ({e})") from None
    return parse(data, str(path))


def parse(data: bytes, where: str = "<bytes>") -> tuple[dict[str, np.ndarray], dict[str, str], dict[str, str]]:
    def bad(why: str) -> CorruptKvFileError:
        return CorruptKvFileError(f"{where}: not a valid safetensors file ({why})")

    if len(data) < 8:
        raise bad(f"{len(data)} bytes, shorter than the header length")
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_HEADER or 8 + n > len(data):
        raise bad(f"header of {n} bytes does not fit in {len(data)} bytes (truncated?)")
    try:
        header = json.loads(data[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise bad("header is not an object")
    meta = header.pop("__metadata__", {}) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise bad("__metadata__ must map strings to strings")
    body = memoryview(data)[8 + n :]
    spans, tensors, kinds = [], {}, {}
    for name, info in header.items():
        try:
            kind, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            dtype = _NP[kind]
            count = math.prod(shape)
            if begin.__class__ is not int or end.__class__ is not int or count.__class__ is not int \
                    or min(shape, default=0) < 0:
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise bad(f"tensor {name!r} has a malformed entry") from None
        if not 0 <= begin <= end <= len(body) or end - begin != count * dtype.itemsize:
            raise bad(f"tensor {name!r}: bytes [{begin}, {end}) do not hold {kind}{shape} "
                      f"within {len(body)} data bytes (truncated?)")
        spans.append((begin, end))
        tensors[name] = np.frombuffer(body[begin:end], dtype=dtype).reshape(shape)
        kinds[name] = kind
    spans.sort()
    pos = 0
    for begin, end in spans:
        if begin != pos:
            raise bad("tensor byte ranges overlap or leave a gap")
        pos = end
    if pos != len(body):
        raise bad(f"{len(body) - pos} bytes after the last tensor")
    return tensors, meta, kinds
