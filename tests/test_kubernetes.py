"""deploy/kubernetes/: every manifest validated offline against the Kubernetes JSON schemas (kubernetes-validate
bundles them; strict: no unknown fields), the InferencePool against a schema of its v1 CRD, and what the
manifests say checked against the server itself: its flags parse, probes ask grpc.health.v1 on the server's
port, the grace period outlasts the drain, the pool selects the Deployment's pods, the picker reads our metrics."""
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
METRICS = {  # EPP flag → our /metrics name (the contract with the HTTP door)
    "total-queued-requests-metric": "lora_serve:num_requests_waiting",
    "total-running-requests-metric": "lora_serve:num_requests_running",
    "kv-cache-usage-percentage-metric": "lora_serve:kv_cache_usage_perc",
    "lora-info-metric": "lora_serve:lora_requests_info",
    "cache-info-metric": "lora_serve:cache_config_info",
}


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
    assert all(path.startswith("/models/") for _, path in args.adapter)
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
    assert {k: args[k] for k in METRICS} == METRICS
    # The plugins file the picker loads scores LoRA affinity, KV-cache use and likely cached prefixes.
    config = yaml.safe_load(find("ConfigMap", ref["name"])["data"][Path(args["config-file"]).name])
    assert config["kind"] == "EndpointPickerConfig"
    scorers = {"lora-affinity-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer"}
    assert scorers <= {p["type"] for p in config["plugins"]}
    assert scorers <= {p["pluginRef"] for p in config["schedulingProfiles"][0]["plugins"]}
    assert epp["spec"]["template"]["spec"]["serviceAccountName"] == find("ServiceAccount", ref["name"])["metadata"]["name"]
