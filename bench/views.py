"""Cost of view bookkeeping per decode step, as a fraction of the step itself.

    python bench/views.py [--quick]

Per decode step every layer creates a ``KvAttentionView`` of its sequence (page-table
snapshot + one batched incref), wraps it in a ``ViewKv`` and releases it (one batched
decref). This times that bookkeeping alone for all 8 layers, and a whole decode step
of bench/decode.py's model (paged cache) in the same run. Last line: the fraction at 4096.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
from decode import HEAD_DIM, KV_HEADS, LAYERS, filled_caches, random_model  # noqa: E402
from timing import fixed_context_step, time_interleaved  # noqa: E402

from pagedkv import KvAttentionView, PagePool, ViewKv  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    repeats = 5 if args.quick else 15
    model = random_model()
    tok = mx.array([[7]])
    print(f"{'context':>8}{'step ms':>10}{'views us/step':>15}{'fraction':>10}")
    frac = {}
    for ctx in (512, 4096):
        pool = PagePool(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, page_size=16,
                        num_pages=ctx // 16 + 64, dtype=mx.float32)
        _, paged = filled_caches(model, pool, ctx)

        t_step = time_interleaved({"s": lambda: fixed_context_step(model, tok, paged)}, repeats, inner=4)["s"]
        n = 200
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            for _ in range(n):
                for c in paged:
                    ViewKv(KvAttentionView.of_cache(c), offset=c.offset - 1).release()
            best = min(best, (time.perf_counter() - t) / n)
        frac[ctx] = best / t_step
        print(f"{ctx:>8}{t_step * 1e3:>10.2f}{best * 1e6:>15.1f}{frac[ctx] * 100:>9.2f}%")
        paged.release()
    print(f"view create+release per layer per step at 4096, fraction of a decode step: {frac[4096] * 100:.2f}%")


if __name__ == "__main__":
    main()
