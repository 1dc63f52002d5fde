"""deploy/kubernetes/: every manifest validated offline against the Kubernetes JSON schemas (kubernetes-validate
bundles them; strict: no unknown fields), the InferencePool against a schema of its v1 CRD, the endpoint picker's
config file against a schema of its v1.5 config API (tests/schemas/), and what the manifests say checked against
the server itself: its flags parse, probes ask grpc.health.v1 on the server's port, the grace period outlasts the
drain, the pool selects the Deployment's pods, the picker reads our metrics (names checked against a real scrape in
test_metrics_vllm.py)."""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "kubernetes"
K8S_VERSION = "1.37"
POOL_SCHEMA = json.loads((ROOT / "tests" / "schemas" / "inferencepool-v1.schema.json").read_text())
PICKER_SCHEMA = json.loads((ROOT / "tests" / "schemas" / "endpointpickerconfig-v1alpha1.schema.json").read_text())
# The engine config's metric specs → our /metrics names (the contract with the HTTP door, default prefix).
METRIC_SPECS = {
    "queuedRequestsSpec": "lora_serve:num_requests_waiting",
    "runningRequestsSpec": "lora_serve:num_requests_running",
    "kvUsageSpec": "lora_serve:kv_cache_usage_perc",
    "loraSpec": "lora_serve:lora_requests_info",
    "cacheInfoSpec": "lora_serve:cache_config_info",
}
# The picker's flags in v1.5.0 (pkg/epp/server/options.go AddFlags; logging adds -v and --zap-*). Its Validate()
# refuses the five metric flags once set ("deprecated and cannot be used; configure metrics via engineConfigs").
PICKER_FLAGS = {
    "grpc-port", "ha-enable-leader-election", "pool-group", "pool-namespace", "pool-name", "endpoint-selector",
    "endpoint-target-ports", "disable-endpoint-subset-filter", "refresh-metrics-interval",
    "refresh-prometheus-metrics-interval", "metrics-staleness-threshold", "tracing", "health-checking",
    "metrics-port", "grpc-health-port", "enable-pprof", "cert-path", "enable-cert-reload", "secure-serving",
    "metrics-endpoint-auth", "config-file", "config-text"}
REFUSED_PICKER_FLAGS = {"total-queued-requests-metric", "total-running-requests-metric",
                        "kv-cache-usage-percentage-metric", "lora-info-metric", "cache-info-metric"}
# Engine configs the picker has built in (pkg/epp/framework/plugins/datalayer/extractor/metrics/factories.go).
BUILTIN_ENGINES = {"vllm", "sglang", "trtllm-serve", "triton-tensorrt-llm"}


def documents() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(K8S.rglob("*.yaml")):
        out += [(f"{path.relative_to(K8S)}:{d['kind']}/{d['metadata']['name']}", d)
                for d in yaml.safe_load_all(path.read_text()) if d]
    return out


def find(kind: str, name: str) -> dict:
    return next(d for _, d in documents() if d["kind"] == kind and d["metadata"]["name"] == name)


def validate(doc: dict) -> None:
    if doc["kind"] == "InferencePool":
        jsonschema.validate(doc, POOL_SCHEMA)
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize(("where", "doc"), documents(), ids=[w for w, _ in documents()])
def test_manifest_is_valid(where, doc):
    validate(doc)


