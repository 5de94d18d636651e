"""``DiskTier``: prefix-cache pages that outlive their eviction from the pool, and the
process.

When the ``PrefixCache`` it is attached to forgets an evicted page, the page's bytes
are copied out of the pool (one gather for all pages evicted together, on the owner
thread; a memory copy, no disk I/O) and queued for a background writer thread, which
writes one page file per page (:mod:`pagedkv.page_file`: safetensors, version, layout,
model fingerprint, CRC-32) crash-safely: temp file, fsync, rename. A decode step
never waits for the disk. A page still queued is served from memory.

A page file is named by its *chain digest*: BLAKE2b-128 over the digest of the prefix
before it and its own token ids, from a root digest of the prefix cache's
``extra_keys``. On a sliding-window model the page a sliding layer keeps for the same
tokens is another file, named by ``window_digest`` of its window (and layer group) and
that chain digest; its parent digest is the chain digest. A later
``PrefixCache.new_cache`` that runs out of RAM pages looks the
next pages' digests up here, reads them back into free pool pages and registers them
again, so they are RAM hits from then on. Each file's page token ids and parent
digest are compared with the request's before its bytes are used, as a RAM hit
compares token ids. A file that fails any check is deleted and counted (a miss, never
an error for the request); one written for another layout or model is refused when
the directory is opened (``KvFileMismatchError``; ``tier.json`` records it).

On open, leftover temp files of a crashed writer are deleted and the directory is
re-indexed from its file names (sizes and modification times; contents are checked
when read), so a restarted process hits the pages a previous one wrote. The directory
is kept under ``max_bytes`` by deleting the least recently used files.

One open tier per directory: the tier holds an exclusive lock on ``tier.lock`` (an
``flock``, which the OS drops when the process ends, however it ends) from open to
``close``. A second tier on the same directory, in this process or another, gets
``DiskTierInUseError`` naming the holder's pid: it would delete the first one's temp
files in flight, never see the files it writes, and keep only its own files under
``max_bytes``. (No lock where the OS has no ``flock``.)

Ownership: the tier owns its files and the host copies it has queued; it holds no pool
pages. Threads: ``spill``/``restore`` run on the pool's owner thread; the writer
thread only writes files and touches the index under a lock.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import stat
import threading
from collections import OrderedDict
from pathlib import Path

import attrs
import numpy as np

from pagedkv import safetensors_file
from pagedkv.errors import (
    DiskTierInUseError,
    InvalidTypeError,
    InvalidValueError,
    KvFileError,
    KvFileMismatchError,
    check_int,
)
from pagedkv.page_file import PageFileSpec, read_pages_file, write_pages_file
from pagedkv.pool import PagePool

log = logging.getLogger("pagedkv.disk_tier")

SUFFIX = ".kvpage"
_DIGEST = 16


def chain_digest(parent: bytes, page_tokens: bytes) -> bytes:
    """The digest naming a page: BLAKE2b-128 of its parent's digest and its token bytes."""
    return hashlib.blake2b(parent + page_tokens, digest_size=_DIGEST).digest()


def window_digest(window: tuple[int, int], node_digest: bytes) -> bytes:
    """The digest naming a sliding-window page: the page that the group of sliding layers
    ``window`` = (window size, group; ``TableSpec``) keeps for the same tokens as the full
    page named ``node_digest`` (other layers' bytes, so another file)."""
    size, group = window
    return hashlib.blake2b(b"pagedkv.window\0" + size.to_bytes(8, "little") + group.to_bytes(8, "little")
                           + node_digest, digest_size=_DIGEST).digest()


def _token_record(page_tokens: bytes) -> str:
    """How a page file records its token ids (JSON), for writing and for comparing."""
    return json.dumps(np.frombuffer(page_tokens, dtype="<i8").tolist())


def _lock_directory(directory: Path) -> int | None:
    """An exclusive ``flock`` on ``directory/tier.lock``, recording this pid: the open file
    descriptor, which holds it until closed. ``DiskTierInUseError`` naming the holder if
    another open file holds it; None where the OS has no ``flock``."""
    try:
        import fcntl
    except ImportError:  # (not on Windows)
        return None
    fd = os.open(directory / "tier.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise DiskTierInUseError(f"{directory} is held by another open disk tier (pid {holder}); close it "
                                 "first, or give this one another directory") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def _unlock_directory(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)  # (closing the last descriptor of the open file drops its flock)


