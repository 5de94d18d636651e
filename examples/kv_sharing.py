"""A Gemma-3n-style model whose later layers share the K/V of earlier ones.

    python examples/kv_sharing.py --steps 32

mlx-lm's gemma3n classes with small random weights. ``KvSharingPlan`` says which layers
own caches (donors) and whose K/V each sharer reads; ``make_paged_cache`` builds paged
caches for the donors only; inside each ``ForwardPass`` every donor publishes a
``ViewKv`` of its step's K/V and its sharers attend over that same object. The pass
releases everything at its end. Prints the KV memory saved by sharing, and checks the
logits against mlx-lm's own cache path.
"""

import argparse

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import _get_classes

from pagedkv import ForwardPass, KvSharingPlan, PagePool, donor_caches, make_paged_cache
from pagedkv.cli import positive_int

CONFIG = {
    "model_type": "gemma3n",
    "text_config": {
        "model_type": "gemma3n_text", "hidden_size": 128, "num_hidden_layers": 12,
        "intermediate_size": 256, "num_attention_heads": 4, "head_dim": 32, "rms_norm_eps": 1e-6,
        "vocab_size": 512, "num_key_value_heads": 2, "num_kv_shared_layers": 6,
        "vocab_size_per_layer_input": 512, "sliding_window": 64, "max_position_embeddings": 2048,
        "rope_local_base_freq": 10000.0, "rope_theta": 1000000.0, "final_logit_softcapping": 30.0,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3
        + ["full_attention"] + ["sliding_attention"] * 3 + ["full_attention"],
        "activation_sparsity_pattern": [0.0] * 12, "hidden_size_per_layer_input": 16,
        "altup_num_inputs": 2, "altup_coef_clip": 120.0, "altup_correct_scale": True,
        "altup_active_idx": 0, "laurel_rank": 16,
    },
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-len", type=positive_int, default=96)
    ap.add_argument("--steps", type=positive_int, default=32)
    args = ap.parse_args()
    model_cls, args_cls = _get_classes(CONFIG)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(CONFIG))
    mx.eval(model.parameters())
    text = CONFIG["text_config"]

    plan = KvSharingPlan.from_model(model)
    print(f"layers: {len(plan.layer_types)}, donors (own a cache): {list(plan.donors)}")
    for donor in plan.donors:
        if plan.sharers_of(donor):
            print(f"  donor {donor} ({plan.layer_types[donor]}) is read by sharers {list(plan.sharers_of(donor))}")

    pool = PagePool(num_layers=plan.num_donors, num_kv_heads=text["num_key_value_heads"],
                    head_dim=text["head_dim"], page_size=16, num_pages=128, dtype=mx.float32)
    paged = make_paged_cache(model, pool)
    caches = donor_caches(paged)
    ref_cache = make_prompt_cache(model)

    mx.random.seed(1)
    x = mx.random.randint(0, text["vocab_size"], (1, args.prompt_len))
    worst = 0.0
    for _ in range(args.steps):
        with ForwardPass():
            logits = model(x, cache=caches)[:, -1]
            mx.eval(logits)
        ref = model(x, cache=ref_cache)[:, -1]
        worst = max(worst, mx.abs(logits - ref).max().item())
        x = mx.argmax(logits, axis=-1)[None]

    tokens = paged.num_tokens
    # Without sharing, every layer owns a cache like its donor's.
    per_layer = {i: c.nbytes for i, c in enumerate(paged)}
    unshared = sum(per_layer[plan.donor_of(i)] for i in range(len(plan.layer_types)))
    donors_only = sum(per_layer.values())
    print(f"\n{tokens} tokens; max |logits - mlx-lm| over {args.steps} steps: {worst:.2e}")
    print(f"KV bytes with sharing:    {donors_only / 2**20:7.2f} MiB ({plan.num_donors} layers own caches)")
    print(f"KV bytes without sharing: {unshared / 2**20:7.2f} MiB (all {len(plan.layer_types)} layers)")
    print(f"saved by sharing: {1 - donors_only / unshared:.0%}")
    paged.release()
    pool.allocator.check()
    if worst > 1e-4:
        raise SystemExit("paged logits differ from mlx-lm's")


if __name__ == "__main__":
    main()
