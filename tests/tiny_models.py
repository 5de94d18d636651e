"""Tiny random-weight mlx-lm models (mlx-lm's own classes, no download) for reference tests."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.utils import _get_classes

from pagedkv import AffineQuant, PagePool, rotated

VOCAB = 128

ON_CPU = mx.default_device() == mx.cpu
LOGITS_ATOL = 1e-4 if ON_CPU else 1e-2
"""How far float32 logits of two exact cache implementations may differ: float rounding
on the CPU. On a CUDA GPU, float32 matmuls of different shapes (B rows vs one, a chunk vs
a whole prompt) differed by up to 4.4e-3 on the H200 (greedy tokens still equal)."""


def logits_atol(pages: str) -> float:
    """``LOGITS_ATOL`` for a page kind. On a GPU, those float differences sometimes flip a
    4-bit rotated code: measured up to 1.04e-2 (a batch row vs the row alone), so 3e-2."""
    return LOGITS_ATOL if ON_CPU or pages in ("fp", "affine8") else 3e-2

CONFIGS = {
    "llama": {
        "model_type": "llama", "hidden_size": 128, "num_hidden_layers": 3, "intermediate_size": 96,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB, "rope_theta": 10000.0, "tie_word_embeddings": False,
    },
    "llama_d128": {  # head_dim 128, so every quantisation group size (32/64/128) fits
        "model_type": "llama", "hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 96,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128, "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB, "rope_theta": 10000.0, "tie_word_embeddings": False,
    },
    "qwen3": {
        "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 3, "intermediate_size": 96,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB, "max_position_embeddings": 1024, "head_dim": 64,
        "tie_word_embeddings": True, "rope_theta": 1000000.0,
    },
    "gemma3_text": {  # sliding-window layers (window 12) between full-attention ones
        "model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 96,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB, "sliding_window": 12, "sliding_window_pattern": 2,
        "max_position_embeddings": 1024, "rope_local_base_freq": 10000.0, "rope_theta": 1000000.0,
        "query_pre_attn_scalar": 16,
    },
    "gemma3n": {
        "model_type": "gemma3n",
        "text_config": {
            "model_type": "gemma3n_text", "hidden_size": 64, "num_hidden_layers": 6,
            "intermediate_size": 96, "num_attention_heads": 4, "head_dim": 16,
            "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "num_key_value_heads": 2,
            "num_kv_shared_layers": 2, "vocab_size_per_layer_input": VOCAB,
            "sliding_window": 12, "max_position_embeddings": 1024,
            "rope_local_base_freq": 10000.0, "rope_theta": 1000000.0,
            "final_logit_softcapping": 30.0,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                            "sliding_attention", "sliding_attention", "full_attention"],
            "activation_sparsity_pattern": [0.0] * 6, "hidden_size_per_layer_input": 8,
            "altup_num_inputs": 2, "altup_coef_clip": 120.0, "altup_correct_scale": True,
            "altup_active_idx": 0, "laurel_rank": 8,
        },
    },
    # hybrids: recurrent layers (mlx-lm ArraysCache) next to attention
    "qwen3_next": {  # gated delta + attention, MoE MLPs
        "model_type": "qwen3_next", "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128,
        "num_attention_heads": 4, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
        "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 64, "mlp_only_layers": [], "moe_intermediate_size": 32,
        "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "num_key_value_heads": 2, "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5, "max_position_embeddings": 1024, "head_dim": 16,
        "full_attention_interval": 2,
    },
    "nemotron_h": {  # Mamba-2 + attention + MLP blocks
        "model_type": "nemotron_h", "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
        "max_position_embeddings": 1024, "num_attention_heads": 4, "num_key_value_heads": 2,
        "attention_bias": False, "mamba_num_heads": 4, "mamba_head_dim": 16, "mamba_proj_bias": False,
        "ssm_state_size": 16, "conv_kernel": 4, "n_groups": 2, "mlp_bias": False,
        "layer_norm_epsilon": 1e-5, "use_bias": False, "use_conv_bias": True,
        "hybrid_override_pattern": ["M", "*", "-", "M", "M", "*"], "head_dim": 16,
    },
    "falcon_h1": {  # Mamba-2 and attention side by side in every layer (mlx-lm CacheList)
        "model_type": "falcon_h1", "head_dim": 16, "hidden_size": 64, "intermediate_size": 128,
        "mamba_d_head": 16, "mamba_d_ssm": 64, "mamba_d_state": 16, "mamba_n_heads": 4, "mamba_n_groups": 1,
        "mamba_chunk_size": 8, "num_attention_heads": 4, "num_hidden_layers": 3, "num_key_value_heads": 2,
        "vocab_size": VOCAB, "max_position_embeddings": 1024,
        "lm_head_multiplier": 1.0, "embedding_multiplier": 1.0,  # (logits of a useful spread)
    },
    "gear": {  # short convolutions (mlx-lm ArraysCache) beside sliding-window and full attention
        "model_type": "gear", "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "rms_norm_eps": 1e-6, "sliding_window": 12, "max_position_embeddings": 1024,
        "layer_types": ["conv_mixer", "sliding_attention", "full_attention"] * 2,
    },
}

HYBRIDS = ("qwen3_next", "nemotron_h", "falcon_h1")
"""mlx-lm hybrid architectures (recurrent + attention layers) the hybrid tests run; "gear"
(recurrent, sliding and full layers) has tests of its own: prefix caching does not serve
sliding hybrids."""


def make_model(kind: str, seed: int = 0):
    """A float32 mlx-lm model of ``kind`` with random weights, evaluated."""
    return model_of_config(CONFIGS[kind], seed)


def model_of_config(cfg: dict, seed: int = 0):
    """mlx-lm's own model class for the config dict ``cfg`` (its "model_type" picks it),
    with random float32 weights drawn from ``seed``, evaluated."""
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(cfg))
    mx.eval(model.parameters())
    return model


def kv_dims(kind: str) -> tuple[int, int, int]:
    """(cache slots, kv heads, head_dim) of ``kind``'s caches."""
    cfg = CONFIGS[kind]
    if kind == "gemma3n":
        t = cfg["text_config"]
        return t["num_hidden_layers"] - t["num_kv_shared_layers"], t["num_key_value_heads"], t["head_dim"]
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    return cfg["num_hidden_layers"], cfg["num_key_value_heads"], head_dim


