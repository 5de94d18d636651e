"""The disk tier under ``PrefixCache``: evicted pages come back from disk with outputs
equal to decoding alone, a restarted process hits them, a writer killed mid-write
leaves only whole files, bad files are misses (deleted, counted), another model's
directory and a directory another open tier holds are refused, and the byte budget holds. A sliding-window model's window pages
go to disk and come back beside its full pages."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from tiny_models import CONFIGS, kv_dims, make_model, model_of_config, prompt_of
from tiny_models import make_pool as tiny_pool

from pagedkv import PagePool, PrefixCache, kv_pool_layers, layout_for
from pagedkv.disk_tier import SUFFIX, DiskTier, window_digest
from pagedkv.errors import DiskTierInUseError, KvFileMismatchError
from pagedkv.generation import generate
from pagedkv.page_file import read_pages_file

PROMPT = list(range(1, 30))  # 7 full pages of 4 before the last token
PARENT, TOKENS = b"p" * 16, np.arange(4, dtype="<i8").tobytes()  # a page spilled by hand: its parent, its ids


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


def test_pages_still_queued_for_writing_are_hits_served_from_memory(model, tmp_path, monkeypatch):
    """The writer held back until the hit is over: the evicted pages come back from the
    write queue (they were dropped as bad files before: the queued record lacked the
    page count a file has)."""
    import pagedkv.disk_tier as disk_tier

    release = threading.Event()
    write = disk_tier.write_pages_file

    def held_back(*args, **kwargs):
        release.wait(60)
        return write(*args, **kwargs)

    monkeypatch.setattr(disk_tier, "write_pages_file", held_back)
    pool = make_pool()
    disk = DiskTier(tmp_path, pool, max_bytes=1 << 30, model_id="tiny")
    prefix = PrefixCache(pool, disk=disk)
    run(model, prefix, PROMPT)
    pool.allocator.evict(pool.allocator.num_cached())
    assert disk.stats.written == 0 and disk.stats.spilled == 8
    got, cached = run(model, prefix, PROMPT)
    assert got == solo(model, PROMPT) and cached == 28
    assert disk.stats.restored == 7 and disk.stats.bad_files == 0
    release.set()
    assert disk.flush(30) and disk.stats.written == 8
    disk.close()


def test_a_digest_listed_twice_in_one_spill_is_written_once_and_the_writer_lives_on(tmp_path):
    """Two evicted pages can carry one digest (the same content filed under two nodes,
    one of them since evicted). The second used to be queued again, and the writer
    thread died on it (KeyError), so nothing was written after it."""
    pool = make_pool()
    disk = DiskTier(tmp_path, pool, max_bytes=1 << 24, model_id="tiny")
    digest = b"d" * 16
    disk.spill([digest, digest], [PARENT, PARENT], [TOKENS, TOKENS], [1, 2])
    assert disk.stats.spilled == 1
    assert disk.flush(30) and disk.stats.written == 1 and disk._writer.is_alive()
    disk.spill([b"e" * 16], [PARENT], [TOKENS], [3])
    assert disk.flush(30) and disk.stats.written == 2
    assert disk.load(digest, PARENT, TOKENS) is not None
    disk.close()


def page_path(directory: Path, digest: bytes) -> Path:
    return directory / (digest.hex() + SUFFIX)


def test_a_page_that_cannot_be_written_is_dropped_and_the_writer_writes_the_next(tmp_path):
    """A failing write (here a directory sits where the file goes, so the rename fails)
    loses that page only: counted, its temp file removed, never a hit."""
    disk = DiskTier(tmp_path, make_pool(), max_bytes=1 << 24, model_id="tiny")
    page_path(tmp_path, b"d" * 16).mkdir()
    disk.spill([b"d" * 16, b"e" * 16], [PARENT] * 2, [TOKENS] * 2, [1, 2])
    assert disk.flush(30) and disk.stats.dropped == 1 and disk.stats.written == 1
    assert disk.load(b"d" * 16, PARENT, TOKENS) is None and disk.load(b"e" * 16, PARENT, TOKENS) is not None
    assert not list(tmp_path.glob(".*.tmp-*"))
    disk.spill([b"f" * 16], [PARENT], [TOKENS], [3])
    assert disk.flush(30) and disk.stats.written == 2
    disk.close()


def directory_in_place_of(path: Path) -> None:
    """Replace a page file by a directory (not empty): reading and deleting it fail."""
    path.unlink()
    path.mkdir()
    (path / "x").touch()


def test_page_files_that_cannot_be_read_or_deleted_are_misses_and_the_writer_lives_on(tmp_path):
    """Page files replaced by directories after the tier listed them. A lookup is a miss
    (the delete that follows a bad read raised IsADirectoryError out of it), the byte
    budget's deletions in the writer thread skip them (the thread died on it), and a
    restarted tier lists no directory as a page."""
    disk = DiskTier(tmp_path, make_pool(), max_bytes=1 << 24, model_id="tiny")
    disk.spill([b"a" * 16, b"b" * 16], [PARENT] * 2, [TOKENS] * 2, [1, 2])
    assert disk.flush(30) and disk.stats.written == 2
    size = page_path(tmp_path, b"a" * 16).stat().st_size
    disk.close()
    disk = DiskTier(tmp_path, make_pool(), max_bytes=2 * size, model_id="tiny")
    assert disk.stats.files == 2
    for digest in (b"a" * 16, b"b" * 16):
        directory_in_place_of(page_path(tmp_path, digest))
    assert disk.load(b"b" * 16, PARENT, TOKENS) is None
    assert disk.stats.bad_files == 1 and not disk.has(b"b" * 16)
    disk.spill([b"c" * 16, b"d" * 16], [PARENT] * 2, [TOKENS] * 2, [1, 2])  # "a" is over the budget
    assert disk.flush(30) and disk._writer.is_alive() and disk.stats.written == 2
    assert disk.stats.files == 2 and disk.stats.bytes_on_disk == 2 * size and not disk.has(b"a" * 16)
    disk.close()
    disk = DiskTier(tmp_path, make_pool(), max_bytes=1 << 24, model_id="tiny")  # (room for all: none trimmed)
    assert disk.stats.files == 2 and disk.has(b"c" * 16) and not disk.has(b"a" * 16)
    disk.close()


def test_a_closed_tier_holds_nothing_and_drops_what_a_prefix_cache_still_spills(model, tmp_path):
    """Pages spilled after ``close`` used to stay queued in memory for a writer that had
    stopped: ``flush()`` (and so ``persist()``) waited for them forever."""
    pool = make_pool()
    disk = DiskTier(tmp_path, pool, max_bytes=1 << 30, model_id="tiny")
    prefix = PrefixCache(pool, disk=disk)
    run(model, prefix, PROMPT)
    assert prefix.persist() == 8
    disk.close()
    digest = next(iter(disk._files))
    assert not disk.has(bytes.fromhex(digest)) and disk.load(bytes.fromhex(digest), PARENT, TOKENS) is None
    evict_everything(model, prefix, pool)  # spills to the closed tier: dropped
    assert disk.stats.dropped > 0 and disk.flush(5) and prefix.persist() == 0
    got, cached = run(model, prefix, PROMPT)  # served as if there were no disk tier
    assert got == solo(model, PROMPT) and cached == 0
    reopened = DiskTier(tmp_path, pool, max_bytes=1 << 30, model_id="tiny")
    assert reopened.stats.files == 8  # what was written before close, and nothing after
    reopened.close()


def test_a_file_whose_parent_or_tokens_are_not_the_requests_is_a_miss_and_is_deleted(tmp_path):
    """A file is used only if the parent digest and token ids it records are the
    request's, not just its name (a file renamed, or written by a buggy process)."""
    pool = make_pool()
    disk = DiskTier(tmp_path, pool, max_bytes=1 << 24, model_id="tiny")
    parent, tokens = PARENT, TOKENS
    disk.spill([b"a" * 16, b"b" * 16, b"c" * 16], [parent] * 3, [tokens] * 3, [1, 2, 3])
    assert disk.flush(30) and len(list(tmp_path.glob("*" + SUFFIX))) == 3
    assert disk.load(b"a" * 16, b"q" * 16, tokens) is None  # another parent
    assert disk.load(b"b" * 16, parent, np.arange(1, 5, dtype="<i8").tobytes()) is None  # other tokens
    assert disk.stats.bad_files == 2
    assert [f.name for f in tmp_path.glob("*" + SUFFIX)] == [(b"c" * 16).hex() + SUFFIX]
    assert disk.load(b"c" * 16, parent, tokens) is not None and disk.stats.restored == 1
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


