"""The Dockerfile and docker-compose.yml, checked statically (no Docker engine needed): services, ports,
environment, health check, build context, and that the commands they run exist."""
from __future__ import annotations

import json
import shlex
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


def test_services_are_wired_together(compose):
    services = compose["services"]
    app, jaeger = services["lora-serve"], services["jaeger"]
    env = app["environment"]
    assert env["OTEL_SERVICE_NAME"] == "lora-serve"
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317" and env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"
    assert "50051:50051" in app["ports"]
    assert jaeger["image"].startswith(("jaegertracing/all-in-one:", "jaegertracing/jaeger:"))
    assert str(jaeger["environment"]["COLLECTOR_OTLP_ENABLED"]).lower() == "true"
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


def test_healthcheck_asks_the_grpc_health_service(compose, scripts):
    from service.cli import client_parser

    check = compose["services"]["lora-serve"]["healthcheck"]
    kind, command = check["test"]
    assert kind == "CMD-SHELL"
    argv = shlex.split(command.split("|")[0])
    assert argv[0] in scripts and scripts[argv[0]] == "service.cli:client_main"
    assert client_parser().parse_args(argv[1:]).command == "health"
    assert "grep -qx SERVING" in command  # `lora-client health` prints the status and exits 0 either way
    assert check["start_period"]  # warm-up compiles for minutes on a cold cache


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
    assert ("VOLUME", '["/cache"]') in steps and "LORA_SERVE_CACHE=/cache" in dict(steps)["ENV"]
    assert ("EXPOSE", "50051") in steps
    # torch at the version pyproject pins, then the project itself.
    pinned = next(d for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
                  if d.startswith("torch"))
    runs = [args for word, args in steps if word == "RUN"]
    assert any(f'"{pinned}"' in r for r in runs) and any("pip install ." in r for r in runs)
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", ".cache"} <= set(ignored)
