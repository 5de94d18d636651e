"""A paged decode step under ``mx.compile``: does compiling remove the host cost? (GPU)

    python3 bench/gpu_compiled_step.py [--model 1b|8b] [--batches 8,32] [--contexts 1024,4096]
                                       [--steps 32] [--bucket 64]

Issue 15 asks for ``mx.compile`` of the paged decode step "where it helps", with the
figure either way. pagedkv's caches mutate Python state and build their index arrays
from numpy inside the model call, which a compiled function would capture as constants,
so they cannot be compiled as they are. This measures what a compiled step would be
worth before redesigning for it: a *functional* paged decode step with everything that
varies per step as inputs

    tokens [B, 1], page table [B, W] (W padded up to ``--bucket`` pages, so the trace is
    reused until a row outgrows the bucket), lengths [B], write pages / slots [B],
    positions [B]

and the pool arrays (K and V per layer, [kv_heads * pages, page_size, D]) as the
compiled function's state (``mx.compile(step, inputs=pools, outputs=pools)``): each
layer scatters the step's K/V into its pool arrays and attends through the CUDA decode
kernel, as ``PagedBatch`` does. Measured in one run, same model (random weights in
mlx-lm's llama class), same rows:

  mlx-lm    ``BatchKVCache`` (the baseline of bench/gpu_generate.py)
  pagedkv   ``PagedBatch`` with attention routed to the pages
  eager     the functional step, not compiled
  compiled  the functional step under ``mx.compile``

Printed per case: decode tokens/s, host time per step (building the graph, plus, for
eager/compiled, making the step's input arrays from numpy), the number of traces, peak
memory growth (a pool array copied instead of written in place would show: donation
across the compiled boundary), and in how many rows compiled and eager end on the same
token (both start from the same K/V).
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
from gpu_generate import PS, SHAPES, filled, generate, model_of  # noqa: E402

from pagedkv.kernels import paged_decode  # noqa: E402


class StepLayer:
    """One layer's cache for the functional step: reads the step's inputs and the pool
    state from ``FunctionalStep``; mlx-lm's attention is routed to ``attend``."""

    reads_pages = True

    def __init__(self, step: FunctionalStep, layer: int):
        self.step, self.layer = step, layer

    @property
    def offset(self):
        return self.step.inputs["positions"]

    def make_mask(self, *args, **kwargs):
        return None

    def update_and_fetch(self, k, v):
        s = self.step
        b, hkv = k.shape[0], k.shape[1]
        rows = (mx.arange(hkv, dtype=mx.int32)[None, :] * s.num_pages
                + s.inputs["write_pages"][:, None]).reshape(-1)
        slots = mx.broadcast_to(s.inputs["write_slots"][:, None], (b, hkv)).reshape(-1)
        for i, x in ((2 * self.layer, k), (2 * self.layer + 1, v)):
            pool = s.pools[i]
            pool[rows, slots] = x.reshape(b * hkv, -1)
            s.pools[i] = pool
        return k, v

    def attend(self, q, scale, mask):
        s = self.step
        return paged_decode.paged_decode(
            q, s.pools[2 * self.layer], s.pools[2 * self.layer + 1], s.inputs["table"], s.inputs["lengths"],
            s.inputs["starts"], scale, num_pages=s.num_pages, page_size=PS, splits=s.splits)


