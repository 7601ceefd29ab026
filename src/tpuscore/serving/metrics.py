"""The server's Prometheus series (`GET /metrics`), in a registry per app: apps do not share
counts.

Two families of names, chosen by `tpuscore serve --metrics-names`: tpuscore's own series, and
the vLLM-named series that dashboards, KEDA scalers and llm-d read (`vllm_metrics.py`), or both.
"""

from __future__ import annotations

from typing import Literal

import prometheus_client
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tpuscore.api.results import ScoreResult
from tpuscore.engine import executables
from tpuscore.serving.vllm_metrics import QueueGauges, VllmMetrics

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
MetricsNames = Literal["tpuscore", "vllm", "both"]
METRICS_NAMES: tuple[MetricsNames, ...] = ("tpuscore", "vllm", "both")


class Metrics:
    """tpuscore_requests_total, _request_seconds, _items_total, _tokens_total and
    _backend_picks_total, each labelled by endpoint (the path) or backend; and the process's
    compiled executables and the served scorer's drops (`Executables`, given its guard); given
    the batcher, tpuscore_requests_waiting and
    _running (`Batcher.counts()`). With names "vllm" or "both", vLLM's series
    (`VllmMetrics`, which reads `batcher`'s queue); "vllm" leaves tpuscore's out."""

    def __init__(
        self,
        names: MetricsNames = "tpuscore",
        *,
        model_name: str = "",
        batcher=None,
        executables_guard: executables.Guard | None = None,
    ) -> None:
        if names not in METRICS_NAMES:
            raise ValueError(f"metrics names must be one of {METRICS_NAMES}, got {names!r}")
        self.registry = prometheus_client.CollectorRegistry()
        own = names != "vllm"
        kw = {"registry": self.registry if own else None, "namespace": "tpuscore"}
        self.vllm = None
        if names != "tpuscore":
            self.vllm = VllmMetrics(self.registry, model_name=model_name, batcher=batcher)
        self.requests = prometheus_client.Counter(
            "requests", "HTTP requests answered", ["endpoint", "status"], **kw
        )
        self.items = prometheus_client.Counter(
            "items", "items or documents scored", ["endpoint"], **kw
        )
        self.tokens = prometheus_client.Counter(
            "tokens", "token positions the model ran", ["endpoint"], **kw
        )
        self.latency = prometheus_client.Histogram(
            "request_seconds",
            "time from request to response",
            ["endpoint"],
            buckets=LATENCY_BUCKETS_S,
            **kw,
        )
        self.backend_picks = prometheus_client.Counter(
            "backend_picks", "scoring results by the backend that ran them", ["backend"], **kw
        )
        if own:
            self.registry.register(Executables(executables_guard))
        if own and batcher is not None:  # the autoscaler's signal (deploy/base/hpa.yaml)
            self.registry.register(
                QueueGauges(
                    batcher,
                    waiting="tpuscore_requests_waiting",
                    running="tpuscore_requests_running",
                    labels={},
                )
            )

    def answered(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        self.latency.labels(endpoint).observe(seconds)
        if self.vllm is not None:
            self.vllm.answered(endpoint, status, seconds)

    def scored(self, endpoint: str, num_items: int, result: ScoreResult) -> None:
        self.items.labels(endpoint).inc(num_items)
        self.tokens.labels(endpoint).inc(result.num_tokens)
        self.backend_picks.labels(result.backend).inc()
        if self.vllm is not None:
            self.vllm.scored(result)

    def text(self) -> bytes:
        """The exposition format, as `GET /metrics` answers it (media type CONTENT_TYPE)."""
        return prometheus_client.generate_latest(self.registry)


class Executables:
    """tpuscore_executables_built_total (compiled or loaded from the persistent cache, by the
    whole process: a service that keeps meeting new shapes shows here), _dropped_total (times
    the served scorer's `guard` dropped its executables to stay under the process's memory-map
    limit; 0 without a guard) and tpuscore_memory_maps (the process's, Linux only): read at each
    scrape."""

    def __init__(self, guard: executables.Guard | None = None) -> None:
        self.guard = guard

    def collect(self):
        yield CounterMetricFamily(
            "tpuscore_executables_built",
            "executables built by this process",
            value=executables.compiles(),
        )
        yield CounterMetricFamily(
            "tpuscore_executables_dropped",
            "times the scorer's executables were dropped to stay under the memory-map limit",
            value=0 if self.guard is None else self.guard.dropped,
        )
        maps = executables.map_count()
        if maps is not None:
            yield GaugeMetricFamily("tpuscore_memory_maps", "memory maps held", value=maps)
