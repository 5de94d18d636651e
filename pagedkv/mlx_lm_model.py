"""``load_mlx_lm``: an mlx-lm model directory (``config.json``, safetensors weights, a
Hugging Face tokenizer) as a ``LoadedModel``, so ``pagedkv serve --model DIR`` serves
any family pagedkv's caches serve (tests/test_model_families.py), not only llama GGUFs.

mlx-lm's own ``load`` builds the model (quantised weights included) and the tokenizer;
this adds what a pool and a server need: the K/V shape, read off mlx-lm's own caches
after a one-token forward (so every family reports it the same way), the fast
tokenizer underneath (``tokenizers.Tokenizer``), its chat template applied by the
tokenizer itself (templates use ``bos_token``, ``raise_exception`` and the like), and
the end-of-sequence ids mlx-lm found. Loads nothing from the network: ``path`` must be
a local directory. Needs the ``examples`` extra (mlx-lm, tokenizers).
"""

from __future__ import annotations

import os
from pathlib import Path

from pagedkv.errors import InvalidValueError, NotSupportedError
from pagedkv.loaded_model import LoadedModel
from pagedkv.pool_factory import kv_shape


def is_mlx_lm_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory holding a ``config.json`` (an mlx-lm model)."""
    return (Path(path) / "config.json").is_file()


def load_mlx_lm(path: str | os.PathLike) -> LoadedModel:
    """The model in directory ``path``, named after the directory. ``InvalidValueError``
    when it is not an mlx-lm model directory or mlx-lm cannot load it (no weights, a
    broken ``config.json``, a family mlx-lm lacks); ``NotSupportedError`` when its tokenizer has
    no fast (``tokenizers``) form or the model has no attention layers."""
    from mlx_lm import load

    path = Path(path)
    if not is_mlx_lm_dir(path):
        raise InvalidValueError(f"{path} is not an mlx-lm model directory (no config.json)")
    try:  # (the wrapper hands other attributes on to the Hugging Face tokenizer)
        model, wrapper = load(str(path))
    except (OSError, ValueError, KeyError, TypeError) as e:  # no weights, bad config.json, unknown family
        raise InvalidValueError(f"cannot load {path} with mlx-lm: {type(e).__name__}: {e}") from None
    backend = getattr(wrapper, "backend_tokenizer", None)
    if backend is None:
        raise NotSupportedError(f"{path}: the tokenizer has no fast (tokenizers) form")
    num_layers, kv_heads, head_dim, v_head_dim = kv_shape(model)
    template = wrapper.chat_template if isinstance(wrapper.chat_template, str) else None

    def render(messages: list[dict]) -> str:
        if template is None:
            raise InvalidValueError(f"{path.name} has no chat template: send a prompt to /v1/completions")
        return wrapper.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    return LoadedModel(
        model=model, tokenizer=backend, chat_template=template or "", eos_token_ids=tuple(sorted(wrapper.eos_token_ids)),
        num_layers=num_layers, num_kv_heads=kv_heads, head_dim=head_dim, name=path.name,
        v_head_dim=v_head_dim if v_head_dim != head_dim else None, render_chat=render,
    )


def save_mlx_lm(lm: LoadedModel, path: str | os.PathLike) -> Path:
    """Write ``lm`` as an mlx-lm model directory that ``load_mlx_lm`` and mlx-lm's own
    ``load`` read back: ``config.json`` (the model's args, each quantised module's group
    size and bits, the end-of-sequence ids), ``model.safetensors`` (every parameter as it
    is, quantised ones packed) and the tokenizer as ``tokenizer.json`` with its chat
    template in ``tokenizer_config.json``. For example, a llama GGUF converted once and
    served as a directory. ``path`` is created; files in it are overwritten."""
    import dataclasses
    import json

    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    args = lm.model.args
    if dataclasses.is_dataclass(args):  # (a field left at its None default is left out: strict
        # config classes, as transformers' that loading the tokenizer reads, refuse a None)
        config = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)
                  if not (getattr(args, f.name) is None and f.default is None)}
        config = json.loads(json.dumps(config, default=lambda o: dataclasses.asdict(o)))
    else:
        config = dict(vars(args))
    quantized = {name: {"group_size": m.group_size, "bits": m.bits} for name, m in lm.model.named_modules()
                 if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}
    if quantized:
        first = next(iter(quantized.values()))
        config["quantization"] = {**first, **quantized}
    config["eos_token_id"] = list(lm.eos_token_ids)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(lm.model.parameters())))
    lm.tokenizer.save(str(path / "tokenizer.json"))
    vocab = lm.tokenizer.get_vocab(with_added_tokens=True)
    ids = {i: t for t, i in vocab.items()}
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": lm.chat_template,
        "eos_token": ids[lm.eos_token_ids[0]], "clean_up_tokenization_spaces": False,
    }, indent=2))
    return path
