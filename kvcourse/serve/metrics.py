"""GET /metrics: the engine's state in Prometheus' text format, named after vLLM's own metrics.

vLLM exports `vllm:num_requests_running`, `vllm:kv_cache_usage_perc`, `vllm:time_to_first_token_seconds`...;
this server exports the same ideas under `kvcourse:`, so a Grafana board for one reads the other.
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


class ServerMetrics:
    """The gauges, counters and histograms of one server, in their own registry."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("kvcourse:num_requests_running", "Requests in the running set.", registry=r)
        self.waiting = Gauge("kvcourse:num_requests_waiting", "Requests waiting for admission.", registry=r)
        self.kv_usage = Gauge("kvcourse:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", registry=r)
        self.free_blocks = Gauge("kvcourse:num_free_blocks", "KV-cache blocks free right now.", registry=r)
        self.num_blocks = Gauge("kvcourse:num_blocks", "KV-cache blocks in the pool.", registry=r)
        self.preemptions = Counter("kvcourse:num_preemptions", "Requests preempted (recompute).", registry=r)
        self.prefix_queries = Gauge(
            "kvcourse:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", registry=r
        )
        self.prefix_hits = Gauge("kvcourse:prefix_cache_hits", "Prompt tokens found in the prefix cache.", registry=r)
        self.prefix_hit_rate = Gauge(
            "kvcourse:prefix_cache_hit_rate", "Prefix-cache hits / queries, in tokens (0-1).", registry=r
        )
        self.prompt_tokens = Counter("kvcourse:prompt_tokens", "Prompt tokens received.", registry=r)
        self.generation_tokens = Counter("kvcourse:generation_tokens", "Tokens sent to clients.", registry=r)
        self.finished = Counter(
            "kvcourse:request_finished", "Requests ended, by finish reason.", ["finished_reason"], registry=r
        )
        self.ttft = Histogram(
            "kvcourse:time_to_first_token_seconds",
            "From arrival to the first token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "kvcourse:time_per_output_token_seconds",
            "Per request: (last token - first token) / (tokens - 1).",
            buckets=TPOT_BUCKETS,
            registry=r,
        )

    def update(self, state: Any, prefix_stats: Any = None) -> None:
        """Set the gauges from the engine loop's latest state."""
        self.running.set(state.num_running)
        self.waiting.set(state.num_waiting)
        self.kv_usage.set(state.kv_cache_usage)
        self.free_blocks.set(state.num_free_blocks)
        self.num_blocks.set(state.num_blocks)
        if prefix_stats is not None:
            queries, hits = int(prefix_stats.queries), int(prefix_stats.hits)
            self.prefix_queries.set(queries)
            self.prefix_hits.set(hits)
            self.prefix_hit_rate.set(hits / queries if queries else 0.0)

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