PAGE_KINDS = ("fp", "affine8", "rotated4", "mixed")
"""Every page kind the engine serves: full precision; one 8-bit affine codec for K and V
(mlx-lm's quantised attention path); TurboQuant-rotated 4-bit K and V; 8-bit affine K
with rotated 4-bit V."""


def codecs_for(pages: str, head_dim: int) -> tuple:
    if pages not in PAGE_KINDS:
        raise ValueError(pages)
    return {
        "fp": lambda: (None, None),
        "affine8": lambda: (AffineQuant(8, 32), AffineQuant(8, 32)),
        "rotated4": lambda: (rotated(4, head_dim, 32, seed=1), rotated(4, head_dim, 32, seed=2)),
        "mixed": lambda: (AffineQuant(8, 32), rotated(4, head_dim, 32, seed=2)),
    }[pages]()


def make_pool(kind: str, page_size: int = 16, num_pages: int = 256, dtype=mx.float32,
              pages: str = "fp", num_layers: int | None = None) -> PagePool:
    """A pool for ``kind``'s caches; ``num_layers``: fewer layers than its cache slots,
    so that ``make_paged_cache`` uses it in layer groups."""
    layers, heads, head_dim = kv_dims(kind)
    k_codec, v_codec = codecs_for(pages, head_dim)
    return PagePool(num_layers=num_layers or layers, num_kv_heads=heads, head_dim=head_dim,
                    page_size=page_size, num_pages=num_pages, dtype=dtype, k_codec=k_codec, v_codec=v_codec)


def greedy(model, prompt: list[int], cache, steps: int) -> tuple[list[int], list[mx.array]]:
    """Prefill ``prompt`` then ``steps`` greedy tokens; returns (tokens, logits per step)."""
    logits = model(mx.array(prompt)[None], cache=cache)[0, -1]
    tokens, all_logits = [], []
    for _ in range(steps):
        mx.eval(logits)
        all_logits.append(logits)
        tok = int(mx.argmax(logits).item())
        tokens.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)[0, -1]
    return tokens, all_logits


def prompt_of(length: int, seed: int = 1) -> list[int]:
    mx.random.seed(seed)
    return mx.random.randint(0, VOCAB, (length,)).tolist()
