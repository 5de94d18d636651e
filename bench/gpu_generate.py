"""Whole-model generation on a GPU: mlx-lm's caches vs pagedkv, tokens per second.

    python3 bench/gpu_generate.py [--model 1b|8b] [--dtype float16|bfloat16]
                                  [--batches 1,8,32,64] [--contexts 1024,4096] [--steps 32]
                                  [--pipelined] [--sync] [--pool-scale 1] [--prefill 1024,4096,16384]
                                  [--gather-prefill] [--scatter-writes]

Model: random weights in mlx-lm's llama class, Llama-3.2-1B-shaped (16 layers, 32 query /
8 KV heads, head_dim 64) or Llama-3-8B-shaped (32 layers, 32 / 8 heads, head_dim 128).

Decode (for each B and context, equal and ragged lengths): both sides start from caches
holding the same random K/V (as bench/gpu_model_decode.py), then generate ``--steps``
tokens greedily, each step's token fed back, the context growing:
  mlx-lm   ``BatchKVCache`` (rows left-padded to the longest)
  paged    ``PagedBatch`` with attention routed to the pages (the CUDA decode kernel)
Printed: decode tokens/s of each and the ratio; for paged, the host time of a step
(building the graph: Python, pagedkv bookkeeping, MLX graph) as a share of the step, and
how far MLX's peak memory rose above what was allocated before its run (a scatter that
copied a layer array instead of writing in place would show here). Greedy tokens are
not compared: with random fp16 weights, near-tied logits flip between two correct
attention implementations (tests/test_gpu_kernel.py checks the kernel against SDPA).

Prefill (B = 1, each context): one prompt through ``make_prompt_cache`` (mlx-lm's
``KVCache``) and through ``make_paged_cache``, in chunks of 2048 tokens, to the first
token; prompt tokens/s. Peak memory is MLX's peak for each side's run. Paged prefill
reads the pages through the CUDA prefill kernel; ``--gather-prefill`` gathers them for
SDPA instead (the path before the kernel), for comparison.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models import llama  # noqa: E402
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache  # noqa: E402

from pagedkv import PagedBatch, PagePool, make_paged_cache  # noqa: E402
from pagedkv.generation import prefill  # noqa: E402
from pagedkv.kernels import paged_prefill  # noqa: E402

SHAPES = {
    "1b": dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, rope_theta=500000.0),
    "8b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, rope_theta=500000.0),
    # for a CPU: the machinery, not the GPU's arithmetic
    "tiny": dict(hidden_size=256, num_hidden_layers=4, intermediate_size=512, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=32, rope_theta=10000.0),
}
PS = 16


def random_model(module, cfg: dict, dtype):
    """``module.Model`` (an mlx-lm model module) built from ``cfg`` with random weights
    of ``dtype`` (seed 0, so every side and run gets the same weights), evaluated."""
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(cfg))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def model_of(shape: str, dtype) -> llama.Model:
    cfg = dict(model_type="llama", rms_norm_eps=1e-5, vocab_size=32000, tie_word_embeddings=True, **SHAPES[shape])
    return random_model(llama, cfg, dtype)


def filled(model, lengths: list[int], steps: int, dtype, sides: str = "both"):
    """mlx-lm's ``BatchKVCache`` and a ``PagedBatch`` holding the same random K/V for
    rows of ``lengths`` (room for ``steps`` more tokens each). ``sides``: "both",
    "mlx_lm" or "paged": the side not built is None, so the largest cases can hold one
    side at a time; the K/V drawn are the same whichever sides are built."""
    a = model.args
    layers, hkv, d = a.num_hidden_layers, a.num_key_value_heads, a.head_dim
    longest = max(lengths)
    ref = [BatchKVCache([longest - n for n in lengths]) for _ in range(layers)] if sides != "paged" else None
    if sides == "mlx_lm":
        for layer in range(layers):
            k = mx.random.normal((len(lengths), hkv, longest, d)).astype(dtype)
            v = mx.random.normal((len(lengths), hkv, longest, d)).astype(dtype)
            mx.eval(ref[layer].update_and_fetch(k, v))
        return ref, None
    pool = PagePool(num_layers=layers, num_kv_heads=hkv, head_dim=d, page_size=PS, dtype=dtype,
                    num_pages=POOL_SCALE * sum(-(-(n + steps + 1) // PS) for n in lengths) + 1,
                    sync_before_rewrite=SYNC, write_kernel=WRITE_KERNEL)
    batch = PagedBatch.for_model(model, pool)
    rows = [make_paged_cache(model, pool) for _ in lengths]
    for layer in range(layers):
        k = mx.random.normal((len(lengths), hkv, longest, d)).astype(dtype)
        v = mx.random.normal((len(lengths), hkv, longest, d)).astype(dtype)
        if ref is not None:
            mx.eval(ref[layer].update_and_fetch(k, v))
        for b, (row, n) in enumerate(zip(rows, lengths)):
            mx.eval(row[layer].update_and_fetch(k[b : b + 1, :, longest - n :], v[b : b + 1, :, longest - n :]))
    for row in rows:
        batch.extend(row)
    return ref, batch


PIPELINED = False  # --pipelined
SYNC = False  # --sync
WRITE_KERNEL: bool | None = None  # --scatter-writes: False (pools write by MLX's scatter, not the write kernel)
POOL_SCALE = 1  # --pool-scale: a pool this many times what the rows need (a copied layer shows in the peak)
QUEUED: list[float] = []  # --pipelined: seconds each step's mx.async_eval took (apart from the host time)


def generate(model, caches, first: mx.array, steps: int) -> tuple[float, float, list[int]]:
    """``run_steps`` of ``model`` over ``caches``."""
    return run_steps(lambda tok: model(tok, cache=caches), first, steps)


def run_steps(forward, first: mx.array, steps: int) -> tuple[float, float, list[int]]:
    """``steps`` greedy steps of ``forward`` (tokens [B, 1] -> logits [B, 1, vocab]):
    (seconds, median host seconds per step, last tokens).

    Default: each step's graph is built, then evaluated. ``PIPELINED``: as mlx-lm's
    ``generate_step``, step n+1's graph is built (and queued with ``mx.async_eval``)
    while step n runs on the GPU, and the host then reads step n's tokens; the host time
    is then the building alone, and the ``mx.async_eval`` that queues it goes to ``QUEUED``."""
    tok = first
    host = []
    mx.synchronize()
    t0 = time.perf_counter()
    if PIPELINED:
        tok = mx.argmax(forward(tok)[:, -1], axis=-1)[:, None]
        mx.async_eval(tok)
        QUEUED.clear()
        for _ in range(steps - 1):
            t = time.perf_counter()
            nxt = mx.argmax(forward(tok)[:, -1], axis=-1)[:, None]
            built = time.perf_counter()
            mx.async_eval(nxt)
            host.append(built - t)
            QUEUED.append(time.perf_counter() - built)
            tok.tolist()  # the server reads step n's tokens while step n + 1 runs
            tok = nxt
        mx.eval(tok)
    else:
        for _ in range(steps):
            t = time.perf_counter()
            tok = mx.argmax(forward(tok)[:, -1], axis=-1)[:, None]
            host.append(time.perf_counter() - t)
            mx.eval(tok)
    mx.synchronize()
    return time.perf_counter() - t0, statistics.median(host), tok[:, 0].tolist()


def decode_case(model, lengths, steps, dtype) -> dict:
    rng = np.random.default_rng(1)
    first = mx.array(rng.integers(0, 32000, (len(lengths), 1)).astype(np.int32))
    out = {}
    mx.clear_cache()
    mx.reset_peak_memory()
    ref, batch = filled(model, lengths, steps, dtype)
    for caches in (batch.caches, ref):  # warm-up (kernels compile), then back to the start
        generate(model, caches, first, 2)
        for c in caches:
            c.trim(2)
    s_ref, _, _ = generate(model, ref, first, steps)
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    s_paged, host, _ = generate(model, batch.caches, first, steps)
    out.update(mlx_lm=len(lengths) * steps / s_ref, paged=len(lengths) * steps / s_paged,
               host=host / (s_paged / steps), growth=(mx.get_peak_memory() - base) / 2**20)
    batch.release()
    del ref
    mx.clear_cache()
    return out


def prefill_case(model, n: int, dtype) -> dict:
    a = model.args
    tokens = np.random.default_rng(2).integers(0, 32000, n + 1).tolist()
    out = {}
    for side in ("mlx_lm", "paged"):
        mx.clear_cache()
        mx.reset_peak_memory()
        if side == "paged":
            pool = PagePool(num_layers=a.num_hidden_layers, num_kv_heads=a.num_key_value_heads, head_dim=a.head_dim,
                            page_size=PS, dtype=dtype, num_pages=-(-(n + 1) // PS) + 1,
                            write_kernel=WRITE_KERNEL)
            cache = make_paged_cache(model, pool)
        else:
            cache = make_prompt_cache(model)
        mx.synchronize()
        t = time.perf_counter()
        prefill(model, cache, tokens[:-1], 2048)
        tok = mx.argmax(model(mx.array(tokens[-1:])[None], cache=cache)[0, -1])
        mx.eval(tok)
        out[side] = n / (time.perf_counter() - t)
        out[side + "_peak"] = mx.get_peak_memory()
        out[side + "_tok"] = int(tok.item())
        if side == "paged":
            cache.release()
        del cache
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--prefill", default="1024,4096,16384", help="B=1 prefill lengths ('' for none)")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--pipelined", action="store_true",
                    help="build step n+1 while step n runs (mx.async_eval, as mlx-lm's generate_step)")
    ap.add_argument("--sync", action="store_true",
                    help="pools synchronise once per step before in-place writes (the former default)")
    ap.add_argument("--pool-scale", type=int, default=1,
                    help="size the pool this many times what the rows need (a copy of a layer array then "
                         "shows plainly in the peak column)")
    ap.add_argument("--scatter-writes", action="store_true",
                    help="pools write tokens by MLX's scatter instead of the in-place write kernel (the former path)")
    ap.add_argument("--gather-prefill", action="store_true",
                    help="prefill gathers the pages for SDPA instead of the paged prefill kernel (the former path)")
    args = ap.parse_args()
    if args.gather_prefill:
        paged_prefill.fits = lambda *a: False
    global PIPELINED, SYNC, POOL_SCALE, WRITE_KERNEL
    PIPELINED, SYNC, POOL_SCALE = args.pipelined, args.sync, args.pool_scale
    WRITE_KERNEL = False if args.scatter_writes else None
    dtype = getattr(mx, args.dtype)
    model = model_of(args.model, dtype)
    print(f"mlx {mx.__version__} {mx.default_device()}; {args.model}-shaped llama, {args.dtype}, "
          f"{args.steps} greedy decode steps per case{', pipelined' if PIPELINED else ''}"
          f"{', pools synchronising once per step' if SYNC else ''}", flush=True)
    print(f"{'B':>3} {'context':>7} {'lengths':>7} {'mlx-lm tok/s':>13} {'paged tok/s':>12} {'paged/mlx-lm':>13} "
          f"{'host share':>11} {'paged peak +MiB':>16}", flush=True)
    rng = np.random.default_rng(0)
    for ctx in [int(x) for x in args.contexts.split(",") if x]:
        for b in [int(x) for x in args.batches.split(",") if x]:
            for kind in ("equal", "ragged"):
                if kind == "ragged" and b == 1:
                    continue
                lengths = [ctx] * b if kind == "equal" else rng.integers(ctx // 8, ctx + 1, b).tolist()
                r = decode_case(model, lengths, args.steps, dtype)
                print(f"{b:>3} {ctx:>7} {kind:>7} {r['mlx_lm']:>13.1f} {r['paged']:>12.1f} "
                      f"{r['paged'] / r['mlx_lm']:>12.2f}x {r['host']:>10.0%} {r['growth']:>16.1f}", flush=True)
    if args.prefill:
        print(f"\n{'prefill N':>9} {'mlx-lm tok/s':>13} {'paged tok/s':>12} {'paged/mlx-lm':>13} "
              f"{'mlx-lm peak GiB':>16} {'paged peak GiB':>15} {'same token':>11}", flush=True)
        prefill_case(model, 2048 + 16, dtype)  # warm-up: both sides' kernels compile outside the figures
        for n in [int(x) for x in args.prefill.split(",")]:
            r = prefill_case(model, n, dtype)
            print(f"{n:>9} {r['mlx_lm']:>13.0f} {r['paged']:>12.0f} {r['paged'] / r['mlx_lm']:>12.2f}x "
                  f"{r['mlx_lm_peak'] / 2**30:>16.2f} {r['paged_peak'] / 2**30:>15.2f} "
                  f"{str(r['mlx_lm_tok'] == r['paged_tok']):>11}", flush=True)


if __name__ == "__main__":
    main()
