"""`pagedkv serve` against `mlx_lm.server` on the same model and the same request trace.

    python bench/serve.py                      # SmolLM2-135M, the default trace
    python bench/serve.py --model tiny-random  # random weights: the serving machinery alone
    python bench/serve.py --quick

Both servers run as subprocesses on loopback ports, one after the other, and get the
same trace from the official `openai` client (streaming, greedy):
* conversations start at Poisson times; each has one of a few shared system prompts
  and several user turns. A turn is sent when the previous answer has arrived, with
  that answer in its history (multi-turn chat);
* single-turn requests with the same system prompts arrive at Poisson times too.
The model is the same weights on both sides: the GGUF is written out as an mlx-lm model
directory (safetensors, config.json, tokenizer.json) for `mlx_lm.server`.

Per server: TTFT (request sent -> first streamed text) p50/p99 over all requests and over
follow-up turns only; TPOT ((last - first token time) / (tokens - 1)) p50/p99;
throughput (generated tokens / makespan); cache hit rate (cached prompt tokens reported
in `usage.prompt_tokens_details.cached_tokens` / prompt tokens); peak KV bytes, two ways:
* held by running requests: pagedkv's pages in use (`pagedkv:kv_peak_bytes`, exact);
  mlx-lm's live cache arrays minus its prompt cache's bytes;
* held in all (running + kept for reuse): pagedkv's pages in use + cached (polled from
  /metrics every 50 ms); mlx-lm's live cache arrays (sampled every 10 ms in its process
  by a wrapper that tracks every cache object mlx-lm makes).
Ratios are pagedkv / mlx-lm for times and bytes (lower is better) and for throughput
(higher is better).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

QUESTIONS = [
    "What is a page table?", "Why do caches use LRU eviction?", "Name three prime numbers.",
    "How does a bicycle stay upright?", "What is the boiling point of water?",
    "Explain recursion briefly.", "What causes the seasons?", "Give me a synonym for quick.",
    "How many legs does a spider have?", "What is the capital of Japan?",
    "Why is the sky blue?", "What does a compiler do?",
]
FOLLOW_UPS = ["Can you say more?", "Give an example.", "Summarise that in five words.",
              "Why is that?", "What else should I know?"]
SYSTEMS = [
    "You are a patient teacher. You explain ideas with short, concrete examples, you avoid "
    "jargon unless asked, and you check the student's understanding at the end of every answer. "
    "Keep answers under three sentences unless the student asks for more detail.",
    "You are a precise technical assistant for systems engineers. Answer directly, give numbers "
    "where they help, mention the trade-offs, and never invent facts. If a question is ambiguous, "
    "say which reading you answer. Keep answers short.",
]

MLX_LM_WRAPPER = r'''
import json, sys, threading, time, weakref
import mlx_lm.models.cache as C
live = weakref.WeakSet()
prompt_caches = []
for name in dir(C):
    cls = getattr(C, name)
    if isinstance(cls, type) and issubclass(cls, C._BaseCache) and cls is not C._BaseCache:
        def init(self, *a, __orig=cls.__init__, **k):
            __orig(self, *a, **k)
            live.add(self)
        cls.__init__ = init
orig_lru = C.LRUPromptCache.__init__
def lru_init(self, *a, **k):
    orig_lru(self, *a, **k)
    prompt_caches.append(self)
C.LRUPromptCache.__init__ = lru_init
out = sys.argv.pop(1)
peak = {"total": 0, "running": 0}
def arrays(c):
    for attr in ("keys", "values"):
        a = getattr(c, attr, None)
        if isinstance(a, (list, tuple)):
            yield from a
        elif a is not None:
            yield a
def sample():
    last = 0.0
    while True:
        seen, total = set(), 0
        for c in list(live):
            for a in arrays(c):
                if id(a) not in seen and hasattr(a, "nbytes"):
                    seen.add(id(a))
                    total += a.nbytes
        kept = sum(pc.nbytes for pc in prompt_caches)
        peak["total"] = max(peak["total"], total)
        peak["running"] = max(peak["running"], total - kept)
        if time.monotonic() - last > 0.2:
            with open(out, "w") as f:
                json.dump(peak, f)
            last = time.monotonic()
        time.sleep(0.01)
threading.Thread(target=sample, daemon=True).start()
from mlx_lm.server import main
sys.argv[0] = "mlx_lm.server"
main()
'''


# ---------------------------------------------------------------------- the model, twice
def load(model: str):
    from pagedkv.gguf_model import load_gguf_llama, smollm2_path, tiny_random_llama

    if model == "tiny-random":
        return tiny_random_llama(smollm2_path(install=True))
    import attrs

    return attrs.evolve(load_gguf_llama(smollm2_path(install=True)), name="smollm2")


def write_mlx_lm_dir(lm, out: Path) -> None:
    """The same weights, tokenizer and chat template as an mlx-lm model directory."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(lm.model.parameters())))
    a = lm.model.args
    config = {
        "model_type": "llama", "hidden_size": a.hidden_size, "num_hidden_layers": a.num_hidden_layers,
        "intermediate_size": a.intermediate_size, "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": a.num_key_value_heads, "rms_norm_eps": a.rms_norm_eps,
        "vocab_size": a.vocab_size, "rope_theta": a.rope_theta, "rope_traditional": a.rope_traditional,
        "tie_word_embeddings": a.tie_word_embeddings, "max_position_embeddings": a.max_position_embeddings,
        "eos_token_id": list(lm.eos_token_ids),
    }
    quantized = {p: {"group_size": m.group_size, "bits": m.bits} for p, m in lm.model.named_modules()
                 if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}
    if quantized:
        first = next(iter(quantized.values()))
        config["quantization"] = {**first, **quantized}
    (out / "config.json").write_text(json.dumps(config))
    lm.tokenizer.save(str(out / "tokenizer.json"))
    vocab = lm.tokenizer.get_vocab()
    eos = next(t for t in ("<|im_end|>", "<|endoftext|>") if t in vocab)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": lm.chat_template,
        "eos_token": eos, "bos_token": None, "add_bos_token": False, "model_max_length": a.max_position_embeddings,
    }))


