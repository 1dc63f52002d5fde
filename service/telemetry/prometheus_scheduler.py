"""The gauges of /metrics that a scheduler snapshot gives (EngineRunner.stats(), taken when Prometheus scrapes, so
exact then): queue, running batch, KV-cache use, the engine's own counters, cache and LoRA info in vLLM's format,
and which adapters sit in memory now.

Per-adapter series (lora_adapter_resident) are built anew at each scrape from the adapters resident now: one that
leaves memory leaves the next scrape, so their number is bounded by what the device slots (--max-loras-per-batch)
and the host cache hold, never by how many adapters were ever used; and by count (--max-adapter-metric-series):
the adapters in a device slot first, then those in host memory, the rest counted in one adapter="other" series per
tier (a host cache of small adapters may hold thousands).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from service.telemetry.prometheus_names import OWN_PREFIX, MetricNames

OTHER_ADAPTERS = "other"  # lora_adapter_resident's label for the adapters past the series cap (their count)

if TYPE_CHECKING:
    from service.runner.reports import SchedulerStats


class SchedulerCollector(Collector):
    """Gauges (and the engine's monotonic counts) from a scheduler snapshot, taken when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], SchedulerStats], model_name: str, names: MetricNames,
                 max_adapter_series: int = 64):
        self._stats = stats
        self._max_adapter_series = max_adapter_series
        self._names = names
        self._labels = list(names.labelnames), list(names.labelvalues(model_name))

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        s, names = self._stats(), self._names
        labelnames, labelvalues = self._labels

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(names(name), doc, labels=labelnames)
            g.add_metric(labelvalues, value)
            return g

        def counter(name: str, doc: str, value: int) -> CounterMetricFamily:
            # The engine's own monotonic counts, read at scrape time (exposed as <name>_total)
            c = CounterMetricFamily(names(name), doc, labels=labelnames)
            c.add_metric(labelvalues, value)
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
        info_labels = ["block_size", "num_gpu_blocks", "enable_prefix_caching", "cache_dtype"]
        info_values = [str(s.block_size), str(s.num_kv_blocks), str(s.prefix_caching), s.cache_dtype]
        if names.vllm:  # vLLM labels its info gauges with the engine index too
            info_labels, info_values = [*info_labels, "engine"], [*info_values, "0"]
        config = GaugeMetricFamily(names("cache_config_info"), "KV cache configuration (the value is 1)",
                                   labels=info_labels)
        config.add_metric(info_values, 1.0)
        yield config
        # vLLM's format, read by the endpoint picker: the value is the time of the snapshot.
        info = GaugeMetricFamily(names("lora_requests_info"), "Running and waiting LoRA adapters",
                                 labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        info.add_metric([str(s.max_loras), ",".join(s.running_adapters), ",".join(s.waiting_adapters)], time.time())
        yield info
        resident = GaugeMetricFamily(OWN_PREFIX + "lora_adapter_resident",
                                     "1 for each adapter held in a tier now: device (a LoRA slot) or host (memory)",
                                     labels=["adapter", "tier"])
        room = self._max_adapter_series
        for tier, adapters in (("device", s.device_adapters), ("host", s.host_adapters)):
            listed, rest = adapters[:room], adapters[room:]
            room -= len(listed)
            for name in listed:
                resident.add_metric([name, tier], 1.0)
            if rest:
                resident.add_metric([OTHER_ADAPTERS, tier], float(len(rest)))
        yield resident
        tiers = GaugeMetricFamily(OWN_PREFIX + "lora_adapters", "Known adapters by the fastest tier holding them "
                                  "(device slot, host memory, disk only)", labels=["tier"])
        for tier, n in s.adapter_tiers.items():
            tiers.add_metric([tier], n)
        yield tiers
