"""Decode step time: PagedKVCache vs mlx-lm's KVCache, same model, same run.

    python bench/decode.py [--quick]

Model: random-weight llama, 8 layers, hidden 1024, 16 heads, 4 KV heads (head_dim 64),
float32. Caches are filled with the same random K/V to each context length (a prefill
through the model would only add time), then decode steps are timed alternately.

Also prints the attention-only ratio at each context: one layer's paged
``update_and_fetch`` + SDPA vs ``mx.fast.scaled_dot_product_attention`` on the same K/V
held contiguously. Last line: whole-step paged/contiguous ratio at 4096.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402
from mlx_lm.utils import _get_classes  # noqa: E402
from timing import fixed_context_step, time_interleaved  # noqa: E402

from pagedkv import PagePool, make_paged_cache  # noqa: E402

CFG = {
    "model_type": "llama", "hidden_size": 1024, "num_hidden_layers": 8, "intermediate_size": 2816,
    "num_attention_heads": 16, "num_key_value_heads": 4, "rms_norm_eps": 1e-5, "vocab_size": 4096,
    "rope_theta": 10000.0, "tie_word_embeddings": False,
}
LAYERS, KV_HEADS, HEAD_DIM, Q_HEADS = 8, 4, 64, 16


def random_model():
    """bench's model: CFG with random weights (seed 0), evaluated."""
    model_cls, args_cls = _get_classes(CFG)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(CFG))
    mx.eval(model.parameters())
    return model


def filled_caches(model, pool, ctx):
    ref = [KVCache() for _ in range(LAYERS)]
    paged = make_paged_cache(model, pool)
    for layer in range(LAYERS):
        k = mx.random.normal((1, KV_HEADS, ctx, HEAD_DIM))
        v = mx.random.normal((1, KV_HEADS, ctx, HEAD_DIM))
        mx.eval(ref[layer].update_and_fetch(k, v), paged[layer].update_and_fetch(k, v))
    return ref, paged


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    repeats = 5 if args.quick else 15
    steps = 4 if args.quick else 8
    model = random_model()
    tok = mx.array([[7]])
    whole = {}
    print(f"{'context':>8}{'KVCache ms':>12}{'paged ms':>10}{'step x':>8}{'sdpa ms':>10}{'paged attn ms':>15}{'attn x':>8}")
    for ctx in (512, 4096):
        pool = PagePool(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, page_size=16,
                        num_pages=(ctx + 64 * steps * (repeats + 4)) // 16 + 16, dtype=mx.float32)
        ref, paged = filled_caches(model, pool, ctx)

        t = time_interleaved({"ref": lambda: fixed_context_step(model, tok, ref),
                              "paged": lambda: fixed_context_step(model, tok, paged)}, repeats, inner=steps)
        # Attention only, one layer: contiguous SDPA vs paged write+gather+SDPA.
        q = mx.random.normal((1, Q_HEADS, 1, HEAD_DIM))
        k1 = mx.random.normal((1, KV_HEADS, 1, HEAD_DIM))
        kc, vc = ref[0].state[0][..., :ctx, :], ref[0].state[1][..., :ctx, :]
        mx.eval(kc, vc)
        scale = HEAD_DIM ** -0.5

        def contiguous():
            return mx.fast.scaled_dot_product_attention(q, kc, vc, scale=scale)

        def paged_attn():
            k, v = paged[0].update_and_fetch(k1, k1)
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)
            paged[0].trim(1)
            return out

        a = time_interleaved({"sdpa": contiguous, "paged": paged_attn}, repeats * 4, inner=steps * 4)
        whole[ctx] = t["paged"] / t["ref"]
        print(f"{ctx:>8}{t['ref'] * 1e3:>12.2f}{t['paged'] * 1e3:>10.2f}{whole[ctx]:>8.3f}"
              f"{a['sdpa'] * 1e3:>10.3f}{a['paged'] * 1e3:>15.3f}{a['paged'] / a['sdpa']:>8.3f}")
        paged.release()
    print(f"whole decode step at 4096, paged/contiguous: {whole[4096]:.3f}x")


if __name__ == "__main__":
    main()