# ---------------------------------------------------------------------- servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, proc: subprocess.Popen, path: str, timeout: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stdout.read()[-3000:]}")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError("the server did not start")


def start_pagedkv(args, name: str) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "pagedkv.cli", "serve", "--model", args.model, "--port", str(port),
           "--log-level", "warning", "--pool-bytes", str(args.pool_mib << 20), "--max-batch", str(args.max_batch),
           "--page-size", str(args.page_size), "--prefill-budget", str(args.prefill_budget)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_up(url, proc, "/health")
    return proc, url, name


def start_mlx_lm(args, model_dir: Path, peak_file: Path) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    cmd = [sys.executable, "-c", MLX_LM_WRAPPER, str(peak_file), "--model", str(model_dir), "--port", str(port),
           "--log-level", "WARNING", "--decode-concurrency", str(args.max_batch), "--max-tokens", str(args.max_tokens)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_up(url, proc, "/v1/models")
    return proc, url, str(model_dir)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


# ---------------------------------------------------------------------- the trace
def make_trace(args) -> dict:
    rng = np.random.default_rng(args.seed)
    starts = np.cumsum(rng.exponential(1 / args.rate, args.conversations + args.singles))
    items = []
    for i, t in enumerate(starts):
        turns = args.turns if i < args.conversations else 1
        qs = [QUESTIONS[int(rng.integers(len(QUESTIONS)))]] + [
            FOLLOW_UPS[int(rng.integers(len(FOLLOW_UPS)))] for _ in range(turns - 1)]
        items.append({"start": float(t), "system": SYSTEMS[i % len(SYSTEMS)], "questions": qs})
    rng.shuffle(items)
    items.sort(key=lambda it: it["start"])
    return {"items": items}


async def run_trace(url: str, model: str, trace: dict, max_tokens: int) -> tuple[list[dict], float]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    records: list[dict] = []
    t0 = time.perf_counter()

    async def ask(messages, turn):
        sent = time.perf_counter()
        first = last = None
        parts, usage, chunks = [], None, 0
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True})
        async for c in stream:
            if c.usage is not None:
                usage = c.usage
            if c.choices and c.choices[0].delta.content:
                now = time.perf_counter()
                first = first or now
                last = now
                chunks += 1
                parts.append(c.choices[0].delta.content)
        done = time.perf_counter()
        tokens = usage.completion_tokens if usage else chunks
        details = getattr(usage, "prompt_tokens_details", None) if usage else None
        cached = (details.cached_tokens or 0) if details is not None else 0
        records.append({"turn": turn, "ttft": (first or done) - sent, "e2e": done - sent,
                        "tpot": (last - first) / (tokens - 1) if first and tokens > 1 else None,
                        "tokens": tokens, "prompt": usage.prompt_tokens if usage else 0, "cached": cached})
        return "".join(parts)

    async def conversation(item):
        await asyncio.sleep(max(0.0, item["start"] - (time.perf_counter() - t0)))
        messages = [{"role": "system", "content": item["system"]}]
        for turn, q in enumerate(item["questions"]):
            messages.append({"role": "user", "content": q})
            answer = await ask(list(messages), turn)
            messages.append({"role": "assistant", "content": answer})

    try:
        await asyncio.gather(*(conversation(it) for it in trace["items"]))
    finally:
        await client.close()
    return records, time.perf_counter() - t0


