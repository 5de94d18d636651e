"""A plain token-by-token generation loop over any mlx-lm-protocol cache.

The demo, the examples and the benchmarks use this one loop for both pagedkv's caches
and mlx-lm's, so comparisons differ only in the cache. On a pagedkv cache of one
sequence the loop is pipelined (the next step queued before a token is read), and its
decode steps can run through ``CompiledDecode`` (by default on CUDA, for pages the
decode kernel reads: ``generate``'s ``compiled``).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterable, Iterator

import attrs
import mlx.core as mx
import numpy as np

from pagedkv.cache import PagedKVCache, PagedPromptCache
from pagedkv.compiled_decode import CompiledDecode
from pagedkv.errors import InvalidTypeError, InvalidValueError, check_int, check_number
from pagedkv.kernels import paged_decode
from pagedkv.model_config import check_eos_ids, check_token_ids, text_config

COMPILE_FROM_TOKENS = 32
"""``generate``'s default decodes through ``CompiledDecode`` (where it does at all) only
for ``max_tokens`` of at least this many: below it the step's trace costs more than its
steps save (bench/RESULTS.md)."""


@attrs.define
class GenerationStats:
    prompt_tokens: int = 0
    generated: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tps(self) -> float:
        # the first token comes out of the prefill
        return max(0, self.generated - 1) / self.decode_s if self.decode_s else 0.0


def written_state(cache) -> list[mx.array]:
    """The arrays that hold what a forward wrote into ``cache`` (a list of per-layer
    caches): a pagedkv layer's pool storage, an mlx-lm cache's ``state``. Evaluating
    them runs a prefill chunk up to the last layer's K/V, with no logits (as mlx-lm's
    ``generate_step`` does)."""
    out: list[mx.array] = []
    for c in cache:
        out.extend(c.storage() if hasattr(c, "storage") else c.state)
    return out


def prefill(model, cache, tokens: list[int], chunk: int = 512, *, prefix=None, keys=None) -> None:
    """Write ``tokens`` into ``cache`` in chunks of ``chunk`` tokens, computing no logits.
    Ids that are not ints in the model's vocabulary raise ``InvalidValueError`` before
    anything is written.

    With a ``PrefixCache`` ``prefix`` and the sequence's ``keys`` (its ``PrefixKeys`` or
    all its token ids), each chunk's full pages are registered after it, and on a hybrid
    model chunks stop at checkpoint boundaries (``PrefixCache.aligned_take``), so later
    requests can start from the recurrent state there."""
    chunk = check_int("chunk", chunk, minimum=1)
    if prefix is not None and keys is None:
        raise InvalidValueError("prefill with a prefix cache needs the sequence's keys (or token ids)")
    tokens = _token_ids(model, tokens)
    i = 0
    while i < len(tokens):
        take = min(chunk, len(tokens) - i)
        if prefix is not None:
            take = prefix.aligned_take(cache.num_tokens, take)
        model(mx.array(tokens[i : i + take])[None], cache=cache)
        mx.eval(written_state(cache))
        if prefix is not None:
            prefix.register(cache, keys)
        i += take


def _token_ids(model, tokens) -> list[int]:
    """Token ids given as a list, tuple, numpy array or mx.array, as a list of ints that
    ``model``'s embedding has (``check_token_ids``)."""
    listed = tokens.tolist() if isinstance(tokens, (mx.array, np.ndarray)) else list(tokens)
    return check_token_ids(listed, text_config(model).get("vocab_size"))


def sample(logits: mx.array, temperature: float) -> mx.array:
    """Greedy for temperature 0, else a draw from softmax(logits / temperature)."""
    if temperature <= 0:
        return mx.argmax(logits, axis=-1)
    return mx.random.categorical(logits * (1.0 / temperature))


