"""``SamplingParams`` (what one request asks for) and ``sample_rows`` (one token per row
of a batch's logits, each row with its own temperature, top-p and seed).

Greedy (temperature 0) rows take the argmax, so a greedy request gives the same tokens
alone or in any batch, up to float rounding of the logits themselves.

A sampled row draws by the Gumbel-max rule (the argmax of its scaled logits plus Gumbel
noise, which is how ``mx.random.categorical`` draws). A row with a ``seed`` takes its
noise from a key that depends only on the seed and the position of the token being
drawn in its sequence (``row_key``, ``keyed_gumbel``: a counter-based hash, one graph for
all seeded rows), so a seeded request gives the same tokens alone or
in any batch, whatever ran before it, and after a preemption (its tokens are not drawn
again), again up to float rounding of its logits. Rows without a seed draw from MLX's
global generator.
"""

from __future__ import annotations

from typing import Sequence

import attrs
import mlx.core as mx

from pagedkv.errors import InvalidTypeError, InvalidValueError, check_number

MAX_STOP_STRINGS = 4  # as OpenAI's API
_MASK64 = (1 << 64) - 1
_MIX = (mx.array(0x7FEB352D, dtype=mx.uint32), mx.array(0x846CA68B, dtype=mx.uint32))


def _max_tokens(_inst, _attr, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidTypeError(f"max_tokens must be an integer, got {value!r}")
    if value < 1:
        raise InvalidValueError(f"max_tokens must be at least 1, got {value}")


def _number(lo: float, hi: float, *, lo_open: bool = False):
    def check(_inst, attr, value) -> None:
        check_number(attr.name, value, lo, hi, lo_open=lo_open)

    return check


def _seed(_inst, _attr, value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidTypeError(f"seed must be an integer, got {value!r}")
    if not -(1 << 63) <= value <= _MASK64:
        raise InvalidValueError(f"seed must fit in 64 bits, got {value}")


def _stop(value) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) for s in value):
        raise InvalidTypeError(f"stop must be a string or a list of strings, got {value!r}")
    if len(value) > MAX_STOP_STRINGS or any(not s for s in value):
        raise InvalidValueError(f"stop takes up to {MAX_STOP_STRINGS} non-empty strings, got {value!r}")
    return tuple(value)


@attrs.frozen
class SamplingParams:
    """How one request is decoded. Validated on construction (typed errors)."""

    max_tokens: int = attrs.field(validator=_max_tokens)
    temperature: float = attrs.field(default=0.0, validator=_number(0.0, 2.0))
    top_p: float = attrs.field(default=1.0, validator=_number(0.0, 1.0, lo_open=True))
    stop: tuple[str, ...] = attrs.field(default=(), converter=_stop)
    seed: int | None = attrs.field(default=None, validator=_seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def row_key(seed: int, position: int) -> int:
    """The 64-bit key of a seeded row drawing the token at ``position`` of its sequence
    (its prompt's length for the first generated token): the two mixed by splitmix64, so
    nearby seeds and positions give unrelated keys. O(1), no device work."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _mix32(x: mx.array) -> mx.array:
    """lowbias32 (Chris Wellons' integer hash) on uint32: a bijection in which every
    output bit depends on every input bit."""
    x = x ^ (x >> 16)
    x = x * _MIX[0]
    x = x ^ (x >> 15)
    x = x * _MIX[1]
    return x ^ (x >> 16)


def keyed_gumbel(keys: Sequence[int], vocab: int) -> mx.array:
    """Gumbel noise float32 [len(keys), vocab] whose row r depends on ``keys[r]`` (64-bit
    ints) alone: token j's uniform is a hash of (key, j) (``_mix32`` twice) cut to 24 bits.
    One graph of a few element-wise ops for all rows, whatever their number."""
    lo = mx.array([k & 0xFFFFFFFF for k in keys], dtype=mx.uint32)[:, None]
    hi = mx.array([k >> 32 for k in keys], dtype=mx.uint32)[:, None]
    h = _mix32(_mix32(mx.arange(vocab, dtype=mx.uint32)[None, :] ^ lo) ^ hi)
    u = ((h >> 8).astype(mx.float32) + 0.5) * (1.0 / (1 << 24))  # in (0, 1)
    return -mx.log(-mx.log(u))


def sample_rows(logits: mx.array, params: Sequence[SamplingParams],
                positions: Sequence[int] | None = None) -> mx.array:
    """One token id per row of ``logits`` [B, V] (uint32 [B]), row b drawn per ``params[b]``.

    Greedy rows: argmax. Other rows: softmax(logits / temperature), restricted to the
    smallest set of tokens whose probability reaches ``top_p`` (nucleus sampling).
    ``positions[b]``: where in its sequence row b's token goes; needed (``InvalidValueError``
    otherwise) when a sampled row has a seed, whose noise it keys (module doc).
    O(B·V), plus a sort of each sampled row when any row has top_p < 1."""
    greedy = mx.argmax(logits, axis=-1)
    if all(p.greedy for p in params):
        return greedy
    seeded = [b for b, p in enumerate(params) if p.seed is not None and not p.greedy]
    if seeded and (positions is None or len(positions) != len(params)):
        raise InvalidValueError("rows with a seed need each row's position (positions, one per row)")
    temps = mx.array([p.temperature if not p.greedy else 1.0 for p in params], dtype=mx.float32)
    scaled = logits.astype(mx.float32) / temps[:, None]
    if any(p.top_p < 1.0 for p in params):
        top_p = mx.array([p.top_p for p in params], dtype=mx.float32)
        order = mx.argsort(-scaled, axis=-1)
        sorted_logits = mx.take_along_axis(scaled, order, axis=-1)
        probs = mx.softmax(sorted_logits, axis=-1)
        before = mx.cumsum(probs, axis=-1) - probs  # mass of the tokens ranked above
        sorted_logits = mx.where(before < top_p[:, None], sorted_logits, -mx.inf)
        scaled = mx.put_along_axis(scaled, order, sorted_logits, axis=-1)
    if seeded:
        keyed = keyed_gumbel([row_key(params[b].seed, positions[b]) for b in seeded], scaled.shape[-1])
        if len(seeded) == len(params):
            noise = keyed
        else:  # the other rows draw from the global generator
            noise = mx.random.gumbel(scaled.shape)
            noise[mx.array(seeded)] = keyed
        drawn = mx.argmax(scaled + noise, axis=-1)
    else:
        drawn = mx.random.categorical(scaled)
    is_greedy = mx.array([p.greedy for p in params])
    return mx.where(is_greedy, greedy, drawn.astype(greedy.dtype))
