"""GET /metrics: the engine's state in Prometheus' text format, under vLLM's own names where the meaning is the same.

Checked against vLLM 0.33's PrometheusStatLogger (vllm/v1/metrics/loggers.py): these have vLLM's name,
type and labels (`model_name`, `engine`; `finished_reason` on request_success), so a panel built on one
of them reads the same series from either server:

    vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc      gauges
    vllm:num_preemptions, vllm:prompt_tokens, vllm:generation_tokens                    counters (_total)
    vllm:prefix_cache_queries, vllm:prefix_cache_hits (in tokens)                       counters (_total)
    vllm:request_success{finished_reason="stop"|"length"|"abort"|"error"}               counter (_total)
    vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds,
    vllm:request_time_per_output_token_seconds, vllm:e2e_request_latency_seconds        histograms

Bucket edges differ from vLLM's (ours start at a tiny model's millisecond steps), so quantiles estimated
from buckets differ a little. vLLM has no free-block or hit-rate series: those here are kvcourse's own
(`kvcourse:num_free_blocks`, `kvcourse:num_blocks`); the hit rate is hits / queries, in PromQL as in vLLM.
Everything vLLM exports beyond these (spec decode, LoRA, queue and prefill times...) is not here.
Each server has its own registry, so several servers (tests, a notebook) can live in one process.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

disable_created_metrics()  # no `_created` timestamp series: they only clutter the page (vLLM drops them too)

# Latency buckets in seconds: from a tiny model's millisecond steps to a large model on a CPU.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
FINISH_REASONS = ("stop", "length", "abort", "error")  # vLLM's FinishReason strings (less "repetition")
LABELS = ("model_name", "engine")  # vLLM's labels on every series


class ServerMetrics:
    """The gauges, counters and histograms of one server, in their own registry."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str = "kvcourse") -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name, "engine": "0"}

        def make(kind: type, name: str, doc: str, **kwargs: Any) -> Any:
            return kind(name, doc, list(LABELS), registry=self.registry, **kwargs).labels(**labels)

        self.running = make(Gauge, "vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = make(Gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = make(Gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.preemptions = make(Counter, "vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prefix_queries = make(
            Counter, "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_hits = make(
            Counter, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.prompt_tokens = make(Counter, "vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = make(Counter, "vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*LABELS, "finished_reason"],
            registry=self.registry,
        )
        self._success = {reason: success.labels(**labels, finished_reason=reason) for reason in FINISH_REASONS}
        self.ttft = make(
            Histogram,
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            buckets=TTFT_BUCKETS,
        )
        self.itl = make(
            Histogram,
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            buckets=TPOT_BUCKETS,
        )
        self.tpot = make(
            Histogram,
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            buckets=TPOT_BUCKETS,
        )
        self.e2e = make(
            Histogram,
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            buckets=E2E_BUCKETS,
        )
        self.free_blocks = make(Gauge, "kvcourse:num_free_blocks", "KV-cache blocks free right now (kvcourse's own).")
        self.num_blocks = make(Gauge, "kvcourse:num_blocks", "KV-cache blocks in the pool (kvcourse's own).")
        self._prefix_seen = (0, 0)  # the manager's (queries, hits) already counted

    def finished(self, reason: str) -> None:
        """Count one request ended for `reason` (one of FINISH_REASONS)."""
        self._success[reason].inc()

    def update(self, state: Any, prefix_stats: Any = None) -> None:
        """Set the gauges from the engine loop's latest state; add the prefix cache's new lookups to the counters."""
        self.running.set(state.num_running)
        self.waiting.set(state.num_waiting)
        self.kv_usage.set(state.kv_cache_usage)
        self.free_blocks.set(state.num_free_blocks)
        self.num_blocks.set(state.num_blocks)
        if prefix_stats is not None:
            queries, hits = int(prefix_stats.queries), int(prefix_stats.hits)
            seen_queries, seen_hits = self._prefix_seen
            if queries < seen_queries or hits < seen_hits:  # the manager's stats were reset: count from zero
                seen_queries = seen_hits = 0
            self.prefix_queries.inc(queries - seen_queries)
            self.prefix_hits.inc(hits - seen_hits)
            self._prefix_seen = (queries, hits)

    def render(self) -> bytes:
        """The text exposition format (what Prometheus scrapes)."""
        return generate_latest(self.registry)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {"name{labels}": value}, for tests and notebooks (comments skipped)."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def metric(values: dict[str, float], name: str, **labels: str) -> float:
    """The sum of the series called `name` whose labels include `labels` (0 when there is none)."""
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    total = 0.0
    for key, value in values.items():
        series, _, label_text = key.partition("{")
        if series == name and all(w in label_text.rstrip("}").split(",") for w in wanted):
            total += value
    return total
