"""/metrics with `--metrics-prefix vllm`, through a real server: vLLM's own Grafana dashboard (tests/data/, its
queries parsed as PromQL) answered by a scrape; vLLM 0.32's names, labels, finish reasons and buckets; the request
histograms checked against the life of known requests; KV-cache usage as the blocks held over the pool's; and the
five metrics the endpoint picker reads, found under the names the gateway manifests give it, in both namings."""
from __future__ import annotations

import http.client
import json
import re
import time
from pathlib import Path

import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from service.server import ServerConfig
from service.telemetry.prometheus import PrometheusMetrics
from service.telemetry.prometheus_names import MetricNames
from tests.http_wire import metric_value, metrics
from tests.service_harness import BackgroundStream, ServerThread, shared_engine, wait_for

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = json.loads((ROOT / "tests" / "data" / "vllm_grafana.json").read_text())
PICKER = ROOT / "deploy" / "kubernetes" / "inference-gateway" / "inferencepool.yaml"
PROMPT = "Once upon a time"
RATE_INTERVAL = "1m"  # what Grafana puts for $__rate_interval (any range parses the same)
# vLLM 0.32's metric families (vllm/v1/metrics/loggers.py, PrometheusStatLogger): a vllm: name we export must be one.
VLLM_FAMILIES = {
    "num_requests_running", "num_requests_waiting", "num_requests_waiting_by_reason", "kv_cache_usage_perc",
    "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens", "prompt_tokens_by_source",
    "prompt_tokens_cached", "generation_tokens", "request_success", "request_prompt_tokens",
    "request_generation_tokens", "iteration_tokens_total", "request_max_num_generation_tokens", "request_params_n",
    "request_params_max_tokens", "time_to_first_token_seconds", "inter_token_latency_seconds",
    "request_time_per_output_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
    "request_inference_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
    "request_num_preemptions", "request_prefill_kv_computed_tokens", "lora_requests_info", "cache_config_info"}
# The picker's built-in vllm engine config (pkg/epp/framework/plugins/datalayer/extractor/metrics/factories.go, v1.5.0)
PICKER_VLLM_SPECS = {
    "queuedRequestsSpec": "vllm:num_requests_waiting", "runningRequestsSpec": "vllm:num_requests_running",
    "kvUsageSpec": "vllm:kv_cache_usage_perc", "loraSpec": "vllm:lora_requests_info",
    "cacheInfoSpec": "vllm:cache_config_info"}


@pytest.fixture(scope="module")
def served():
    server = ServerThread(shared_engine(), ServerConfig(port=0, http_port=0, metrics_prefix="vllm"))
    yield server
    server.stop()


def _text(server: ServerThread) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", server.server.http_port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return text


def _scrape(text: str) -> tuple[dict[str, list], dict[str, str]]:
    """Samples by sample name, and each sample name's family type (counter, gauge, histogram)."""
    samples: dict[str, list] = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
            types[sample.name] = family.type
    return samples, types


def _closed(server: ServerThread) -> None:
    """Every stream's end has reached the observers (the client has its answer a little before)."""
    wait_for(lambda: server.server.runner.num_open_streams == 0, what="every stream to close")


@pytest.fixture(scope="module")
def traffic(served):
    """Requests that end each way the dashboard's finish-reason panel shows: length, stop, cancelled (abort)."""
    prompt = served.engine.tokenizer.encode(PROMPT)
    with served.client() as client:
        length = client.complete(prompt, max_new_tokens=6, ignore_eos=True)
        stop = client.complete(prompt, max_new_tokens=6, ignore_eos=True, stop_token_ids=[length.token_ids[2]])
    stream = BackgroundStream(served, prompt, max_new_tokens=200, ignore_eos=True)
    stream.stop()
    _closed(served)
    assert (length.finish_reason, stop.finish_reason) == ("length", "stop")


# --- vLLM's dashboard --------------------------------------------------------------------------------------------
def _queries() -> list[tuple[str, str]]:
    """(panel title and refId, PromQL) of every panel query, as Grafana sends them for model `$model_name`."""
    return [(f"{panel['title']} {target['refId']}", target["expr"])
            for panel in DASHBOARD["panels"] for target in panel["targets"]]


def _grafana(expr: str, model: str) -> str:
    return expr.replace("$__rate_interval", RATE_INTERVAL).replace("$model_name", model)


def _children(node) -> list:
    kind = type(node).__name__
    if kind == "MatrixSelector":
        return [node.vector_selector]
    if kind == "Call":
        return list(node.args)
    if kind == "BinaryExpr":
        return [node.lhs, node.rhs]
    if kind in ("AggregateExpr", "ParenExpr", "UnaryExpr", "SubqueryExpr"):
        return [node.expr]
    return []


