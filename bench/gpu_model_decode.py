"""A whole model's batched decode step on a GPU: does the kernel serve the model?

    python3 bench/gpu_model_decode.py [--batch 32] [--context 4096] [--quick]

Model: Llama-3.2-1B-shaped, random weights, fp16 (16 layers, hidden 2048, 32 query heads,
8 KV heads, head_dim 64). Caches are filled with random K/V (a prefill would only add
time), then decode steps are timed, interleaved, in one process:

  mlx-lm     ``BatchKVCache`` (rows left-padded to the longest), mlx-lm's attention
  paged      ``PagedBatch`` with the model's attention routed to the pages
             (``route_attention``: the CUDA decode kernel on a GPU)
  gathered   the same ``PagedBatch`` with routing off: mlx-lm's SDPA on the K/V that
             ``update_and_fetch`` gathers from the pages (the path before the row-set engine)

for equal lengths and for ragged ones (uniform in [context/8, context]). On a CPU the
kernel does not apply and "paged" equals "gathered".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models import llama  # noqa: E402
from mlx_lm.models.cache import BatchKVCache  # noqa: E402
from timing import fixed_context_step, time_interleaved  # noqa: E402

from pagedkv import PagedBatch, PagePool, make_paged_cache  # noqa: E402
from pagedkv.cache import LayerFace  # noqa: E402

CFG = dict(model_type="llama", hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
           num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
           vocab_size=32000, rope_theta=500000.0, tie_word_embeddings=True)
LAYERS, HKV, D, PS = 16, 8, 64, 16


def model_of() -> llama.Model:
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(CFG))
    model.set_dtype(mx.float16)
    mx.eval(model.parameters())
    return model


def filled(model, lengths: list[int]):
    longest = max(lengths)
    ref = [BatchKVCache([longest - n for n in lengths]) for _ in range(LAYERS)]
    pool = PagePool(num_layers=LAYERS, num_kv_heads=HKV, head_dim=D, page_size=PS, dtype=mx.float16,
                    num_pages=sum(-(-(n + 8) // PS) for n in lengths) + 1)
    batch = PagedBatch.for_model(model, pool)
    rows = [make_paged_cache(model, pool) for _ in lengths]
    for layer in range(LAYERS):
        k = mx.random.normal((len(lengths), HKV, longest, D)).astype(mx.float16)
        v = mx.random.normal((len(lengths), HKV, longest, D)).astype(mx.float16)
        mx.eval(ref[layer].update_and_fetch(k, v))
        for b, (row, n) in enumerate(zip(rows, lengths)):  # each row's own tokens, no padding
            mx.eval(row[layer].update_and_fetch(k[b : b + 1, :, longest - n :], v[b : b + 1, :, longest - n :]))
    for row in rows:
        batch.extend(row)
    return ref, batch


def routed(flag: bool):
    def step(model, token, caches):
        LayerFace.reads_pages = flag
        try:
            return fixed_context_step(model, token, caches)
        finally:
            LayerFace.reads_pages = True

    return step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    print(f"mlx {mx.__version__} {mx.default_device()}; B={args.batch}, context {args.context}, fp16")
    model = model_of()
    rng = np.random.default_rng(0)
    token = mx.array(rng.integers(0, 1000, (args.batch, 1)).astype(np.int32))
    print(f"{'lengths':>8} {'mlx-lm ms':>10} {'paged ms':>9} {'gathered ms':>12} {'paged/mlx-lm':>13} "
          f"{'gathered/mlx-lm':>16}")
    for name in ("equal", "ragged"):
        lengths = [args.context] * args.batch if name == "equal" else \
            rng.integers(args.context // 8, args.context + 1, args.batch).tolist()
        ref, batch = filled(model, lengths)
        t = time_interleaved({
            "mlx-lm": lambda: fixed_context_step(model, token, ref),
            "paged": lambda: routed(True)(model, token, batch.caches),
            "gathered": lambda: routed(False)(model, token, batch.caches),
        }, repeats=5 if args.quick else 15, inner=2)
        print(f"{name:>8} {t['mlx-lm'] * 1e3:>10.2f} {t['paged'] * 1e3:>9.2f} {t['gathered'] * 1e3:>12.2f} "
              f"{t['paged'] / t['mlx-lm']:>13.3f} {t['gathered'] / t['mlx-lm']:>16.3f}")
        batch.release()
        ref = None  # free its K/V before the next case
        mx.clear_cache()


if __name__ == "__main__":
    main()
