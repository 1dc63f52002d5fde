"""The Dockerfile and docker-compose.yml, checked statically (no Docker engine needed): services, ports,
environment, health check, build context, stop timeouts, the admin token, and that the commands they run exist.
The health check's own command also runs here, against a real server process and an in-process health service."""
from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

import pytest

yaml = pytest.importorskip("yaml")
tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def scripts() -> dict[str, str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines, current = [], ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        current += line[:-1] + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            word, _, rest = current.partition(" ")
            lines.append((word.upper(), rest.strip()))
            current = ""
    return lines


def ports(service: dict) -> set[str]:
    return {str(p).split(":")[-1].split("/")[0] for p in service.get("ports", [])}


def seconds(duration: str) -> float:
    """A compose duration ("45s", "1m30s") in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * {"ms": 1e-3, "s": 1, "m": 60, "h": 3600}[u] for n, u in parts)


def healthcheck_code(compose: dict) -> str:
    test = compose["services"]["lora-serve"]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"] and len(test) == 4, test  # exec form: no shell in between
    return test[3]


def run_healthcheck(code: str, target: str, *flags: str) -> tuple[subprocess.CompletedProcess, float]:
    """The health check's command as the container runs it, aimed at `target`; and its wall time."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, *flags, "-c", code.replace("127.0.0.1:50051", target)],
                          capture_output=True, text=True, timeout=60, cwd="/")
    return proc, time.perf_counter() - t0


def test_services_are_wired_together(compose):
    services = compose["services"]
    app, jaeger = services["lora-serve"], services["jaeger"]
    env = app["environment"]
    assert env["OTEL_SERVICE_NAME"] == "lora-serve"
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317" and env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"
    assert "50051:50051" in app["ports"]
    assert re.fullmatch(r"jaegertracing/jaeger:2\.\d+\.\d+", jaeger["image"])  # v2, pinned (v1 is end-of-life)
    assert "COLLECTOR_OTLP_ENABLED" not in jaeger.get("environment", {})  # v1's switch; v2 receives OTLP anyway
    assert {"4317", "4318", "16686"} <= ports(jaeger)
    # Every OTLP endpoint names a service of this file, on a port that service publishes, and is waited for.
    for key in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"):
        url = urlparse(env[key])
        assert url.hostname in services and str(url.port) in ports(services[url.hostname])
        assert url.hostname in app["depends_on"]
    assert "--web.enable-otlp-receiver" in services["prometheus"]["command"]
    assert env["OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"].endswith("/api/v1/otlp/v1/metrics")
    assert env["OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"] == "http/protobuf"
    assert any(v.endswith(":/cache") for v in app["volumes"]) and "lora-serve-cache" in compose["volumes"]


def test_healthcheck_asks_the_grpc_health_service_and_imports_no_torch(compose):
    check = compose["services"]["lora-serve"]["healthcheck"]
    code = healthcheck_code(compose)
    assert "lora-client" not in code and "$" not in code  # compose would interpolate a "$"
    assert "127.0.0.1:50051" in code and "50051:50051" in compose["services"]["lora-serve"]["ports"]
    imported = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module)
    assert imported == {"sys", "grpc", "grpc_health.v1"}  # grpcio-health-checking: a dependency of the image
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith("grpcio-health-checking") for d in deps)
    deadline = float(re.search(r"timeout=(\d+(?:\.\d+)?)", code).group(1))
    assert deadline < seconds(check["timeout"]) <= seconds(check["interval"])  # the RPC gives up before Docker does
    assert check["start_period"]  # warm-up compiles for minutes on a cold cache