def _selectors(node, by: frozenset = frozenset()):
    """(metric name, [(label, op, value)], labels an aggregation above groups by) of each vector selector."""
    kind = type(node).__name__
    if kind == "VectorSelector":
        yield node.name, [(m.name, str(m.op).rsplit(".", 1)[-1], m.value) for m in node.matchers.matchers], by
        return
    if kind == "AggregateExpr" and node.modifier is not None and node.modifier.type == promql_parser.AggModifierType.By:
        by = by | set(node.modifier.labels)
    for child in _children(node):
        yield from _selectors(child, by)


def _matches(value: str, op: str, want: str) -> bool:
    """A label matcher (promql_parser's MatchOp names) on one series' label value ("" when it has none)."""
    return {"Equal": lambda: value == want, "NotEqual": lambda: value != want,
            "Re": lambda: re.fullmatch(want, value) is not None,
            "NotRe": lambda: re.fullmatch(want, value) is None}[op]()


def _unanswered(expr: str, samples: dict, types: dict) -> list[str]:
    """Why this query would not return data from this scrape (empty: it does). A counter or histogram must have
    counted something (a sample above 0); a gauge must exist."""
    why = []
    for name, matchers, by in _selectors(promql_parser.parse(expr)):
        series = [s for s in samples.get(name, [])
                  if all(_matches(s.labels.get(label, ""), op, value) for label, op, value in matchers)]
        if not series:
            why.append(f"{name}{matchers}: no series")
        elif missing := {label for label in by if any(label not in s.labels for s in series)}:
            why.append(f"{name}: no label {sorted(missing)} to group by")
        elif types[name] != "gauge" and not any(s.value > 0 for s in series):
            why.append(f"{name}: nothing counted")
    return why


def test_vllm_grafana_dashboard_queries_all_return_data(served, traffic):
    """Every query of vLLM's dashboard finds its series, with the labels it filters and groups by, and data."""
    model = served.server.runner.model_info().model
    samples, types = _scrape(_text(served))
    queries = _queries()
    unanswered = {where: why for where, expr in queries if (why := _unanswered(_grafana(expr, model), samples, types))}
    assert not unanswered, f"{len(queries) - len(unanswered)} of {len(queries)} answered: {unanswered}"
    # 27 panel queries naming 21 series, plus the model variable's label_values(model_name): the 22 counted in #31.
    names = {name for _, expr in queries for name, _, _ in _selectors(promql_parser.parse(_grafana(expr, model)))}
    assert (len(queries), len(names)) == (27, 21)
    (variable,) = [v for v in DASHBOARD["templating"]["list"] if v["name"] == "model_name"]
    assert variable["query"]["query"] == "label_values(model_name)"
    assert model in {s.labels.get("model_name") for series in samples.values() for s in series}


def test_the_dashboard_check_fails_without_the_vllm_names(served, traffic):
    """The same queries against our default names (another registry on the same runner) find nothing."""
    info = served.server.runner.model_info()
    ours = PrometheusMetrics(served.server.runner.stats, info.model, info.max_seq_len)
    samples, types = _scrape(ours.exposition().decode())
    assert all(_unanswered(_grafana(expr, info.model), samples, types) for _, expr in _queries())


# --- vLLM's names, labels and values -----------------------------------------------------------------------------
def test_names_labels_and_finish_reasons_are_vllms(served, traffic):
    families = {f.name: f for f in text_string_to_metric_families(_text(served))}
    ours = {name.removeprefix("vllm:") for name in families if name.startswith("vllm:")}
    assert ours <= VLLM_FAMILIES, ours - VLLM_FAMILIES
    assert {name for name in families if not name.startswith("vllm:")} == {
        "lora_serve:lora_adapter_resident", "lora_serve:lora_adapters", "lora_serve:lora_adapter_loads",
        "lora_serve:lora_adapter_evictions", "lora_serve:lora_adapter_load_seconds"}  # no vLLM counterpart
    model = served.server.runner.model_info().model
    for name in ours - {"lora_requests_info", "cache_config_info"}:  # vLLM labels these two its own way
        for sample in families["vllm:" + name].samples:
            assert (sample.labels["model_name"], sample.labels["engine"]) == (model, "0"), sample
    # vLLM's FinishReason strings, each from the start; ours ("eos", "cancelled") never appear.
    success = {s.labels["finished_reason"]: s.value for s in families["vllm:request_success"].samples}
    assert set(success) == {"stop", "length", "abort", "error", "repetition"}
    assert success["length"] >= 1 and success["stop"] >= 1 and success["abort"] >= 1


