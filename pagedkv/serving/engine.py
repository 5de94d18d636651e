"""``Engine``: continuous batching of generation requests over one ``PagedBatch``.

One engine serves one model from one ``PagePool``. It is synchronous and not thread-safe:
whoever calls ``step`` owns it and every MLX array it touches (a server runs it on one
owner thread, see :mod:`pagedkv.serving.engine_thread`; a script may call ``step`` in a
loop). Each ``step``:

1. retires finished and aborted rows (their full pages are registered in the
   ``PrefixCache``, then released: they stay CACHED until the room is needed);
2. spends the step's prefill budget (``prefill_budget`` tokens): first on prompts being
   prefilled, then on waiting requests, admitted first come, first served while
   ``can_admit`` says their pages fit (counting the compiled decode step's lookahead
   pages, which it gives back when a request fits only with them). Each is prefilled
   alone in its own cache from its longest cached prefix, over as many steps as its
   prompt needs (chunked prefill);
   then it samples its first token and joins the batch with no K/V copy
   (``PagedBatch.extend``);
3. decodes one token for every running row in one batched forward. If the pool runs
   out, the newest row is preempted (its pages registered and released, the request
   back at the head of the queue, every token it already emitted kept) and the step is
   retried;
4. retires the rows that just finished.

Overlapped decode (``overlap_decode``, on by default): step 3 queues its forward
(``mx.async_eval``) and only then reads the tokens of the step before, so the host work
of a step (graph building, bookkeeping, sampling set-up, text and sinks) runs while the
device computes the previous one, as mlx-lm's ``generate_step`` does. The step's input
for a row that was in the previous step is that step's sampled token, still on the
device (``_unread``). Tokens reach their sinks one step later, and a row that finishes
has had one more step computed for it, whose token is dropped (its K/V is one more
token of a row that is released anyway). What a row has written is always a prefix of
its request's tokens, so prefix registration and preemption see the same tokens as
without overlap: before the pool's pages are reclaimed (a preemption) the engine reads
the tokens in flight first (``_drain``).

A request hands the engine a ``sink``: a callable that receives one ``Delta`` per
generated token (its text, held back at multi-byte characters and stop-string
prefixes) and a last ``Delta`` with the finish reason and usage. Sinks are called on
the owner thread and must not block.

Admission refuses, with ``RequestTooLarge`` and before any prefill, a request whose
prompt plus ``max_tokens`` can never fit in the whole pool (or the model's context), so
every admitted request can finish even alone, and a queue never stalls.

A hybrid model (recurrent layers next to attention) runs the same way with a
``state_pool``: each request also holds one recurrent-state slot, and prefix hits
restore the state from checkpoints (:mod:`pagedkv.prefix`).

Costs per step: O(B) Python for B running rows plus the model's forward; admission
O(pages matched) per waiting request looked at.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from typing import Callable, Iterable

import attrs
import mlx.core as mx

from pagedkv.attention_routing import route_attention
from pagedkv.batch import PagedBatch
from pagedkv.cache import PagedPromptCache, layout_for, make_paged_cache
from pagedkv.compiled_decode import CompiledDecode
from pagedkv.disk_tier import DiskTier
from pagedkv.errors import (
    InvalidTypeError,
    InvalidValueError,
    NotSupportedError,
    PoolExhausted,
    check_int,
)
from pagedkv.generation import prefill
from pagedkv.kernels import paged_decode
from pagedkv.model_config import check_eos_ids, check_token_ids, text_config
from pagedkv.pool import PagePool
from pagedkv.prefix import PrefixCache, prefix_cache_serves
from pagedkv.prefix_keys import PrefixKeys
from pagedkv.scheduling import can_admit, check_watermark
from pagedkv.serving.metrics import ServingMetrics
from pagedkv.serving.sampling import SamplingParams, sample_rows
from pagedkv.serving.text_stream import TextStream
from pagedkv.state_pool import StatePool
from pagedkv.table import peak_pages

FINISH_REASONS = ("stop", "length", "abort", "error")


class RequestTooLarge(InvalidValueError):
    """A request whose prompt plus ``max_tokens`` can never fit (pool or context)."""


@attrs.frozen
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served by the prefix cache at first admission


@attrs.frozen
class Delta:
    """What a request's sink receives: new text and ids, and on the last one the finish
    reason (one of ``FINISH_REASONS``) with the usage (and a message for "error")."""

    rid: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str | None = None


@attrs.frozen
class EngineLimits:
    """What one request may ask for; plain ints, safe to read from any thread."""

    max_model_len: int  # prompt + max_tokens, from the model's context
    max_pool_tokens: int  # prompt + max_tokens the whole pool can hold
    vocab_size: int

    @property
    def max_request_tokens(self) -> int:
        return min(self.max_model_len, self.max_pool_tokens)

    def check_tokens(self, ids: list[int]) -> None:
        """``InvalidValueError`` unless every id is an int in [0, vocab_size)."""
        not_int = [t for t in ids if t.__class__ is not int]  # (a request's ids are JSON ints, no numpy)
        if not_int:
            raise InvalidValueError(f"token ids must be ints, got {not_int[:4]}")
        check_token_ids(ids, self.vocab_size)

    def check(self, prompt_tokens: int, max_tokens: int) -> None:
        """``RequestTooLarge`` unless ``prompt_tokens + max_tokens`` can ever be served."""
        total = prompt_tokens + max_tokens
        if total > self.max_model_len:
            raise RequestTooLarge(
                f"the prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) is {total} tokens, "
                f"more than the model's context of {self.max_model_len}")
        if total > self.max_pool_tokens:
            raise RequestTooLarge(
                f"the prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) is {total} tokens, "
                f"more than the whole KV pool holds ({self.max_pool_tokens}); it could never finish")


@attrs.define(eq=False)
class _Prefill:
    """A request being prefilled: its own cache and the tokens still to run."""

    req: GenerationRequest
    cache: PagedPromptCache
    rest: list[int]  # (the last one is run alone, for the first token's logits)


@attrs.define(eq=False)
class GenerationRequest:
    """One request, owned by the engine from ``add`` until its last ``Delta``."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    sink: Callable[[Delta], None]
    arrival: float = attrs.field(factory=time.perf_counter)
    # engine state
    generated: list[int] = attrs.field(factory=list)
    keys: PrefixKeys | None = None
    stream: TextStream | None = None
    cached_tokens: int | None = None  # set at first admission
    first_token_at: float | None = None
    last_token_at: float | None = None
    finish_reason: str | None = None
    preemptions: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated


