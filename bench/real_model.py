"""SmolLM2-135M decode speed: PagedKVCache vs mlx-lm's KVCache, same run.

    python bench/real_model.py [--quick]

Both caches hold the same K/V (prefilled once with real text through KVCache, then
copied into the paged cache), then decode steps alternate between them; each step is
trimmed away again so the context stays at 256 or 2048 tokens. Last line: paged/KVCache
decode tokens/s at 2048.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from timing import fixed_context_step, time_interleaved  # noqa: E402

from pagedkv import make_paged_cache  # noqa: E402
from pagedkv.gguf_model import load_smollm2  # noqa: E402
from pagedkv.pool_factory import pool_for  # noqa: E402

TEXT = (
    "Paged attention stores the key and value cache of a language model in fixed-size blocks. "
    "A block table maps each sequence's logical positions to physical blocks, so memory is "
    "reserved a page at a time instead of for the longest possible sequence. "
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    repeats = 3 if args.quick else 9
    inner = 4 if args.quick else 8
    lm = load_smollm2()
    ids = lm.tokenizer.encode(TEXT * 200, add_special_tokens=False).ids
    print(f"{'context':>8}{'KVCache tok/s':>15}{'paged tok/s':>13}{'ratio':>8}")
    ratio = {}
    for ctx in (256, 2048):
        ref = make_prompt_cache(lm.model)
        for i in range(0, ctx, 512):
            mx.eval(lm.model(mx.array(ids[i : min(ctx, i + 512)])[None], cache=ref))
        pool = pool_for(lm, page_size=16, tokens=ctx + 64)
        paged = make_paged_cache(lm.model, pool)
        for r, p in zip(ref, paged):
            p.state = (r.keys[..., :ctx, :], r.values[..., :ctx, :])
        tok = mx.array([[ids[ctx]]])

        t = time_interleaved({"ref": lambda: fixed_context_step(lm.model, tok, ref),
                              "paged": lambda: fixed_context_step(lm.model, tok, paged)}, repeats, inner=inner)
        ratio[ctx] = t["ref"] / t["paged"]
        print(f"{ctx:>8}{1 / t['ref']:>15.1f}{1 / t['paged']:>13.1f}{ratio[ctx]:>8.3f}")
        paged.release()
    print(f"decode tokens/s at 2048, paged/KVCache: {ratio[2048]:.3f}")


if __name__ == "__main__":
    main()