def test_finish_reasons_map_to_vllms():
    """vLLM says stop for an EOS token as for a stop string or token, abort for a client gone, error for a
    failure (vllm/v1/engine/__init__.py FinishReason); our names say which."""
    vllm, ours = MetricNames("vllm"), MetricNames()
    reasons = ("length", "stop", "eos", "grammar", "cancelled", None)
    assert [vllm.finish_reason(r) for r in reasons] == ["length", "stop", "stop", "stop", "abort", "error"]
    assert [ours.finish_reason(r) for r in reasons] == ["length", "stop", "eos", "grammar", "cancelled", None]
    with pytest.raises(ValueError, match="lora_serve, vllm"):
        MetricNames("vLLM")


def test_metrics_prefix_flag():
    from service.cli import _server_config, serve_parser

    assert _server_config(serve_parser().parse_args([])).metrics_prefix == "lora_serve"
    assert _server_config(serve_parser().parse_args(["--metrics-prefix", "vllm"])).metrics_prefix == "vllm"
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--metrics-prefix", "vLLM"])


def test_histogram_buckets_are_vllms(served):
    samples, _ = _scrape(_text(served))

    def bounds(name: str) -> list[float]:
        return sorted(float(s.labels["le"]) for s in samples[f"vllm:{name}_bucket"] if s.labels["le"] != "+Inf")

    # vllm/v1/metrics/buckets.py
    assert bounds("e2e_request_latency_seconds") == bounds("request_queue_time_seconds") == [
        0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
        1920.0, 7680.0]
    assert bounds("time_to_first_token_seconds") == [
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
        160.0, 640.0, 2560.0]
    assert bounds("inter_token_latency_seconds") == bounds("request_time_per_output_token_seconds") == [
        0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
    max_len = served.engine.config.max_seq_len  # 1-2-5 up to the context length
    assert bounds("request_prompt_tokens") == [b for b in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000) if b <= max_len]


# --- the request histograms ---------------------------------------------------------------------------------------
def test_request_histograms_follow_one_request(served):
    """One request alone, 8 tokens: each histogram counts it once; its 7 token gaps add up to its decode phase, and
    queue + prefill + decode to its end-to-end latency, which the client saw whole."""
    port = served.server.http_port
    prompt = served.engine.tokenizer.encode(PROMPT)
    before = metrics(port)
    with served.client() as client:
        t0 = time.perf_counter()
        out = client.complete(prompt, max_new_tokens=8, ignore_eos=True)
        wall = time.perf_counter() - t0
    _closed(served)
    after = metrics(port)

    def delta(name: str, **labels) -> float:
        return metric_value(after, f"vllm:{name}", **labels) - metric_value(before, f"vllm:{name}", **labels)

    assert (len(out.token_ids), out.finish_reason) == (8, "length")
    assert delta("request_success_total", finished_reason="length") == 1
    assert (delta("prompt_tokens_total"), delta("generation_tokens_total")) == (len(prompt), 8)
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds", "time_to_first_token_seconds",
                 "request_time_per_output_token_seconds", "request_prompt_tokens", "request_generation_tokens",
                 "request_max_num_generation_tokens", "request_params_max_tokens", "request_params_n",
                 "request_num_preemptions", "request_prefill_kv_computed_tokens"):
        assert delta(f"{name}_count") == 1, name
    assert delta("request_prompt_tokens_sum") == len(prompt)
    assert delta("request_generation_tokens_sum") == delta("request_max_num_generation_tokens_sum") == 8
    assert (delta("request_params_max_tokens_sum"), delta("request_params_n_sum")) == (8, 1)
    assert delta("request_num_preemptions_sum") == 0
    assert delta("inter_token_latency_seconds_count") == 7
    queue, prefill = delta("request_queue_time_seconds_sum"), delta("request_prefill_time_seconds_sum")
    decode, e2e = delta("request_decode_time_seconds_sum"), delta("e2e_request_latency_seconds_sum")
    assert delta("inter_token_latency_seconds_sum") == pytest.approx(decode, abs=1e-6)
    assert delta("request_time_per_output_token_seconds_sum") == pytest.approx(decode / 7, abs=1e-6)
    assert delta("time_to_first_token_seconds_sum") == pytest.approx(queue + prefill, abs=1e-6)
    assert delta("request_inference_time_seconds_sum") == pytest.approx(prefill + decode, abs=1e-6)
    assert queue + prefill + decode == pytest.approx(e2e, abs=1e-6)
    assert min(queue, prefill, decode) > 0 and e2e <= wall
    # Its prefill and 7 decodes ran in at least 8 steps, which computed its prompt (what the prefix cache did not
    # hold) and 7 sampled tokens.
    assert delta("iteration_tokens_total_count") >= 8
    assert delta("iteration_tokens_total_sum") >= delta("request_prefill_kv_computed_tokens_sum") + 7 > 7