def poll_pagedkv_pool(url: str, stop_event: threading.Event, out: dict) -> None:
    import httpx

    with httpx.Client(timeout=5) as http:
        while not stop_event.is_set():
            text = http.get(url + "/metrics").text
            vals = {m.group(1): float(m.group(2)) for m in
                    re.finditer(r'^pagedkv:(kv_pages_in_use|kv_pages_cached)\{[^}]*\} ([0-9.e+]+)$', text, re.M)}
            out["pages"] = max(out.get("pages", 0), vals.get("kv_pages_in_use", 0) + vals.get("kv_pages_cached", 0))
            time.sleep(0.05)


def pagedkv_gauge(url: str, name: str) -> float:
    import httpx

    m = re.search(rf'^pagedkv:{name}\{{[^}}]*\}} ([0-9.e+]+)$', httpx.get(url + "/metrics").text, re.M)
    return float(m.group(1))


def summarise(records: list[dict], seconds: float) -> dict:
    def pct(xs, q):
        return float(np.percentile(xs, q)) if xs else float("nan")

    ttft = [r["ttft"] for r in records]
    follow = [r["ttft"] for r in records if r["turn"] > 0]
    tpot = [r["tpot"] for r in records if r["tpot"] is not None]
    prompt = sum(r["prompt"] for r in records)
    return {
        "requests": len(records), "generated": sum(r["tokens"] for r in records), "seconds": seconds,
        "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
        "ttft_follow_p50": pct(follow, 50), "ttft_follow_p99": pct(follow, 99),
        "tpot_p50": pct(tpot, 50), "tpot_p99": pct(tpot, 99),
        "throughput": sum(r["tokens"] for r in records) / seconds,
        "hit_rate": sum(r["cached"] for r in records) / prompt if prompt else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["smollm2", "tiny-random"], default="smollm2")
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--singles", type=int, default=6)
    ap.add_argument("--rate", type=float, default=0.5, help="conversation starts per second")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--pool-mib", type=int, default=256, help="pagedkv's KV pool")
    ap.add_argument("--page-size", type=int, default=16, help="pagedkv's page size")
    ap.add_argument("--prefill-budget", type=int, default=512, help="pagedkv's prompt tokens per step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="3 conversations of 2 turns and 2 singles")
    ap.add_argument("--only", choices=["pagedkv", "mlx_lm"], default=None)
    args = ap.parse_args()
    if args.quick:
        args.conversations, args.turns, args.singles = 3, 2, 2
    trace = make_trace(args)
    n_req = sum(len(it["questions"]) for it in trace["items"])
    print(f"trace: {args.conversations} conversations of {args.turns} turns + {args.singles} single turns "
          f"= {n_req} requests, starts at {args.rate}/s, max_tokens {args.max_tokens}, greedy, streamed; "
          f"model {args.model}", flush=True)
    lm = load(args.model)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        write_mlx_lm_dir(lm, model_dir)
        for side in ("pagedkv", "mlx_lm"):
            if args.only and side != args.only:
                continue
            peak_file = Path(tmp) / "mlx_lm_peak.json"
            t = time.perf_counter()
            if side == "pagedkv":
                proc, url, name = start_pagedkv(args, lm.name)
            else:
                proc, url, name = start_mlx_lm(args, model_dir, peak_file)
            print(f"[{side}] up in {time.perf_counter() - t:.1f} s; warming up ...", flush=True)
            try:
                asyncio.run(run_trace(url, name, {"items": [
                    {"start": 0.0, "system": "Warm-up.", "questions": ["Hi."]}]}, 2))
                polled: dict = {}
                stop_poll = threading.Event()
                poller = None
                if side == "pagedkv":
                    poller = threading.Thread(target=poll_pagedkv_pool, args=(url, stop_poll, polled), daemon=True)
                    poller.start()
                records, seconds = asyncio.run(run_trace(url, name, trace, args.max_tokens))
                stop_poll.set()
                if poller:
                    poller.join()
                s = summarise(records, seconds)
                if side == "pagedkv":
                    from pagedkv.pool_factory import pool_for

                    per_page = pool_for(lm, page_size=args.page_size, tokens=16).bytes_per_page
                    s["kv_running"] = pagedkv_gauge(url, "kv_peak_bytes")
                    s["kv_total"] = polled.get("pages", 0) * per_page
            finally:
                stop(proc)
            if side == "mlx_lm":
                peak = json.loads(peak_file.read_text()) if peak_file.exists() else {}
                s["kv_running"] = float(peak.get("running", float("nan")))
                s["kv_total"] = float(peak.get("total", float("nan")))
            results[side] = s
            print(f"[{side}] {s['requests']} requests, {s['generated']} tokens in {s['seconds']:.1f} s", flush=True)
    show(results)


def show(results: dict) -> None:
    rows = [
        ("TTFT p50, all (s)", "ttft_p50", "lower"), ("TTFT p99, all (s)", "ttft_p99", "lower"),
        ("TTFT p50, follow-up turns (s)", "ttft_follow_p50", "lower"),
        ("TTFT p99, follow-up turns (s)", "ttft_follow_p99", "lower"),
        ("TPOT p50 (s)", "tpot_p50", "lower"), ("TPOT p99 (s)", "tpot_p99", "lower"),
        ("throughput (tokens/s)", "throughput", "higher"),
        ("cache hit rate (prompt tokens)", "hit_rate", "higher"),
        ("peak KV MiB, running requests", "kv_running", "lower"),
        ("peak KV MiB, running + kept for reuse", "kv_total", "lower"),
    ]
    sides = [s for s in ("pagedkv", "mlx_lm") if s in results]
    print()
    print(f"{'':40s}" + "".join(f"{s:>12s}" for s in sides) + ("   pagedkv / mlx_lm" if len(sides) == 2 else ""))
    for label, key, better in rows:
        vals = [results[s].get(key, float("nan")) for s in sides]
        if key.startswith("kv_"):
            vals = [v / 2**20 for v in vals]
        line = f"{label:40s}" + "".join(f"{v:12.3f}" for v in vals)
        if len(vals) == 2 and vals[1]:
            line += f"   {vals[0] / vals[1]:.2f}x ({better} is better)"
        print(line)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
