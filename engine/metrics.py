"""Prometheus metrics under vLLM's names, so existing vLLM dashboards and autoscalers work unchanged.

Gauges and counters are read from the engine's latest ``EngineSnapshot`` at scrape time (a custom collector:
nothing to keep in sync, no engine internals read from the scraping thread, and a model switch simply changes the
``model_name`` label). Latency histograms are observed as
streams progress (``RequestTiming``). Each AsyncEngine owns its own ``CollectorRegistry`` (never the global
one), so several engines can live in one process.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.request import RequestOutput
from engine.snapshot import EngineSnapshot

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py), so histogram_quantile panels line up.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort")
CONTENT_TYPE = CONTENT_TYPE_LATEST


MEMORY_MAX_AGE = 1.0  # seconds: an older memory report is refreshed by the engine loop before a scrape reads it


class SnapshotSource(Protocol):
    """What the collector reads: AsyncEngine.snapshot()."""

    def snapshot(self, max_memory_age: float | None = None, wait: float = 0.0) -> EngineSnapshot | None: ...


class _EngineStatsCollector(Collector):
    """Reads the engine's latest snapshot on every scrape."""

    def __init__(self, source: SnapshotSource):
        self.source = source

    def collect(self) -> Iterator[Metric]:
        snapshot = self.source.snapshot(max_memory_age=MEMORY_MAX_AGE, wait=0.2)
        name = snapshot.model_name if snapshot else None
        loaded = GaugeMetricFamily("pagoda:model_loaded", "1 while a model is loaded and serving.",
                                   labels=["model_name"])
        loaded.add_metric([name or ""], 1.0 if name else 0.0)
        yield loaded
        if snapshot is None:
            return
        stats = snapshot.stats()
        label = [name]
        for metric_name, doc, key in (
                ("vllm:num_requests_running", "Requests in the running batch.", "num_running"),
                ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting"),
                ("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", "kv_cache_usage"),
                ("vllm:gpu_cache_usage_perc", "Deprecated vLLM name of vllm:kv_cache_usage_perc.", "kv_cache_usage"),
                ("pagoda:kv_cache_total_blocks", "KV-cache blocks in the pool.", "num_total_blocks"),
                ("pagoda:kv_cache_free_blocks", "KV-cache blocks free (never used or evicted).", "num_free_blocks"),
                ("pagoda:kv_cache_cached_blocks", "KV-cache blocks free but holding a reusable prefix.",
                 "num_cached_blocks"),
                ("pagoda:max_model_len", "Context length of the served model.", "max_model_len")):
            gauge = GaugeMetricFamily(metric_name, doc, labels=["model_name"])
            gauge.add_metric(label, float(stats.get(key) or 0))
            yield gauge
        for metric_name, doc, key in (
                ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
                ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
                ("vllm:prompt_tokens", "Prompt tokens processed.", "prompt_tokens_total"),
                ("vllm:generation_tokens", "Tokens generated.", "generation_tokens_total"),
                ("vllm:num_preemptions", "Requests preempted (blocks freed, recomputed later).", "num_preemptions")):
            counter = CounterMetricFamily(metric_name, doc, labels=["model_name"])
            counter.add_metric(label, float(stats.get(key) or 0))
            yield counter
        success = CounterMetricFamily("vllm:request_success", "Finished requests (per sample) by finish reason.",
                                      labels=["model_name", "finished_reason"])
        finished = stats.get("request_success_total") or {}
        for reason in sorted(set(FINISH_REASONS) | set(finished)):
            success.add_metric([name, reason], float(finished.get(reason, 0)))
        yield success
        if snapshot.memory is not None:
            yield self._memory(name, snapshot.memory.report.as_dict())

    @staticmethod
    def _memory(name: str, report: dict) -> Metric:
        """The memory report's byte fields (pagoda:memory_bytes{kind})."""
        gauge = GaugeMetricFamily("pagoda:memory_bytes", "Where memory goes (engine.memory_report()).",
                                  labels=["model_name", "kind"])
        for kind, value in report.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                gauge.add_metric([name, str(kind)], float(value))
        return gauge


class RequestTiming:
    """Observes one request's time to first token, inter-token latencies and end-to-end latency."""

    def __init__(self, metrics: EngineMetrics, model_name: str):
        # the labelled children, looked up once: ``labels()`` takes a lock and a dict lookup, once per token
        self._ttft = metrics.ttft.labels(model_name)
        self._itl = metrics.itl.labels(model_name)
        self._e2e = metrics.e2e.labels(model_name)
        self.arrival = time.monotonic()
        self.last_token_time: float | None = None
        self.num_tokens = 0

    def on_output(self, output: RequestOutput) -> None:
        now = time.monotonic()
        # Samples advance together; the most advanced one counts the tokens delivered so far.
        total = max((len(o.token_ids) for o in output.outputs), default=0)
        new = total - self.num_tokens
        if new > 0:
            if self.last_token_time is None:
                self._ttft.observe(now - self.arrival)
                new -= 1
            per_token = (now - (self.last_token_time or now)) / new if new else 0.0
            for _ in range(new):  # outputs merged under load still count one interval per token
                self._itl.observe(per_token)
            self.last_token_time, self.num_tokens = now, total
        if output.finished:
            self._e2e.observe(now - self.arrival)


class EngineMetrics:
    """The per-engine registry: a stats collector plus the three latency histograms."""

    def __init__(self, source: SnapshotSource):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineStatsCollector(source))
        labels = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", labels,
                              registry=self.registry, buckets=TTFT_BUCKETS)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between generated tokens.", labels,
                             registry=self.registry, buckets=ITL_BUCKETS)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to finish of a request.", labels,
                             registry=self.registry, buckets=E2E_BUCKETS)

    def start_request(self, model_name: str) -> RequestTiming:
        return RequestTiming(self, model_name)

    def render(self) -> bytes:
        """The Prometheus text exposition of everything in this registry."""
        return generate_latest(self.registry)
