"""The serving ``Engine`` with and without ``compiled_decode`` and ``overlap_decode``,
same requests, one run.

    python3 bench/gpu_engine.py [--model 1b|8b|tiny|gemma3-1b|gemma3-tiny|gemma3n-e2b|gemma3n-tiny|
                                         lfm2-1.2b|lfm2-tiny|granite4-micro|granite4-tiny]
                                [--requests 32] [--prompt 512]
                                [--new 128] [--rounds 2] [--dtype float16|bfloat16|float32]

Issue 15: what ``CompiledDecode`` gives a server, not a fixed batch. ``--requests``
requests of ``--prompt`` random tokens each are queued at once; request i asks for
``--new`` minus (i % 8) x new/16 tokens, so the batch shrinks in 8 stages near the end
and the compiled engine meets 8 batch sizes (a trace each). Prefill budget: every
prompt in the first step, so decoding is what the run measures. Greedy; no prefix
caching (random prompts share nothing).

Each side keeps one engine for the whole run, as a server would; a round queues the
requests again and steps until every one is done (the sides take turns). Round 1 of the
compiled side pays its traces (one per batch size and table width); later rounds
replay them.
Sides: ``eager`` and ``compiled`` read each step's tokens before building the next
(``overlap_decode=False``); ``eager+ovl`` and ``compiled+ovl`` build step n + 1 while
step n runs (``overlap_decode=True``, the engine's default).
Printed per round and side: wall seconds, generated tokens/s, engine steps, and for
the compiled sides their traces so far; per round, compiled / eager and each side with
overlap / without. Last: how many requests gave the same tokens on each side as on
``eager`` (fp16 rounding can flip a near-tie between random-weight logits).
Model: mlx-lm's llama class with random weights (``gpu_generate.model_of``), fp16 unless
``--dtype`` says otherwise; ``--model gemma3-1b`` (or ``gemma3-tiny``) is mlx-lm's
gemma3_text class in Gemma 3 1B's shape (26 layers, 5 of each 6 with a sliding window of
512; head_dim 256, one KV head; a 262k vocabulary), so prompts of 512 and more leave the
window and the sliding layers drop pages as they decode. ``--model gemma3n-e2b`` (or
``gemma3n-tiny``) is mlx-lm's gemma3n class in Gemma 3n E2B's text shape (30 layers, 4 of
each 5 sliding over 512; the last 10 layers read earlier layers' K/V; a 262k vocabulary).
Hybrid models (recurrent layers beside attention; each engine gets a ``StatePool`` with a
slot per request and a few spare): ``--model lfm2-1.2b`` is mlx-lm's lfm2 class in
LFM2-1.2B's shape (16 layers, 10 short-convolution and 6 attention), ``granite4-micro``
its granitemoehybrid class in a Granite-4.0-H-Micro-like shape (40 layers, 36 Mamba-2
and 4 attention); ``lfm2-tiny`` and ``granite4-tiny`` are small ones.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from gpu_generate import PS, SHAPES, model_of, random_model  # noqa: E402

from pagedkv import PagePool, StatePool  # noqa: E402
from pagedkv.model_config import text_config  # noqa: E402
from pagedkv.serving import Engine, GenerationRequest, SamplingParams  # noqa: E402

# gemma3_text shapes: 5 sliding-window layers to each full-attention one
GEMMA3_SHAPES = {
    "gemma3-1b": dict(hidden_size=1152, num_hidden_layers=26, intermediate_size=6912, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=256, sliding_window=512, vocab_size=262144,
                      query_pre_attn_scalar=256),
    "gemma3-tiny": dict(hidden_size=256, num_hidden_layers=6, intermediate_size=512, num_attention_heads=4,
                        num_key_value_heads=1, head_dim=64, sliding_window=64, vocab_size=32000,
                        query_pre_attn_scalar=64),
}
# gemma3n shapes (its text stack): 4 sliding layers to each full one, the last layers KV-shared
GEMMA3N_SHAPES = {
    "gemma3n-e2b": dict(hidden_size=2048, num_hidden_layers=30, intermediate_size=8192, num_attention_heads=8,
                        num_key_value_heads=2, head_dim=256, sliding_window=512, vocab_size=262400,
                        num_kv_shared_layers=10, vocab_size_per_layer_input=262144, hidden_size_per_layer_input=256,
                        laurel_rank=64),
    "gemma3n-tiny": dict(hidden_size=256, num_hidden_layers=10, intermediate_size=512, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, sliding_window=64, vocab_size=32000,
                         num_kv_shared_layers=4, vocab_size_per_layer_input=32000, hidden_size_per_layer_input=16,
                         laurel_rank=16),
}


# hybrid shapes: mlx-lm model type and config
HYBRID_SHAPES = {
    "lfm2-1.2b": ("lfm2", dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                               vocab_size=65536, block_dim=2048, block_ff_dim=12288, block_multiple_of=256,
                               block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True,
                               full_attn_idxs=[2, 5, 8, 10, 12, 14])),
    "lfm2-tiny": ("lfm2", dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                               vocab_size=32000, block_dim=256, block_ff_dim=512, block_multiple_of=64,
                               block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False,
                               full_attn_idxs=[2, 5])),
    "granite4-micro": ("granitemoehybrid", dict(
        hidden_size=2048, num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8, vocab_size=100352,
        intermediate_size=8192, shared_intermediate_size=8192, mamba_n_heads=64, mamba_d_head=64,
        mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4, mamba_chunk_size=256,
        layer_types=["attention" if i % 10 == 9 else "mamba" for i in range(40)])),
    "granite4-tiny": ("granitemoehybrid", dict(
        hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, vocab_size=32000,
        intermediate_size=512, shared_intermediate_size=512, mamba_n_heads=8, mamba_d_head=32, mamba_d_state=32,
        mamba_n_groups=1, mamba_d_conv=4, mamba_chunk_size=64,
        layer_types=["attention" if i % 4 == 3 else "mamba" for i in range(8)])),
}
HYBRID_DEFAULTS = {
    "lfm2": dict(max_position_embeddings=128000, norm_eps=1e-5, conv_bias=False, conv_L_cache=3),
    "granitemoehybrid": dict(max_position_embeddings=131072, rms_norm_eps=1e-5, attention_bias=False,
                             embedding_multiplier=12.0, attention_multiplier=0.0078125, logits_scaling=8.0,
                             residual_multiplier=0.22, num_local_experts=None, num_experts_per_tok=None,
                             mamba_proj_bias=False, mamba_conv_bias=True, mlp_bias=False,
                             position_embedding_type="rope", rope_theta=10000.0, time_step_limit=(0.0, float("inf")),
                             tie_word_embeddings=True),
}


def hybrid_of(shape: str, dtype):
    """mlx-lm's lfm2 or granitemoehybrid class with random weights in ``shape``."""
    import importlib

    kind, cfg = HYBRID_SHAPES[shape]
    return random_model(importlib.import_module(f"mlx_lm.models.{kind}"),
                        dict(model_type=kind, **HYBRID_DEFAULTS[kind], **cfg), dtype)


