"""The disk tier under ``PrefixCache``: evicted pages come back from disk with outputs
equal to decoding alone, a restarted process hits them, a writer killed mid-write
leaves only whole files, bad files are misses (deleted, counted), another model's
directory is refused, and the byte budget holds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from tiny_models import kv_dims, make_model

from pagedkv import PagePool, PrefixCache
from pagedkv.disk_tier import SUFFIX, DiskTier
from pagedkv.errors import KvFileMismatchError
from pagedkv.generation import generate
from pagedkv.page_file import read_pages_file

PROMPT = list(range(1, 30))  # 7 full pages of 4 before the last token


@pytest.fixture(scope="module")
def model():
    return make_model("llama")


def make_pool(num_pages=12):
    L, H, D = kv_dims("llama")
    return PagePool(num_layers=L, num_kv_heads=H, head_dim=D, page_size=4, num_pages=num_pages, dtype=mx.float32)


def run(model, prefix, tokens, n=5):
    """Greedy tokens of ``tokens`` through ``prefix.new_cache``; its pages registered."""
    cache, rest = prefix.new_cache(model, tokens)
    try:
        out = list(generate(model, cache, rest, max_tokens=n))
        prefix.register(cache, tokens + out)
        return out, len(tokens) - len(rest)
    finally:
        cache.release()


def evict_everything(model, prefix, pool):
    """Fill the pool with another sequence, so every cached page is evicted."""
    other = [100 + i % 20 for i in range(4 * pool.usable_pages - 1)]
    run(model, prefix, other, n=1)


def solo(model, tokens, n=5):
    return list(generate(model, make_prompt_cache(model), tokens, max_tokens=n))


def persisted(model, directory) -> None:
    """A process that ran PROMPT (+ 5 generated tokens) and wrote its 8 pages to disk."""
    pool = make_pool()
    disk = DiskTier(directory, pool, max_bytes=1 << 30, model_id="tiny")
    prefix = PrefixCache(pool, disk=disk)
    run(model, prefix, PROMPT)
    assert prefix.persist() == 8  # 29 prompt tokens + 4 generated ones written
    disk.close()


def test_evicted_pages_come_back_from_disk_and_give_the_same_tokens(model, tmp_path):
    pool = make_pool()
    disk = DiskTier(tmp_path, pool, max_bytes=1 << 30, model_id="tiny")
    prefix = PrefixCache(pool, disk=disk)
    assert run(model, prefix, PROMPT)[0] == solo(model, PROMPT)
    evict_everything(model, prefix, pool)
    assert disk.flush(30) and disk.stats.written >= 7
    got, cached = run(model, prefix, PROMPT)
    assert got == solo(model, PROMPT) and cached == 28
    assert prefix.stats().disk_hit_pages == 7 and disk.stats.restored == 7
    assert pool.allocator.num_in_use() == 0
    pool.allocator.check()
    disk.close()


def test_a_restarted_process_hits_the_pages_an_earlier_one_persisted(model, tmp_path):
    persisted(model, tmp_path)
    pool2 = make_pool()
    disk2 = DiskTier(tmp_path, pool2, max_bytes=1 << 30, model_id="tiny")
    got, cached = run(model, PrefixCache(pool2, disk=disk2), PROMPT + [3, 4])
    assert cached == 28 and got == solo(model, PROMPT + [3, 4])
    disk2.close()


def test_a_corrupted_file_is_a_miss_and_is_deleted(model, tmp_path):
    persisted(model, tmp_path)
    files = sorted(tmp_path.glob("*" + SUFFIX), key=os.path.getmtime)
    data = bytearray(files[3].read_bytes())
    data[-7] ^= 0xFF  # one bit pattern in the page bytes
    files[3].write_bytes(bytes(data))
    pool2 = make_pool()
    disk2 = DiskTier(tmp_path, pool2, max_bytes=1 << 30, model_id="tiny")
    got, cached = run(model, PrefixCache(pool2, disk=disk2), PROMPT)
    assert got == solo(model, PROMPT)
    assert disk2.stats.bad_files == 1 and not files[3].exists()
    assert cached < 28  # the chain stops at the bad page
    disk2.close()


def test_another_models_directory_is_refused(model, tmp_path):
    DiskTier(tmp_path, make_pool(), max_bytes=1 << 20, model_id="model-a").close()
    with pytest.raises(KvFileMismatchError):
        DiskTier(tmp_path, make_pool(), max_bytes=1 << 20, model_id="model-b")
    L, H, D = kv_dims("llama")
    other = PagePool(num_layers=L, num_kv_heads=H, head_dim=D, page_size=8, num_pages=12, dtype=mx.float32)
    with pytest.raises(KvFileMismatchError):
        DiskTier(tmp_path, other, max_bytes=1 << 20, model_id="model-a")


def test_the_directory_stays_under_its_byte_budget(model, tmp_path):
    persisted(model, tmp_path)
    by_age = sorted(tmp_path.glob("*" + SUFFIX), key=lambda p: p.stat().st_mtime_ns)
    budget = sum(p.stat().st_size for p in by_age[-3:])
    disk = DiskTier(tmp_path, make_pool(), max_bytes=budget, model_id="tiny")
    assert disk.stats.files == 3 and disk.stats.deleted == 5
    assert sorted(tmp_path.glob("*" + SUFFIX)) == sorted(by_age[-3:])  # the least recently used went
    disk.close()


WRITER = r'''
import sys
sys.path.insert(0, "tests")
import mlx.core as mx
from tiny_models import kv_dims, make_model
from pagedkv import PagePool, PrefixCache
from pagedkv.disk_tier import DiskTier
from pagedkv.generation import prefill
model = make_model("llama")
L, H, D = kv_dims("llama")
pool = PagePool(num_layers=L, num_kv_heads=H, head_dim=D, page_size=4, num_pages=12, dtype=mx.float32)
disk = DiskTier(sys.argv[1], pool, max_bytes=1 << 30, model_id="tiny")
prefix = PrefixCache(pool, disk=disk)
i = 0
while True:  # new prompts forever: every eviction spills, the writer never rests
    tokens = [(i * 7 + j) % 128 for j in range(41)]
    cache, rest = prefix.new_cache(model, tokens)
    prefill(model, cache, rest[:-1])
    prefix.register(cache, tokens)
    cache.release()
    i += 1
    if i == 3:
        print("writing", flush=True)
'''


@pytest.mark.slow
def test_a_writer_killed_mid_write_leaves_only_whole_files_and_a_restart_hits(model, tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).parents[1])
    assert proc.stdout.readline().strip() == "writing"
    time.sleep(1.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    pool = make_pool(num_pages=20)
    disk = DiskTier(tmp_path, pool, max_bytes=1 << 30, model_id="tiny")
    assert not list(tmp_path.glob(".*.tmp-*"))  # leftovers of the killed write are gone
    files = list(tmp_path.glob("*" + SUFFIX))
    assert len(files) >= 5 and disk.stats.files == len(files)
    for f in files:  # every file that has its final name is whole
        read_pages_file(f, disk.spec)
    tokens = [(0 * 7 + j) % 128 for j in range(41)]  # the first prompt the writer ran
    got, cached = run(model, PrefixCache(pool, disk=disk), tokens)
    assert cached > 0 and got == solo(model, tokens)
    disk.close()


def test_a_page_registered_below_an_evicted_page_is_filed_without_a_digest(tmp_path):
    """A sequence whose page content was already cached continues from the other page's
    node; once that page is evicted (its digest goes with it), the sequence's next page
    is still registered, changes nothing on disk, and raises nothing (it raised a bare
    KeyError after marking the page cacheable)."""
    pool = make_pool(num_pages=8)
    disk = DiskTier(tmp_path, pool, max_bytes=1 << 24, model_id="tiny")
    prefix = PrefixCache(pool, disk=disk)
    alloc = pool.allocator
    first, second = prefix.keys(PROMPT[:13]), prefix.keys(PROMPT[:13])
    owned = alloc.allocate(2).tolist()
    prefix.register_pages(owned, first)
    duplicate = alloc.allocate(1).tolist()
    assert prefix.register_pages(duplicate, second) == 0  # the content is owned's first page
    alloc.decref(owned[::-1])
    alloc.evict(2)  # owned's pages and digests go
    page = alloc.allocate(1).tolist()
    assert prefix.register_pages(page, second, 1) == 1
    assert prefix.match(PROMPT[:13]) == []  # below an evicted page: unreachable, as without disk
    assert prefix.persist() == 0
    alloc.decref(page + duplicate)
    alloc.check()
    disk.close()