def generate(
    model,
    cache,
    prompt: list[int],
    *,
    max_tokens: int,
    temperature: float = 0.0,
    eos_ids: Iterable[int] = (),
    stats: GenerationStats | None = None,
    prefill_chunk: int = 512,
    compiled: bool | CompiledDecode | None = None,
) -> Iterator[int]:
    """Yield up to ``max_tokens`` new token ids (stopping after an EOS id).

    The prompt is prefilled in chunks of ``prefill_chunk`` tokens. ``stats`` (optional)
    is filled in as the loop runs. Bad arguments (token ids outside the model's
    vocabulary included) raise a typed error before anything is written to ``cache``.

    On a pagedkv cache of one sequence (``make_paged_cache``) without recurrent layers,
    the loop is pipelined, eager or compiled: the next step is queued on the device
    before a token is read (as mlx-lm's ``generate_step``), except a step that drops a
    page behind a sliding window (one in a page's worth of a sliding-window model's
    steps), which runs serially. Other caches (mlx-lm's, a hybrid model's) run serially.

    ``compiled``: run the decode steps through ``CompiledDecode`` (the step traced once
    per call and page-table width bucket, then replayed), which needs a pagedkv cache of
    one sequence. None (default): compiled where it was measured faster, traces included:
    MLX on a CUDA GPU with pages the CUDA decode kernel reads (plain fp16/bf16), for
    ``max_tokens`` of at least ``COMPILE_FROM_TOKENS`` (32: 1.11-1.66x the pipelined
    eager loop on an H100 at 32 and 128 tokens, but 0.79-1.05x at 8, where the trace is
    not paid back; bench/RESULTS.md); eager elsewhere (a float32 or quantised pool,
    where the compiled step gathers its pages every step, as the demo's SmolLM2 showed;
    a CPU; other caches; shorter generations). The cache ends up the same either way:
    the prompt and every yielded token but the last, written (a step queued past the end
    is trimmed off), and an error is raised after the same tokens. The compiled step's
    lookahead pages go back when the loop ends (or the generator is closed).

    A ``CompiledDecode`` made for ``model`` (``CompiledDecode(model, cache)``) may be
    passed as ``compiled`` to keep its traces from one call to the next: each call
    rebinds it to ``cache`` (``CompiledDecode.rebind``: a cache of the same layout, a
    new request's cache on the same pools, say) and decodes through it.
    A call otherwise traces the step anew (about 60 ms for SmolLM2's 30 layers on an
    H100). It holds the last cache it decoded until it is rebound or dropped.
    """
    prompt = _token_ids(model, prompt)
    if not prompt:
        raise InvalidValueError("prompt must hold at least one token")
    max_tokens = check_int("max_tokens", max_tokens, minimum=0)
    prefill_chunk = check_int("prefill_chunk", prefill_chunk, minimum=1)
    temperature = check_number("temperature", temperature, 0.0, math.inf)  # (NaN sampled garbage)
    eos = check_eos_ids("eos_ids", eos_ids)
    compiled = _compiled_for(model, cache, compiled, max_tokens)
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = len(prompt)
    t = time.perf_counter()
    prefill(model, cache, prompt[:-1], prefill_chunk)
    logits = model(mx.array(prompt[-1:])[None], cache=cache)[0, -1]
    token = sample(logits, temperature)
    mx.eval(token)
    stats.prefill_s = time.perf_counter() - t
    t = time.perf_counter()
    if isinstance(compiled, CompiledDecode):
        kept = compiled if max_tokens > 1 else None  # (rebound to the cache by _compiled_for)
    else:
        kept = CompiledDecode(model, cache) if compiled and max_tokens > 1 else None
    if kept is not None:
        kept.busy = True
    step = kept if kept is not None else functools.partial(model, cache=cache)
    # Pipelined (where the cache can drop its last token again): step n + 1 is queued on
    # the device, fed token n still lazy, before token n is read and yielded.
    # Where the loop then stops (an EOS id, or the caller closing it) that step wrote
    # one token the serial loop would not have, and it is trimmed off; an error from
    # queuing it is raised where the serial loop raises it, after token n is yielded.
    # A step that would drop a page behind a sliding window (one in a page's worth of
    # steps) runs serially instead: trimming it would not bring the page back.
    ahead = max_tokens > 1 and _can_trim_a_queued_step(cache)
    queued, error = False, None
    try:
        for n in range(max_tokens):
            more = n + 1 < max_tokens
            if ahead and more and not _next_step_drops_pages(cache):
                try:
                    upcoming = sample(step(token.reshape(1, 1))[0, -1], temperature)
                    mx.async_eval(upcoming)
                    queued = True
                except Exception as e:  # noqa: BLE001 (re-raised below, unless the loop stops first)
                    error = e
            tok = int(token.item())
            stats.generated = n + 1
            stats.decode_s = time.perf_counter() - t
            yield tok
            if tok in eos or not more:
                break
            if error is not None:
                raise error
            if queued:
                token, queued = upcoming, False
                continue
            logits = step(mx.array([[tok]]))[0, -1]
            token = sample(logits, temperature)
            mx.eval(token)
        stats.decode_s = time.perf_counter() - t
    finally:
        if queued:  # the queued step wrote the last token yielded: as the serial loop, keep it out
            for layer in cache:
                layer.trim(1)
        if kept is not None:
            kept.release_lookahead()
            kept.busy = False


