"""Prometheus metrics for `/metrics` (the HTTP door), in the `lora_serve:` namespace: the model-server protocol of
the Gateway API Inference Extension (queue, running, KV-cache use, cache config, LoRA state in vLLM's
`lora_requests_info` format) and vLLM's request, prefix-cache and preemption counters and latency histograms.

Two sources, neither of which steers anything:
  - gauges and the engine's own counters (prefix cache, preemptions) are read from the scheduler at scrape time
    (`EngineRunner.stats()`), so they are exact when scraped;
  - counters and histograms are fed by the runner's observer hooks (`on_finished`: the request's lifecycle events).
One registry per server (a process may run several, as the tests do). The OTLP metrics of observer.py are
independent of these and keep working.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from service.runner.request import RequestEventType
from service.telemetry.adapter_events import LOAD_BUCKETS, adapter_metric
from service.telemetry.setup import never_raise

if TYPE_CHECKING:
    from service.runner.reports import IterationResult, SchedulerStats
    from service.runner.request_state import RequestState

disable_created_metrics()  # no `_created` series beside every counter and histogram (vLLM does the same)
PREFIX = "lora_serve:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets for the same histograms.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


class _SchedulerCollector(Collector):
    """Gauges from a scheduler snapshot, taken when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], SchedulerStats], model_name: str):
        self._stats = stats
        self._model = model_name

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        s = self._stats()
        model = ["model_name"], [self._model]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=model[0])
            g.add_metric(model[1], value)
            return g

        def counter(name: str, doc: str, value: int) -> CounterMetricFamily:
            # The engine's own monotonic counts, read at scrape time (exposed as <name>_total)
            c = CounterMetricFamily(PREFIX + name, doc, labels=model[0])
            c.add_metric(model[1], value)
            return c

        yield gauge("num_requests_running", "Requests in the running batch", s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be admitted", s.num_waiting)
        yield gauge("kv_cache_usage_perc", "KV-cache usage: share of the KV blocks held by running requests (0..1)",
                    s.kv_cache_usage)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache", s.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache (their KV not computed again)",
                      s.prefix_cache_hits)
        yield counter("num_preemptions", "Running requests preempted for KV blocks (recomputed when readmitted)",
                      s.num_preemptions)
        # vLLM's cache_config_info: the endpoint picker's prefix-cache scorer sizes its per-pod index from these
        # labels (block_size, num_gpu_blocks: the blocks of the KV pool, on whichever device holds it).
        config = GaugeMetricFamily(PREFIX + "cache_config_info", "KV cache configuration (the value is 1)",
                                   labels=["block_size", "num_gpu_blocks", "enable_prefix_caching"])
        config.add_metric([str(s.block_size), str(s.num_kv_blocks), str(s.prefix_caching)], 1.0)
        yield config
        # vLLM's format, read by the endpoint picker: the value is the time of the snapshot.
        info = GaugeMetricFamily(PREFIX + "lora_requests_info", "Running and waiting LoRA adapters",
                                 labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        info.add_metric([str(s.max_loras), ",".join(s.running_adapters), ",".join(s.waiting_adapters)], time.time())
        yield info
        resident = GaugeMetricFamily(PREFIX + "lora_adapter_resident",
                                     "1 for each adapter held in a tier: device (a LoRA slot) or host (memory)",
                                     labels=["adapter", "tier"])
        for tier, names in (("device", s.device_adapters), ("host", s.host_adapters)):
            for name in names:
                resident.add_metric([name, tier], 1.0)
        yield resident
        tiers = GaugeMetricFamily(PREFIX + "lora_adapters", "Known adapters by the fastest tier holding them "
                                  "(device slot, host memory, disk only)", labels=["tier"])
        for tier, n in s.adapter_tiers.items():
            tiers.add_metric([tier], n)
        yield tiers


class PrometheusMetrics:
    """The registry behind `/metrics`, and a RunnerObserver that feeds its counters and histograms."""

    def __init__(self, stats: Callable[[], SchedulerStats], model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_SchedulerCollector(stats, model_name))
        labels = {"labelnames": ["model_name"], "registry": self.registry}
        self._model = model_name
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests", **labels)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens", **labels)
        self.request_success = Counter(PREFIX + "request_success", "Requests that ended, by finish reason "
                                       "(length, stop, eos, cancelled)",
                                       labelnames=["model_name", "finished_reason"], registry=self.registry)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time from arrival to the first token",
                              buckets=_TTFT_BUCKETS, **labels)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds", "Time per output token after the first",
                              buckets=_TPOT_BUCKETS, **labels)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Time from arrival to the last token",
                             buckets=_E2E_BUCKETS, **labels)

        self.adapter_loads = Counter(PREFIX + "lora_adapter_loads", "Adapter reads from disk, by result (ok, error)",
                                     labelnames=["result"], registry=self.registry)
        self.adapter_evictions = Counter(PREFIX + "lora_adapter_evictions", "Adapters evicted, by tier (device, host)",
                                         labelnames=["tier"], registry=self.registry)
        self.adapter_load_time = Histogram(PREFIX + "lora_adapter_load_seconds", "Adapter load time by phase "
                                           "(disk_read: loader thread; device_copy: between steps)",
                                           labelnames=["phase"], buckets=LOAD_BUCKETS, registry=self.registry)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    # --- RunnerObserver ----------------------------------------------------------------------------
    def on_added(self, state: RequestState) -> None:
        pass

    @never_raise
    def on_iteration(self, result: IterationResult) -> None:
        for m in map(adapter_metric, result.adapter_events):
            if m.evicted_tier is not None:
                self.adapter_evictions.labels(m.evicted_tier).inc()
            if m.load_result is not None:
                self.adapter_loads.labels(m.load_result).inc()
            if m.phase is not None:
                self.adapter_load_time.labels(m.phase).observe(m.seconds)

    @never_raise
    def on_finished(self, state: RequestState) -> None:
        queued = first = finished = None
        reason, aborted = None, False
        for event in list(state.events):
            if event.type is RequestEventType.QUEUED:
                queued = event.time_ns
            elif event.type is RequestEventType.FIRST_TOKEN:
                first = event.time_ns
            elif event.type is RequestEventType.FINISHED:
                finished = event.time_ns
                reason = (event.fields or {}).get("finish_reason")  # None: the request failed
            elif event.type is RequestEventType.ABORTED:
                aborted = True
        model = self._model
        generated = len(state.seq.output_ids)
        if first is not None:  # admitted and prefilled: its prompt was computed
            self.prompt_tokens.labels(model).inc(len(state.request.prompt_ids))
            self.ttft.labels(model).observe((first - queued) / 1e9)
        self.generation_tokens.labels(model).inc(generated)
        if reason is None and aborted:
            reason = "cancelled"
        if reason is None:
            return  # an error: not a success of any kind
        self.request_success.labels(model, reason).inc()
        if finished is not None and queued is not None:
            self.e2e.labels(model).observe((finished - queued) / 1e9)
            if first is not None and generated > 1:
                self.tpot.labels(model).observe((finished - first) / 1e9 / (generated - 1))
