"""Page-pool layout, write cost vs pool size, and MLX's buffer-cache limit.

    python bench/pool.py [--quick]

1. Layout: attention over L tokens gathered from pages, two layouts, vs SDPA on the same
   K/V held contiguously ([1, kv_heads, L, D]):
     head-major  [kv_heads * pages, page_size, D]: one take on axis 0, reshape, no transpose
     token-major [pages, page_size, kv_heads, D]: take, reshape, transpose to heads-first
2. Token write: one-token ``PagedKVCache.update_and_fetch`` write into pools of 512 and
   16384 pages (the same sequence); the ratio should stay near 1 (writes are in place).
3. Cache limit: a 16384-token gather+SDPA with MLX's buffer cache at 32 MiB vs 1 GiB.
Last line: the write-time ratio 16384/512 pages.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from timing import time_interleaved  # noqa: E402

from pagedkv import PagedKVCache, PagePool, PageTable  # noqa: E402

H, QH, D, PS = 8, 32, 64, 16


def layout(lengths, repeats):
    print(f"{'L':>6}{'contiguous ms':>15}{'head-major x':>14}{'token-major x':>15}")
    q = mx.random.normal((1, QH, 1, D))
    scale = D ** -0.5
    for L in lengths:
        n = L // PS
        total = 4 * n
        perm = np.random.default_rng(0).permutation(total)[:n]
        kc = mx.random.normal((1, H, L, D))
        # head-major pool holding kc's tokens at pages `perm`
        hm = mx.zeros((H * total, PS, D))
        rows = (np.arange(H)[:, None] * total + perm[None, :]).reshape(-1)
        hm[mx.array(rows)] = kc[0].reshape(H, n, PS, D).reshape(H * n, PS, D)
        tm = mx.zeros((total, PS, H, D))
        tm[mx.array(perm)] = kc[0].transpose(1, 0, 2).reshape(n, PS, H, D)
        idx_hm, idx_tm = mx.array(rows.astype(np.int32)), mx.array(perm.astype(np.int32))
        mx.eval(hm, tm, kc)

        def contiguous():
            return mx.fast.scaled_dot_product_attention(q, kc, kc, scale=scale)

        def head_major():
            k = mx.take(hm, idx_hm, axis=0).reshape(1, H, L, D)
            return mx.fast.scaled_dot_product_attention(q, k, k, scale=scale)

        def token_major():
            k = mx.take(tm, idx_tm, axis=0).reshape(1, L, H, D).transpose(0, 2, 1, 3)
            return mx.fast.scaled_dot_product_attention(q, k, k, scale=scale)

        assert mx.allclose(head_major(), contiguous()) and mx.allclose(token_major(), contiguous())
        t = time_interleaved({"c": contiguous, "h": head_major, "t": token_major}, repeats, inner=4)
        print(f"{L:>6}{t['c'] * 1e3:>15.3f}{t['h'] / t['c']:>14.2f}{t['t'] / t['c']:>15.2f}")


def write_cost(repeats):
    out = {}
    for pages in (512, 16384):
        pool = PagePool(num_layers=1, num_kv_heads=H, head_dim=D, page_size=PS, num_pages=pages,
                        dtype=mx.float16)
        cache = PagedKVCache(PageTable(pool), 0)
        tok = mx.random.normal((1, H, 1, D)).astype(mx.float16)
        mx.eval(cache.update_and_fetch(tok, tok))
        mx.reset_peak_memory()
        base = mx.get_active_memory()

        def write():
            cache.update_and_fetch(tok, tok)
            cache.trim(1)
            return tok

        def write_eval():
            k, v = cache.update_and_fetch(tok, tok)
            cache.trim(1)
            return k[..., -1:, :]

        t = time_interleaved({"w": write_eval}, repeats, inner=50)["w"]
        out[pages] = (t, pool.nbytes, mx.get_peak_memory() - base)
    print(f"{'pages':>7}{'pool MiB':>10}{'write+read us':>15}{'peak growth MiB':>17}")
    for pages, (t, nbytes, growth) in out.items():
        print(f"{pages:>7}{nbytes / 2**20:>10.1f}{t * 1e6:>15.1f}{growth / 2**20:>17.2f}")
    return out[16384][0] / out[512][0]


def cache_limit(repeats):
    L = 16384
    pool = PagePool(num_layers=1, num_kv_heads=H, head_dim=D, page_size=PS, num_pages=L // PS + 8,
                    dtype=mx.float32, cache_limit=None)
    cache = PagedKVCache(PageTable(pool), 0)
    kv = mx.random.normal((1, H, L, D))
    mx.eval(cache.update_and_fetch(kv, kv))
    q = mx.random.normal((1, QH, 1, D))

    def attend():
        k, v = cache.keys_and_values()
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5)

    res = {}
    for limit in (32 << 20, 1 << 30):
        mx.set_cache_limit(limit)
        mx.clear_cache()
        res[limit] = time_interleaved({"a": attend}, repeats, inner=8)["a"]
    print(f"gather+SDPA of {L} tokens ({2 * L * H * D * 4 / 2**20:.0f} MiB gathered): "
          f"cache limit 32 MiB {res[32 << 20] * 1e3:.2f} ms, 1 GiB {res[1 << 30] * 1e3:.2f} ms, "
          f"ratio {res[32 << 20] / res[1 << 30]:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    reps = 5 if args.quick else 15
    mx.random.seed(0)
    layout((512, 4096, 16384) if not args.quick else (512, 4096), reps)
    cache_limit(reps)
    ratio = write_cost(reps)
    print(f"token write time, 16384-page / 512-page pool: {ratio:.2f}x")


if __name__ == "__main__":
    main()
