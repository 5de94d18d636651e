"""``LoadedModel``: an mlx-lm model with what serving it needs besides the weights.

The tokenizer (a ``tokenizers.Tokenizer``), the chat template, the end-of-sequence ids
and the shape of its K/V (attention cache slots, KV heads, key and value widths), so a
pool can be sized for it. Two loaders make one: ``gguf_model.load_gguf_llama`` (a
llama GGUF) and ``mlx_lm_model.load_mlx_lm`` (an mlx-lm model directory, any family
pagedkv serves). Immutable; it owns nothing the engine releases.
"""

from __future__ import annotations

import functools
from typing import Callable

import attrs
import mlx.nn as nn

from pagedkv.model_config import text_config


@attrs.frozen
class LoadedModel:
    model: nn.Module  # an mlx-lm model (``model(tokens, cache=...)`` gives logits)
    tokenizer: object  # a tokenizers.Tokenizer
    chat_template: str  # Jinja source; what ``chat_tokens`` renders unless ``render_chat`` is set
    eos_token_ids: tuple[int, ...]
    num_layers: int  # attention cache slots (the pool has kv_pool_layers(model) layers)
    num_kv_heads: int
    head_dim: int

    name: str = "model"  # what a server calls it
    v_head_dim: int | None = None  # the values' width where it differs from the keys'
    # messages -> prompt text, where the template needs more than messages and
    # add_generation_prompt (a Hugging Face tokenizer's apply_chat_template)
    render_chat: Callable[[list[dict]], str] | None = None

    def chat_prompt(self, user: str, system: str | None = None) -> list[int]:
        """Token ids of the chat template applied to one user message (+ generation prompt)."""
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": user}
        ]
        return self.chat_tokens(messages)

    def chat_tokens(self, messages: list[dict]) -> list[int]:
        """Token ids of the chat template applied to ``messages`` (dicts with "role" and
        "content" strings), ending with the assistant's generation prompt."""
        if self.render_chat is not None:
            return self.encode(self.render_chat(messages))
        text = _template(self.chat_template).render(messages=messages, add_generation_prompt=True)
        return self.encode(text)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; control tokens written in it (``<|im_start|>``) count."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    @property
    def context_length(self) -> int:
        return int(text_config(self.model).get("max_position_embeddings") or 1 << 30)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


@functools.lru_cache(maxsize=8)
def _template(source: str):
    """A chat template, compiled once (compiling costs milliseconds per request)."""
    from jinja2 import Template

    return Template(source)