class Engine:
    def __init__(
        self,
        model,
        pool: PagePool,
        *,
        decode: Callable[[list[int]], str],
        eos_token_ids: Iterable[int] = (),
        max_model_len: int | None = None,
        max_batch: int = 32,
        prefix_caching: bool = True,
        prefill_chunk: int = 512,
        prefill_budget: int = 512,
        watermark: float = 0.01,
        metrics: ServingMetrics | None = None,
        disk_tier: DiskTier | None = None,
        state_pool: StatePool | None = None,
        checkpoint_every: int = 16,
        compiled_decode: bool | None = None,
        overlap_decode: bool = True,
    ) -> None:
        """``decode`` turns token ids into text (special tokens skipped).
        ``prefill_budget``: prompt tokens prefilled per step (chunked prefill: a longer
        prompt is spread over several steps, with the running rows decoding between
        them, so a long prompt cannot stall everyone's next token).
        ``prefill_chunk``: the most tokens in one forward.
        ``prefix_caching``: keep full prompt pages for later requests (``PrefixCache``).
        A model with sliding-window layers keeps, besides, the pages of each window that
        its sliding tables held when a request was registered, so a hit also needs the
        last window's pages at its end (``PrefixCache`` module doc); a model whose
        layers all slide, or a hybrid with sliding layers, needs it off
        (``NotSupportedError`` here otherwise). Sliding layers hold only their window's
        pages per row.
        ``disk_tier``: keeps evicted prefix pages on disk (and every cached page at
        ``close``), so prefix hits survive eviction and restarts.
        ``state_pool``: a hybrid model's recurrent-state slots (one per running request,
        plus prefix checkpoints, kept every ``checkpoint_every`` pages: prefill forwards
        are cut at those boundaries, and decoding rows leave a checkpoint as they cross one).
        ``compiled_decode``: run the decode step through ``CompiledDecode`` (the model
        traced once per batch size and page-table width, then replayed: 1.2-1.4x the
        eager engine's tokens/s on an H200, bench/RESULTS.md; hybrid models included).
        True: on. None (default): on where it was measured faster, MLX on a CUDA GPU;
        eager otherwise. False: eager.
        ``overlap_decode``: build each decode step while the previous one runs (see the
        module doc); False reads every step's tokens before the next step is built."""
        self.model = model
        self.pool = pool
        prefill_chunk = check_int("prefill_chunk", prefill_chunk, minimum=1)
        prefill_budget = check_int("prefill_budget", prefill_budget, minimum=1)
        max_batch = check_int("max_batch", max_batch, minimum=1)  # (0 would admit nothing, forever)
        if max_model_len is not None:
            max_model_len = check_int("max_model_len", max_model_len, minimum=2)
        watermark = check_watermark(watermark)
        if not callable(decode):
            raise InvalidTypeError(f"decode must turn token ids into text, got {type(decode).__name__}")
        if state_pool is not None and (not isinstance(state_pool, StatePool) or state_pool.usable_slots < 2):
            raise InvalidValueError("state_pool must be a StatePool with at least 2 usable slots (a running "
                                    "request and the one it moves to off a checkpoint)")
        self.state_pool = state_pool
        if compiled_decode is not None and not isinstance(compiled_decode, bool):
            raise InvalidTypeError(f"compiled_decode must be a bool or None, got {type(compiled_decode).__name__}")
        self._compile_asked = compiled_decode
        if not isinstance(overlap_decode, bool):
            raise InvalidTypeError(f"overlap_decode must be a bool, got {type(overlap_decode).__name__}")
        self.overlap_decode = overlap_decode
        config = text_config(model)  # (read before the pool is touched, as every check here)
        if "vocab_size" not in config:
            raise InvalidValueError("the model's args (or their text_config) hold no vocab_size")
        vocab = int(config["vocab_size"])
        eos = check_eos_ids("eos_token_ids", eos_token_ids)
        ctx = max_model_len or int(config.get("max_position_embeddings") or 1 << 30)
        self._layout = layout_for(model, pool, state_pool=state_pool)  # every batch's (frozen)
        if prefix_caching and not prefix_cache_serves(self._layout, hybrid=state_pool is not None):
            # (checked before the model is routed or the pool touched)
            raise NotSupportedError("the prefix cache serves sliding-window models that have full-attention "
                                    "layers and no recurrent ones: pass prefix_caching=False to serve this one")
        self._new_batch()
        self.compiled_decode = self._compiled is not None  # what the engine does
        if disk_tier is not None and not prefix_caching:
            raise InvalidValueError("a disk tier keeps prefix-cache pages: it needs prefix_caching")
        self.prefix = PrefixCache(pool, disk=disk_tier, state_pool=state_pool, checkpoint_every=checkpoint_every,
                                  windows=self._layout.windows) if prefix_caching else None
        self.decode = decode
        self.eos = eos
        self.limits = EngineLimits(ctx, self._pool_tokens(min(prefill_chunk, prefill_budget)), vocab)
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.prefill_budget = prefill_budget
        self.watermark = watermark
        self.metrics = metrics if metrics is not None else ServingMetrics()
        self.waiting: deque[GenerationRequest] = deque()
        self.prefilling: list[_Prefill] = []  # admitted, prompt not all in yet (own caches)
        self.running: list[GenerationRequest] = []  # rows of the batch, in order
        # the next input token of each running row: an emitted token id, unless the row
        # was in the step in flight (its input is then its entry of ``_unread``)
        self._pending: list[int] = []
        self._unread: mx.array | None = None  # the tokens of the step in flight, not read yet
        self._unread_rows: list[GenerationRequest] = []  # whose, in ``_unread``'s order
        self._ids: dict[str, GenerationRequest] = {}
        self._closed = False
        self._update_gauges()  # (a scrape before the first request sees the empty pool)

    # ------------------------------------------------------------------ requests in / out
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def add(self, req: GenerationRequest) -> None:
        """Queue ``req``. Typed errors (and nothing queued) for a bad or duplicate request
        or one that can never fit (``RequestTooLarge``)."""
        if self._closed:
            raise InvalidValueError("the engine is closed")
        if not isinstance(req, GenerationRequest):
            raise InvalidTypeError(f"add takes a GenerationRequest, got {type(req).__name__}")
        if not isinstance(req.rid, str) or not callable(req.sink):  # (a list id raised a bare TypeError)
            raise InvalidTypeError(f"a request needs a str id and a callable sink, got {type(req.rid).__name__} "
                                   f"and {type(req.sink).__name__}")
        if req.rid in self._ids:
            raise InvalidValueError(f"request id {req.rid!r} is already in the engine")
        if req.generated or req.finish_reason is not None:
            raise InvalidValueError("a request can be added once, before it has run")
        if not isinstance(req.params, SamplingParams):
            raise InvalidTypeError(f"params must be SamplingParams, got {type(req.params).__name__}")
        if not isinstance(req.prompt, list) or not req.prompt:
            raise InvalidValueError("the prompt must be a non-empty list of token ids")
        self.limits.check_tokens(req.prompt)
        self.limits.check(len(req.prompt), req.params.max_tokens)
        req.stream = TextStream(self.decode, req.params.stop)
        self._ids[req.rid] = req
        self.waiting.append(req)
        self._update_gauges()

    def abort(self, rid: str) -> bool:
        """End request ``rid`` now (a client went away): its last ``Delta`` says "abort".
        A waiting request leaves the queue; a running row leaves the batch (its pages
        released) at the start of the next step. Returns whether it was still running
        or waiting."""
        req = self._ids.get(rid)
        if req is None or req.finish_reason is not None:
            return False
        self._finish(req, "abort", "")
        return True

    def close(self) -> None:
        """Abort everything and give every page back; with a disk tier, write every
        cached page to it first and wait for the writes."""
        for req in list(self._ids.values()):
            self.abort(req.rid)
        self._retire()
        self.batch.release()
        if self.prefix is not None and self.prefix.disk is not None:
            self.prefix.persist()
            self.prefix.disk.close()
        self._closed = True
        self._update_gauges()

    def fail_all(self, message: str) -> None:
        """After an unexpected error in a step: end every request with "error" and start
        from an empty batch (the pages of every row are released)."""
        for req in list(self._ids.values()):
            if req.finish_reason is None:
                self._end(req, "error")
                self._deliver(req, Delta(req.rid, "", (), "error", self._usage(req), message))
        for job in list(self.prefilling):
            self.prefilling.remove(job)
            job.cache.release()
        self.waiting.clear()
        self.running.clear()
        self._pending.clear()
        self._unread, self._unread_rows = None, []
        self._ids.clear()
        self.batch.release()
        if self._compiled is not None:  # (its step holds lookahead pages until told)
            self._compiled.release_lookahead()
        self._new_batch()
        self._update_gauges()

    def _new_batch(self) -> None:
        """An empty batch, and its compiled decode step if asked for (or by default, see
        ``compiled_decode``)."""
        route_attention(self.model)  # (idempotent: as PagedBatch.for_model does)
        self.batch = PagedBatch(self._layout)
        asked = self._compile_asked
        if asked is None:
            asked = paged_decode.available()
        self._compiled = CompiledDecode(self.model, self.batch) if asked else None

    # ------------------------------------------------------------------ the step
    def step(self) -> None:
        """One engine step (see the module doc)."""
        self._retire()
        self._admit()
        self._retire()  # (a request may end at its first token)
        if self.running:
            self._decode_step()
        self._retire()
        self._update_gauges()

    def _keys(self, req: GenerationRequest) -> PrefixKeys:
        """The request's prefix keys, brought up to its tokens (each page cut once)."""
        n = len(req.prompt) + len(req.generated)
        if req.keys is None:
            req.keys = self.prefix.keys(req.tokens)
        elif req.keys.num_tokens < n:
            req.keys.extend(req.tokens[req.keys.num_tokens :])
        return req.keys

    def _admit(self) -> None:
        """Spend this step's prefill budget: first on the prompts already being prefilled,
        then on waiting requests, first come first served, while their pages fit."""
        budget = self.prefill_budget
        for job in list(self.prefilling):
            budget = self._advance(job, budget)
            if budget <= 0:
                return
        ps = self.pool.page_size
        while self.waiting and budget > 0 and len(self.running) + len(self.prefilling) < self.max_batch:
            req = self.waiting[0]
            n = len(req.prompt) + len(req.generated)
            if self.running or self.prefilling:
                hit = self.prefix.match(self._keys(req)) if self.prefix else []
                refcount, ahead_tokens = self.pool.allocator.refcount, min(req.params.max_tokens - len(req.generated), 16)
                fit = functools.partial(can_admit, self.pool, n, ahead_tokens, cached_tokens=len(hit) * ps,
                                        revived=sum(1 for page in hit if refcount(page) == 0),
                                        extra_pages=self._extra_pages(n + ahead_tokens),
                                        watermark=self.watermark, state_pool=self.state_pool)
                ahead = self._compiled.lookahead_pages if self._compiled is not None else 0
                if not fit(releasable=ahead):
                    break
                if ahead and not fit():  # it fits with the decode step's lookahead pages: they yield
                    self._compiled.release_lookahead()
            self.waiting.popleft()
            budget = self._advance(self._start(req), budget)

    def _extra_pages(self, tokens: int) -> int:
        """Pages a ``tokens``-token sequence holds between forwards beyond the one
        full-attention table ``can_admit`` counts: its other tables' (sliding windows at
        their window, more full-attention groups in full). An admission estimate: a
        prefill that runs out stops, and resumes."""
        counted = any(spec.window is None for spec in self._layout.specs)
        return self._layout.pages_for(tokens, chunk=0) - (peak_pages(tokens, self.pool.page_size) if counted else 0)

    def _pool_tokens(self, chunk: int) -> int:
        """The longest sequence (prompt + max_tokens) whose tables, written at most
        ``chunk`` tokens per forward, fit the whole pool at their peak
        (``LayerLayout.pages_for``): one table of full pages per full-attention spec,
        plus each sliding-window table's. A request longer than that could never
        finish even alone. O(specs · log pool tokens)."""
        lo, hi = 0, self.pool.usable_pages * self.pool.page_size  # (pages_for grows with tokens)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._layout.pages_for(mid, chunk) <= self.pool.usable_pages:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _start(self, req: GenerationRequest) -> _Prefill:
        """A cache for ``req`` holding its longest cached prefix; the rest is to prefill."""
        if self.prefix is not None:
            cache, rest = self.prefix.new_cache(self.model, self._keys(req))
        else:
            cache, rest = make_paged_cache(self.model, self.pool, state_pool=self.state_pool), req.tokens
        if req.cached_tokens is None:  # first admission (a preempted request has tokens)
            req.cached_tokens = len(req.prompt) - len(rest) if not req.generated else 0
            self.metrics.prefix_queried(len(req.prompt), req.cached_tokens)
        job = _Prefill(req, cache, rest)
        self.prefilling.append(job)
        return job

    def _advance(self, job: _Prefill, budget: int) -> int:
        """Prefill up to ``budget`` more tokens of ``job`` (chunks of ``prefill_chunk``);
        when all are in, it samples the first token and joins the batch. Returns the
        budget left. If the pool runs out, the pages computed so far are registered, the
        rest released, and the request waits at the head of the queue."""
        req, cache = job.req, job.cache
        resumed = bool(req.generated)  # preempted: its last token is emitted, not written
        try:
            while len(job.rest) > 1 and budget > 0:
                take = min(len(job.rest) - 1, budget, self.prefill_chunk)
                if self.prefix is not None:  # (hybrids: stop at the next checkpoint boundary)
                    take = self.prefix.aligned_take(cache.num_tokens, take)
                prefill(self.model, cache, job.rest[:take], take)
                job.rest = job.rest[take:]
                budget -= take
                if self.prefix is not None:  # its computed pages serve requests admitted now
                    self.prefix.register(cache, self._keys(req))
            if len(job.rest) > 1 or (budget <= 0 and not resumed):
                return budget
            if not resumed:
                logits = self.model(mx.array(job.rest)[None], cache=cache)[:, -1]
                token = int(sample_rows(logits, [req.params], [len(req.prompt)]).item())
                budget -= 1
        except PoolExhausted:
            self._drop_prefill(job)
            self.waiting.appendleft(req)
            if self._compiled is not None:  # its lookahead pages serve the next try
                self._compiled.release_lookahead()
            return 0
        except BaseException:
            self._drop_prefill(job)
            raise
        self.prefilling.remove(job)
        if self.prefix is not None:
            self.prefix.register(cache, self._keys(req))  # its prompt pages serve the next ones
        self.batch.extend(cache)
        self.running.append(req)
        self._pending.append(req.generated[-1] if resumed else token)
        if not resumed:
            self._emit(req, token)
        return budget

    def _drop_prefill(self, job: _Prefill) -> None:
        """Stop prefilling ``job``: its full pages stay findable, the rest go back."""
        self.prefilling.remove(job)
        if self.prefix is not None and not job.cache.released:
            self.prefix.register(job.cache, self._keys(job.req))
        job.cache.release()

    def _decode_step(self) -> None:
        while self.running:
            try:
                tokens = self._inputs()
                if self._compiled is not None:
                    logits = self._compiled(tokens)[:, -1]
                else:
                    logits = self.model(tokens, cache=self.batch.caches)[:, -1]
                params = [r.params for r in self.running]  # (a seeded row's noise is keyed by position)
                positions = self.batch.lengths if any(p.seed is not None for p in params) else None
                sampled = sample_rows(logits, params, positions)
                break
            except PoolExhausted:  # (the step changed nothing)
                if self._unread is not None:  # the tokens in flight first: some rows may end
                    self._drain()
                    self._retire()
                    continue
                self._preempt_newest()
        else:
            return
        if self.overlap_decode:
            mx.async_eval(sampled)
            done, done_rows = self._unread, self._unread_rows
            self._unread, self._unread_rows = sampled, list(self.running)
            if done is not None:
                self._read(done_rows, done)
        else:
            self._read(self.running, sampled)
        if self.state_pool is not None and self.prefix is not None:  # checkpoints as rows cross boundaries
            every = self.prefix.checkpoint_tokens
            for i, n in enumerate(self.batch.lengths):
                if n % every == 0 and self.running[i].finish_reason is None:
                    self.prefix.register_row(self.batch.rows, i, self._keys(self.running[i]))

    def _inputs(self) -> mx.array:
        """The decode step's input tokens, uint32 [B, 1] (the dtype of sampled tokens,
        so a compiled step traces one): each row's entry of ``_unread`` if it was in
        the step in flight, else its pending token."""
        if self._unread is None:
            return mx.array(self._pending, dtype=mx.uint32)[:, None]
        if self._unread_rows == self.running:  # the same rows (requests compare by identity)
            return self._unread[:, None]
        at = {id(req): j for j, req in enumerate(self._unread_rows)}
        where = [at.get(id(req), -1) for req in self.running]
        unread = self._unread[mx.array([max(j, 0) for j in where])]
        pending = mx.array(self._pending, dtype=mx.uint32)
        return mx.where(mx.array([j >= 0 for j in where]), unread, pending)[:, None]

    def _drain(self) -> None:
        """Read the tokens in flight and emit them: every running row's next input is
        then a pending token id, as without overlap."""
        done, done_rows = self._unread, self._unread_rows
        self._unread, self._unread_rows = None, []
        self._read(done_rows, done)

    def _read(self, rows: list[GenerationRequest], sampled: mx.array) -> None:
        """Read a step's tokens (``sampled``, one per request of ``rows``, the step's rows
        in order): each becomes its row's pending token if the row still runs, and is
        emitted unless the request ended meanwhile (by its previous token, or aborted)."""
        at = {id(req): i for i, req in enumerate(self.running)}
        for req, tok in zip(rows, sampled.tolist()):
            i = at.get(id(req))
            if i is not None:
                self._pending[i] = tok
            if req.finish_reason is None:
                self._emit(req, tok)

    def _preempt_newest(self) -> None:
        """Preempt the newest row (no tokens in flight: ``_drain`` first)."""
        row = len(self.running) - 1
        req = self.running.pop()
        self._pending.pop()
        cache = self.batch.extract(row)
        if self.prefix is not None:
            self.prefix.register(cache, self._keys(req))
        cache.release()
        req.preemptions += 1
        self.metrics.preempted()
        self.waiting.appendleft(req)

    def _emit(self, req: GenerationRequest, token: int) -> None:
        req.generated.append(token)
        now = time.perf_counter()
        if req.first_token_at is None:
            req.first_token_at = now
            self.metrics.first_token(now - req.arrival)
        else:
            self.metrics.next_token(now - req.last_token_at)
        req.last_token_at = now
        try:  # (the caller's decode, on this request's ids)
            if token in self.eos:
                reason, text = "stop", req.stream.finish()
            else:
                text = req.stream.push(token)
                reason = "stop" if req.stream.stopped else "length" if len(req.generated) >= req.params.max_tokens \
                    else None
                if reason == "length":
                    text += req.stream.finish()
        except Exception as e:  # it alone ends: a step's other rows still take their tokens
            self._end(req, "error")
            self._deliver(req, Delta(req.rid, "", (token,), "error", self._usage(req),
                                     f"decoding its tokens failed: {type(e).__name__}: {e}"))
            return
        if reason is None:
            self._deliver(req, Delta(req.rid, text, (token,)))
        else:
            self._finish(req, reason, text, (token,))

    def _finish(self, req: GenerationRequest, reason: str, text: str, ids: tuple[int, ...] = ()) -> None:
        """End ``req`` and send its last delta."""
        self._end(req, reason)
        self._deliver(req, Delta(req.rid, text, ids, reason, self._usage(req)))

    def _end(self, req: GenerationRequest, reason: str) -> None:
        """Mark ``req`` ended: a waiting request leaves the queue; a running row or a
        prefill stays until ``_retire`` gives its pages back (and keeps its id until then)."""
        req.finish_reason = reason
        self.metrics.finished(req, reason)
        if req in self.waiting:
            self.waiting.remove(req)
        if req not in self.running:
            self._ids.pop(req.rid, None)

    def _usage(self, req: GenerationRequest) -> Usage:
        return Usage(len(req.prompt), len(req.generated), req.cached_tokens or 0)

    def _deliver(self, req: GenerationRequest, delta: Delta) -> None:
        try:
            req.sink(delta)
        except Exception:  # a sink that fails has lost its client: stop generating for it
            if req.finish_reason is None:
                self._end(req, "abort")

    def _retire(self) -> None:
        """Rows and prefills whose request ended leave; their full pages are registered."""
        for job in [j for j in self.prefilling if j.req.finish_reason is not None]:
            self._drop_prefill(job)
            self._ids.pop(job.req.rid, None)
        done = [i for i, r in enumerate(self.running) if r.finish_reason is not None]
        if not done:
            return
        for i in done:
            req = self.running[i]
            if self.prefix is not None:
                self.prefix.register_row(self.batch.rows, i, self._keys(req))
            self._ids.pop(req.rid, None)
        keep = [i for i, r in enumerate(self.running) if r.finish_reason is None]
        self.batch.filter(keep)
        self.running = [self.running[i] for i in keep]
        self._pending = [self._pending[i] for i in keep]
        if not keep:
            self._unread, self._unread_rows = None, []  # (only ended rows' tokens)
            if self._compiled is not None:  # idle: every page back in the pool
                self._compiled.release_lookahead()

    def _update_gauges(self) -> None:
        self.metrics.scheduler(len(self.running) + len(self.prefilling), len(self.waiting), self.pool.allocator.stats(),
                               self.pool.usable_pages, self.pool.bytes_per_page)
        if self.state_pool is not None:
            self.metrics.states(self.state_pool.allocator.stats(), self.state_pool.bytes_per_slot)
