"""Token writes on a GPU: the in-place write kernel against MLX's scatter, in one run.

    python3 bench/gpu_page_write.py [--batches 1,32] [--contexts 1024,4096] [--tokens 4096,16384]

Needs MLX on a CUDA GPU. Three parts, each pool built twice, ``write_kernel=True`` (the
default on a GPU: ``pagedkv.kernels.page_write``) and ``write_kernel=False`` (MLX's
``a[rows, slots] = v``, the path before it):

1. Exactness: random token writes into fp16, bf16, float32 and 4-bit (``AffineQuant``)
   pools by both paths give bit-identical arrays.
2. Batched decode of a Llama-3.2-1B-shaped model (``bench/gpu_generate.py``'s
   ``decode_case``: mlx-lm's ``BatchKVCache`` and a ``PagedBatch`` with the same random
   K/V, greedy steps): tokens/s of each write path, and over mlx-lm's; host share of a
   step; MLX's peak memory above what was allocated before the paged run.
3. A Gemma-3-shaped model (``bench/sliding_memory.py``'s: 10 sliding layers of window
   512 + 2 full, bf16) prefilling P tokens and decoding 16, on a pool of a layer per
   model layer and on a grouped pool (``kv_pool_layers(model)`` layers, so one forward
   writes each pool array 5-6 times): decode ms per token and peak memory above the
   start of the decode, and the same greedy tokens as mlx-lm's caches (checked).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_generate  # noqa: E402
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from sliding_memory import DECODE, GEMMA3_SHAPE, PAGE  # noqa: E402

from pagedkv import AffineQuant, PagePool, kv_pool_layers, make_paged_cache  # noqa: E402
from pagedkv.generation import prefill  # noqa: E402
from pagedkv.kernels import page_write  # noqa: E402

PATHS = (("kernel", True), ("scatter", False))


def exactness() -> None:
    for dtype, codec in ((mx.float16, None), (mx.bfloat16, None), (mx.float32, None), (mx.float16, AffineQuant(4, 32))):
        pools = {}
        for name, kernel in PATHS:
            pool = pools[name] = PagePool(num_layers=2, num_kv_heads=4, head_dim=128, page_size=16, num_pages=64,
                                          dtype=dtype, k_codec=codec, write_kernel=kernel)
            r2 = np.random.default_rng(1)
            for step in range(20):
                t = int(r2.integers(1, 40))
                flat = r2.choice(4 * 64 * 16, 4 * t, replace=False).reshape(4, t)  # distinct (row, slot)s
                rows, slots = mx.array((flat // 16).astype(np.int32)), mx.array((flat % 16).astype(np.int32))
                keys = mx.array(r2.standard_normal((4, t, 128)).astype(np.float32)).astype(dtype)
                values = mx.array(r2.standard_normal((4, t, 128)).astype(np.float32)).astype(dtype)
                pool.write(step % 2, rows, slots, keys, values)
            mx.eval([pool.written(layer) for layer in range(2)])  # (storage is read directly below)
        same = all(
            np.array_equal(np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a),
                           np.array(b.view(mx.uint16) if b.dtype == mx.bfloat16 else b))
            for layer in range(2) for a, b in zip(pools["kernel"].storage(layer), pools["scatter"].storage(layer)))
        print(f"exact: {dtype}, {'4-bit K' if codec else 'full precision'}: kernel == scatter: {same}", flush=True)
        assert same


def batched_decode(batches: list[int], contexts: list[int], steps: int) -> None:
    dtype = mx.float16
    model = gpu_generate.model_of("1b", dtype)
    print(f"\n1b-shaped llama, float16, {steps} greedy steps; tok/s (over mlx-lm's), host share, peak +MiB")
    print(f"{'B':>3} {'ctx':>6} {'lengths':>7} {'kernel':>24} {'scatter':>24} {'kernel/scatter':>15}", flush=True)
    rng = np.random.default_rng(0)
    for ctx in contexts:
        for b in batches:
            for kind in ("equal", "ragged"):
                if kind == "ragged" and b == 1:
                    continue
                lengths = [ctx] * b if kind == "equal" else rng.integers(ctx // 8, ctx + 1, b).tolist()
                r = {}
                for name, kernel in PATHS + PATHS[:1]:  # kernel, scatter, kernel again (the first warms up)
                    gpu_generate.WRITE_KERNEL = kernel
                    r[name] = gpu_generate.decode_case(model, lengths, steps, dtype)

                def cell(x: dict) -> str:
                    return f"{x['paged']:>8.0f} ({x['paged'] / x['mlx_lm']:.2f}x) {x['host']:>4.0%} {x['growth']:>5.0f}"

                print(f"{b:>3} {ctx:>6} {kind:>7} {cell(r['kernel']):>24} {cell(r['scatter']):>24} "
                      f"{r['kernel']['paged'] / r['scatter']['paged']:>14.2f}x", flush=True)
    gpu_generate.WRITE_KERNEL = None


def gemma_decode(model, cache, prompt: list[int]) -> tuple[list[int], float, float]:
    """(greedy tokens, decode seconds per token, peak MiB above the start of the decode)."""
    prefill(model, cache, prompt[:-1], 512)
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    out, nxt = [], prompt[-1]
    t = time.perf_counter()
    for _ in range(DECODE):
        nxt = int(mx.argmax(model(mx.array([[nxt]]), cache=cache)[0, -1]).item())
        out.append(nxt)
    return out, (time.perf_counter() - t) / DECODE, (mx.get_peak_memory() - base) / 2**20


def sliding(tokens: list[int]) -> None:
    from mlx_lm.models import gemma3_text
    from mlx_lm.models.cache import make_prompt_cache

    mx.random.seed(0)
    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(GEMMA3_SHAPE))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    c = GEMMA3_SHAPE
    print(f"\ngemma3_text shape, bfloat16, one sequence: decode ms/token, peak +MiB during the decode; "
          f"pool of {kv_pool_layers(model)} layers (grouped) or {c['num_hidden_layers']} (a layer per layer)")
    print(f"{'P':>6} {'pool':>10} {'kernel':>16} {'scatter':>16} {'kernel/scatter':>15} {'tokens = mlx-lm':>16}",
          flush=True)
    for n in tokens:
        prompt = [(i * 7919) % 4000 + 1 for i in range(n)]
        for _ in range(2):  # the second run counts (the first compiles kernels)
            want, ref_s, _ = gemma_decode(model, make_prompt_cache(model), prompt)
        for name, layers in (("grouped", kv_pool_layers(model)), ("per-layer", c["num_hidden_layers"])):
            r, same = {}, True
            for path, kernel in PATHS + PATHS:  # each twice: the second run counts
                pool = PagePool(num_layers=layers, num_kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"],
                                page_size=PAGE, num_pages=(n + DECODE) // PAGE + 512, dtype=mx.bfloat16,
                                write_kernel=kernel)
                with make_paged_cache(model, pool) as cache:
                    got, s, peak = gemma_decode(model, cache, prompt)
                r[path] = (s, peak)
                same = same and got == want
                del pool
                mx.clear_cache()
            print(f"{n:>6} {name:>10} {r['kernel'][0] * 1e3:>7.2f} {r['kernel'][1]:>7.0f} "
                  f"{r['scatter'][0] * 1e3:>7.2f} {r['scatter'][1]:>7.0f} {r['scatter'][0] / r['kernel'][0]:>14.2f}x "
                  f"{str(same):>16}", flush=True)
        print(f"{n:>6} {'mlx-lm':>10} {ref_s * 1e3:>7.2f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--tokens", default="4096,16384")
    args = ap.parse_args()
    if not page_write.available():
        sys.exit("needs MLX on a CUDA GPU")
    print(f"mlx {mx.__version__} {mx.default_device()}", flush=True)
    exactness()
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    batched_decode(ints(args.batches), ints(args.contexts), args.steps)
    sliding(ints(args.tokens))


if __name__ == "__main__":
    main()
