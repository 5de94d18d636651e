"""Host time of an eager decode step: mlx-lm's caches against pagedkv's, one sequence.

    python bench/host_time.py                 # CPU or GPU, whichever MLX runs on
    python bench/host_time.py --dtype bfloat16 --context 4096   # (a GPU)
    python bench/host_time.py --dtype bfloat16 --context 4096 --pool-pages 1024

A user who hands ``make_paged_cache`` to mlx-lm's own generation loop runs the model
eagerly: every layer's ``update_and_fetch`` and attention build MLX graph nodes on the
host, then the step is evaluated. Where the device is fast (a GPU, Apple silicon) and
the model small, the host's graph building is the step's floor, so the cache's Python
per layer is what the user sees in tokens per second.

Models (mlx-lm's own classes, random weights, ``--dtype``, float32 by default): a llama with 16 layers (hidden
128, 4 query heads, 2 KV heads of 64), and a ``gemma3_text`` with 12 layers (10 with a
sliding window of 64, 2 full; pagedkv lays it out in layer groups). Each side prefills
P tokens (in 512-token forwards), then runs ``--steps`` decode forwards. Per forward, timed apart:

* build: calling the model (graph building only; nothing is evaluated). A one-off numpy
  allocation runs before it on both sides, so the C allocator's tidying after the last
  step's frees lands outside the timing (bench/RESULTS.md, "where a step's first host
  work goes").
* eval: ``mx.eval`` of the logits.

The two sides' steps alternate, so drift on a shared machine hits both; build time is
the main thread's CPU time. The pool holds just the run's pages unless ``--pool-pages``
gives a count (a round one, such as 1024, is what bench/RESULTS.md measured against
MLX's CUDA attention's misreads: ``PagePool.rows_per_head``). Then tokens/s of mlx-lm's
``generate_step`` (its pipelined loop, ``mx.async_eval``) on a fresh cache of each
side, one after the other. ``--rounds`` rounds (3): printed are the round with the
median build ratio (its medians per step, and pagedkv's extra host time per layer) and
the median of the rounds' generate ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import _get_classes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedkv import PagePool, kv_pages_for, kv_pool_layers, make_paged_cache  # noqa: E402
from pagedkv.generation import prefill  # noqa: E402

LLAMA = {
    "model_type": "llama", "hidden_size": 128, "num_hidden_layers": 16, "intermediate_size": 96,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "rms_norm_eps": 1e-5,
    "vocab_size": 128, "rope_theta": 10000.0, "tie_word_embeddings": False,
}
GEMMA3 = {
    "model_type": "gemma3_text", "hidden_size": 128, "num_hidden_layers": 12, "intermediate_size": 96,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "rms_norm_eps": 1e-6,
    "vocab_size": 128, "sliding_window": 64, "sliding_window_pattern": 6,
    "max_position_embeddings": 4096, "rope_local_base_freq": 10000.0, "rope_theta": 1000000.0,
    "query_pre_attn_scalar": 64,
}
PAGE = 16


def model_of(config: dict, dtype: mx.Dtype = mx.float32):
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(config))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def paged_cache(model, config: dict, tokens: int, dtype: mx.Dtype = mx.float32, pages: int | None = None):
    """A pool for one sequence of ``tokens`` tokens prefilled in chunks of up to 2048
    (mlx-lm's ``generate_step``), in layer groups where the model has sliding layers;
    of ``pages`` pages where given (at least what the sequence needs)."""
    layers = kv_pool_layers(model)
    need = kv_pages_for(model, tokens, PAGE, layers, chunk=2048)
    pool = PagePool(num_layers=layers, num_kv_heads=config["num_key_value_heads"], head_dim=config["head_dim"],
                    page_size=PAGE, num_pages=max(need, pages or 0), dtype=dtype)
    return make_paged_cache(model, pool)


def timed_steps(model, caches: dict, prompt: list[int], steps: int) -> dict[str, tuple[float, float, list[int]]]:
    """Per side: (median build seconds, median eval seconds, greedy tokens) of ``steps``
    forwards, the sides' steps interleaved (so drift on a shared machine hits both).
    Build time is the main thread's CPU time (``time.thread_time``): being descheduled
    does not count."""
    for cache in caches.values():
        prefill(model, cache, prompt[:-1], 512)
    builds = {side: [] for side in caches}
    evals = {side: [] for side in caches}
    out = {side: [] for side in caches}
    token = {side: prompt[-1] for side in caches}
    for _ in range(steps):
        for side, cache in caches.items():
            x = mx.array([[token[side]]])
            np.empty(4096)  # (the allocator's tidying, outside the timing)
            t0 = time.thread_time()
            logits = model(x, cache=cache)
            t1 = time.thread_time()
            w1 = time.perf_counter()
            nxt = mx.argmax(logits[0, -1])
            mx.eval(nxt)
            evals[side].append(time.perf_counter() - w1)
            builds[side].append(t1 - t0)
            token[side] = int(nxt.item())
            out[side].append(token[side])
    return {side: (statistics.median(builds[side]), statistics.median(evals[side]), out[side]) for side in caches}


def generate_tps(model, cache, prompt: list[int], steps: int) -> float:
    """Tokens/s of mlx-lm's ``generate_step`` after its first 8 tokens."""
    start, n = None, 0
    for n, _ in enumerate(generate_step(mx.array(prompt), model, max_tokens=steps + 8, prompt_cache=cache), 1):
        if n == 8:
            start = time.perf_counter()
    return (n - 8) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--context", type=int, default=256, help="prompt tokens before the decode")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--pool-pages", type=int, default=None, help="pages in the pool (default: what the run needs)")
    args = ap.parse_args()
    dtype = getattr(mx, args.dtype)
    print(f"device: {mx.default_device()}, {args.dtype}, prompt {args.context} tokens, {args.steps} steps, "
          f"{args.rounds} rounds (the round with the median build ratio), pool of "
          f"{args.pool_pages or 'just enough'} pages")
    print(f"{'model':>12} {'layers':>6} {'side':>8} {'build us':>9} {'eval us':>9} {'gen tok/s':>10}")
    summary = []
    for name, config in (("llama", LLAMA), ("gemma3_text", GEMMA3)):
        model = model_of(config, dtype)
        layers = config["num_hidden_layers"]
        prompt = [(7 * i) % 100 + 1 for i in range(args.context)]
        tokens = args.context + args.steps + 16
        rounds = []
        for _ in range(args.rounds):
            caches = {"mlx-lm": make_prompt_cache(model),
                      "pagedkv": paged_cache(model, config, tokens, dtype, args.pool_pages)}
            stepped = timed_steps(model, caches, prompt, args.steps)
            tps = {"mlx-lm": generate_tps(model, make_prompt_cache(model), prompt, args.steps),
                   "pagedkv": generate_tps(model, paged_cache(model, config, tokens, dtype, args.pool_pages),
                                           prompt, args.steps)}
            rounds.append({side: (*stepped[side], tps[side]) for side in caches})
        rounds.sort(key=lambda r: r["pagedkv"][0] / r["mlx-lm"][0])
        mid = rounds[len(rounds) // 2]
        for side, (build, ev, _, tps) in mid.items():
            print(f"{name:>12} {layers:>6} {side:>8} {build * 1e6:9.0f} {ev * 1e6:9.0f} {tps:10.1f}")
        ref, ours = mid["mlx-lm"], mid["pagedkv"]
        gen = statistics.median(r["pagedkv"][3] / r["mlx-lm"][3] for r in rounds)
        summary.append((name, ours[0] / ref[0], (ours[0] - ref[0]) / layers * 1e6, gen, ours[2] == ref[2]))
    print()
    print(f"{'model':>12} {'build paged/mlx-lm':>19} {'extra us/layer':>15} {'generate tok/s paged/mlx-lm':>28}"
          f" {'same tokens':>12}")
    for name, build_ratio, extra, gen_ratio, same in summary:
        print(f"{name:>12} {build_ratio:18.2f}x {extra:15.1f} {gen_ratio:27.2f}x {str(same):>12}")


if __name__ == "__main__":
    main()
