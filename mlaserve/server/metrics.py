"""Prometheus metrics for `/metrics` (with --enable-metrics), in a registry of their own: token counters and
load gauges read from the scheduler's stats at scrape time, latency histograms fed by the tokenizer manager."""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "mlaserve:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)

# (name in the scheduler's stats, metric name, help)
COUNTERS = (
    ("prompt_tokens", "prompt_tokens", "prompt tokens computed (prefilled)"),
    ("cached_tokens", "cached_tokens", "prompt tokens served from the prefix cache"),
    ("generation_tokens", "generation_tokens", "tokens generated"),
    ("num_retracted", "num_retracted_reqs", "requests retracted to free KV-cache room"),
    ("mixed_steps", "mixed_steps", "steps whose running decodes rode in a prefill batch (--enable-mixed-chunk)"),
    ("piecewise_graph_steps", "piecewise_graph_steps",
     "extend batches run through piecewise CUDA graphs (--enable-piecewise-cuda-graph)"),
    ("extends_as_decode", "extends_as_decode_steps",
     "extend batches of one new token per request (fully cached prompts) run as decode steps"),
)
GAUGES = (
    ("num_running_reqs", "num_running_reqs", "requests in the running batch"),
    ("num_waiting_reqs", "num_queue_reqs", "requests waiting to be scheduled"),
    ("token_usage", "token_usage", "fraction of KV-cache token slots in use (prefix cache included)"),
    ("used_tokens", "used_tokens", "KV-cache token slots in use"),
    ("max_total_tokens", "max_total_tokens", "KV-cache size in tokens"),
    ("avg_spec_accept_length", "spec_accept_length",
     "speculative decoding: mean tokens per verify step since start (0 without speculation)"),
)


class _StatsCollector(Collector):
    """Yields the counters and gauges of the last `get_stats()` snapshot: one sample each, or under DP attention
    one per DP group, labelled `dp_rank`."""

    def __init__(self) -> None:
        self.stats: dict = {}

    def collect(self) -> Iterator[Metric]:
        groups = self.stats.get("dp_groups")
        for family, table in ((CounterMetricFamily, COUNTERS), (GaugeMetricFamily, GAUGES)):
            for key, name, help_ in table:
                yield self._family(family, name, help_, lambda s, k=key: float(s.get(k, 0)), groups)
        yield self._family(GaugeMetricFamily, "cache_hit_rate", "share of prompt tokens served from the prefix cache",
                           cache_hit_rate, groups)

    def _family(self, family, name: str, help_: str, value, groups: list[dict] | None) -> Metric:
        if not groups:
            return family(PREFIX + name, help_, value=value(self.stats))
        metric = family(PREFIX + name, help_, labels=["dp_rank"])
        for g in groups:
            metric.add_metric([str(g.get("dp_rank", 0))], value(g))
        return metric


def cache_hit_rate(stats: dict) -> float:
    cached, computed = stats.get("cached_tokens", 0), stats.get("prompt_tokens", 0)
    return cached / (cached + computed) if cached + computed else 0.0


class ServerMetrics:
    """The server's Prometheus registry. The manager calls `observe("ttft" | "itl" | "e2e", seconds)`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._stats = _StatsCollector()
        self.registry.register(self._stats)
        self.histograms = {
            "ttft": Histogram(PREFIX + "time_to_first_token_seconds", "time to first token",
                              buckets=TTFT_BUCKETS, registry=self.registry),
            "itl": Histogram(PREFIX + "inter_token_latency_seconds", "time between consecutive output tokens",
                             buckets=ITL_BUCKETS, registry=self.registry),
            "e2e": Histogram(PREFIX + "e2e_request_latency_seconds", "request latency, arrival to last token",
                             buckets=E2E_BUCKETS, registry=self.registry),
        }

    def observe(self, name: str, seconds: float) -> None:
        self.histograms[name].observe(seconds)

    def update(self, stats: dict) -> None:
        """Refresh counters and gauges from the scheduler's `get_stats()` (call before `render`)."""
        self._stats.stats = dict(stats)

    def render(self) -> bytes:
        return generate_latest(self.registry)