def _can_trim_a_queued_step(cache) -> bool:
    """Whether trimming the token a queued step wrote leaves ``cache`` exactly as if the
    step had not run, for a step that drops no page behind a sliding window
    (``_next_step_drops_pages``): a pagedkv cache of one sequence with no recurrent
    state (it cannot go back), one ``PagedKVCache`` per layer."""
    return (isinstance(cache, PagedPromptCache) and cache.rows.layout.state_pool is None
            and all(isinstance(layer, PagedKVCache) for layer in cache))


def _next_step_drops_pages(cache: PagedPromptCache) -> bool:
    """Whether the next one-token step drops a page behind a sliding window: a trim does
    not bring such a page back, so the cache would hold a page fewer than the serial
    loop's. O(sliding-window tables)."""
    rows = cache.rows
    return any(t.drops_pages_at(t.num_tokens) for s, spec in enumerate(rows.layout.specs)
               if spec.window is not None for t in rows.tables(s))


def _compiled_for(model, cache, compiled: bool | CompiledDecode | None,
                  max_tokens: int) -> bool | CompiledDecode:
    """``generate``'s choice of decode step (see there); a typed error, before anything
    is written, for a value that is not a bool, a ``CompiledDecode`` or None, ``True``
    on a cache the compiled step does not serve, or a ``CompiledDecode`` made for
    another model or one ``CompiledDecode.rebind`` refuses (a cache of another layout,
    a step another loop is decoding through). A ``CompiledDecode`` is rebound to
    ``cache`` here, before the prefill."""
    if isinstance(compiled, CompiledDecode):
        if not isinstance(cache, PagedPromptCache):
            raise InvalidValueError("a CompiledDecode decodes a pagedkv cache of one sequence (make_paged_cache), "
                                    f"got {type(cache).__name__}")
        if compiled.model is not model:
            raise InvalidValueError("the CompiledDecode passed as compiled was made for another model")
        compiled.rebind(cache)
        return compiled
    if compiled is not None and not isinstance(compiled, bool):
        raise InvalidTypeError(f"compiled must be a bool, a CompiledDecode or None, got {type(compiled).__name__}")
    paged = isinstance(cache, PagedPromptCache)
    if compiled and not paged:
        raise InvalidValueError("compiled=True needs a pagedkv cache of one sequence (make_paged_cache), "
                                f"got {type(cache).__name__}")
    if compiled is None:
        return paged and max_tokens >= COMPILE_FROM_TOKENS and paged_decode.available() and all(
            spec.pool.kind.decode_kernel for spec in cache.rows.layout.specs)
    return compiled
