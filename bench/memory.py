"""KV memory and decode throughput of continuous batching, three ways, one trace.

    python bench/memory.py [--quick]

The same synthetic trace (examples/serve.py: Poisson arrivals, long-tailed lengths, half
of the requests share a 96-token system prompt) is served, every request admitted on
arrival, greedy decoding, by:
  (a) pagedkv: PagedBatch + PrefixCache (pages of 16 tokens)
  (b) mlx-lm BatchKVCache: rows prefilled alone, merged left-padded, extend/filter
  (c) mlx-lm KVCache per request (256-token growth steps); its reservation follows
      from the row lengths of (b)'s schedule: ceil(n / 256) * 256 tokens per request
Per engine step: KV bytes reserved (pages in use for (a); cached evictable pages are
reported apart) and bytes of live token K/V (each running request's tokens).
Reports peak reserved bytes, reserved/live mean and peak, and decode throughput of (a)
vs (b) (time in decode forwards plus row joins and leaves). Last line: pagedkv's
reserved/live ratio and its peak-memory ratio to (b).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache  # noqa: E402

from pagedkv import PagePool  # noqa: E402

spec = importlib.util.spec_from_file_location("serve", ROOT / "examples" / "serve.py")
serve = importlib.util.module_from_spec(spec)
sys.modules["serve"] = serve
spec.loader.exec_module(serve)


def run_mlx_batch(model, trace, bytes_per_token: int):
    """(b): mlx-lm BatchKVCache continuous batching; returns per-step stats."""
    waiting = sorted(trace, key=lambda r: r.arrival)
    running, pending, batch = [], [], None
    reserved, live, per_request = [], [], []
    step = decode_tokens = 0
    decode_s = 0.0
    layers = len(model.layers)
    while waiting or running:
        while waiting and waiting[0].arrival <= step:
            req = waiting.pop(0)
            c = make_prompt_cache(model)
            logits = model(mx.array(req.prompt)[None], cache=c)[0, -1]
            tok = int(mx.argmax(logits).item())
            req.generated = [tok]
            t = time.perf_counter()
            new = [BatchKVCache.merge([c[i]]) for i in range(layers)]
            if batch is None:
                batch = new
            else:
                for i in range(layers):
                    batch[i].extend(new[i])
            mx.eval([(b.keys, b.values) for b in batch])
            decode_s += time.perf_counter() - t
            running.append(req)
            pending.append(tok)
        if running:
            t = time.perf_counter()
            logits = model(mx.array(pending)[:, None], cache=batch)[:, -1]
            toks = mx.argmax(logits, axis=-1).tolist()
            decode_s += time.perf_counter() - t
            decode_tokens += len(toks)
            for i, tok in enumerate(toks):
                running[i].generated.append(tok)
                pending[i] = tok
        keep = [i for i, r in enumerate(running) if not r.done]
        if len(keep) != len(running):
            t = time.perf_counter()
            if keep:
                for b in batch:
                    b.filter(keep)
                mx.eval([(b.keys, b.values) for b in batch])
            else:
                batch = None
            decode_s += time.perf_counter() - t
            running = [running[i] for i in keep]
            pending = [pending[i] for i in keep]
        lengths = [len(r.prompt) + len(r.generated) - 1 for r in running]
        reserved.append(sum(b.keys.nbytes + b.values.nbytes for b in batch) if batch else 0)
        live.append(sum(lengths) * bytes_per_token)
        per_request.append(sum(-(-n // 256) * 256 for n in lengths) * bytes_per_token)
        step += 1
    return dict(reserved=reserved, live=live, per_request=per_request,
                throughput=decode_tokens / decode_s, steps=step)


def ratios(reserved, live):
    r = [a / b for a, b in zip(reserved, live) if b]
    return float(np.mean(r)), float(np.max(r))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--requests", type=int, default=None)
    args = ap.parse_args()
    n = args.requests or (32 if args.quick else 96)
    model, layers, kv_heads, head_dim, dtype, vocab = serve.load_model("random")
    bpt = layers * kv_heads * head_dim * 2 * dtype.size  # K+V bytes per token, all layers

    trace = serve.make_trace(n, vocab, seed=0, rate=1.0)
    pool = PagePool(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, page_size=16,
                    num_pages=4096, dtype=dtype)
    rep = serve.serve(model, pool, trace, max_batch=10**6, watermark=0.0, progress=False)
    a_reserved = [u[0] * pool.bytes_per_page for u in rep.usage]
    a_cached = [u[1] * pool.bytes_per_page for u in rep.usage]
    a_live = [t * bpt for t in rep.live_tokens]
    a_tp = rep.decode_tokens / rep.decode_seconds

    b = run_mlx_batch(model, serve.make_trace(n, vocab, seed=0, rate=1.0), bpt)

    rows = [
        ("(a) pagedkv batch + prefix", a_reserved, a_live),
        ("(b) mlx-lm BatchKVCache", b["reserved"], b["live"]),
        ("(c) KVCache per request", b["per_request"], b["live"]),
    ]
    print(f"trace: {n} requests, {rep.steps} engine steps (b: {b['steps']}); "
          f"{bpt} bytes of K+V per token; prefix hit rate (a) {rep.prefix_hit_rate:.1%}")
    print(f"{'':<30}{'peak reserved MiB':>18}{'reserved/live mean':>20}{'peak':>8}")
    for name, res, liv in rows:
        mean, peak = ratios(res, liv)
        print(f"{name:<30}{max(res) / 2**20:>18.2f}{mean:>20.3f}{peak:>8.3f}")
    print(f"(a) also keeps up to {max(a_cached) / 2**20:.2f} MiB of cached, evictable prefix pages")
    print(f"decode throughput: (a) {a_tp:.1f} tokens/s, (b) {b['throughput']:.1f} tokens/s, "
          f"ratio {a_tp / b['throughput']:.2f}")
    mean_a, _ = ratios(a_reserved, a_live)
    print(f"pagedkv reserved/live: {mean_a:.3f}; peak reserved vs BatchKVCache: "
          f"{max(a_reserved) / max(b['reserved']):.3f}")


if __name__ == "__main__":
    main()