def test_healthcheck_exit_status_follows_the_serving_status(compose):
    """Against grpc's own health service: 0 only for SERVING; NOT_SERVING and no server at all fail."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    code = healthcheck_code(compose)
    server = grpc.server(ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        for status, rc in (("NOT_SERVING", 1), ("SERVING", 0)):
            servicer.set("", health_pb2.HealthCheckResponse.ServingStatus.Value(status))
            proc, _ = run_healthcheck(code, f"127.0.0.1:{port}")
            assert (proc.returncode, proc.stdout) == (rc, status + "\n"), proc.stderr
    finally:
        server.stop(None)
    proc, _ = run_healthcheck(code, f"127.0.0.1:{port}")  # nothing listens there now
    assert proc.returncode == 1 and proc.stderr.startswith("UNAVAILABLE: ") and proc.stderr.count("\n") == 1


@pytest.mark.slow
def test_healthcheck_against_a_real_server(compose):
    from tests.test_service_process import ServeProcess

    code = healthcheck_code(compose)
    server = ServeProcess()  # python -m service --no-compile --port 0 ...
    try:
        proc, wall = run_healthcheck(code, server.target)
        assert (proc.returncode, proc.stdout) == (0, "SERVING\n"), proc.stderr
        timed, _ = run_healthcheck(code, server.target, "-X", "importtime")
    finally:
        server.proc.kill()
        server.proc.wait()
    assert timed.returncode == 0
    modules = {line.rsplit("|", 1)[-1].strip() for line in timed.stderr.splitlines() if line.startswith("import time:")}
    assert "grpc" in modules and "grpc_health.v1.health_pb2" in modules
    heavy = sorted(m for m in modules if m.split(".")[0] in ("torch", "lora_compile", "service", "numpy"))
    assert not heavy, heavy
    print(f"\nhealthcheck: exit 0, SERVING, {wall:.3f} s wall; {len(modules)} modules imported, none of torch")


def test_build_uses_the_repository_dockerfile(compose, scripts):
    build = compose["services"]["lora-serve"]["build"]
    context = ROOT / build["context"]
    assert (context / build.get("dockerfile", "Dockerfile")).resolve() == ROOT / "Dockerfile"
    steps = dockerfile()
    assert steps[0] == ("FROM", "python:3.11-slim")
    cmd = json.loads(dict(steps)["CMD"])
    assert cmd[0] in scripts and scripts[cmd[0]] == "service.cli:serve_main"
    from service.cli import serve_parser

    args = serve_parser().parse_args(cmd[1:])
    assert args.host == "0.0.0.0" and args.tracing and args.model is None  # the demo model, reachable, traced
    assert args.disable_adapter_management  # `docker run` with no token: no LoadAdapter from the network
    assert ("VOLUME", '["/cache"]') in steps and "LORA_SERVE_CACHE=/cache" in dict(steps)["ENV"]
    assert ("EXPOSE", "50051") in steps and ("EXPOSE", "8000") in steps  # gRPC, and the HTTP door
    # torch at the version pyproject pins, then the project itself.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned = next(d for d in [*project["dependencies"], *project.get("optional-dependencies", {}).get("server", [])]
                  if d.startswith("torch"))  # a base dependency, or the server extra's (main since f01b97f)
    runs = [args for word, args in steps if word == "RUN"]
    assert any(f'"{pinned}"' in r for r in runs)
    assert any(re.search(r'pip install "?\.(\[server\])?"?(\s|$)', r) for r in runs)
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", ".cache"} <= set(ignored)


def test_stop_grace_period_outlasts_the_drain(compose):
    """Docker sends SIGKILL after stop_grace_period (docker run: --stop-timeout): it must outlast the drain,
    the server's 1 s for the last messages and the last telemetry flush."""
    from service.cli import serve_parser
    from service.telemetry.setup import SHUTDOWN_TIMEOUT_S

    app = compose["services"]["lora-serve"]
    image_cmd = json.loads(dict(dockerfile())["CMD"])
    assert "--grace-period" in app["command"] and "--grace-period" in image_cmd  # explicit, not a default
    grace = serve_parser().parse_args(app["command"][1:]).grace_period
    assert serve_parser().parse_args(image_cmd[1:]).grace_period == grace
    drain = grace + 1.0 + SHUTDOWN_TIMEOUT_S
    assert seconds(app["stop_grace_period"]) > drain
    documented = [int(t) for t in re.findall(r"--stop-timeout (\d+)", (ROOT / "Dockerfile").read_text())]
    assert documented and min(documented) > drain


def test_admin_rpcs_need_a_token_from_the_environment(compose, scripts, monkeypatch):
    from service.cli import _server_config, serve_parser

    app = compose["services"]["lora-serve"]
    # compose's "required" form: `docker compose up` refuses to start while the variable is unset or empty.
    assert re.fullmatch(r"\$\{LORA_SERVE_ADMIN_TOKEN:\?[^}$]+\}", app["environment"]["LORA_SERVE_ADMIN_TOKEN"])
    assert scripts[app["command"][0]] == "service.cli:serve_main"
    assert not any("token" in a for a in app["command"])  # never on argv
    monkeypatch.setenv("LORA_SERVE_ADMIN_TOKEN", "from-compose")
    args = serve_parser().parse_args(app["command"][1:])
    security = _server_config(args).security
    assert args.host == "0.0.0.0" and security.admin_token == "from-compose"
    assert not security.disable_adapter_management


