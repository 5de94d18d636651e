"""Paged decode attention and token writes on a CUDA GPU (run on the H200).

    python bench/gpu_attention.py [--quick | --focus] [--sinks] [--skip-attention] [--skip-prefill]
                                  [--skip-writes] [--out FILE]

1. Attention, fp16, 32 query heads, 8 KV heads, D=128, pages of 16 tokens in random
   order, B in {1, 8, 32, 64, 128}, L in {1k, 4k, 16k, 32k}, plus ragged batches
   (lengths uniform in [256, 8k]). In the same run: the paged kernel, SDPA on the same
   K/V held contiguously (padded + masked for ragged rows), and gather + SDPA (the
   exact fallback path). Effective KV bandwidth = K/V bytes read / kernel time, next to
   a plain device-to-device copy (read + write bytes / time) measured here. ``--sinks``:
   every contender with attention sinks (gpt_oss; one logit per query head), which the
   paged path read by gather + SDPA until the kernel's merge took them.
2. Prefill attention (D = 64 and 128; contexts to 16k, whole and chunked prefill,
   ragged rows): the paged prefill kernel, SDPA on contiguous K/V, gather + SDPA.
3. Token writes vs pool size (0.5 to 4 GiB per layer array): ``pool[rows, slots] = tok``
   as PagePool writes it, the same after ``mx.synchronize()``, and into 64 MiB chunk
   arrays; time per token and peak memory growth.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from pagedkv.kernels import paged_decode, paged_prefill  # noqa: E402

HQ, HKV, D, PS = 32, 8, 128, 16
LINES: list[str] = []


def say(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def bench(fn, iters: int = 10, repeats: int = 5) -> float:
    """Seconds per call: ``iters`` independent calls evaluated together, best of ``repeats``.

    The calls' graphs are built before the clock starts: building them in Python is host
    work that a decode loop overlaps with the GPU (``mx.async_eval``); the timed part is
    MLX's evaluation (kernel launches) and the GPU's execution, for every contender alike.
    """
    mx.eval(fn())
    best = float("inf")
    for _ in range(repeats):
        outs = [fn() for _ in range(iters)]
        mx.synchronize()
        t = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        best = min(best, (time.perf_counter() - t) / iters)
    return best


def memory_baseline() -> int:
    """Drain the GPU, reset the peak counter; returns active bytes to measure growth from."""
    mx.synchronize()
    mx.reset_peak_memory()
    return mx.get_active_memory()


def copy_bandwidth() -> float:
    x = mx.random.normal((1 << 30,)).astype(mx.float16)  # 2 GiB
    mx.eval(x)
    t = bench(lambda: x + 0, iters=5)
    return 2 * x.nbytes / t / 1e12


def setup(lengths: list[int], rng, d: int = D):
    pages = [-(-n // PS) for n in lengths]
    total = sum(pages)
    perm = rng.permutation(total)
    width = max(pages)
    table = np.zeros((len(lengths), width), dtype=np.int32)
    at = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[at : at + n]
        at += n
    kpool = mx.random.normal((HKV * total, PS, d)).astype(mx.float16)
    vpool = mx.random.normal((HKV * total, PS, d)).astype(mx.float16)
    index = mx.array((np.arange(HKV)[None, :, None] * total + table[:, None, :]).reshape(-1).astype(np.int32))
    L = width * PS
    kc = mx.take(kpool, index, axis=0).reshape(len(lengths), HKV, L, d)  # contiguous copy
    vc = mx.take(vpool, index, axis=0).reshape(len(lengths), HKV, L, d)
    mx.eval(kpool, vpool, kc, vc)
    return kpool, vpool, mx.array(table), index, kc, vc, total


def baselines(q, kpool, vpool, index, kc, vc, scale: float, mask, sinks=None):
    """The two references a paged kernel is timed against: SDPA on the contiguous K/V
    (``kc``/``vc``), and gathering the pages (``index``) for SDPA."""
    def sdpa():
        return mx.fast.scaled_dot_product_attention(q, kc, vc, scale=scale, mask=mask, sinks=sinks)

    def gather():
        k = mx.take(kpool, index, axis=0).reshape(kc.shape)
        v = mx.take(vpool, index, axis=0).reshape(vc.shape)
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)

    return sdpa, gather


def attention(args) -> None:
    rng = np.random.default_rng(0)
    copy_tbs = copy_bandwidth()
    say(f"device-to-device copy: {copy_tbs:.2f} TB/s (read + write)")
    say(f"{'B':>4}{'L':>7}{'kernel us':>11}{'SDPA us':>10}{'gather+SDPA us':>16}"
        f"{'kern/SDPA':>11}{'gather/SDPA':>13}{'KV TB/s':>9}")
    batches = (1, 8, 32, 64, 128)
    lens = (1024, 4096, 16384, 32768)
    if args.quick:
        batches, lens = (1, 32, 64), (4096, 16384)
    cases = [(b, [L] * b, f"{L}") for b in batches for L in lens]
    cases += [(b, rng.integers(256, 8193, b).tolist(), "ragged") for b in (8, 32, 64, 128)]
    if args.focus:  # the configurations the targets name
        cases = [(b, [4096] * b, "4096") for b in (8, 32, 64)] + [(64, rng.integers(256, 8193, 64).tolist(), "ragged")]
    scale = D ** -0.5
    sinks = mx.random.normal((HQ,)).astype(mx.float16) + 4 if args.sinks else None
    if args.sinks:
        say("attention sinks: every contender")
    for b, lengths, label in cases:
        if b * max(lengths) * HKV * D >= 2**31:  # MLX's take (the fallback) indexes with int32
            say(f"{b:>4}{label:>7}   skipped: {b * max(lengths) * HKV * D} elements per K copy >= 2^31")
            continue
        kpool, vpool, table, index, kc, vc, total = setup(lengths, rng)
        q = mx.random.normal((b, HQ, 1, D)).astype(mx.float16)
        lens_a = mx.array(lengths, dtype=mx.int32)
        starts = mx.zeros((b,), dtype=mx.int32)
        L = kc.shape[2]
        mask = None
        if len(set(lengths)) > 1:
            mask = (mx.arange(L)[None, :] < lens_a[:, None])[:, None, None, :]

        def kernel():
            return paged_decode.paged_decode(q, kpool, vpool, table, lens_a, starts, scale,
                                             rows_per_head=total, page_size=PS, sinks=sinks)

        sdpa, gather = baselines(q, kpool, vpool, index, kc, vc, scale, mask, sinks)
        err = (mx.abs(kernel().astype(mx.float32) - sdpa().astype(mx.float32)).max()).item()
        tk, ts, tg = bench(kernel), bench(sdpa), bench(gather, iters=3)
        kv_bytes = sum(lengths) * HKV * D * 2 * 2
        say(f"{b:>4}{label:>7}{tk * 1e6:>11.1f}{ts * 1e6:>10.1f}{tg * 1e6:>16.1f}"
            f"{tk / ts:>11.2f}{tg / ts:>13.2f}{kv_bytes / tk / 1e12:>9.2f}   max|kern-sdpa| {err:.1e}")
        mx.clear_cache()


def prefill(args) -> None:
    """Prefill and chunked prefill: L new queries per row at the end of each row's
    context, causal. The paged prefill kernel against SDPA on the same K/V held
    contiguously (the floor a paged reader aims at) and gather + SDPA (what pagedkv ran
    before the kernel)."""
    rng = np.random.default_rng(1)
    say("prefill attention, fp16, 32 query heads, 8 KV heads, causal; TFLOP/s counts the visible scores")
    say(f"{'D':>4}{'B':>4}{'context':>9}{'new':>6}{'kernel us':>11}{'SDPA us':>10}{'gather+SDPA us':>16}"
        f"{'kern/SDPA':>11}{'gather/kern':>13}{'TFLOP/s':>9}")
    cases = [(1, 1024, 1024), (1, 4096, 4096), (4, 4096, 4096), (1, 16384, 16384), (1, 16384, 512),
             (1, 16384, 128), (1, 16384, 16), (8, 8192, 256), (32, 4096, 128), (8, "ragged", 512)]
    if args.quick:
        cases = [(1, 4096, 4096), (1, 16384, 512), (1, 16384, 128), (1, 16384, 16), (8, "ragged", 512)]
    for d in (64, 128):
        scale = d ** -0.5
        for b, ctx, lq in cases:
            lengths = rng.integers(lq, 8193, b).tolist() if ctx == "ragged" else [ctx] * b
            kpool, vpool, table, index, kc, vc, total = setup(lengths, rng, d)
            q = mx.random.normal((b, HQ, lq, d)).astype(mx.float16)
            lens_a = mx.array(lengths, dtype=mx.int32)
            starts = mx.zeros((b,), dtype=mx.int32)
            L = kc.shape[2]
            # query i of row b sits at lengths[b] - lq + i and sees keys up to it
            pos = lens_a[:, None, None, None] - lq + mx.arange(lq)[None, None, :, None]
            mask = "causal" if ctx != "ragged" else mx.arange(L)[None, None, None, :] <= pos

            def kernel(tiling=None):
                return paged_prefill.paged_prefill(q, kpool, vpool, table, lens_a, starts, scale,
                                                   rows_per_head=total, page_size=PS, tiling=tiling)

            sdpa, gather = baselines(q, kpool, vpool, index, kc, vc, scale, mask)
            err = (mx.abs(kernel().astype(mx.float32) - sdpa().astype(mx.float32)).max()).item()
            tk, ts, tg = bench(kernel, iters=3), bench(sdpa, iters=3), bench(gather, iters=3)
            scores = sum(lq * n - lq * (lq - 1) // 2 for n in lengths) * HQ
            say(f"{d:>4}{b:>4}{str(ctx):>9}{lq:>6}{tk * 1e6:>11.1f}{ts * 1e6:>10.1f}{tg * 1e6:>16.1f}"
                f"{tk / ts:>11.2f}{tg / tk:>13.2f}{4 * scores * d / tk / 1e12:>9.1f}   max|kern-sdpa| {err:.1e}")
            for tiling in args.tilings:
                say(f"{'':>36}{paged_prefill.Tiling(*tiling)}: "
                    f"{bench(lambda: kernel(paged_prefill.Tiling(*tiling)), iters=3) * 1e6:.1f} us")
            mx.clear_cache()


def writes(args) -> None:
    say("")
    say("token write into one layer's K array (one token, 8 KV heads, D=128, fp16)")
    say(f"{'pool GiB':>9}{'plain us':>10}{'peak +MiB':>11}{'sync us':>9}{'peak +MiB':>11}"
        f"{'chunked us':>12}{'peak +MiB':>11}")
    sizes = (0.5, 1, 2, 4) if not args.quick else (0.5, 4)
    tok = mx.random.normal((HKV, 1, D)).astype(mx.float16)
    slots = mx.array([3], dtype=mx.int32)
    chunk_rows = (64 << 20) // (PS * D * 2)
    for gib in sizes:
        rows_total = int(gib * (1 << 30)) // (PS * D * 2)
        res = []
        for mode in ("plain", "sync", "chunked"):
            mx.clear_cache()
            if mode == "chunked":
                arrays = [mx.zeros((chunk_rows, PS, D), mx.float16) for _ in range(rows_total // chunk_rows)]
            else:
                arrays = [mx.zeros((rows_total, PS, D), mx.float16)]
            mx.eval(arrays)
            base = memory_baseline()
            n = 50
            t = time.perf_counter()
            for i in range(n):
                page = (i * 7919) % (rows_total // HKV)
                rows_np = np.arange(HKV) * (rows_total // HKV) + page
                if mode == "chunked":
                    c = int(rows_np[0]) // chunk_rows  # same chunk for this demo's rows
                    r = mx.array((rows_np % chunk_rows).astype(np.int32))[:, None]
                    arrays[c][r, slots] = tok
                    mx.eval(arrays[c])
                else:
                    if mode == "sync":
                        mx.synchronize()
                    r = mx.array(rows_np.astype(np.int32))[:, None]
                    arrays[0][r, slots] = tok
                    mx.eval(arrays[0])
            mx.synchronize()
            res.append(((time.perf_counter() - t) / n * 1e6, (mx.get_peak_memory() - base) / 2**20))
            del arrays
        say(f"{gib:>9}{res[0][0]:>10.1f}{res[0][1]:>11.1f}{res[1][0]:>9.1f}{res[1][1]:>11.1f}"
            f"{res[2][0]:>12.1f}{res[2][1]:>11.1f}")


def pool_writes(args) -> None:
    """One-token writes through PagePool (all layers per step), as a decode loop does."""
    from pagedkv import PagedPromptCache, PagePool

    say("")
    say("PagePool.write, one token per layer per step, 4 layers (what pagedkv does)")
    say(f"{'pool GiB/layer':>15}{'us per token-layer':>20}{'peak +MiB':>11}")
    sizes = (0.5, 1, 2, 4) if not args.quick else (0.5, 4)
    base_t = None
    for gib in sizes:
        pages = int(gib * (1 << 30)) // (2 * HKV * PS * D * 2)
        mx.clear_cache()
        pool = PagePool(num_layers=4, num_kv_heads=HKV, head_dim=D, page_size=PS, num_pages=pages,
                        dtype=mx.float16, cache_limit=None)
        caches = PagedPromptCache.of_layers(pool)  # one sequence: its four layers share a table
        tok = mx.random.normal((1, HKV, 1, D)).astype(mx.float16)
        for c in caches:
            mx.eval(c.update_and_fetch(tok, tok))
        base = memory_baseline()
        n = 40
        t = time.perf_counter()
        for _ in range(n):
            outs = [c.update_and_fetch(tok, tok)[0][..., -1:, :] for c in caches]
            mx.eval(outs)
        mx.synchronize()
        per = (time.perf_counter() - t) / (n * 4) * 1e6
        base_t = base_t or per
        say(f"{gib:>15}{per:>20.1f}{(mx.get_peak_memory() - base) / 2**20:>11.1f}")
        del pool, caches
    say(f"write time, largest / smallest pool: {per / base_t:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip-attention", action="store_true")
    ap.add_argument("--skip-writes", action="store_true")
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--tilings", default="", help="prefill kernel tilings to time too, e.g. 2x32,2x64 "
                    "(m16 tiles per warp x keys per stage)")
    ap.add_argument("--focus", action="store_true", help="B=8/32/64 at L=4k and one ragged batch; no writes")
    ap.add_argument("--sinks", action="store_true", help="attention sinks on every contender (decode)")
    args = ap.parse_args()
    args.tilings = [tuple(int(x) for x in t.split("x")) for t in args.tilings.split(",") if t]
    if not paged_decode.available():
        raise SystemExit("needs MLX on a CUDA GPU")
    say(f"mlx {mx.__version__} {mx.default_device()}")
    if not args.skip_attention:
        attention(args)
    if not args.focus and not args.skip_prefill:
        prefill(args)
    if not args.focus and not args.skip_writes:
        writes(args)
        pool_writes(args)
    if args.out:
        Path(args.out).write_text("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
