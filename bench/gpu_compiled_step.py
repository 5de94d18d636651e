"""``CompiledDecode`` (a PagedBatch's decode step under ``mx.compile``) on the GPU.

    python3 bench/gpu_compiled_step.py [--model 1b|8b] [--batches 8,32] [--contexts 1024,4096]
                                       [--lengths equal,ragged] [--steps 32] [--bucket 64] [--pipelined]
                                       [--pool-scale 1]

Issue 15: ``mx.compile`` of the paged decode step, with the figure either way. Same model
(random weights in mlx-lm's llama class, fp16) and rows for every side, in one run:

  mlx-lm     ``BatchKVCache`` (the baseline of bench/gpu_generate.py)
  pagedkv    ``PagedBatch``, eager: the model's graph built in Python every step
  compiled   ``CompiledDecode(model, batch)``: the step's bookkeeping on the host, the
             model traced once per (B, table bucket) and replayed
  floor      the same model with no KV cache at all, compiled: each row attends to its
             one new token only. Every other kernel of the step is the same, so this is
             the fastest step any KV cache could give, and mlx-lm's time over it the
             largest speed-up over mlx-lm that paging could reach at that shape

Printed per case (each side warmed up first; the compiled one with the timed steps
themselves, so no trace falls in the timed ones): decode tokens/s with the host time
per step in brackets (building and queueing the step, bookkeeping included; with
``--pipelined`` the building alone, and the ``mx.async_eval`` that queues it on a line
of its own), the compiled side's traces and, of the timed steps, how many copied their
state to the device (``CompiledDecode.uploads``), its peak memory growth (a pool array
copied instead of written in place would show as a layer's size), and in how many rows
eager and compiled pagedkv end on the same token (both start from the same K/V; fp16
rounding can flip a near-tie).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_generate  # noqa: E402
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from gpu_generate import SHAPES, filled, generate, model_of, run_steps  # noqa: E402

from pagedkv import CompiledDecode  # noqa: E402
from pagedkv.kernels import paged_decode  # noqa: E402


def case(model, lengths: list[int], steps: int, bucket: int, dtype) -> dict:
    rng = np.random.default_rng(1)
    first = mx.array(rng.integers(0, 32000, (len(lengths), 1)).astype(np.int32))
    out = {}
    queued = {}  # --pipelined: median ms of each side's mx.async_eval
    gc.collect()  # (frees what the previous case left in any reference cycle)
    mx.clear_cache()  # (and the buffers it left cached)
    # one side's K/V in memory at a time (the same K/V for each: same seed), so that
    # B=64 at 16k fits one GPU
    for side in ("mlx_lm", "pagedkv"):
        mx.random.seed(5)
        ref, batch = filled(model, lengths, steps + 4, dtype, sides="mlx_lm" if side == "mlx_lm" else "paged")
        caches = ref if side == "mlx_lm" else batch.caches
        generate(model, caches, first, 2)  # warm-up (kernels compile), then back to the start
        for c in caches:
            c.trim(2)
        t, host, toks = generate(model, caches, first, steps)
        out[side], queued[side] = (len(lengths) * steps / t, host), list(gpu_generate.QUEUED)
        if batch is not None:
            eager_toks = toks
            batch.release()
        del ref, batch, caches
        gc.collect()
        mx.clear_cache()
    mx.random.seed(5)
    mx.clear_cache()
    _, twin = filled(model, lengths, steps + 4, dtype, sides="paged")  # the same K/V, for the compiled side
    step = CompiledDecode(model, twin, bucket=bucket)
    # warm-up: the timed steps themselves, then back to the start, so that every trace
    # they need (int32 tokens, then argmax's uint32, at each table width they reach) is
    # made before the clock starts
    run_steps(step, first, steps)
    for c in twin.caches:
        c.trim(steps)
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    uploads = step.uploads
    t, host, toks = run_steps(step, first, steps)
    out["uploads"] = step.uploads - uploads
    out["compiled"], queued["compiled"] = (len(lengths) * steps / t, host), list(gpu_generate.QUEUED)
    out["queued"] = {k: statistics.median(v) * 1e3 for k, v in queued.items() if v}
    out["traces"] = step.traces
    out["growth"] = (mx.get_peak_memory() - base) / 2**20
    out["same"] = f"{sum(a == b for a, b in zip(eager_toks, toks))}/{len(lengths)}"
    twin.release()
    del step, twin
    mx.clear_cache()
    floor = mx.compile(lambda tok: model(tok))  # after the peak was read
    run_steps(floor, first, 2)  # warm-up: trace
    t, host, _ = run_steps(floor, first, steps)
    out["floor"] = (len(lengths) * steps / t, host)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--bucket", type=int, default=64)
    ap.add_argument("--pipelined", action="store_true", help="as gpu_generate.py --pipelined")
    ap.add_argument("--pool-scale", type=int, default=1, help="as gpu_generate.py --pool-scale")
    ap.add_argument("--lengths", default="equal",
                    help="equal and/or ragged (comma-separated): ragged rows hold ctx/8..ctx tokens, "
                         "as in gpu_generate.py")
    args = ap.parse_args()
    gpu_generate.PIPELINED, gpu_generate.POOL_SCALE = args.pipelined, args.pool_scale
    if not paged_decode.available():
        raise SystemExit("needs MLX on a CUDA GPU")
    dtype = mx.float16
    model = model_of(args.model, dtype)
    print(f"mlx {mx.__version__} {mx.default_device()}; {args.model}-shaped llama, float16, {args.steps} greedy "
          f"steps{', pipelined' if args.pipelined else ''}, table bucket {args.bucket} pages; "
          f"tok/s (host ms per step)", flush=True)
    print(f"{'B':>3} {'context':>7} {'lengths':>7} {'mlx-lm':>16} {'pagedkv':>16} {'compiled':>16} "
          f"{'compiled/pagedkv':>17} {'compiled/mlx-lm':>16} {'floor':>16} {'floor/mlx-lm':>13} "
          f"{'traces':>7} {'copies':>7} {'peak +MiB':>10} {'same last token':>16}", flush=True)
    rng = np.random.default_rng(0)
    for ctx in [int(x) for x in args.contexts.split(",") if x]:
        for b in [int(x) for x in args.batches.split(",") if x]:
            for kind in args.lengths.split(","):
                if kind == "ragged" and b == 1:
                    continue
                lengths = [ctx] * b if kind == "equal" else rng.integers(ctx // 8, ctx + 1, b).tolist()
                r = case(model, lengths, args.steps, args.bucket, dtype)
                cells = " ".join(f"{r[k][0]:>8.0f} ({r[k][1] * 1e3:>4.2f})" for k in ("mlx_lm", "pagedkv", "compiled"))
                print(f"{b:>3} {ctx:>7} {kind:>7} {cells} {r['compiled'][0] / r['pagedkv'][0]:>16.2f}x "
                      f"{r['compiled'][0] / r['mlx_lm'][0]:>15.2f}x {r['floor'][0]:>8.0f} ({r['floor'][1] * 1e3:>4.2f}) "
                      f"{r['floor'][0] / r['mlx_lm'][0]:>12.2f}x {r['traces']:>7} {r['uploads']:>7} {r['growth']:>10.0f} "
                      f"{r['same']:>16}", flush=True)
                if r["queued"]:
                    print("      mx.async_eval ms per step (not in the host time): "
                          + ", ".join(f"{k} {v:.2f}" for k, v in r["queued"].items()), flush=True)


if __name__ == "__main__":
    main()
