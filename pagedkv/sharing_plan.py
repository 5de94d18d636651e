"""``KvSharingPlan``: which layers own KV caches and which layers read whose K/V.

Gemma 3n / Gemma 4 style: the first ``n - num_kv_shared_layers`` layers are donors and
own caches; each later layer (a sharer) attends over the K/V of the *last donor of its
own attention type* (sliding sharers read the last sliding donor, full-attention
sharers the last full donor)::

    layer_types: [S, S, F, S, S, F]   num_kv_shared_layers = 2
    donors:       0  1  2  3            sharers: 4 (S) -> 3, 5 (F) -> 2
    source:      [0, 1, 2, 3, 3, 2]
"""

from __future__ import annotations

import attrs

from pagedkv.errors import InvalidValueError, check_index
from pagedkv.model_config import text_config


def _types(value) -> tuple[str, ...]:
    return tuple(str(t) for t in value)


@attrs.frozen
class KvSharingPlan:
    layer_types: tuple[str, ...] = attrs.field(converter=_types)
    num_kv_shared_layers: int = attrs.field(validator=attrs.validators.ge(0))
    source: tuple[int, ...] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        n = len(self.layer_types)
        if self.num_kv_shared_layers >= n and n:
            raise InvalidValueError(f"{self.num_kv_shared_layers} shared layers leave no donor among {n}")
        first = n - self.num_kv_shared_layers
        last_of: dict[str, int] = {}
        for i, t in enumerate(self.layer_types[:first]):
            last_of[t] = i
        source = list(range(first))
        for i in range(first, n):
            t = self.layer_types[i]
            if t not in last_of:
                raise InvalidValueError(f"sharer layer {i} ({t}) has no donor of its type")
            source.append(last_of[t])
        object.__setattr__(self, "source", tuple(source))

    @property
    def num_donors(self) -> int:
        return len(self.layer_types) - self.num_kv_shared_layers

    @property
    def donors(self) -> tuple[int, ...]:
        """Layers that own a cache (and compute K/V)."""
        return tuple(range(self.num_donors))

    def donor_of(self, layer: int) -> int:
        """The layer whose K/V ``layer`` attends over (itself for a donor). A layer that
        is not an int in range raises a typed error."""
        source = self.source
        return source[check_index("layer", layer, len(source))]

    def sharers_of(self, donor: int) -> tuple[int, ...]:
        """The sharer layers that read ``donor``'s K/V (none for a sharer)."""
        check_index("donor", donor, len(self.source))
        return tuple(i for i, s in enumerate(self.source) if s == donor and i != donor)

    @classmethod
    def from_model(cls, model) -> KvSharingPlan:
        """Read ``layer_types`` and ``num_kv_shared_layers`` from an mlx-lm model's args."""
        cfg = text_config(model)
        if "layer_types" not in cfg:
            n = len(model.layers)
            return cls(("full_attention",) * n, 0)
        return cls(cfg["layer_types"], cfg.get("num_kv_shared_layers", 0) or 0)
