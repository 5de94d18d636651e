"""Prefix hits on a hybrid model (gated-delta + attention): time to first token.

    python bench/hybrid_prefix.py                       # CPU: P = 512, 1024
    python bench/hybrid_prefix.py --tokens 2048,8192    # (a GPU)

A Qwen3-Next-shaped model (mlx-lm's ``qwen3_next`` class, random weights, 8 layers: 6
gated-delta, 2 attention, MoE MLPs). A request is a shared P-token prefix plus 32 new
tokens. In one process, its time to first token:

* mlx-lm: mlx-lm's own caches (``make_prompt_cache``: KVCache + ArraysCache), the whole
  prompt prefilled in 512-token forwards (no prefix reuse: mlx-lm's prompt cache cannot
  rewind recurrent state, so a hybrid gets no partial hits there);
* paged, no cache: pagedkv pages + ``StatePool``, the whole prompt prefilled;
* paged hit: an earlier request left the prefix's pages and a recurrent-state
  checkpoint (``PrefixCache(state_pool=..., checkpoint_every=k)``); only the last
  tokens are computed.

Also the cost of checkpoints: the cold (miss) prefill with forwards cut at every k pages
(k = 1, 4, 16, 32), against one without checkpoints. Every variant gives the same first
token (checked).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedkv import PagePool, PrefixCache, StatePool, make_paged_cache  # noqa: E402
from pagedkv.generation import prefill, written_state  # noqa: E402

QWEN3_NEXT_SMALL = {
    "model_type": "qwen3_next", "hidden_size": 512, "num_hidden_layers": 8, "intermediate_size": 1024,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "linear_num_value_heads": 8,
    "linear_num_key_heads": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4, "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
    "shared_expert_intermediate_size": 512, "mlp_only_layers": [], "moe_intermediate_size": 256,
    "rms_norm_eps": 1e-6, "vocab_size": 8192, "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
    "max_position_embeddings": 65536, "full_attention_interval": 4,
}
PAGE = 16
SUFFIX = 32


def build():
    from mlx_lm.models import qwen3_next

    mx.random.seed(0)
    model = qwen3_next.Model(qwen3_next.ModelArgs.from_dict(QWEN3_NEXT_SMALL))
    if mx.default_device() == mx.gpu:
        model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return model


def first_token(model, cache, rest: list[int], chunk: int = 512) -> tuple[int, float]:
    t = time.perf_counter()
    prefill(model, cache, rest[:-1], chunk)
    tok = int(mx.argmax(model(mx.array([rest[-1:]]), cache=cache)[0, -1]).item())
    return tok, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="512,1024")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    from mlx_lm.models.cache import make_prompt_cache

    model = build()
    print(f"device {mx.default_device()}, qwen3_next small (6 gated-delta + 2 attention layers), page {PAGE}")
    for n in [int(x) for x in args.tokens.split(",")]:
        shared = [(i * 7919) % 8000 + 1 for i in range(n)]
        pool = PagePool(num_layers=2, num_kv_heads=2, head_dim=64, page_size=PAGE,
                        num_pages=4 * (n + 2 * SUFFIX) // PAGE + 8, dtype=next(iter(
                            model.parameters()["model"]["embed_tokens"].values())).dtype
                        if mx.default_device() == mx.gpu else mx.float32)
        states = StatePool.for_model(model, num_slots=96)
        times: dict[str, list[float]] = {"mlx-lm": [], "paged, no cache": [], "paged hit": []}
        firsts: set[int] = set()
        for r in range(args.repeats):
            prompt = shared + [(r * 31 + i) % 8000 + 1 for i in range(SUFFIX)]
            tok, s = first_token(model, make_prompt_cache(model), prompt)
            times["mlx-lm"].append(s)
            firsts.add(tok)
            with make_paged_cache(model, pool, state_pool=states) as cache:
                tok, s = first_token(model, cache, prompt)
            times["paged, no cache"].append(s)
            firsts.add(tok)
            prefix = PrefixCache(pool, state_pool=states, checkpoint_every=16)
            seed = shared + [8001] * SUFFIX  # an earlier request left the prefix behind
            keys = prefix.keys(seed)
            with make_paged_cache(model, pool, state_pool=states) as cache:
                prefill(model, cache, seed, 512, prefix=prefix, keys=keys)
            t = time.perf_counter()
            cache, rest = prefix.new_cache(model, prompt)
            hit = len(prompt) - len(rest)
            tok, s = first_token(model, cache, rest)
            times["paged hit"].append(time.perf_counter() - t)
            firsts.add(tok)
            cache.release()
            pool.allocator.evict(pool.allocator.num_cached())
            states.allocator.evict(states.allocator.num_cached())
        assert len(firsts) <= args.repeats, "variants disagree on the first token"
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"\nP = {n} shared + {SUFFIX} new tokens (hit: {hit} tokens), median of {args.repeats}:")
        for k, v in med.items():
            print(f"  {k:16s} TTFT {v * 1e3:9.1f} ms   mlx-lm / this = {med['mlx-lm'] / v:6.2f}x")
        # the cost of checkpoints on a miss: forwards cut at every k pages
        base = None
        for k in (None, 1, 4, 16, 32):
            prefix = PrefixCache(pool, state_pool=states, checkpoint_every=k or 1)
            prompt = shared + [8002] * SUFFIX
            keys = prefix.keys(prompt)
            samples, kept = [], 0
            for _ in range(args.repeats):
                with make_paged_cache(model, pool, state_pool=states) as cache:
                    t = time.perf_counter()
                    if k is None:
                        prefill(model, cache, prompt, 512)
                    else:
                        prefill(model, cache, prompt, 512, prefix=prefix, keys=keys)
                    mx.eval(written_state(cache))
                    samples.append(time.perf_counter() - t)
                kept = prefix.stats().checkpoints if k else 0
                pool.allocator.evict(pool.allocator.num_cached())
                states.allocator.evict(states.allocator.num_cached())
            s = statistics.median(samples)
            base = base or s
            label = "no checkpoints" if k is None else f"every {k:2d} pages"
            print(f"  miss prefill, {label:16s} {s * 1e3:9.1f} ms  ({s / base:5.2f}x;"
                  f" {kept} checkpoints kept)")


if __name__ == "__main__":
    main()
