"""KV bytes a sliding-window model's sequence holds: mlx-lm's caches, pagedkv's grouped
pool (a layer per full-attention layer), and a pool with a layer per model layer.

    python bench/sliding_memory.py                       # CPU: P = 2048, 8192
    python bench/sliding_memory.py --tokens 8192,32768   # (a GPU)

A Gemma-3-shaped model (mlx-lm's ``gemma3_text`` class, random weights, 12 layers: 10
with a sliding window of 512, 2 full attention, as Gemma 3's 5:1 pattern; hidden 256,
2 KV heads of 128) prefills P tokens in 512-token forwards and decodes 16 more, on each
cache. Bytes held after that:

* mlx-lm: the K/V arrays of ``make_prompt_cache`` (``KVCache`` grows in steps of 256
  tokens; ``RotatingKVCache`` keeps its window);
* pagedkv, grouped: pages in use x page bytes, on a pool of ``kv_pool_layers(model)``
  layers (2 here), so the sliding layers form 5 groups with their own tables and a
  full-attention page holds the 2 full layers only (``layout_for``);
* pagedkv, a layer per model layer: the same on a 12-layer pool (what the factories
  gave before groups became their default), where every page keeps room for all 12 layers.

All three give the same greedy tokens (checked). Ideal: P x 2 full layers + the window x
10 sliding layers of K/V. Also printed: each side's prefill time and time per decode step
(of a second run, so no kernel compiles), and mlx-lm's over them.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sliding_prefix import GEMMA3_SMALL  # noqa: E402

from pagedkv import PagePool, kv_pool_layers, make_paged_cache  # noqa: E402
from pagedkv.generation import prefill  # noqa: E402

GEMMA3_SHAPE = dict(GEMMA3_SMALL, hidden_size=256, num_hidden_layers=12, intermediate_size=512, num_attention_heads=4,
                    head_dim=128, vocab_size=4096, query_pre_attn_scalar=128)
PAGE = 16
DECODE = 16


def decode(model, cache, prompt: list[int]) -> tuple[list[int], float, float]:
    """(greedy tokens, prefill seconds, seconds per decode step)."""
    t = time.perf_counter()
    prefill(model, cache, prompt[:-1], 512)
    mx.synchronize()
    t1 = time.perf_counter()
    out, nxt = [], prompt[-1]
    for _ in range(DECODE):
        nxt = int(mx.argmax(model(mx.array([[nxt]]), cache=cache)[0, -1]).item())
        out.append(nxt)
    return out, t1 - t, (time.perf_counter() - t1) / DECODE


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="2048,8192")
    args = ap.parse_args()
    from mlx_lm.models import gemma3_text
    from mlx_lm.models.cache import make_prompt_cache

    mx.random.seed(0)
    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(GEMMA3_SHAPE))
    mx.eval(model.parameters())
    c = GEMMA3_SHAPE
    kv, d = c["num_key_value_heads"], c["head_dim"]
    per_token_layer = 2 * kv * d * 4  # K + V, float32
    n_full = c["num_hidden_layers"] // c["sliding_window_pattern"]
    n_sliding = c["num_hidden_layers"] - n_full
    print(f"device {mx.default_device()}, float32, gemma3_text shape: {n_sliding} sliding layers (window "
          f"{c['sliding_window']}) + {n_full} full, pages of {PAGE}; kv_pool_layers = {kv_pool_layers(model)}")
    print(f"{'P':>7} {'ideal MiB':>10} {'mlx-lm':>9} {'grouped':>9} {'per-layer':>10} {'mlx-lm/grouped':>15} "
          f"{'per-layer/grouped':>18}")
    speeds = []
    for n in [int(x) for x in args.tokens.split(",")]:
        prompt = [(i * 7919) % 4000 + 1 for i in range(n)]
        tokens = n + DECODE
        ideal = (tokens * n_full + c["sliding_window"] * n_sliding) * per_token_layer
        times = {}
        for _ in range(2):  # the second run is timed (the first compiles kernels)
            ref_cache = make_prompt_cache(model)
            want, *times["mlx-lm"] = decode(model, ref_cache, prompt)
        theirs = sum(x.nbytes for cache in ref_cache for x in (cache.keys, cache.values))
        held = {}
        for name, layers in (("grouped", kv_pool_layers(model)), ("per-layer", c["num_hidden_layers"])):
            pool = PagePool(num_layers=layers, num_kv_heads=kv, head_dim=d, page_size=PAGE,
                            num_pages=tokens // PAGE + 512,  # (a forward's window pages: 5 x 64)
                            dtype=mx.float32)
            for _ in range(2):
                with make_paged_cache(model, pool) as cache:
                    got, *times[name] = decode(model, cache, prompt)
                    held[name] = pool.allocator.num_in_use() * pool.bytes_per_page
                assert got == want, f"{name}: {got} != {want}"
        mib = 1 << 20
        print(f"{n:>7} {ideal / mib:>10.1f} {theirs / mib:>9.1f} {held['grouped'] / mib:>9.1f} "
              f"{held['per-layer'] / mib:>10.1f} {theirs / held['grouped']:>14.2f}x "
              f"{held['per-layer'] / held['grouped']:>17.2f}x", flush=True)
        speeds.append((n, times))
    print("\ntime (second run): prefill s / decode ms per token; mlx-lm's time over each side's")
    for n, times in speeds:
        base = times["mlx-lm"]
        print(f"{n:>7} " + "  ".join(f"{k} {v[0]:.3f} s / {v[1] * 1e3:.2f} ms ({base[0] / v[0]:.2f}x, "
                                     f"{base[1] / v[1]:.2f}x)" for k, v in times.items()), flush=True)


if __name__ == "__main__":
    main()