def test_n_choices_count_once_per_prompt_for_n_and_max_tokens(served):
    """n = 3: three requests for the per-request histograms, one prompt for request_params_n and
    request_max_num_generation_tokens (vLLM's parent request)."""
    port = served.server.http_port
    before = metrics(port)
    with served.client() as client:
        choices = client.complete_choices(PROMPT, n=3, max_new_tokens=5, ignore_eos=True, seed=7, temperature=1.0)
    _closed(served)
    after = metrics(port)

    def delta(name: str) -> float:
        return metric_value(after, f"vllm:{name}") - metric_value(before, f"vllm:{name}")

    assert sorted(c.index for c in choices) == [0, 1, 2]
    assert delta("e2e_request_latency_seconds_count") == delta("request_generation_tokens_count") == 3
    assert (delta("request_params_n_count"), delta("request_params_n_sum")) == (1, 3)
    assert (delta("request_max_num_generation_tokens_count"), delta("request_max_num_generation_tokens_sum")) == (1, 5)


# --- KV-cache usage -----------------------------------------------------------------------------------------------
def test_kv_cache_usage_is_blocks_held_over_the_pool(served):
    """While a request runs, kv_cache_usage_perc is the pool's held blocks over its blocks, scraped between two
    steps (the engine thread runs the scrape, so no block is taken or freed meanwhile)."""
    kv, port = served.engine.kv_cache, served.server.http_port
    prompt = served.engine.tokenizer.encode(PROMPT * 6)
    stream = BackgroundStream(served, prompt, max_new_tokens=150, ignore_eos=True)  # returns once a token arrived

    def scrape_between_steps():
        return metrics(port), kv.num_blocks - kv.num_free_blocks

    samples, held = served.in_engine_thread(scrape_between_steps)
    stream.stop()
    _closed(served)
    usage = metric_value(samples, "vllm:kv_cache_usage_perc")
    assert metric_value(samples, "vllm:num_requests_running") == 1
    assert held >= -(-len(prompt) // kv.block_size) > 0  # at least its prompt's blocks
    assert usage == pytest.approx(held / kv.num_blocks, rel=1e-12) and usage > 0
    (config,) = samples["vllm:cache_config_info"]
    assert (int(config.labels["num_gpu_blocks"]), int(config.labels["block_size"])) == (kv.num_blocks, kv.block_size)


# --- the endpoint picker's five metrics ---------------------------------------------------------------------------
def _picker_specs() -> dict[str, str]:
    """The metric specs of the engine config the gateway manifests' picker applies to our pods (its default)."""
    docs = [d for d in yaml.safe_load_all(PICKER.read_text()) if d]
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap"]
    config = yaml.safe_load(config_map["data"]["plugins.yaml"])
    extractor = next(p for p in config["plugins"] if p["type"] == "core-metrics-extractor")["parameters"]
    return next(e for e in extractor["engineConfigs"] if e["name"] == extractor["defaultEngine"])


def test_endpoint_picker_finds_its_metrics_under_both_namings(served, traffic):
    """As the picker reads a pod (extractor/metrics: spec.go parseStringToSpec, extractFamily, extractValue): each
    spec is an instant vector selector naming a gauge family of the scrape; LoRA info carries the adapter labels and
    cache info the block labels. Default naming: the manifests' engine config; vllm: the picker's built-in one."""
    info = served.server.runner.model_info()
    default = PrometheusMetrics(served.server.runner.stats, info.model, info.max_seq_len).exposition().decode()
    for specs, text in ((_picker_specs(), default), (PICKER_VLLM_SPECS, _text(served))):
        families = {f.name: f for f in text_string_to_metric_families(text)}
        for field in PICKER_VLLM_SPECS:
            selector = promql_parser.parse(specs[field])
            assert type(selector).__name__ == "VectorSelector" and not selector.matchers.matchers, specs[field]
            family = families[selector.name]
            assert family.type == "gauge" and family.samples, selector.name
        (lora,) = families[specs["loraSpec"]].samples
        assert {"running_lora_adapters", "waiting_lora_adapters", "max_lora"} <= lora.labels.keys()
        assert lora.value == pytest.approx(time.time(), abs=60)  # the picker keeps the newest by value
        (cache,) = families[specs["cacheInfoSpec"]].samples
        assert int(cache.labels["block_size"]) == served.engine.kv_cache.block_size
        assert int(cache.labels["num_gpu_blocks"]) == served.engine.kv_cache.num_blocks
