"""A model of vLLM v1's block pool, the baseline that bench/allocator.py measures against.

Written here from vLLM's documented design (docs "Automatic Prefix Caching" and the v1
``block_pool.py`` / ``kv_cache_utils.py`` API), keeping the work each call does per block:

- ``KVCacheBlock``: a dataclass per block (id, ref count, block hash, the two free-list
  links, is_null), its hash behind a property whose setter asserts it was unset.
- ``FreeKVCacheBlockQueue``: a doubly linked list of blocks with a fake head and tail.
  Freed blocks are appended at the tail, allocation pops from the head, so the least
  recently freed block is reused first. A freed block that still has a hash stays
  findable while it waits in the queue (that is vLLM's cache: "evictable" blocks).
- ``BlockHashToBlockMap``: hash (+ group id) → block, or → {block id: block} when two
  blocks carry the same hash.
- ``BlockPool``: ``get_new_blocks(n)`` pops n blocks and, with caching on, evicts each
  popped block's hash; ``cache_full_blocks`` sets the hashes of newly full blocks and
  inserts them; ``touch`` takes a reference on hit blocks, unlinking those with count 0
  from the free queue; ``free_blocks`` drops one reference each and appends the blocks
  that reach zero to the queue; ``get_cached_block`` looks a hash up.
- ``request_block_hashes``: vLLM's request block hasher with its default hash function
  ``sha256`` (SHA-256 of the pickled ``(parent hash, block token tuple, extra keys)``).

Left out, as in a default single-group deployment: KV-cache events, the metrics
collector, multi-modal / LoRA extra keys (they are ``None``), hybrid groups.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from dataclasses import dataclass
from itertools import islice
from typing import Iterable, Optional

NONE_HASH = os.urandom(32)


def sha256(value: object) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def hash_block_tokens(parent: Optional[bytes], tokens, extra_keys=None) -> bytes:
    if not parent:
        parent = NONE_HASH
    return sha256((parent, tuple(tokens), extra_keys))


def _extra_keys(request, start: int, end: int, mm_index: int):
    # No multi-modal inputs, LoRA or cache salt: nothing to add (vLLM returns None, index).
    if not request.mm_features and request.lora_request is None and request.cache_salt is None:
        return None, mm_index
    raise NotImplementedError


@dataclass
class Request:
    all_token_ids: list
    block_hashes: list
    mm_features: tuple = ()
    lora_request: object = None
    cache_salt: object = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def request_block_hashes(request: Request, block_size: int) -> list[bytes]:
    """The hashes of the request's full blocks not hashed yet (vLLM's block hasher)."""
    start = len(request.block_hashes) * block_size
    if start + block_size > request.num_tokens:
        return []
    mm_index = 0
    out = []
    prev = request.block_hashes[-1] if request.block_hashes else None
    while True:
        end = start + block_size
        if end > request.num_tokens:
            break
        extra, mm_index = _extra_keys(request, start, end, mm_index)
        block_hash = hash_block_tokens(prev, request.all_token_ids[start:end], extra)
        out.append(block_hash)
        start += block_size
        prev = block_hash
    return out


def make_block_hash_with_group_id(block_hash: bytes, group_id: int) -> bytes:
    return block_hash + group_id.to_bytes(4, "big", signed=False)


@dataclass
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    _block_hash: Optional[bytes] = None
    prev_free_block: Optional["KVCacheBlock"] = None
    next_free_block: Optional["KVCacheBlock"] = None
    is_null: bool = False

    @property
    def block_hash(self) -> Optional[bytes]:
        return self._block_hash

    @block_hash.setter
    def block_hash(self, block_hash: bytes) -> None:
        assert self._block_hash is None, "The block already has a hash."
        self._block_hash = block_hash

    def reset_hash(self) -> None:
        self._block_hash = None


class FreeKVCacheBlockQueue:
    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        for i in range(len(blocks)):
            if i > 0:
                blocks[i].prev_free_block = blocks[i - 1]
            if i < len(blocks) - 1:
                blocks[i].next_free_block = blocks[i + 1]
        self.fake_head = KVCacheBlock(block_id=-1)
        self.fake_tail = KVCacheBlock(block_id=-1)
        if blocks:
            self.fake_head.next_free_block = blocks[0]
            blocks[0].prev_free_block = self.fake_head
            self.fake_tail.prev_free_block = blocks[-1]
            blocks[-1].next_free_block = self.fake_tail
        else:
            self.fake_head.next_free_block = self.fake_tail
            self.fake_tail.prev_free_block = self.fake_head

    def popleft(self) -> KVCacheBlock:
        first = self.fake_head.next_free_block
        if first is self.fake_tail or first is None:
            raise ValueError("No free blocks available")
        self.fake_head.next_free_block = first.next_free_block
        first.next_free_block.prev_free_block = self.fake_head
        first.prev_free_block = first.next_free_block = None
        self.num_free_blocks -= 1
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n == 0:
            return []
        assert self.num_free_blocks >= n
        self.num_free_blocks -= n
        curr = self.fake_head.next_free_block
        ret = []
        for _ in range(n):
            assert curr is not None
            ret.append(curr)
            last = curr
            curr = curr.next_free_block
            last.prev_free_block = None
            last.next_free_block = None
        if curr is not None:
            self.fake_head.next_free_block = curr
            curr.prev_free_block = self.fake_head
        return ret

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is None or block.next_free_block is None:
            raise RuntimeError(f"remove() called on an invalid block: {block}")
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        if len(blocks) == 0:
            return
        last = self.fake_tail.prev_free_block
        assert last is not None
        for block in blocks:
            block.prev_free_block = last
            last.next_free_block = block
            last = block
        last.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = last
        self.num_free_blocks += len(blocks)


class BlockHashToBlockMap:
    def __init__(self) -> None:
        self._cache: dict[bytes, object] = {}

    def get_one_block(self, key: bytes) -> Optional[KVCacheBlock]:
        blocks = self._cache.get(key)
        if blocks is not None:
            if isinstance(blocks, KVCacheBlock):
                return blocks
            if isinstance(blocks, dict):
                return next(iter(blocks.values()))
            raise AssertionError("unexpected block map entry")
        return None

    def insert(self, key: bytes, block: KVCacheBlock) -> None:
        blocks = self._cache.get(key)
        if blocks is None:
            self._cache[key] = block
        elif isinstance(blocks, KVCacheBlock):
            self._cache[key] = {blocks.block_id: blocks, block.block_id: block}
        elif isinstance(blocks, dict):
            blocks[block.block_id] = block
        else:
            raise AssertionError("unexpected block map entry")

    def pop(self, key: bytes, block_id: int) -> Optional[KVCacheBlock]:
        blocks = self._cache.pop(key, None)
        if blocks is None:
            return None
        if isinstance(blocks, KVCacheBlock):
            if blocks.block_id == block_id:
                return blocks
            self._cache[key] = blocks
            return None
        if isinstance(blocks, dict):
            block = blocks.pop(block_id, None)
            if len(blocks) > 0:
                self._cache[key] = blocks
            return block
        raise AssertionError("unexpected block map entry")

    def __len__(self) -> int:
        return len(self._cache)


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.num_gpu_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.evictions = 0  # audit counter (not in vLLM)

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_cached_block(self, block_hash: bytes, group_ids: list[int]) -> Optional[list[KVCacheBlock]]:
        cached = []
        for group_id in group_ids:
            block = self.cached_block_hash_to_block.get_one_block(make_block_hash_with_group_id(block_hash, group_id))
            if not block:
                return None
            cached.append(block)
        return cached

    def cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_cached_blocks: int,
                          num_full_blocks: int, block_size: int, kv_cache_group_id: int) -> None:
        if num_cached_blocks >= num_full_blocks:
            return
        new_full_blocks = blocks[num_cached_blocks:num_full_blocks]
        assert len(request.block_hashes) >= num_full_blocks
        new_block_hashes = request.block_hashes[num_cached_blocks:]
        for i, blk in enumerate(new_full_blocks):
            if blk.is_null:
                continue
            assert blk.block_hash is None
            key = make_block_hash_with_group_id(new_block_hashes[i], kv_cache_group_id)
            blk.block_hash = key
            self.cached_block_hash_to_block.insert(key, blk)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        ret = self.free_block_queue.popleft_n(num_blocks)
        if self.enable_caching:
            for block in ret:
                self._maybe_evict_cached_block(block)
                assert block.ref_cnt == 0
                block.ref_cnt += 1
        else:
            for block in ret:
                assert block.ref_cnt == 0
                block.ref_cnt += 1
        return ret

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        block_hash = block.block_hash
        if block_hash is None:
            return False
        if self.cached_block_hash_to_block.pop(block_hash, block.block_id) is None:
            return False
        block.reset_hash()
        self.evictions += 1
        return True

    def touch(self, blocks: tuple[list[KVCacheBlock], ...]) -> None:
        for blocks_per_group in blocks:
            for block in blocks_per_group:
                if block.ref_cnt == 0 and not block.is_null:
                    self.free_block_queue.remove(block)
                block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        blocks_list = list(ordered_blocks)
        for block in blocks_list:
            block.ref_cnt -= 1
        self.free_block_queue.append_n([b for b in blocks_list if b.ref_cnt == 0 and not b.is_null])


def find_longest_cache_hit(block_hashes: list[bytes], max_length: int, pool: BlockPool,
                           block_size: int, group_ids: list[int]) -> tuple[list[KVCacheBlock], ...]:
    """vLLM's full-attention prefix lookup: blocks of the longest run of cached hashes."""
    computed: tuple[list[KVCacheBlock], ...] = tuple([] for _ in range(len(group_ids)))
    for block_hash in islice(block_hashes, max_length // block_size):
        cached = pool.get_cached_block(block_hash, group_ids)
        if not cached:
            break
        for c, b in zip(computed, cached):
            c.append(b)
    return computed
