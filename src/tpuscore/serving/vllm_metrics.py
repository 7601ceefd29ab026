"""vLLM's Prometheus series, as vLLM's v1 engine names and defines them (docs/design/metrics.md,
vllm/v1/metrics/loggers.py), for the dashboards, KEDA scalers and llm-d tooling that read them.

Each series carries vLLM's labels (`model_name`, `engine`) and vLLM's meaning, mapped onto the
Batcher: "waiting" is a request accepted and not in the running batch (vLLM's WAITING queue),
"running" one in the batch on the device (vLLM's RUNNING), queue time runs from the request's
entry into the queue, after tokenization as vLLM's frontend tokenizes before its engine queue,
to its first batch. docs/serving.md lists vLLM's series that have no meaning for a scorer.
"""

from __future__ import annotations

import prometheus_client
from prometheus_client.core import GaugeMetricFamily

from tpuscore.api.results import ScoreResult

# tpuscore's buckets (serving/metrics.py), finer than vLLM's (from 0.3 s): scoring requests take
# milliseconds. Quantiles over histograms work with any buckets.
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# Endpoints that are not engine requests in vLLM (no queue, no model): not counted as requests.
NOT_ENGINE_REQUESTS = frozenset({"/health", "/v1/models", "/tokenize", "/detokenize", "/metrics"})
# vLLM's finished_reason for a request answered, and for one whose client left (499).
FINISHED_REASONS = {200: "stop", 499: "abort"}
ENGINE = "0"  # one engine per server process


class VllmMetrics:
    """vllm:num_requests_running, _waiting (gauges, read from the batcher at each scrape),
    vllm:request_queue_time_seconds, vllm:e2e_request_latency_seconds (histograms),
    vllm:prompt_tokens_total and vllm:request_success_total (counters)."""

    def __init__(self, registry: prometheus_client.CollectorRegistry, *, model_name: str, batcher):
        self.labels = {"model_name": model_name, "engine": ENGINE}
        names = list(self.labels)
        kw = {"registry": registry}
        self.queue_time = prometheus_client.Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            names,
            buckets=LATENCY_BUCKETS_S,
            **kw,
        ).labels(**self.labels)
        self.e2e_latency = prometheus_client.Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            names,
            buckets=LATENCY_BUCKETS_S,
            **kw,
        ).labels(**self.labels)
        self.prompt_tokens = prometheus_client.Counter(
            "vllm:prompt_tokens",
            "Number of prefill tokens processed (token positions the model ran).",
            names,
            **kw,
        ).labels(**self.labels)
        self.success = prometheus_client.Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*names, "finished_reason"],
            **kw,
        )
        if batcher is not None:
            registry.register(
                QueueGauges(
                    batcher,
                    waiting="vllm:num_requests_waiting",
                    running="vllm:num_requests_running",
                    labels=self.labels,
                )
            )
            batcher.on_batched = self.queue_time.observe

    def answered(self, endpoint: str, status: int, seconds: float) -> None:
        if endpoint in NOT_ENGINE_REQUESTS:
            return
        self.e2e_latency.observe(seconds)
        reason = FINISHED_REASONS.get(status)
        if reason is not None:
            self.success.labels(**self.labels, finished_reason=reason).inc()

    def scored(self, result: ScoreResult) -> None:
        self.prompt_tokens.inc(result.num_tokens)


class QueueGauges:
    """A waiting and a running gauge, read from `Batcher.counts()` at each scrape, under the
    names given (vLLM's, or tpuscore's in serving/metrics.py)."""

    def __init__(self, batcher, *, waiting: str, running: str, labels: dict[str, str]):
        self.batcher, self.names, self.labels = batcher, (waiting, running), labels

    def collect(self):
        counts = self.batcher.counts()
        docs = (
            "Number of requests waiting to be processed.",
            "Number of requests in model execution batches.",
        )
        for name, doc, value in zip(self.names, docs, counts, strict=True):
            family = GaugeMetricFamily(name, doc, labels=list(self.labels))
            family.add_metric(list(self.labels.values()), value)
            yield family
