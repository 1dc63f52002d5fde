"""The names and label values of /metrics: ours (`lora_serve:`, the default) or vLLM's (`--metrics-prefix vllm`).

With `vllm`, every metric vLLM also exports carries vLLM 0.32's name, labels (`model_name`, `engine="0"`) and
label values (`finished_reason` "stop" where we say "eos", "abort" where we say "cancelled"), so vLLM's Grafana
dashboard and the Gateway API Inference Extension's endpoint picker read this server unchanged. Metrics vLLM has
no counterpart for (adapter tiers, loads, evictions) keep `lora_serve:` either way, out of vLLM's namespace.
Bucket bounds are vLLM's (vllm/v1/metrics/buckets.py) in both namings.
"""
from __future__ import annotations

from dataclasses import dataclass

METRICS_PREFIXES = ("lora_serve", "vllm")
DEFAULT_METRICS_PREFIX = "lora_serve"
OWN_PREFIX = "lora_serve:"  # metrics of our own, whatever the naming

# vLLM's FinishReason strings (vllm/v1/engine/__init__.py), each series created at zero as vLLM does.
VLLM_FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
# Ours (RequestOutput.finish_reason, and "cancelled": the client went away). A failed request is not counted.
FINISH_REASONS = ("length", "stop", "eos", "grammar", "cancelled")
_TO_VLLM_REASON = {"length": "length", "stop": "stop", "eos": "stop", "grammar": "stop", "cancelled": "abort",
                   None: "error"}

# Where vLLM 0.32's name differs from ours (the rest share the part after the prefix).
_VLLM_NAMES = {"time_per_output_token_seconds": "request_time_per_output_token_seconds"}

# vLLM's bucket families.
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)


def request_tokens_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to the context length."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(out)
            out.append(mantissa * scale)
        scale *= 10


@dataclass(frozen=True)
class MetricNames:
    """One naming of the metrics both servers export (`prefix`: lora_serve or vllm)."""

    prefix: str = DEFAULT_METRICS_PREFIX

    def __post_init__(self) -> None:
        if self.prefix not in METRICS_PREFIXES:
            raise ValueError(f"metrics prefix {self.prefix!r}: use one of {', '.join(METRICS_PREFIXES)}")

    @property
    def vllm(self) -> bool:
        return self.prefix == "vllm"

    def __call__(self, name: str) -> str:
        """The exported name of the metric we call `name` (without the _total a counter gains)."""
        return f"{self.prefix}:{_VLLM_NAMES.get(name, name) if self.vllm else name}"

    @property
    def labelnames(self) -> tuple[str, ...]:
        """The labels of every per-model metric (vLLM adds its engine index; one engine here)."""
        return ("model_name", "engine") if self.vllm else ("model_name",)

    def labelvalues(self, model_name: str) -> tuple[str, ...]:
        return (model_name, "0") if self.vllm else (model_name,)

    @property
    def finish_reasons(self) -> tuple[str, ...]:
        """The `finished_reason` values of request_success (all exported from the start, at zero)."""
        return VLLM_FINISH_REASONS if self.vllm else FINISH_REASONS

    def finish_reason(self, reason: str | None) -> str | None:
        """Our finish reason (None: the request failed) as this naming's label value; None: not counted."""
        if self.vllm:
            return _TO_VLLM_REASON.get(reason, "error")
        return reason