class FunctionalStep:
    """The rows' state on the host (page lists, lengths) and one decode step as a
    function of arrays, eager or compiled."""

    def __init__(self, model, lengths: list[int], steps: int, bucket: int, compiled: bool, dtype):
        a = model.args
        self.model, self.bucket = model, bucket
        self.num_pages = sum(-(-(n + steps + 1) // PS) for n in lengths) + 1
        hkv, d = a.num_key_value_heads, a.head_dim
        self.pools = []
        mx.random.seed(3)  # eager and compiled start from the same K/V
        for _ in range(a.num_hidden_layers):
            self.pools += [mx.random.normal((hkv * self.num_pages, PS, d)).astype(dtype) for _ in range(2)]
        mx.eval(self.pools)
        self.lengths = np.array(lengths, dtype=np.int64)
        rng = np.random.default_rng(0)
        free = list(rng.permutation(np.arange(1, self.num_pages)))
        self.pages = [[int(free.pop()) for _ in range(-(-n // PS))] for n in lengths]
        self.free = free
        self.layers = [StepLayer(self, i) for i in range(a.num_hidden_layers)]
        self.traces = 0
        self.inputs: dict[str, mx.array] = {}
        # the table width is a bucket, so the split count must not follow the exact width
        self.splits = None
        fn = self._step
        self.fn = mx.compile(fn, inputs=self.pools, outputs=self.pools) if compiled else fn

    def _step(self, tokens, table, lengths, starts, write_pages, write_slots, positions):
        self.traces += 1  # Python runs here only while tracing (or every call, eager)
        self.inputs = dict(table=table, lengths=lengths, starts=starts, write_pages=write_pages,
                           write_slots=write_slots, positions=positions)
        logits = self.model(tokens, cache=self.layers)
        return mx.argmax(logits[:, -1], axis=-1)[:, None]

    def __call__(self, tokens):
        pos = self.lengths
        for b, p in enumerate(pos.tolist()):  # a new page when a row's write starts one
            if p % PS == 0:
                self.pages[b].append(int(self.free.pop()))
        width = max(len(p) for p in self.pages)
        width = -(-width // self.bucket) * self.bucket
        table = np.zeros((len(self.pages), width), dtype=np.int32)
        for b, p in enumerate(self.pages):
            table[b, : len(p)] = p
        write_pages = table[np.arange(len(pos)), pos // PS]
        self.splits = paged_decode.choose_splits(len(pos), self.pools[0].shape[0] // self.num_pages, width)
        out = self.fn(tokens, mx.array(table), mx.array((pos + 1).astype(np.int32)),
                      mx.zeros((len(pos),), dtype=mx.int32), mx.array(write_pages.astype(np.int32)),
                      mx.array((pos % PS).astype(np.int32)), mx.array(pos.astype(np.int32)))
        self.lengths = pos + 1
        return out


def run_functional(step: FunctionalStep, first: mx.array, steps: int):
    tok, host = first, []
    mx.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        tok = step(tok)
        host.append(time.perf_counter() - t)
        mx.eval(tok)
    mx.synchronize()
    return time.perf_counter() - t0, statistics.median(host), tok[:, 0].tolist()


def case(model, lengths: list[int], steps: int, bucket: int, dtype) -> dict:
    rng = np.random.default_rng(1)
    first = mx.array(rng.integers(0, 32000, (len(lengths), 1)).astype(np.int32))
    out = {}
    ref, batch = filled(model, lengths, steps, dtype)
    for caches in (batch.caches, ref):
        generate(model, caches, first, 2)
        for c in caches:
            c.trim(2)
    t, host, _ = generate(model, ref, first, steps)
    out["mlx_lm"] = (len(lengths) * steps / t, host)
    t, host, _ = generate(model, batch.caches, first, steps)
    out["pagedkv"] = (len(lengths) * steps / t, host)
    batch.release()
    del ref, batch
    toks = {}
    for name in ("eager", "compiled"):
        mx.clear_cache()
        step = FunctionalStep(model, lengths, steps + 2, bucket, name == "compiled", dtype)
        run_functional(step, first, 2)  # warm-up: trace and compile
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        t, host, toks[name] = run_functional(step, first, steps)
        out[name] = (len(lengths) * steps / t, host)
        out[name + "_traces"] = step.traces
        out[name + "_growth"] = (mx.get_peak_memory() - base) / 2**20
        del step
    out["same"] = f"{sum(a == b for a, b in zip(toks['eager'], toks['compiled']))}/{len(lengths)}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--bucket", type=int, default=64)
    args = ap.parse_args()
    if not paged_decode.available():
        raise SystemExit("needs MLX on a CUDA GPU")
    dtype = mx.float16
    model = model_of(args.model, dtype)
    print(f"mlx {mx.__version__} {mx.default_device()}; {args.model}-shaped llama, float16, {args.steps} greedy "
          f"steps, table bucket {args.bucket} pages; tok/s (host ms per step)", flush=True)
    print(f"{'B':>3} {'context':>7} {'mlx-lm':>16} {'pagedkv':>16} {'eager':>16} {'compiled':>16} "
          f"{'compiled/eager':>15} {'traces':>7} {'peak +MiB e/c':>14} {'same last token':>16}", flush=True)
    for ctx in [int(x) for x in args.contexts.split(",") if x]:
        for b in [int(x) for x in args.batches.split(",") if x]:
            r = case(model, [ctx] * b, args.steps, args.bucket, dtype)
            cells = " ".join(f"{r[k][0]:>8.0f} ({r[k][1] * 1e3:>4.2f})" for k in ("mlx_lm", "pagedkv", "eager", "compiled"))
            print(f"{b:>3} {ctx:>7} {cells} {r['compiled'][0] / r['eager'][0]:>14.2f}x {r['compiled_traces']:>7} "
                  f"{r['eager_growth']:>6.0f}/{r['compiled_growth']:<7.0f} {r['same']:>16}", flush=True)


if __name__ == "__main__":
    main()
