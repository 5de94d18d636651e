"""One sequence through ``pagedkv.generation.generate``, end to end: eager against compiled.

    python bench/generate_loop.py                                # CPU or GPU
    python bench/generate_loop.py --models llama,gemma3_text,1b --dtype bfloat16   # (a GPU)

What a user of ``generate`` (the demo's loop) sees: tokens per second of its decode,
from the first token out of the prefill to the last, with everything a compiled step
costs on the way counted (its traces: one per page-table width bucket, and its first
copies to the device). Sides, each on a fresh cache with the same prompt:

* ``mlx-lm``: what a user of mlx-lm gets: its own ``generate_step`` (pipelined: the next
  step is queued before a token is read) on its own ``KVCache`` list;
* ``eager``: ``make_paged_cache``, ``generate(..., compiled=False)`` (pipelined, as
  ``compiled``);
* ``compiled``: the same with ``compiled=True`` (``CompiledDecode`` over the cache;
  pipelined without recurrent layers, but for the steps that drop a page behind a
  sliding window);
* ``kept``: the same with one ``CompiledDecode`` passed as ``compiled`` from request to
  request (``CompiledDecode.rebind``): each request on a fresh cache of one pool, the
  step traced by a request before the timed ones. ``compiled`` against ``kept`` is
  what a call's traces cost.

Models (mlx-lm's own classes, random weights, seed 0): ``llama`` and ``gemma3_text``
are ``bench/host_time.py``'s small ones (16 and 12 layers, hidden 128: the host's
graph building bounds their steps), ``1b`` the Llama-3.2-1B shape of
``bench/gpu_generate.py`` (too slow for a CPU). Greedy; the compiled side's tokens are
checked against the eager side's (``same``: they may part at a near-tie of half-
precision logits). ``--rounds`` rounds with the sides in turn; printed are the medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_generate import model_of as shaped_model  # noqa: E402
from host_time import GEMMA3, LLAMA, paged_cache  # noqa: E402
from host_time import model_of as small_model  # noqa: E402

from pagedkv import CompiledDecode, make_paged_cache  # noqa: E402
from pagedkv.generation import GenerationStats, generate  # noqa: E402
from pagedkv.model_config import text_config  # noqa: E402


def model_named(name: str, dtype: mx.Dtype):
    if name == "llama":
        return small_model(LLAMA, dtype)
    if name == "gemma3_text":
        return small_model(GEMMA3, dtype)
    return shaped_model(name, dtype)


def run_side(model, side: str, prompt: list[int], new: int, dtype: mx.Dtype,
             kept: dict | None = None) -> tuple[float, list[int]]:
    """(decode tokens/s after the first token, the tokens) of one generation on a fresh
    cache; ``kept`` (side ``kept``): the pool and the step kept from request to request,
    made by the first call (untimed: it traces the step)."""
    if side == "mlx-lm":
        tokens, first = [], 0.0
        for tok, _ in generate_step(mx.array(prompt), model, max_tokens=new, prompt_cache=make_prompt_cache(model)):
            tokens.append(int(tok))
            if len(tokens) == 1:
                first = time.perf_counter()
        return (len(tokens) - 1) / (time.perf_counter() - first), tokens
    if side == "kept":
        if not kept:
            cache = paged_cache(model, text_config(model), len(prompt) + new, dtype)
            kept.update(pool=cache.rows.layout.specs[0].pool, step=CompiledDecode(model, cache))
            list(generate(model, cache, prompt, max_tokens=new, compiled=kept["step"]))  # (traces)
            cache.release()
        cache, compiled = make_paged_cache(model, kept["pool"]), kept["step"]
    else:
        cache, compiled = paged_cache(model, text_config(model), len(prompt) + new, dtype), side == "compiled"
    stats = GenerationStats()
    tokens = list(generate(model, cache, prompt, max_tokens=new, stats=stats, compiled=compiled))
    cache.release()
    return stats.decode_tps, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama,gemma3_text")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens")
    ap.add_argument("--new", default="32,128,512", help="tokens to generate, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    dtype = getattr(mx, args.dtype)
    print(f"device: {mx.default_device()}, {args.dtype}, prompt {args.prompt} tokens, {args.rounds} rounds")
    print(f"{'model':>12} {'new':>5} {'mlx-lm tok/s':>13} {'eager':>8} {'compiled':>9} {'kept':>8}"
          f" {'eager/mlx-lm':>13} {'compiled/mlx-lm':>16} {'kept/mlx-lm':>12} {'compiled/eager':>15}"
          f" {'kept/compiled':>14} {'same':>5}")
    for name in args.models.split(","):
        model = model_named(name, dtype)
        vocab = text_config(model)["vocab_size"]
        prompt = [(7 * i) % (vocab - 1) + 1 for i in range(args.prompt)]
        run_side(model, "mlx-lm", prompt[:64], 4, dtype)  # (MLX's kernels built once, outside the timing)
        run_side(model, "eager", prompt[:64], 4, dtype)
        for new in (int(n) for n in args.new.split(",")):
            tps: dict[str, list[float]] = {"mlx-lm": [], "eager": [], "compiled": [], "kept": []}
            same, kept = True, {}
            for _ in range(args.rounds):
                out = {side: run_side(model, side, prompt, new, dtype, kept) for side in tps}
                for side, (t, _) in out.items():
                    tps[side].append(t)
                same &= out["compiled"][1] == out["eager"][1] == out["kept"][1]
            m = {side: statistics.median(v) for side, v in tps.items()}
            print(f"{name:>12} {new:5d} {m['mlx-lm']:13.1f} {m['eager']:8.1f} {m['compiled']:9.1f} {m['kept']:8.1f}"
                  f" {m['eager'] / m['mlx-lm']:12.2f}x {m['compiled'] / m['mlx-lm']:15.2f}x"
                  f" {m['kept'] / m['mlx-lm']:11.2f}x {m['compiled'] / m['eager']:14.2f}x"
                  f" {m['kept'] / m['compiled']:13.2f}x {str(same):>5}", flush=True)


if __name__ == "__main__":
    main()
