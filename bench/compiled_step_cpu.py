"""A ``CompiledDecode`` step against the eager ``PagedBatch`` step on the CPU: a tiny
random llama, B rows over a long context, the same rows on both sides.

    python bench/compiled_step_cpu.py [--rows 8] [--context 1500] [--steps 40]

Prints each side's median wall time per decode step (host bookkeeping, graph building
or replay, and the arithmetic) and compiled / eager. Steps alternate between the sides.
On a machine without a GPU this is where a change to the compiled step's code shows:
run it in two checkouts (``PYTHONPATH=CHECKOUT``) and compare the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
from tiny_models import make_model, make_pool, prompt_of  # noqa: E402

from pagedkv import CompiledDecode, PagedBatch, make_paged_cache  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--context", type=int, default=1500)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    model = make_model("llama")
    pages = args.rows * (-(-(args.context + 2 * args.steps + 16) // 16) + 2) + 1

    def filled() -> PagedBatch:
        batch = PagedBatch.for_model(model, make_pool("llama", page_size=16, num_pages=pages))
        for i in range(args.rows):
            cache = make_paged_cache(model, batch.pool)
            model(mx.array(prompt_of(args.context, seed=i + 1))[None], cache=cache)
            batch.extend(cache)
        return batch

    eager_batch, compiled_batch = filled(), filled()
    step = CompiledDecode(model, compiled_batch)
    sides = {"eager": lambda t: model(t, cache=eager_batch.caches), "compiled": step}
    tokens = mx.array([[1]] * args.rows)
    times: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(args.steps + 5):
        for name, run in sides.items():
            t = time.perf_counter()
            mx.eval(run(tokens))
            if i >= 5:  # (warm-up: the trace, the first uploads)
                times[name].append(time.perf_counter() - t)
    med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    print(f"{Path(__file__).resolve().parents[1].name}: B={args.rows} over {args.context} tokens, median step "
          f"eager {med['eager']:.2f} ms, compiled {med['compiled']:.2f} ms, "
          f"compiled/eager {med['eager'] / med['compiled']:.2f}x speed ({args.steps} steps each)")

if __name__ == "__main__":
    main()
