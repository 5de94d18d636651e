"""Prefix hits on a sliding-window model: time to first token and the pages a hit holds.

    python bench/sliding_prefix.py                       # CPU: P = 1024, 2048
    python bench/sliding_prefix.py --tokens 4096,16384   # (a GPU)

A Gemma-3-shaped model (mlx-lm's ``gemma3_text`` class, random weights, 6 layers: 5
with a sliding window of 512 tokens, 1 full attention; hidden 512). A request is a
shared P-token prefix plus 32 new tokens. In one process, its time to first token:

* mlx-lm: mlx-lm's own caches (``make_prompt_cache``: ``RotatingKVCache`` for the
  sliding layers), the whole prompt prefilled in 512-token forwards. Its prompt cache
  cannot serve a partial hit here: a rotating cache that has wrapped cannot be trimmed
  back to the shared prefix;
* paged, no cache: pagedkv pages, the whole prompt prefilled;
* paged hit: an earlier request left the prefix behind (``PrefixCache(pool,
  windows=(512,))``, registered after each prefill chunk, as the engine does); only the
  new tokens are computed. The hit's full-attention table holds all P / 16 pages, its
  sliding table only the window's last pages (printed).

The paged hit gives the same first token as the paged miss (checked); whether mlx-lm's
agrees is printed (in float32 it does; in bfloat16 the two attention paths round
differently over long prompts, and random weights leave near-ties).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hybrid_prefix import first_token  # noqa: E402

from pagedkv import PagePool, PrefixCache, make_paged_cache  # noqa: E402
from pagedkv.generation import prefill  # noqa: E402

GEMMA3_SMALL = {
    "model_type": "gemma3_text", "hidden_size": 512, "num_hidden_layers": 6, "intermediate_size": 1024,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "rms_norm_eps": 1e-6,
    "vocab_size": 8192, "sliding_window": 512, "sliding_window_pattern": 6, "max_position_embeddings": 65536,
    "rope_local_base_freq": 10000.0, "rope_theta": 1000000.0, "query_pre_attn_scalar": 64,
}
PAGE = 16
SUFFIX = 32


def build(dtype=mx.float32):
    from mlx_lm.models import gemma3_text

    mx.random.seed(0)
    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(GEMMA3_SMALL))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1024,2048")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    args = ap.parse_args()
    from mlx_lm.models.cache import make_prompt_cache

    dtype = getattr(mx, args.dtype)
    model = build(dtype)
    window = GEMMA3_SMALL["sliding_window"]
    print(f"device {mx.default_device()}, {args.dtype}, gemma3_text small (5 sliding-window layers of {window} + 1 full), "
          f"page {PAGE}")
    for n in [int(x) for x in args.tokens.split(",")]:
        shared = [(i * 7919) % 8000 + 1 for i in range(n)]
        pool = PagePool(num_layers=6, num_kv_heads=2, head_dim=64, page_size=PAGE,
                        num_pages=6 * (n + 2 * SUFFIX) // PAGE + 8, dtype=dtype)
        times: dict[str, list[float]] = {"mlx-lm": [], "paged, no cache": [], "paged hit": []}
        agree = 0
        for r in range(args.repeats):
            firsts = []
            prompt = shared + [(r * 31 + i) % 8000 + 1 for i in range(SUFFIX)]
            tok, s = first_token(model, make_prompt_cache(model), prompt)
            times["mlx-lm"].append(s)
            firsts.append(tok)
            with make_paged_cache(model, pool) as cache:
                tok, s = first_token(model, cache, prompt)
            times["paged, no cache"].append(s)
            firsts.append(tok)
            prefix = PrefixCache(pool, windows=(window,))
            seed = shared + [8001] * SUFFIX  # an earlier request left the prefix behind
            with make_paged_cache(model, pool) as cache:
                prefill(model, cache, seed, 512, prefix=prefix, keys=prefix.keys(seed))
            t = time.perf_counter()
            cache, rest = prefix.new_cache(model, prompt)
            hit = len(prompt) - len(rest)
            full, sliding = sorted(cache.tables, key=lambda tb: tb.window is not None)
            held = (full.num_pages, sliding.num_pages)
            tok, s = first_token(model, cache, rest)
            times["paged hit"].append(time.perf_counter() - t)
            firsts.append(tok)
            cache.release()
            pool.allocator.evict(pool.allocator.num_cached())
            assert firsts[1] == firsts[2], f"the hit's first token differs from the miss's: {firsts}"
            agree += firsts[0] == firsts[1]
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"\nP = {n} shared + {SUFFIX} new tokens (hit: {hit} tokens; the hit's tables hold "
              f"{held[0]} full-attention pages and {held[1]} sliding-window pages), median of {args.repeats}; "
              f"mlx-lm's first token the same in {agree}/{args.repeats}:")
        for k, v in med.items():
            print(f"  {k:16s} TTFT {v * 1e3:9.1f} ms   mlx-lm / this = {med['mlx-lm'] / v:6.2f}x")


if __name__ == "__main__":
    main()
