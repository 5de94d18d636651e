"""``PrefixKeys``: one sequence's token ids, cut into the keys of its full pages once.

A full page's key is ``(node, page_bytes)``: ``node`` names the exact prefix before the
page (a serial number the prefix cache gives each registered page and never reuses),
and ``page_bytes`` are the page's token ids as little-endian int64. So equal keys mean
equal whole prefixes, exactly: a lookup compares the token bytes themselves (no digest
can collide), and Python's dict hashes them with SipHash under a per-process random
key, so crafted prompts cannot flood one bucket.

A request keeps one ``PrefixKeys`` for its whole life, as vLLM keeps a request's block
hashes: ``extend`` adds tokens as they are generated and cuts each page that fills, once.
``PrefixCache.match`` records the nodes of the pages that hit, and
``PrefixCache.register`` continues from there, so no page is cut or looked up twice
between a match and the registrations that follow it.

Ownership: plain Python bytes and ints; no pages, no references. Costs: ``extend`` is
O(new tokens), and hashes each page as it is cut (as vLLM hashes a block when its
tokens arrive), so lookups and inserts in the cache hash no token bytes; ``truncate`` O(pages dropped); ``token_ids(start)`` O(tokens returned).
"""

from __future__ import annotations

import struct
from array import array
from typing import Sequence

import numpy as np

from pagedkv.errors import InvalidTypeError, InvalidValueError, check_int

_TOKEN = 8  # bytes per token id in a key


class PrefixKeys:
    """Keys of one sequence's full pages for one ``PrefixCache``; see the module doc.

    Build it with ``PrefixCache.keys(tokens)``. ``pages[i]`` is page i's token bytes,
    ``nodes[i]`` (known for ``i < len(nodes)``) the node naming tokens
    ``[0, (i + 1) * page_size)`` in the cache, ``root`` the node of the empty prefix.
    """

    __slots__ = ("owner", "page_size", "root", "pages", "nodes", "num_tokens", "_tail")

    def __init__(self, owner: object, page_size: int, root: int, tokens: Sequence[int] = ()) -> None:
        self.owner = owner
        self.page_size = page_size
        self.root = root
        self.pages: list[bytes] = []
        self.nodes: list[int] = []
        self.num_tokens = 0
        self._tail = b""  # tokens after the last full page
        if tokens.__class__ not in (list, tuple) or tokens:  # (no tokens yet: nothing to cut)
            self.extend(tokens)

    @property
    def num_full_pages(self) -> int:
        return len(self.pages)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append token ids (a list, tuple, 1-d integer numpy or MLX array); each page
        that fills is cut once. Raises ``InvalidTypeError`` for anything else, before
        any change."""
        data = self._tail + token_bytes(tokens)
        step = self.page_size * _TOKEN
        full = len(data) // step
        pages = [data[i : i + step] for i in range(0, full * step, step)]
        for _ in map(hash, pages):  # bytes keep their hash: the cache's lookups reuse it
            pass
        self.pages += pages
        self._tail = data[full * step :]
        self.num_tokens = len(self.pages) * self.page_size + len(self._tail) // _TOKEN

    def truncate(self, num_tokens: int) -> None:
        """Keep only the first ``num_tokens`` tokens (a sequence that was trimmed)."""
        num_tokens = check_int("num_tokens", num_tokens, minimum=0)
        if num_tokens >= self.num_tokens:
            return
        data = self.token_bytes(num_tokens // self.page_size * self.page_size)
        keep = num_tokens // self.page_size
        del self.pages[keep:]
        del self.nodes[keep:]
        self._tail = data[: (num_tokens - keep * self.page_size) * _TOKEN]
        self.num_tokens = num_tokens

    def token_bytes(self, start: int = 0) -> bytes:
        """Token ids ``[start, num_tokens)`` as little-endian int64 bytes (``start`` in
        [0, num_tokens]: ``InvalidValueError`` otherwise)."""
        start = check_int("start", start, minimum=0, maximum=self.num_tokens)
        first = start // self.page_size
        data = b"".join(self.pages[first:]) + self._tail
        return data[(start - first * self.page_size) * _TOKEN :]

    def token_ids(self, start: int = 0) -> list[int]:
        """Token ids ``[start, num_tokens)`` as Python ints."""
        out = array("q")
        out.frombytes(self.token_bytes(start))
        return out.tolist()

    def __repr__(self) -> str:
        return f"PrefixKeys(tokens={self.num_tokens}, full_pages={len(self.pages)}, known_nodes={len(self.nodes)})"


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian int64 bytes, or ``InvalidTypeError``/``InvalidValueError``."""
    if isinstance(tokens, (list, tuple, range)):
        try:
            return struct.pack(f"<{len(tokens)}q", *tokens)  # ~3x array('q', tokens)
        except struct.error:
            pass  # not all ints, or too large: array() says which
        try:
            array("q", tokens)
        except TypeError as e:
            raise InvalidTypeError(f"token ids must be ints: {e}") from None
        except OverflowError as e:
            raise InvalidValueError(f"a token id does not fit 64 bits: {e}") from None
        raise InvalidTypeError("token ids must be ints")
    if isinstance(tokens, (str, bytes)):
        raise InvalidTypeError(f"token ids must be a sequence of ints, got {type(tokens).__name__}")
    try:
        arr = np.asarray(tokens)
    except (TypeError, ValueError) as e:
        raise InvalidTypeError(f"token ids must be a sequence of ints: {e}") from None
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidTypeError(f"token ids must be a 1-d sequence of ints, got {arr.dtype} of shape {arr.shape}")
    if arr.dtype.kind == "u" and arr.size and arr.max() > np.iinfo(np.int64).max:
        raise InvalidValueError("a token id does not fit 64 bits")
    return arr.astype("<i8").tobytes()