def test_a_directory_is_one_open_tiers_until_it_closes_and_a_refused_open_keeps_nothing(tmp_path):
    first = DiskTier(tmp_path, make_pool(), max_bytes=1 << 20, model_id="tiny")
    temp = tmp_path / ".abc.kvpage.tmp-1"  # as if its writer were mid-write
    temp.write_bytes(b"half a page")
    with pytest.raises(DiskTierInUseError, match=f"pid {os.getpid()}"):
        DiskTier(tmp_path, make_pool(), max_bytes=1 << 20, model_id="tiny")
    assert temp.exists()  # the refused open deleted nothing
    first.close()
    first.close()  # (idempotent)
    with pytest.raises(KvFileMismatchError):  # refused after taking the lock: it lets it go
        DiskTier(tmp_path, make_pool(), max_bytes=1 << 20, model_id="another model")
    second = DiskTier(tmp_path, make_pool(), max_bytes=1 << 20, model_id="tiny")
    assert not temp.exists()  # no writer can own it now: a crash's leftover, deleted
    second.close()


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
from tiny_models import CONFIGS, kv_dims, make_model, model_of_config, prompt_of
from tiny_models import make_pool as tiny_pool
from pagedkv import PagePool, PrefixCache, kv_pool_layers, layout_for
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
    with pytest.raises(DiskTierInUseError, match=f"pid {proc.pid}"):  # it would delete the writer's temp files
        DiskTier(tmp_path, make_pool(), max_bytes=1 << 30, model_id="tiny")
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


