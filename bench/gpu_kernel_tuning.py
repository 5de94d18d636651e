"""Sweep the paged decode kernel's pipeline shape and split count on a CUDA GPU.

    python bench/gpu_kernel_tuning.py [--batches 8 32 64] [--pipelines 0 1 3]
                                      [--splits 1 2 4 8] [--out FILE]

At L=4k (the issue's target cases; fp16, 32 query heads, 8 KV heads, D=128, 16-token
pages in random order) it times each ``Pipeline`` of PIPELINES (by index) with each
split count, next to SDPA on the same K/V held contiguously, in the same run, and
prints kernel / SDPA; ``choose_splits``' pick is marked ``*``. It also prints the host
time to build one call's graph. What it found is what ``DEFAULT_PIPELINE`` and
``choose_splits`` use (bench/RESULTS.md has the runs).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from gpu_attention import HKV, HQ, LINES, PS, D, bench, say, setup  # noqa: E402

from pagedkv.kernels import paged_decode  # noqa: E402
from pagedkv.kernels.paged_decode import Pipeline  # noqa: E402

PIPELINES = [Pipeline(4, 4, 2), Pipeline(4, 4, 3), Pipeline(8, 4, 2),
             Pipeline(4, 4, 2, tensor_cores=False), Pipeline(4, 4, 3, tensor_cores=False),
             Pipeline(4, 2, 3, tensor_cores=False)]
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--pipelines", type=int, nargs="+", default=list(range(len(PIPELINES))),
                    help="indices into PIPELINES to sweep")
    ap.add_argument("--splits", type=int, nargs="+", default=list(SPLITS))
    args = ap.parse_args()
    if not paged_decode.available():
        raise SystemExit("needs MLX on a CUDA GPU")
    rng = np.random.default_rng(0)
    scale = D ** -0.5
    for b in args.batches:
        lengths = [4096] * b
        kpool, vpool, table, _, kc, vc, total = setup(lengths, rng)
        q = mx.random.normal((b, HQ, 1, D)).astype(mx.float16)
        lens = mx.array(lengths, dtype=mx.int32)
        starts = mx.zeros((b,), dtype=mx.int32)
        want = mx.fast.scaled_dot_product_attention(q, kc, vc, scale=scale)

        def sdpa():
            return mx.fast.scaled_dot_product_attention(q, kc, vc, scale=scale)

        auto = paged_decode.choose_splits(b, HKV, table.shape[1])
        say(f"B={b} L=4096: kernel / SDPA (choose_splits picks {auto})")
        say(f"{'pipeline (warps, groups, stages, mma)':>40}" + "".join(f"{f'S={s}':>8}" for s in args.splits))
        for pipe in [PIPELINES[i] for i in args.pipelines]:
            cells = []
            for s in args.splits:
                def kernel(s=s, pipe=pipe):
                    return paged_decode.paged_decode(q, kpool, vpool, table, lens, starts, scale,
                                                     rows_per_head=total, page_size=PS, splits=s, pipeline=pipe)
                err = mx.abs(kernel().astype(mx.float32) - want.astype(mx.float32)).max().item()
                if not err < 1e-2:
                    cells.append(f"{'ERR':>8}")
                    continue
                ts = bench(sdpa, repeats=3)
                tk = bench(kernel, repeats=6)
                ts = min(ts, bench(sdpa, repeats=3))
                cells.append(f"{tk / ts:>7.3f}{'*' if s == auto else ' '}")
            say(f"{str((pipe.warps, pipe.groups, pipe.stages, pipe.tensor_cores)):>40}" + "".join(cells))
        for name, fn in (("SDPA", sdpa), ("kernel", lambda: paged_decode.paged_decode(
                q, kpool, vpool, table, lens, starts, scale, rows_per_head=total, page_size=PS))):
            t = time.perf_counter()
            outs = [fn() for _ in range(200)]
            say(f"host time to build one call's graph, {name}: {(time.perf_counter() - t) / 200 * 1e6:.1f} us")
            mx.eval(outs)
        mx.clear_cache()
    if args.out:
        Path(args.out).write_text("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
