"""Half-precision logits over long contexts: mlx-lm's caches and pagedkv's pages, each
measured against a float32 reference.

    python bench/long_context_precision.py                        # CPU: P = 512, 1024
    python bench/long_context_precision.py --tokens 4096,16384    # (a GPU)

Two small models with random weights, built once in float32 and cast: a Llama-shaped
one (mlx-lm's ``llama`` class, 4 full-attention layers, 8 query / 2 KV heads, D = 64)
and a Gemma-3-shaped one (``gemma3_text``, 5 sliding-window layers of 512 + 1 full).
For each context length P, the prompt is prefilled in 512-token forwards, then 8 tokens
are decoded teacher-forced (the same tokens on every side). The reference is mlx-lm's
own caches in float32. For each half dtype, mlx-lm's caches and a paged cache run the
same steps; the table gives, over the 9 positions, the largest |logit - reference| and
how many of the 9 argmaxes equal the reference's.

"paged / mlx-lm" is the ratio of the two errors: about 1 means pagedkv rounds no worse
than mlx-lm does. On a GPU the paged side reads its pages with the CUDA kernels
(decode, and prefill where they are preferred); on the CPU it gathers them for SDPA.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedkv import PagePool, make_paged_cache  # noqa: E402
from pagedkv.generation import prefill  # noqa: E402

LLAMA_SMALL = {
    "model_type": "llama", "hidden_size": 512, "num_hidden_layers": 4, "intermediate_size": 1024,
    "num_attention_heads": 8, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 8192,
    "rope_theta": 500000.0, "tie_word_embeddings": True,
}
GEMMA3_SMALL = {
    "model_type": "gemma3_text", "hidden_size": 512, "num_hidden_layers": 6, "intermediate_size": 1024,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "rms_norm_eps": 1e-6,
    "vocab_size": 8192, "sliding_window": 512, "sliding_window_pattern": 6, "max_position_embeddings": 65536,
    "rope_local_base_freq": 10000.0, "rope_theta": 1000000.0, "query_pre_attn_scalar": 64,
}
MODELS = {"llama": ("llama", LLAMA_SMALL), "gemma3": ("gemma3_text", GEMMA3_SMALL)}
PAGE = 16
DECODE = 8
CHUNK = 512


def build(name: str, dtype: mx.Dtype):
    """The model ``name`` with the same random weights for every dtype (made in float32)."""
    import importlib

    module_name, config = MODELS[name]
    module = importlib.import_module(f"mlx_lm.models.{module_name}")
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def run_logits(model, cache, prompt: list[int], forced: list[int]) -> np.ndarray:
    """Float32 logits [1 + len(forced), vocab]: the prompt's last position, then one per
    teacher-forced decode step."""
    prefill(model, cache, prompt[:-1], CHUNK)
    out = []
    nxt = prompt[-1]
    for tok in [None, *forced]:
        if tok is not None:
            nxt = tok
        logits = model(mx.array([[nxt]]), cache=cache)[0, -1].astype(mx.float32)
        out.append(np.array(logits))
    return np.stack(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="512,1024")
    ap.add_argument("--models", default="llama,gemma3")
    ap.add_argument("--dtypes", default="bfloat16,float16")
    args = ap.parse_args()
    from mlx_lm.models.cache import make_prompt_cache

    print(f"device {mx.default_device()}; prefill in {CHUNK}-token forwards, then {DECODE} decode steps; "
          f"error = max |logit - float32 mlx-lm| over the {DECODE + 1} positions")
    print(f"{'model':8s}{'P':>7s}  {'dtype':9s}{'mlx-lm err':>11s}{'paged err':>11s}{'paged / mlx-lm':>16s}"
          f"{'top-1 mlx-lm':>14s}{'top-1 paged':>13s}{'|ref|max':>10s}")
    for name in args.models.split(","):
        cfg = MODELS[name][1]
        heads = cfg["num_key_value_heads"]
        head_dim = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
        models = {d: build(name, getattr(mx, d)) for d in ["float32", *args.dtypes.split(",")]}
        for n in [int(x) for x in args.tokens.split(",")]:
            prompt = [(i * 7919) % 8000 + 1 for i in range(n)]
            forced = [(i * 104729) % 8000 + 1 for i in range(DECODE)]
            ref = run_logits(models["float32"], make_prompt_cache(models["float32"]), prompt, forced)
            ref_top = ref.argmax(-1)
            for dtype in args.dtypes.split(","):
                model = models[dtype]
                theirs = run_logits(model, make_prompt_cache(model), prompt, forced)
                pool = PagePool(num_layers=cfg["num_hidden_layers"], num_kv_heads=heads, head_dim=head_dim,
                                page_size=PAGE, num_pages=cfg["num_hidden_layers"] * (n + 2 * DECODE) // PAGE + 8,
                                dtype=getattr(mx, dtype))
                with make_paged_cache(model, pool) as cache:
                    ours = run_logits(model, cache, prompt, forced)
                e_theirs = float(np.abs(theirs - ref).max())
                e_ours = float(np.abs(ours - ref).max())
                print(f"{name:8s}{n:7d}  {dtype:9s}{e_theirs:11.4f}{e_ours:11.4f}{e_ours / max(e_theirs, 1e-30):16.2f}"
                      f"{int((theirs.argmax(-1) == ref_top).sum()):>11d}/{len(ref)}"
                      f"{int((ours.argmax(-1) == ref_top).sum()):>10d}/{len(ref)}{float(np.abs(ref).max()):10.2f}",
                      flush=True)


if __name__ == "__main__":
    main()
