"""Prometheus metrics for `/metrics` (the HTTP door): the model-server protocol of the Gateway API Inference
Extension (queue, running, KV-cache use, cache config, LoRA state in vLLM's `lora_requests_info` format) and vLLM's
request, token, latency, prefix-cache and preemption metrics, named ours (`lora_serve:`) or vLLM's
(`--metrics-prefix vllm`; prometheus_names.py).

Two sources, neither of which steers anything:
  - gauges and the engine's own counters (prefix cache, preemptions) are read from the scheduler at scrape time
    (prometheus_scheduler.py), so they are exact when scraped;
  - counters and histograms are fed by the runner's observer hooks: each step's sampled tokens (on_iteration:
    token counts, time to first token, inter-token latency, tokens per step) and each request's lifecycle events
    when its stream ends (on_finished: request_times.py).
One registry per server (a process may run several, as the tests do). The OTLP metrics of observer.py are
independent of these and keep working.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest

from service.telemetry.adapter_events import LOAD_BUCKETS, adapter_metric
from service.telemetry.prometheus_names import (
    INTER_TOKEN_LATENCY_BUCKETS,
    ITERATION_TOKENS_BUCKETS,
    OWN_PREFIX,
    REQUEST_LATENCY_BUCKETS,
    REQUEST_NUM_PREEMPTIONS_BUCKETS,
    REQUEST_PARAMS_N_BUCKETS,
    TTFT_BUCKETS,
    MetricNames,
    request_tokens_buckets,
)
from service.telemetry.prometheus_scheduler import SchedulerCollector
from service.telemetry.request_times import RequestTimes
from service.telemetry.setup import never_raise

if TYPE_CHECKING:
    from collections.abc import Callable

    from service.runner.reports import IterationResult, SchedulerStats
    from service.runner.request_state import RequestState

disable_created_metrics()  # no `_created` series beside every counter and histogram (vLLM does the same)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TOKENS = "request_tokens"  # vLLM's 1-2-5 token buckets up to the context length
# name → (help, buckets); vLLM's names after the prefix (prometheus_names maps the one that differs).
_HISTOGRAMS: dict[str, tuple[str, tuple | str]] = {
    "time_to_first_token_seconds": ("Time from arrival to the first token", TTFT_BUCKETS),
    "inter_token_latency_seconds": ("Time between two tokens of a request (each gap)", INTER_TOKEN_LATENCY_BUCKETS),
    "time_per_output_token_seconds": ("Mean time per output token after the first, per request",
                                      INTER_TOKEN_LATENCY_BUCKETS),
    "e2e_request_latency_seconds": ("Time from arrival to the last token", REQUEST_LATENCY_BUCKETS),
    "request_queue_time_seconds": ("Time from arrival to the first admission (waiting)", REQUEST_LATENCY_BUCKETS),
    "request_prefill_time_seconds": ("Time from the first admission to the first token", REQUEST_LATENCY_BUCKETS),
    "request_decode_time_seconds": ("Time from the first token to the last", REQUEST_LATENCY_BUCKETS),
    "request_inference_time_seconds": ("Time from the first admission to the last token", REQUEST_LATENCY_BUCKETS),
    "request_prompt_tokens": ("Prompt tokens per finished request", _TOKENS),
    "request_generation_tokens": ("Generated tokens per finished request", _TOKENS),
    "request_max_num_generation_tokens": ("Generated tokens per finished request (the most of its choices)",
                                          _TOKENS),
    "request_params_max_tokens": ("The max_tokens (max_new_tokens) of finished requests", _TOKENS),
    "request_params_n": ("The n (choices) of finished requests", REQUEST_PARAMS_N_BUCKETS),
    "request_prefill_kv_computed_tokens": ("Prompt tokens computed at prefill (not found in the prefix cache)",
                                           _TOKENS),
    "request_num_preemptions": ("Times a finished request was preempted", REQUEST_NUM_PREEMPTIONS_BUCKETS),
    "iteration_tokens_total": ("Tokens per engine step (prefill chunks and decodes)", ITERATION_TOKENS_BUCKETS),
}


class PrometheusMetrics:
    """The registry behind `/metrics`, and a RunnerObserver that feeds its counters and histograms.
    `max_model_len` bounds the token-count buckets (vLLM's); `prefix`: "lora_serve" or "vllm"."""

    def __init__(self, stats: Callable[[], SchedulerStats], model_name: str, max_model_len: int,
                 prefix: str = "lora_serve", max_adapter_series: int = 64):
        names = self.names = MetricNames(prefix)
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(SchedulerCollector(stats, model_name, names, max_adapter_series))
        model = names.labelvalues(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(names(name), doc, names.labelnames, registry=self.registry).labels(*model)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of prefilled requests")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.request_success = Counter(names("request_success"), "Requests that ended, by finish reason",
                                       [*names.labelnames, "finished_reason"], registry=self.registry)
        for reason in names.finish_reasons:  # each at zero from the start, as vLLM's
            self.request_success.labels(*model, reason)
        self._model = model
        token_buckets = request_tokens_buckets(max_model_len)
        self.histograms = {
            key: Histogram(names(key), doc, names.labelnames, registry=self.registry,
                           buckets=token_buckets if buckets == _TOKENS else buckets).labels(*model)
            for key, (doc, buckets) in _HISTOGRAMS.items()}
        # When each running request's last token was sampled (end of its step): inter-token gaps, last token.
        self._last_token_ns: dict[RequestState, int] = {}
        # A prompt's n choices still running: (parent, prompt index) → [choices left, most generated, any finished]
        self._prompts: dict[tuple, list] = {}

        # Adapter tiers: no vLLM counterpart, so always ours.
        self.adapter_loads = Counter(OWN_PREFIX + "lora_adapter_loads", "Adapter reads from disk, by result "
                                     "(ok, error)", labelnames=["result"], registry=self.registry)
        self.adapter_evictions = Counter(OWN_PREFIX + "lora_adapter_evictions", "Adapters evicted, by tier "
                                         "(device, host)", labelnames=["tier"], registry=self.registry)
        self.adapter_load_time = Histogram(OWN_PREFIX + "lora_adapter_load_seconds", "Adapter load time by phase "
                                           "(disk_read: loader thread; device_copy: between steps)",
                                           labelnames=["phase"], buckets=LOAD_BUCKETS, registry=self.registry)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def _observe(self, name: str, value: float | None) -> None:
        if value is not None:
            self.histograms[name].observe(value)

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
        step = result.step
        if step is None:  # nothing ran, or the step failed
            return
        self.histograms["iteration_tokens_total"].observe(step.num_tokens)
        # (Read from the step's own output: the engine thread may already be running the next one.)
        by_seq = {s.seq.seq_id: s for s in result.stepped}
        end = step.end_ns
        for seq_id in step.seq_ids:
            state = by_seq.get(seq_id)
            if state is None or state.closed:  # its stream has ended: on_finished has run
                continue
            last = self._last_token_ns.get(state)
            if last is None:  # its first token: the prompt was computed
                self.prompt_tokens.inc(len(state.request.prompt_ids))
                self._observe("time_to_first_token_seconds", RequestTimes.seconds(state.events[0].time_ns, end))
            else:
                self._observe("inter_token_latency_seconds", RequestTimes.seconds(last, end))
            self.generation_tokens.inc()
            self._last_token_ns[state] = end

    @never_raise
    def on_finished(self, state: RequestState) -> None:
        last_token_ns = self._last_token_ns.pop(state, None)
        t = RequestTimes.of(state)
        reason = self.names.finish_reason(t.outcome)
        if reason is not None:
            self.request_success.labels(*self._model, reason).inc()
        generated = len(state.seq.output_ids)
        completed = t.finished_ns is not None and not t.failed
        self._prompt_choices_done(state, generated, completed)
        if not completed:
            return  # cancelled or failed: how long it ran says nothing of the server's latency
        last = last_token_ns if last_token_ns is not None else t.finished_ns
        prompt = len(state.request.prompt_ids)
        decode = RequestTimes.seconds(t.first_token_ns, last)
        for name, value in (
                ("e2e_request_latency_seconds", RequestTimes.seconds(t.queued_ns, last)),
                ("request_queue_time_seconds", RequestTimes.seconds(t.queued_ns, t.admitted_ns)),
                ("request_prefill_time_seconds", RequestTimes.seconds(t.admitted_ns, t.first_token_ns)),
                ("request_decode_time_seconds", decode),
                ("request_inference_time_seconds", RequestTimes.seconds(t.admitted_ns, last)),
                ("time_per_output_token_seconds", decode / (generated - 1) if decode is not None
                 and generated > 1 else None),
                ("request_prompt_tokens", prompt),
                ("request_generation_tokens", generated),
                ("request_params_max_tokens", state.request.sampling.max_new_tokens),
                ("request_prefill_kv_computed_tokens", prompt - t.cached_tokens),
                ("request_num_preemptions", state.seq.num_preemptions)):
            self._observe(name, value)

    def _prompt_choices_done(self, state: RequestState, generated: int, completed: bool) -> None:
        """n and the most tokens any choice generated, once per prompt when its last choice ends (vLLM's
        ParentRequest: each choice is a request of its own for the other metrics)."""
        n = state.request.n
        if n == 1 or state.parent is None:
            key, group = None, [1, generated, completed]
        else:
            key = (state.parent, state.index // n)  # choice index = prompt_index * n + i
            group = self._prompts.setdefault(key, [n, 0, False])
            group[1], group[2] = max(group[1], generated), group[2] or completed
        group[0] -= 1
        if group[0] > 0:
            return
        self._prompts.pop(key, None)
        if group[2]:  # one of its choices finished (not all cancelled or failed)
            self._observe("request_params_n", n)
            self._observe("request_max_num_generation_tokens", group[1])