def root_digest(extra: bytes) -> bytes:
    return hashlib.blake2b(b"pagedkv.root\0" + extra, digest_size=_DIGEST).digest()


@attrs.define
class DiskTierStats:
    spilled: int = 0  # pages queued for writing
    written: int = 0  # page files written
    dropped: int = 0  # pages not spilled: the write queue was full, a write failed, or the tier was closed
    restored: int = 0  # pages handed back by ``load`` (to be written into the pool)
    bad_files: int = 0  # files that failed a check (deleted)
    deleted: int = 0  # files deleted to stay under max_bytes
    bytes_written: int = 0
    bytes_read: int = 0
    files: int = 0
    bytes_on_disk: int = 0


class DiskTier:
    def __init__(self, directory: str | os.PathLike, pool: PagePool, *, max_bytes: int,
                 model_id: str = "", max_pending_bytes: int = 256 << 20) -> None:
        """Open (or create) ``directory`` for ``pool``'s pages of model ``model_id``; it
        stays this tier's alone until ``close`` (``DiskTierInUseError`` while another
        tier has it open; ``KvFileMismatchError`` if it holds another model's pages)."""
        if not isinstance(pool, PagePool):
            raise InvalidTypeError(f"pool must be a PagePool, got {type(pool).__name__}")
        if not isinstance(model_id, str):
            raise InvalidTypeError(f"model_id must be a str, got {type(model_id).__name__}")
        self.directory = Path(directory)
        self.pool = pool
        self.max_bytes = check_int("max_bytes", max_bytes, minimum=1)
        self.max_pending_bytes = check_int("max_pending_bytes", max_pending_bytes, minimum=0)
        self.spec = PageFileSpec(pool, model_id)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = _lock_directory(self.directory)
        try:
            self._check_directory()
            safetensors_file.remove_stale_temps(self.directory)  # (no live writer: the lock is ours)
        except BaseException:
            _unlock_directory(self._lock_fd)
            raise
        self._lock = threading.Lock()
        self._files: OrderedDict[str, int] = OrderedDict()  # digest hex -> size, LRU first
        self._pending: dict[str, tuple[dict, dict]] = {}  # queued, not yet on disk
        self._pending_bytes = 0
        self._closed = False
        self.stats = DiskTierStats()
        found = []
        for p in self.directory.glob("*" + SUFFIX):
            try:
                st = p.stat()
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):  # (a directory of that name is no page)
                continue
            found.append((st.st_mtime_ns, p.name[: -len(SUFFIX)], st.st_size))
        for _, name, size in sorted(found):
            self._files[name] = size
            self.stats.bytes_on_disk += size
        self._trim()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._writer = threading.Thread(target=self._write_loop, name="pagedkv-disk-tier", daemon=True)
        self._writer.start()

    def _check_directory(self) -> None:
        record = self.directory / "tier.json"
        want = {"format": "pagedkv.disk_tier", "version": 1, "layout": self.spec.layout, "model": self.spec.model}
        if record.exists():
            try:
                have = json.loads(record.read_text())
            except (OSError, json.JSONDecodeError):
                have = None
            if have != want:
                raise KvFileMismatchError(f"{self.directory} holds pages of another model or pool layout "
                                          f"({record}); use another directory")
        else:
            safetensors_file.write_atomic(record, [json.dumps(want, sort_keys=True).encode()])

    # ------------------------------------------------------------------ owner thread
    def spill(self, digests: list[bytes], parents: list[bytes], tokens: list[bytes], pages: list[int]) -> None:
        """Queue ``pages`` (held or just evicted, still unchanged in the pool) for writing
        under ``digests`` (a digest already queued or on disk, or listed before in the
        same call, is skipped). One gather from the pool; no disk I/O here."""
        if self._closed:  # (an evict listener calls this: it must not raise)
            self.stats.dropped += len(set(digests))
            return
        todo, seen = [], set()
        for i, d in enumerate(digests):  # (one digest can come twice: equal content under two nodes)
            if d not in seen and not self.has(d):
                seen.add(d)
                todo.append(i)
        room = (self.max_pending_bytes - self._pending_bytes) // max(1, self.spec.bytes_per_page)
        if len(todo) > room:
            self.stats.dropped += len(todo) - max(0, room)
            todo = todo[: max(0, room)]
        if not todo:
            return
        data = self.pool.read_pages([pages[i] for i in todo])
        for j, i in enumerate(todo):
            one = {name: arr[j : j + 1] for name, arr in data.items()}
            meta = {"kind": "tier", "digest": digests[i].hex(), "parent": parents[i].hex(),
                    "tokens": _token_record(tokens[i])}
            key = digests[i].hex()
            with self._lock:
                self._pending[key] = (one, meta)
                self._pending_bytes += self.spec.bytes_per_page
            self._idle.clear()
            self._queue.put(key)
        self.stats.spilled += len(todo)

    def has(self, digest: bytes) -> bool:
        key = digest.hex()
        with self._lock:
            return not self._closed and (key in self._pending or key in self._files)

    def load(self, digest: bytes, parent: bytes, tokens: bytes) -> dict[str, np.ndarray] | None:
        """The page named ``digest`` if it is there and checks out (its parent digest
        and token ids equal the request's), else None (a bad file is deleted)."""
        key = digest.hex()
        with self._lock:
            pending = self._pending.get(key)
            if self._closed or (pending is None and key not in self._files):
                return None
        if pending is not None:
            data, meta = pending
        else:
            path = self._path(key)
            try:
                data, meta = read_pages_file(path, self.spec)
            except (KvFileError, OSError) as e:  # (a failing disk too: a miss)
                self._drop_bad(key, e)
                return None
            self.stats.bytes_read += sum(a.nbytes for a in data.values())
        if meta.get("digest") != key or meta.get("parent") != parent.hex() \
                or meta.get("tokens") != _token_record(tokens) or (pending is None and meta.get("pages") != "1"):
            self._drop_bad(key, InvalidValueError("its digest, parent or token ids are not the request's"))
            return None
        with self._lock:
            if key in self._files:
                self._files.move_to_end(key)
        self.stats.restored += 1
        return data

    def _drop_bad(self, key: str, why: Exception) -> None:
        log.warning("disk tier: dropping page file %s: %s", key, why)
        self.stats.bad_files += 1
        with self._lock:
            size = self._files.pop(key, None)
            if size is not None:
                self.stats.bytes_on_disk -= size
        self._remove(key)

    def _remove(self, key: str) -> None:
        """Delete ``key``'s file, which the tier has already forgotten. A file that cannot
        be deleted (a failing disk, a directory in its place) is logged and left: the
        tier never reads it again in this process, and neither a lookup nor the writer
        thread may fail on it."""
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as e:
            log.warning("disk tier: cannot delete %s: %s", key, e)

    def _path(self, key: str) -> Path:
        return self.directory / (key + SUFFIX)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued page is on disk; False on timeout."""
        return self._idle.wait(timeout)

    def close(self) -> None:
        """Write what is queued, stop the writer and let the directory go (another tier
        may open it from then on). Idempotent. A closed tier holds nothing: ``has`` is
        False, ``load`` None, and ``spill`` drops the pages (counted in
        ``stats.dropped``), so a prefix cache still using it loses only its disk hits
        (pages queued after close were kept in memory, never written, and ``flush()``
        waited for them forever)."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
        with self._lock:
            self._closed = True
        fd, self._lock_fd = self._lock_fd, None
        _unlock_directory(fd)

    # ------------------------------------------------------------------ writer thread
    def _write_loop(self) -> None:
        while True:
            key = self._queue.get()
            if key is None:
                self._idle.set()
                return
            with self._lock:
                data, meta = self._pending[key]  # (spill queues a digest once)
            try:
                size = write_pages_file(self._path(key), data, self.spec, meta)
            except OSError as e:  # a full or failing disk: the page is simply not kept
                log.warning("disk tier: cannot write %s: %s", key, e)
                size = None
            with self._lock:
                self._pending.pop(key, None)
                self._pending_bytes -= self.spec.bytes_per_page
                if size is None:
                    self.stats.dropped += 1
                else:
                    self.stats.written += 1
                    self.stats.bytes_written += size
                    old = self._files.pop(key, None)
                    self.stats.bytes_on_disk += size - (old or 0)
                    self._files[key] = size
                self._trim_locked()
                if self._queue.empty():
                    self._idle.set()

    def _trim(self) -> None:
        with self._lock:
            self._trim_locked()

    def _trim_locked(self) -> None:
        while self.stats.bytes_on_disk > self.max_bytes and self._files:
            key, size = self._files.popitem(last=False)
            self._remove(key)
            self.stats.bytes_on_disk -= size
            self.stats.deleted += 1
        self.stats.files = len(self._files)