WINDOWED = prompt_of(29, seed=4)  # gemma3_text, window 12, pages of 4: 7 full pages + 1 token


@pytest.fixture(scope="module")
def gemma():
    return make_model("gemma3_text")


@pytest.fixture(scope="module")
def gemma_groups():
    """4 sliding layers, 2 full: on a pool of 2 layers, two groups of sliding layers."""
    return model_of_config(dict(CONFIGS["gemma3_text"], num_hidden_layers=6, sliding_window_pattern=3))


def windowed_tier(directory, num_pages=48, model=None):
    """A pool for ``model`` (``kv_pool_layers``; default tiny gemma3_text's 4 layers), its
    disk tier and its prefix cache."""
    pool = tiny_pool("gemma3_text", page_size=4, num_pages=num_pages)
    if model is not None:
        pool = PagePool(num_layers=kv_pool_layers(model), num_kv_heads=pool.num_kv_heads, head_dim=pool.head_dim,
                        page_size=4, num_pages=num_pages, dtype=mx.float32)
    disk = DiskTier(directory, pool, max_bytes=1 << 30, model_id="tiny-gemma")
    windows = (12,) if model is None else layout_for(model, pool).windows
    return pool, disk, PrefixCache(pool, disk=disk, windows=windows)


def windowed_run(model, prefix, tokens, n=5):
    """``run`` for a sliding-window model: the pages are also registered right after the
    prefill, while the sliding table still holds them (the engine registers after each
    prefill chunk)."""
    cache, rest = prefix.new_cache(model, tokens)
    try:
        if len(rest) > 1:
            model(mx.array(rest[:-1])[None], cache=cache)
        prefix.register(cache, tokens)
        out = list(generate(model, cache, rest[-1:], max_tokens=n))
        prefix.register(cache, tokens + out)
        return out, len(tokens) - len(rest)
    finally:
        cache.release()