def test_validators_refuse_broken_manifests():
    """The checks above can fail: a wrong type, an unknown field, a pool without its picker's port."""
    deployment = copy.deepcopy(find("Deployment", "lora-serve"))
    deployment["spec"]["replicas"] = "three"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)
    deployment = copy.deepcopy(find("Deployment", "lora-serve"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grcp"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)
    pool = copy.deepcopy(find("InferencePool", "lora-serve"))
    del pool["spec"]["endpointPickerRef"]["port"]
    with pytest.raises(jsonschema.ValidationError):
        validate(pool)
    pool = copy.deepcopy(find("InferencePool", "lora-serve"))
    pool["spec"]["targetPorts"] = []
    with pytest.raises(jsonschema.ValidationError):
        validate(pool)


def _container(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def test_deployment_runs_a_draining_warmed_up_server():
    from service.cli import _server_config, serve_parser
    from service.telemetry.setup import SHUTDOWN_TIMEOUT_S

    deployment = find("Deployment", "lora-serve")
    pod, container = deployment["spec"]["template"]["spec"], _container(deployment)
    assert container["args"][0] == "lora-serve"
    args = serve_parser().parse_args(container["args"][1:])
    config = _server_config(args)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert args.host == "0.0.0.0" and ports["grpc"] == config.port
    # Readiness and liveness: grpc.health.v1 on the server's port (SERVING only after warm-up, not while draining);
    # the startup probe covers a cold compile.
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["grpc"]["port"] == config.port and "service" not in container[probe]["grpc"]
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300  # as compose's start_period
    # preStop, then SIGTERM: the drain, its last messages and the telemetry flush fit before SIGKILL.
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert "--grace-period" in container["args"]
    assert pod["terminationGracePeriodSeconds"] > pre_stop + config.grace_period_s + 1.0 + SHUTDOWN_TIMEOUT_S
    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
    assert re.search(r"(?m)^\s+# nvidia\.com/gpu: 1$", (K8S / "lora-serve.yaml").read_text())
    # One read-only model volume, one shared cache volume where the server keeps its Inductor cache.
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["models"]["readOnly"] and volumes["models"]["persistentVolumeClaim"]["readOnly"]
    assert args.model.startswith(mounts["models"]["mountPath"] + "/")
    assert all(path.startswith("/models/") for path in (m.path for m in args.adapter))
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["LORA_SERVE_CACHE"] == mounts["cache"]["mountPath"]
    assert find("PersistentVolumeClaim", volumes["cache"]["persistentVolumeClaim"]["claimName"])
    assert find("PersistentVolumeClaim", volumes["models"]["persistentVolumeClaim"]["claimName"])
    assert not any("token" in a for a in container["args"])  # secrets come from the environment
    # The Service reaches the pods' gRPC port.
    service = find("Service", "lora-serve")
    assert service["spec"]["selector"] == deployment["spec"]["template"]["metadata"]["labels"]
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports)


def test_inference_pool_selects_the_pods_and_the_picker_reads_our_metrics():
    deployment = find("Deployment", "lora-serve")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    pool = find("InferencePool", "lora-serve")
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    http_port = {p["name"]: p["containerPort"] for p in _container(deployment)["ports"]}["http"]
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [http_port]
    ref = pool["spec"]["endpointPickerRef"]
    epp_service = find("Service", ref["name"])
    assert ref["port"]["number"] in {p["port"] for p in epp_service["spec"]["ports"]}
    epp = find("Deployment", ref["name"])
    assert epp_service["spec"]["selector"] == epp["spec"]["template"]["metadata"]["labels"]
    args = dict(a.removeprefix("--").split("=", 1) for a in _container(epp)["args"])
    assert args["pool-name"] == pool["metadata"]["name"] and args["pool-group"] == "inference.networking.k8s.io"
    assert args.keys() <= PICKER_FLAGS and not args.keys() & REFUSED_PICKER_FLAGS
    # The plugins file the picker loads scores LoRA affinity, KV-cache use and likely cached prefixes, and reads
    # our metric names through its data layer.
    config = picker_config()
    validate_picker_config(config)
    scorers = {"lora-affinity-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer"}
    assert scorers <= {p["type"] for p in config["plugins"]}
    assert scorers <= {p["pluginRef"] for p in config["schedulingProfiles"][0]["plugins"]}
    extractor = next(p for p in config["plugins"] if p["type"] == "core-metrics-extractor")["parameters"]
    engine = next(e for e in extractor["engineConfigs"] if e["name"] == extractor["defaultEngine"])
    assert {k: engine.get(k) for k in METRIC_SPECS} == METRIC_SPECS
    assert epp["spec"]["template"]["spec"]["serviceAccountName"] == find("ServiceAccount", ref["name"])["metadata"]["name"]


def picker_config() -> dict:
    """The EndpointPickerConfig the picker Deployment loads (--config-file, from its ConfigMap)."""
    epp = find("Deployment", find("InferencePool", "lora-serve")["spec"]["endpointPickerRef"]["name"])
    args = dict(a.removeprefix("--").split("=", 1) for a in _container(epp)["args"])
    volume = next(v for v in epp["spec"]["template"]["spec"]["volumes"] if v.get("configMap"))
    mount = next(m for m in _container(epp)["volumeMounts"] if m["name"] == volume["name"])
    path = Path(args["config-file"])
    assert str(path.parent) == mount["mountPath"]
    return yaml.safe_load(find("ConfigMap", volume["configMap"]["name"])["data"][path.name])


def validate_picker_config(config: dict) -> None:
    """What the v1.5 picker checks before it starts: the file's schema (strict decoding), then its loader
    (pkg/epp/config/loader: configloader.go instantiatePlugins, validation.go validateSchedulingProfiles, defaults.go
    applyStaticDefaults; buildDataLayerConfig) and the metrics extractor's factory (factories.go)."""
    jsonschema.validate(config, PICKER_SCHEMA)
    plugins = {p.get("name") or p["type"]: p for p in config["plugins"]}  # a name defaults to the type
    assert len(plugins) == len(config["plugins"]), "duplicate plugin name"
    profiles = [p["name"] for p in config["schedulingProfiles"]]
    assert len(set(profiles)) == len(profiles) and all(profiles), "profile names must be set and unique"
    for profile in config["schedulingProfiles"]:
        for ref in profile["plugins"]:
            assert ref["pluginRef"] in plugins, f"profile {profile['name']} references undefined {ref['pluginRef']}"
    for source in (config.get("dataLayer") or {}).get("sources", []):
        assert plugins[source["pluginRef"]]["type"] == "metrics-data-source", f"{source} is not a data source"
        for extractor in source["extractors"]:
            assert plugins[extractor["pluginRef"]]["type"] == "core-metrics-extractor", f"{extractor}: no extractor"
    for plugin in plugins.values():
        if plugin["type"] == "core-metrics-extractor":
            params = plugin.get("parameters") or {}
            engines = [e["name"] for e in params.get("engineConfigs", [])]
            assert len(set(engines)) == len(engines), "engine configs registered twice"
            assert params.get("defaultEngine", "vllm") in {*engines, *BUILTIN_ENGINES}, "defaultEngine not found"


def _broken_picker_configs():
    """(what is wrong, the config): mistakes the v1.5 picker refuses at start, leaves out of its schema (+required)
    or would silently drop (a misspelt parameter)."""
    def edit(change):
        config = copy.deepcopy(picker_config())
        change(config)
        return config

    def extractor(config):
        return next(p for p in config["plugins"] if p["type"] == "core-metrics-extractor")["parameters"]

    yield "data: (the docs' spelling) is not a field", edit(lambda c: c.update(data=c.pop("dataLayer")))
    yield "no schedulingProfiles (+required)", edit(lambda c: c.pop("schedulingProfiles"))
    yield "an unknown plugin type", edit(lambda c: c["plugins"].append({"type": "lora-affinity-scorrer"}))
    yield "a weight that is not a number", edit(
        lambda c: c["schedulingProfiles"][0]["plugins"][0].update(weight="1"))
    yield "a misspelt spec key (dropped by the picker)", edit(
        lambda c: extractor(c)["engineConfigs"][0].update(queuedRequestSpec="x"))
    yield "an engine named default", edit(lambda c: extractor(c)["engineConfigs"][0].update(name="default"))
    yield "a defaultEngine with no config", edit(lambda c: extractor(c).update(defaultEngine="lora_serve"))
    yield "a profile naming an undefined plugin", edit(
        lambda c: c["schedulingProfiles"][0]["plugins"].append({"pluginRef": "lora-affinity"}))
    yield "a source that is not a data source", edit(
        lambda c: c["dataLayer"]["sources"][0].update(pluginRef="queue-scorer"))


@pytest.mark.parametrize(("what", "config"), list(_broken_picker_configs()),
                         ids=[w for w, _ in _broken_picker_configs()])
def test_picker_config_checks_refuse_what_the_picker_refuses(what, config):
    with pytest.raises((jsonschema.ValidationError, AssertionError, KeyError)):
        validate_picker_config(config)