def gemma3_of(shape: str, dtype):
    """mlx-lm's gemma3_text class with random weights (Gemma 3 1B's shape, or a tiny one)."""
    from mlx_lm.models import gemma3_text

    cfg = dict(model_type="gemma3_text", rms_norm_eps=1e-6, sliding_window_pattern=6, rope_theta=1000000.0,
               rope_local_base_freq=10000.0, max_position_embeddings=32768, **GEMMA3_SHAPES[shape])
    return random_model(gemma3_text, cfg, dtype)


def gemma3n_of(shape: str, dtype):
    """mlx-lm's gemma3n class with random weights: every fifth layer full attention, the
    others a sliding window; the last ``num_kv_shared_layers`` layers compute no K/V and
    read those of the last earlier layer of their kind (Gemma 3n E2B's shape, or a tiny one)."""
    from mlx_lm.models import gemma3n

    text = dict(GEMMA3N_SHAPES[shape])
    n = text["num_hidden_layers"]
    text.update(model_type="gemma3n_text", rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                max_position_embeddings=32768, final_logit_softcapping=30.0, altup_num_inputs=4,
                altup_coef_clip=120.0, altup_correct_scale=True, altup_active_idx=0,
                layer_types=["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(n)],
                activation_sparsity_pattern=[0.0] * n)
    return random_model(gemma3n, dict(model_type="gemma3n", text_config=text), dtype)


def make_engine(model, prompts: list[list[int]], news: list[int], compiled: bool, overlap: bool, dtype) -> Engine:
    a = text_config(model)
    pages = sum(-(-(len(p) + n + 1) // PS) for p, n in zip(prompts, news)) + 2
    # one pool layer per cache slot (a KV-sharing model has fewer slots than layers)
    from pagedkv.mlx_lm_caches import flat_caches

    attn = [c for c in flat_caches(model.make_cache()) if type(c).__name__ != "ArraysCache"]
    pool = PagePool(num_layers=len(attn), num_kv_heads=a["num_key_value_heads"],
                    head_dim=a.get("head_dim") or a["hidden_size"] // a["num_attention_heads"], page_size=PS, num_pages=pages, dtype=dtype)
    states = StatePool.for_model(model, num_slots=len(prompts) + 4) if is_hybrid(model) else None
    return Engine(model, pool, decode=lambda ids: "", max_batch=len(prompts), prefix_caching=False, state_pool=states,
                  prefill_budget=sum(map(len, prompts)), prefill_chunk=max(map(len, prompts)),
                  compiled_decode=compiled, overlap_decode=overlap)


def is_hybrid(model) -> bool:
    from pagedkv.mlx_lm_caches import flat_caches

    return any(type(c).__name__ == "ArraysCache" for c in flat_caches(model.make_cache()))


def run_round(engine: Engine, prompts: list[list[int]], news: list[int], r: int) -> dict:
    """Queue every request (ids of round ``r``) and step until all are done."""
    out: dict[str, list[int]] = {}

    def sink(d) -> None:
        out.setdefault(d.rid, []).extend(d.token_ids)

    for i, (p, n) in enumerate(zip(prompts, news)):
        engine.add(GenerationRequest(f"{r}.{i}", p, SamplingParams(max_tokens=n), sink))
    mx.synchronize()
    t0 = time.perf_counter()
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
    mx.synchronize()
    seconds = time.perf_counter() - t0
    return dict(seconds=seconds, tokens=sum(map(len, out.values())), steps=steps,
                out=[out[f"{r}.{i}"] for i in range(len(prompts))],
                traces=engine._compiled.traces if engine._compiled is not None else 0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(SHAPES) + sorted(GEMMA3_SHAPES) + sorted(GEMMA3N_SHAPES) + sorted(HYBRID_SHAPES),
                    default="1b")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    args = ap.parse_args()
    dtype = getattr(mx, args.dtype)
    build, kind = ((gemma3_of, "gemma3_text") if args.model in GEMMA3_SHAPES else
                   (gemma3n_of, "gemma3n") if args.model in GEMMA3N_SHAPES else
                   (hybrid_of, HYBRID_SHAPES[args.model][0]) if args.model in HYBRID_SHAPES else (model_of, "llama"))
    model = build(args.model, dtype)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, text_config(model)["vocab_size"], args.prompt).tolist() for _ in range(args.requests)]
    news = [args.new - (i % 8) * (args.new // 16) for i in range(args.requests)]
    print(f"mlx {mx.__version__} {mx.default_device()}; {args.model}-shaped {kind}, {args.dtype}; {args.requests} requests "
          f"of {args.prompt} prompt tokens, {min(news)}-{max(news)} new tokens each", flush=True)
    print(f"{'round':>5} {'side':>12} {'seconds':>8} {'tok/s':>8} {'steps':>6} {'traces':>7}", flush=True)
    sides = {"eager": (False, False), "eager+ovl": (False, True), "compiled": (True, False),
             "compiled+ovl": (True, True)}
    engines = {side: make_engine(model, prompts, news, compiled, overlap, dtype)
               for side, (compiled, overlap) in sides.items()}
    last = {}
    for r in range(1, args.rounds + 1):
        for side, engine in engines.items():
            res = run_round(engine, prompts, news, r)
            last[side] = res
            print(f"{r:>5} {side:>12} {res['seconds']:>8.2f} {res['tokens'] / res['seconds']:>8.0f} "
                  f"{res['steps']:>6} {res['traces'] if sides[side][0] else '':>7}", flush=True)
        speed = {side: res["tokens"] / res["seconds"] for side, res in last.items()}
        print(f"      round {r}: tokens/s compiled/eager {speed['compiled'] / speed['eager']:.2f}x, "
              f"overlap/not: eager {speed['eager+ovl'] / speed['eager']:.2f}x, "
              f"compiled {speed['compiled+ovl'] / speed['compiled']:.2f}x", flush=True)
    same = {side: sum(e == c for e, c in zip(last["eager"]["out"], res["out"])) for side, res in last.items()}
    print("same tokens as eager: " + ", ".join(f"{side} {n}/{args.requests}" for side, n in same.items()
                                                if side != "eager"), flush=True)
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
