"""`/metrics` under vLLM's names (`--metrics-names vllm|both`): each series vLLM's v1 engine
exports with its name, type and labels (vllm/v1/metrics/loggers.py, docs/design/metrics.md),
scraped over HTTP before and after traffic, and the scheduler gauges read while a batch runs.
"""

import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import ServerThread
from test_server import CASE, TEMPLATE
from tpuscore.serving import app as server
from tpuscore.serving.batcher import Batcher
from tpuscore.serving.metrics import Metrics

MODEL_NAME = "tiny-qwen3"
# vLLM's name -> its Prometheus type.
VLLM_SERIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:prompt_tokens": "counter",
    "vllm:request_success": "counter",
}
LABELS = {"model_name": MODEL_NAME, "engine": "0"}


def scrape(client) -> dict[str, tuple[str, dict[str, float]]]:
    """name -> (type, {sample name + labels: value}) of every family /metrics answers."""
    response = client.get("/metrics")
    assert response.status_code == 200
    families = {}
    for family in text_string_to_metric_families(response.text):
        samples = {
            s.name + repr(sorted(s.labels.items())): s.value
            for s in family.samples
            if {k: s.labels.get(k) for k in LABELS} == LABELS or not family.name.startswith("vllm")
        }
        families[family.name] = (family.type, samples)
    return families


def sample(families, name, suffix="", **labels) -> float:
    _, samples = families[name]
    key = name + suffix + repr(sorted({**LABELS, **labels}.items()))
    return samples[key]


@pytest.fixture(scope="module")
def servers(scorers):
    """One server per --metrics-names choice, on the same scorer."""
    running = {
        names: ServerThread(
            server.create_app(
                scorers(CASE),
                model_name=MODEL_NAME,
                rerank_template=TEMPLATE,
                metrics_names=names,
            )
        )
        for names in ("tpuscore", "vllm", "both")
    }
    yield {names: r.url for names, r in running.items()}
    for r in running.values():
        r.stop()


def test_vllm_series_names_types_and_traffic(servers):
    with httpx.Client(base_url=servers["both"], timeout=60) as client:
        before = scrape(client)
        for name, kind in VLLM_SERIES.items():
            assert before[name][0] == kind, (name, before[name][0])
        assert "tpuscore_requests" in before  # both: tpuscore's too
        assert sample(before, "vllm:num_requests_waiting") == 0
        assert sample(before, "vllm:num_requests_running") == 0

        prompt_tokens = 0
        requests = [
            ("/v1/score", {"query": "the fox", "items": [" jumps", " naps"], "labels": ["x", "e"]}),
            ("/v1/rerank", {"query": "a fox?", "documents": ["a fox", "a dog"]}),
            ("/rerank", {"query": "a fox?", "texts": ["a fox", "a dog"]}),
        ]
        for path, body in requests:
            response = client.post(path, json=body)
            assert response.status_code == 200, response.text
            usage = response.json().get("usage") if path != "/rerank" else None
            prompt_tokens += usage["prompt_tokens"] if usage else 0
        # Not engine requests: counted by tpuscore's series only.
        assert client.post("/tokenize", json={"prompt": "the fox"}).status_code == 200
        assert client.post("/v1/score", json={"query": "x"}).status_code == 400
        after = scrape(client)

    n = len(requests)
    for name in ("vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds"):
        count = sample(after, name, "_count") - sample(before, name, "_count")
        assert count == n + (name == "vllm:e2e_request_latency_seconds"), name  # + the 400
        assert sample(after, name, "_sum") > sample(before, name, "_sum")
    success = sample(after, "vllm:request_success", "_total", finished_reason="stop")
    assert success == n
    tokens = sample(after, "vllm:prompt_tokens", "_total") - sample(
        before, "vllm:prompt_tokens", "_total"
    )
    assert tokens > prompt_tokens > 0  # the TEI rerank's tokens count too, it reports none
    assert sample(after, "vllm:num_requests_waiting") == 0
    assert sample(after, "vllm:num_requests_running") == 0


def test_names_choose_the_series(servers):
    names = {}
    for choice, url in servers.items():
        with httpx.Client(base_url=url, timeout=60) as client:
            names[choice] = set(scrape(client))
    vllm = set(VLLM_SERIES)
    assert not vllm & names["tpuscore"] and "tpuscore_requests" in names["tpuscore"]
    assert vllm <= names["vllm"] and not any(n.startswith("tpuscore") for n in names["vllm"])
    assert vllm <= names["both"] and "tpuscore_requests" in names["both"]
    with pytest.raises(ValueError, match="metrics names"):
        Metrics("prometheus")


class HeldScorer:
    """The scorer, whose `run` waits for `release` after telling `entered`."""

    def __init__(self, scorer):
        self._scorer = scorer
        self.prepare_request = scorer.prepare_request  # the Batcher's Scoring protocol
        self.entered, self.release = threading.Event(), threading.Event()

    def run(self, requests, backend=None):
        self.entered.set()
        assert self.release.wait(60)
        return self._scorer.run(requests, backend=backend)


def test_scheduler_gauges_follow_the_batcher(scorers):
    """One request in the running batch, two queued behind it: running 1, waiting 2; both 0
    once they are answered; three queue times observed."""
    held = HeldScorer(scorers(CASE))
    with Batcher(held, max_wait_ms=0) as batcher:
        metrics = Metrics("vllm", model_name=MODEL_NAME, batcher=batcher)
        request = {"query": [5, 6, 7], "items": [[8, 9]], "label_token_ids": [3]}
        futures = [batcher.submit(**request)]
        assert held.entered.wait(60)
        futures += [batcher.submit(**request) for _ in range(2)]
        assert batcher.counts() == (2, 1)
        text = metrics.text().decode()
        assert 'vllm:num_requests_waiting{engine="0",model_name="tiny-qwen3"} 2.0' in text
        assert 'vllm:num_requests_running{engine="0",model_name="tiny-qwen3"} 1.0' in text
        own = Metrics("tpuscore", batcher=batcher).text().decode()
        assert "\ntpuscore_requests_waiting 2.0\n" in own
        assert "\ntpuscore_requests_running 1.0\n" in own
        held.release.set()
        for future in futures:
            future.result(timeout=60)
        assert batcher.counts() == (0, 0)
        families = {f.name: f for f in text_string_to_metric_families(metrics.text().decode())}
        counts = [
            s.value
            for s in families["vllm:request_queue_time_seconds"].samples
            if s.name.endswith("_count")
        ]
        assert counts == [3]