@pytest.mark.parametrize("groups", [1, 2])
def test_a_sliding_window_models_evicted_pages_come_back_from_disk_and_give_the_same_tokens(
        gemma, gemma_groups, groups, tmp_path):
    """Every cached page evicted: the hit takes its 7 full pages and, per group of
    sliding layers, the 3 window pages a query after them sees (pages 4-6) from disk,
    and decodes what mlx-lm's caches decode."""
    model = gemma if groups == 1 else gemma_groups
    pool, disk, prefix = windowed_tier(tmp_path, num_pages=64, model=None if groups == 1 else model)
    assert windowed_run(model, prefix, WINDOWED) == (solo(model, WINDOWED), 0)
    pool.allocator.evict(pool.allocator.num_cached())
    assert disk.flush(30)
    got, cached = windowed_run(model, prefix, WINDOWED)
    assert got == solo(model, WINDOWED) and cached == 28
    assert prefix.stats().disk_hit_pages == 7 and disk.stats.restored == 7 + 3 * groups
    assert pool.allocator.num_in_use() == 0
    pool.allocator.check()
    disk.close()


def test_a_window_page_evicted_alone_comes_back_from_disk_beside_the_full_pages_in_ram(gemma, tmp_path):
    pool, disk, prefix = windowed_tier(tmp_path)
    cache, rest = prefix.new_cache(gemma, WINDOWED)
    gemma(mx.array(rest[:-1])[None], cache=cache)
    prefix.register(cache, WINDOWED)
    victim = next(t for t in cache.tables if t.window is not None).page_at(5)
    cache.release()
    cached = [p for p in pool.allocator.cached_pages() if p != victim]
    pool.allocator.touch(cached)  # every cached page but the victim in use: it is the one evicted
    assert pool.allocator.evict(1) == [victim]
    pool.allocator.decref(cached)
    assert disk.flush(30) and disk.stats.written == 1
    assert len(prefix.match(WINDOWED)) == 5  # RAM alone: a query after page 5 or 6 would need the victim
    got, hit = windowed_run(gemma, prefix, WINDOWED)
    assert hit == 28 and got == solo(gemma, WINDOWED)
    assert prefix.stats().disk_hit_pages == 0 and disk.stats.restored == 1
    assert pool.allocator.num_in_use() == 0
    pool.allocator.check()
    disk.close()


def test_a_restarted_process_hits_a_sliding_window_models_pages_and_a_bad_window_file_ends_the_hit_early(
        gemma, tmp_path):
    """``persist`` writes the window pages too; a new process hits all 7 pages. With the
    file of window page 5 corrupted, the hit ends after page 5 (a query after page 6 or 7
    sees page 5; one after page 5 sees pages 2-4) and the bad file is deleted."""
    pool, disk, prefix = windowed_tier(tmp_path)
    windowed_run(gemma, prefix, WINDOWED)
    assert prefix.persist() == prefix.stats().registered_pages
    disk.close()

    pool2, disk2, prefix2 = windowed_tier(tmp_path)
    got, cached = windowed_run(gemma, prefix2, WINDOWED)
    assert cached == 28 and got == solo(gemma, WINDOWED)
    disk2.close()

    chain = []  # the full pages' digests, in order
    parent = None
    metas = {f: read_pages_file(f, disk2.spec)[1] for f in tmp_path.glob("*" + SUFFIX)}
    by_parent = {m["parent"]: m["digest"] for m in metas.values()
                 if m["digest"] != window_digest((12, 0), bytes.fromhex(m["parent"])).hex()}
    parent = next(p for p in by_parent if p not in by_parent.values())  # the root digest
    while parent in by_parent:
        parent = by_parent[parent]
        chain.append(parent)
    bad = tmp_path / (window_digest((12, 0), bytes.fromhex(chain[5])).hex() + SUFFIX)
    data = bytearray(bad.read_bytes())
    data[-7] ^= 0xFF
    bad.write_bytes(bytes(data))
    pool3, disk3, prefix3 = windowed_tier(tmp_path)
    got, cached = windowed_run(gemma, prefix3, WINDOWED)
    assert cached == 20 and got == solo(gemma, WINDOWED)
    assert disk3.stats.bad_files == 1 and not bad.exists()
    assert pool3.allocator.num_in_use() == 0
    pool3.allocator.check()
    disk3.close()