# --- profile "scale": replicas behind HAProxy (docs/scaling.md) ---------------------------------------------
def _replicas(compose: dict) -> dict[str, dict]:
    return {name: s for name, s in compose["services"].items() if re.fullmatch(r"lora-serve-\d+", name)}


def test_scale_profile_runs_named_replicas_of_one_model(compose):
    from lora_serve_demo import ADAPTERS_DIRNAME, DEMO_ADAPTERS, MODEL_DIRNAME
    from service.cli import _server_config, serve_parser
    from service.server import ServerConfig

    replicas = _replicas(compose)
    assert len(replicas) >= 2
    init = compose["services"]["model-init"]
    assert init["profiles"] == ["scale"] and "lora-serve-models:/models" in init["volumes"]
    assert "write_demo_adapters(Path('/models'))" in " ".join(init["command"])
    for name, service in replicas.items():
        assert service["profiles"] == ["scale"] and service["image"] == compose["services"]["lora-serve"]["image"]
        assert "ports" not in service  # reached through HAProxy only
        args = serve_parser().parse_args(service["command"][1:])
        assert args.replica_id == name and args.host == "0.0.0.0" and args.tracing
        assert _server_config(args).port == ServerConfig().port == 50051  # the port haproxy.cfg names
        # One read-only model and adapter volume, written once by model-init; one shared Inductor cache volume.
        assert "lora-serve-models:/models:ro" in service["volumes"] and "lora-serve-cache:/cache" in service["volumes"]
        assert args.model == f"/models/{MODEL_DIRNAME}"
        served = {m.name: m.path for m in args.adapter}
        assert served == {a.name: f"/models/{ADAPTERS_DIRNAME}/{a.name}" for a in DEMO_ADAPTERS}
        assert service["depends_on"]["model-init"]["condition"] == "service_completed_successfully"
        # Traces from every replica into the same Jaeger; the replica id is their service.instance.id.
        assert service["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
        assert "jaeger" in service["depends_on"]
    assert len({serve_parser().parse_args(s["command"][1:]).replica_id for s in replicas.values()}) == len(replicas)
    assert {"lora-serve-models", "lora-serve-cache"} <= set(compose["volumes"])


def test_scale_profile_replicas_drain_within_the_stop_grace_period(compose):
    from service.cli import serve_parser
    from service.telemetry.setup import SHUTDOWN_TIMEOUT_S

    for service in _replicas(compose).values():
        grace = serve_parser().parse_args(service["command"][1:]).grace_period
        assert "--grace-period" in service["command"]
        assert seconds(service["stop_grace_period"]) > grace + 1.0 + SHUTDOWN_TIMEOUT_S
        assert service["healthcheck"]["test"] == compose["services"]["lora-serve"]["healthcheck"]["test"]


def test_scale_profile_haproxy_routes_to_exactly_the_replicas(compose):
    haproxy = compose["services"]["haproxy"]
    assert haproxy["profiles"] == ["scale"] and re.fullmatch(r"haproxy:\d+\.\d+(\.\d+)?", haproxy["image"])
    mount = next(v for v in haproxy["volumes"] if v.endswith("/usr/local/etc/haproxy/haproxy.cfg:ro"))
    config = (ROOT / mount.split(":")[0]).read_text()
    from service.cli import _server_config, serve_parser

    addresses = re.findall(r"(?m)^  server \S+ (\S+)$", config)
    # Each replica's both doors, on the ports its flags give it.
    expected = []
    for name, service in _replicas(compose).items():
        config_ = _server_config(serve_parser().parse_args(service["command"][1:]))
        expected += [f"{name}:{config_.port}", f"{name}:{config_.http_port}"]
    assert sorted(addresses) == sorted(expected) and len(addresses) == 2 * len(_replicas(compose))
    assert set(haproxy["depends_on"]) == set(_replicas(compose))
    assert "50051:50051" in haproxy["ports"] and re.search(r"(?m)^  bind :50051 proto h2$", config)
    assert "8000:8000" in haproxy["ports"] and re.search(r"(?m)^  bind :8000$", config)
    assert "balance hdr(x-adapter-id)" in config and "hash-type consistent" in config
    assert "nameserver dns 127.0.0.11:53" in config  # Docker's DNS: a restarted replica's new address is found
    # The documented command frees port 50051 from the single server.
    assert "docker compose --profile scale up --build -d --scale lora-serve=0" in (ROOT / "docker-compose.yml").read_text()
