"""``text_config``: the hyper-parameters of an mlx-lm model's language stack.

mlx-lm's text-only models keep them on ``model.args`` (an attrs-like dataclass:
``vocab_size``, ``max_position_embeddings``, ``layer_types``...). Its multimodal
wrappers (gemma3n, gemma3) keep the language model's under ``model.args.text_config``,
a dict or a dataclass, and ``args`` itself holds no ``vocab_size``. Code that sizes
requests or plans layers reads them through this one function, so both kinds work.
"""

from __future__ import annotations

from typing import Any


def text_config(model: Any) -> dict:
    """The language model's hyper-parameters as a dict (a new dict; the model's args are
    not changed). Empty when ``model`` has no ``args``. O(number of fields)."""
    args = getattr(model, "args", None)
    if args is None:
        return {}
    inner = getattr(args, "text_config", None)
    cfg = inner if inner else args
    return dict(cfg) if isinstance(cfg, dict) else dict(vars(cfg))
