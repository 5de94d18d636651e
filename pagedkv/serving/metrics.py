"""``ServingMetrics``: the engine's counters, gauges and latency histograms in Prometheus
form (``prometheus_client``, one registry per engine so several servers can share a
process).

Names follow vLLM's where vLLM has the metric, with the ``pagedkv:`` prefix in place of
``vllm:`` (counters get ``_total`` appended on the wire, as in vLLM)::

    pagedkv:num_requests_running / _waiting       gauges
    pagedkv:kv_cache_usage_perc                   gauge, pages in use / usable pages (0-1)
    pagedkv:prefix_cache_queries / _hits          counters, in prompt tokens
    pagedkv:num_preemptions                       counter
    pagedkv:prompt_tokens / generation_tokens     counters
    pagedkv:request_success                       counter, label finished_reason
    pagedkv:time_to_first_token_seconds           histogram, arrival to first token
    pagedkv:inter_token_latency_seconds           histogram, between a request's tokens
    pagedkv:e2e_request_latency_seconds           histogram, arrival to last token
and pagedkv's own pool gauges: ``pagedkv:kv_pages_in_use``, ``_cached``, ``_free``,
``pagedkv:kv_peak_bytes`` (the most pages ever held by requests, in bytes), and for
hybrid models ``pagedkv:state_slots_in_use`` / ``_cached`` (recurrent-state slots: one
per running sequence, the checkpoints) and ``pagedkv:state_bytes_in_use``.

Written by the engine's owner thread, read by whoever scrapes (prometheus_client locks).
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

disable_created_metrics()  # no ``*_created`` series (process-wide in prometheus_client)

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


# attribute -> (kind, name after "pagedkv:", help); every one is labelled by model_name
_METRICS = {
    "running": (Gauge, "num_requests_running", "Requests admitted: prefilling or in the batch."),
    "waiting": (Gauge, "num_requests_waiting", "Requests waiting for admission."),
    "usage": (Gauge, "kv_cache_usage_perc", "Fraction of usable KV pages in use (0-1)."),
    "pages_in_use": (Gauge, "kv_pages_in_use", "KV pages held by requests."),
    "pages_cached": (Gauge, "kv_pages_cached", "Evictable pages of finished prefixes."),
    "pages_free": (Gauge, "kv_pages_free", "Free KV pages."),
    "peak_bytes": (Gauge, "kv_peak_bytes", "Most KV bytes ever held by requests."),
    "state_in_use": (Gauge, "state_slots_in_use", "Recurrent-state slots held by requests (hybrid models)."),
    "state_cached": (Gauge, "state_slots_cached", "Evictable recurrent-state checkpoints (hybrid models)."),
    "state_bytes": (Gauge, "state_bytes_in_use", "Bytes of recurrent-state slots held by requests."),
    "queries": (Counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "hits": (Counter, "prefix_cache_hits", "Prompt tokens served by the prefix cache."),
    "preemptions": (Counter, "num_preemptions", "Requests preempted to free KV pages."),
    "prompt_tokens": (Counter, "prompt_tokens", "Prompt tokens of admitted requests."),
    "generation_tokens": (Counter, "generation_tokens", "Generated tokens."),
    "ttft": (Histogram, "time_to_first_token_seconds", "Arrival to first token."),
    "itl": (Histogram, "inter_token_latency_seconds", "Time between a request's tokens."),
    "e2e": (Histogram, "e2e_request_latency_seconds", "Arrival to last token."),
}
_BUCKETS = {"ttft": _TTFT_BUCKETS, "itl": _ITL_BUCKETS, "e2e": _E2E_BUCKETS}


class ServingMetrics:
    def __init__(self, model_name: str = "pagedkv") -> None:
        self.registry = CollectorRegistry()
        self._model = model_name
        for attr, (kind, name, doc) in _METRICS.items():
            extra = {"buckets": _BUCKETS[attr]} if attr in _BUCKETS else {}
            metric = kind(f"pagedkv:{name}", doc, ["model_name"], registry=self.registry, **extra)
            setattr(self, attr, metric.labels(model_name))
        self._success = Counter("pagedkv:request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)

    # -- called by the engine
    def prefix_queried(self, prompt_tokens: int, hit_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.queries.inc(prompt_tokens)
        self.hits.inc(hit_tokens)

    def preempted(self) -> None:
        self.preemptions.inc()

    def first_token(self, seconds: float) -> None:
        self.generation_tokens.inc()
        self.ttft.observe(seconds)

    def next_token(self, seconds: float) -> None:
        self.generation_tokens.inc()
        self.itl.observe(seconds)

    def finished(self, req, reason: str) -> None:
        self._success.labels(self._model, reason).inc()
        if req.last_token_at is not None:
            self.e2e.observe(req.last_token_at - req.arrival)

    def scheduler(self, running: int, waiting: int, stats, usable_pages: int, bytes_per_page: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.usage.set(stats.in_use / usable_pages if usable_pages else 0.0)
        self.pages_in_use.set(stats.in_use)
        self.pages_cached.set(stats.cached)
        self.pages_free.set(stats.free)
        self.peak_bytes.set(stats.peak_in_use * bytes_per_page)

    def states(self, stats, bytes_per_slot: int) -> None:
        """The recurrent-state pool's allocator ``stats`` (hybrid models)."""
        self.state_in_use.set(stats.in_use)
        self.state_cached.set(stats.cached)
        self.state_bytes.set(stats.in_use * bytes_per_slot)

    # -- read by a scrape
    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
