"""``text_config``: the hyper-parameters of an mlx-lm model's language stack, and
``check_token_ids``: token ids a model's embedding can take.

mlx-lm's text-only models keep them on ``model.args`` (an attrs-like dataclass:
``vocab_size``, ``max_position_embeddings``, ``layer_types``...). Its multimodal
wrappers (gemma3n, gemma3) keep the language model's under ``model.args.text_config``,
a dict or a dataclass, and ``args`` itself holds no ``vocab_size``. Code that sizes
requests or plans layers reads them through this one function, so both kinds work.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Sequence

import numpy as np

from pagedkv.errors import InvalidTypeError, InvalidValueError


def text_config(model: Any) -> dict:
    """The language model's hyper-parameters as a dict (a new dict; the model's args are
    not changed). Empty when ``model`` has no ``args``. O(number of fields)."""
    args = getattr(model, "args", None)
    if args is None:
        return {}
    inner = getattr(args, "text_config", None)
    cfg = inner if inner else args
    return dict(cfg) if isinstance(cfg, dict) else dict(vars(cfg))


def check_eos_ids(name: str, ids: object) -> frozenset[int]:
    """End-of-sequence ids ``name``: any iterable of ints >= 0 (``check_token_ids``). A
    str, bytes or a single int is an ``InvalidTypeError`` (a str was taken apart into
    characters that never match; an int raised a bare ``TypeError``). An id past the
    vocabulary is let through: it is never sampled, and some tokenizers list such ids."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise InvalidTypeError(f"{name} must be an iterable of token ids, got {type(ids).__name__}")
    try:
        return frozenset(check_token_ids(list(ids), None))
    except InvalidValueError as e:
        raise InvalidValueError(f"{name}: {e}") from None


def check_token_ids(ids: Sequence[Any], vocab_size: int | None) -> list[int]:
    """``ids`` as a list of Python ints, or ``InvalidValueError`` naming the first few bad
    ones unless each is an integer (Python or numpy; not a bool) in [0, vocab_size) (any
    id >= 0 where the vocabulary size is not known). An id past the embedding table is
    not an error MLX reports: it reads past the table, and the model writes what it read
    into the cache. O(len(ids))."""
    out = [int(t) if isinstance(t, np.integer) else t for t in ids]
    top = vocab_size if vocab_size else float("inf")
    bad = [t for t in out if t.__class__ is not int or not 0 <= t < top]
    if bad:
        shown = bad[:4]
        raise InvalidValueError(f"token ids must be ints in [0, {vocab_size or 'inf'}), got {shown}"
                                + (f" and {len(bad) - 4} more" if len(bad) > 4 else ""))
    return out
