"""Who may touch adapters: adapter roots (traversal, symlink escapes), safetensors only (nothing unpickles),
bearer tokens for generation and for management, management switched off, TLS and mutual TLS."""
from __future__ import annotations

import ast
import functools
import os
import shutil
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service._proto import pb, pb_grpc
from service.cli import _server_config, serve_parser
from service.client import (
    InvalidArgumentError,
    LoraServeClient,
    PermissionDeniedError,
    UnauthenticatedError,
    UnavailableError,
)
from service.client.channel import ClientTLS
from service.client.cli import main as client_main
from service.security import SecurityConfig, TlsConfig
from service.server import ServerConfig
from tests.certs import CertificateAuthority
from tests.service_harness import ServerThread, build_engine, demo_paths, shared_engine

ROOT = Path(__file__).resolve().parents[1]
API, ADMIN = "gen-secret-0123", "admin-secret-4567"


# --- adapter roots ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rooted(tmp_path_factory):
    """A server whose engine loads adapters only from `root` (a second engine: roots are engine config)."""
    base = tmp_path_factory.mktemp("roots")
    root, outside = base / "root", base / "outside"
    _, adapters = demo_paths()
    shutil.copytree(adapters["pirate"], root / "pirate")
    shutil.copytree(adapters["poet"], outside / "poet")
    model, _ = demo_paths()
    engine = build_engine(model, {}, adapter_roots=(str(root),))
    server = ServerThread(engine)
    yield server, root, outside
    server.stop()


def _escapes(root: Path, outside: Path) -> dict[str, tuple[str, str]]:
    """name: (path as the client sends it, what the message must say)."""
    (root / "link-out").symlink_to(outside / "poet", target_is_directory=True)
    files = root / "file-links"
    files.mkdir()
    (files / "adapter_config.json").symlink_to(outside / "poet" / "adapter_config.json")
    (files / "adapter_model.safetensors").symlink_to(outside / "poet" / "adapter_model.safetensors")
    return {
        "dotdot": (f"{root}/../outside/poet", "leaves the adapter roots through '..'"),
        "absolute": (str(outside / "poet"), "is outside the adapter roots"),
        "symlinked directory": (str(root / "link-out"), "a symlink takes it to"),
        "symlinked files": (str(files), "is outside the allowed adapter roots"),
        "relative": (os.path.relpath(outside / "poet"), "resolves to"),
    }


def test_adapter_paths_outside_the_roots_are_refused(rooted):
    server, root, outside = rooted
    with server.client() as client:
        for name, (path, says) in _escapes(root, outside).items():
            with pytest.raises(InvalidArgumentError) as info:
                client.load_adapter(f"evil-{name.replace(' ', '-')}", path)
            assert says in info.value.message, (name, info.value.message)
            assert [v.field for v in info.value.field_violations] == ["path"], name
        names = {a.name for a in client.list_adapters()}
        assert not any(n.startswith("evil") for n in names)
        # Inside the root: fine, and usable at once.
        assert client.load_adapter("pirate", str(root / "pirate")).rank == 8
        assert client.complete("Hi", adapter="pirate", max_new_tokens=3).usage.completion_tokens == 3
    server.wait_idle()


def test_the_cli_passes_adapter_roots_and_security_flags_through(monkeypatch, tmp_path):
    monkeypatch.setenv("LORA_SERVE_ADMIN_TOKEN", ADMIN)
    args = serve_parser().parse_args(["--adapter-root", str(tmp_path), "--api-token", API,
                                      "--max-prompt-tokens", "100", "--max-new-tokens-limit", "50",
                                      "--max-concurrent-streams", "9", "--disable-adapter-management"])
    config = _server_config(args)
    assert args.adapter_root == [str(tmp_path)]  # → EngineConfig.adapter_roots (serve_main)
    assert config.security == SecurityConfig(api_token=API, admin_token=ADMIN, disable_adapter_management=True)
    assert (config.limits.max_prompt_tokens, config.limits.max_new_tokens) == (100, 50)
    assert config.limits.max_concurrent_streams == 9
    with pytest.raises(ValueError, match="go together"):
        _server_config(serve_parser().parse_args(["--tls-cert", "c.pem"]))


# --- nothing unpickles ------------------------------------------------------------------------------
_PICKLE_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}
_PICKLE_CALLS = {"torch.load", "torch.jit.load", "torch.serialization.load", "np.load", "numpy.load",
                 "pd.read_pickle", "pandas.read_pickle", "from_pretrained"}


def _unpickling(source: str, filename: str = "<source>") -> list[str]:
    """Imports of pickle-like modules and calls that unpickle, found in the syntax tree (not in comments)."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            names = [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else []
            if any(m.split(".")[0] in _PICKLE_MODULES for m in modules) or \
                    (modules == ["torch"] and "load" in names):
                found.append(f"{filename}:{node.lineno}: import {', '.join(modules + names)}")
        elif isinstance(node, ast.Call):
            dotted = _dotted(node.func)
            if dotted in _PICKLE_CALLS or dotted.endswith((".from_pretrained", ".read_pickle")):
                found.append(f"{filename}:{node.lineno}: {dotted}(...)")
    return found


def _dotted(node) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def test_no_code_path_unpickles():
    assert sorted(_unpickling("import torch\nx = torch.load('w.bin')\nfrom pickle import loads\n")) == [
        "<source>:2: torch.load(...)", "<source>:3: import pickle, loads"]  # the checker works
    found = []
    for package in ("lora_compile", "service"):
        for path in sorted((ROOT / package).rglob("*.py")):
            found += _unpickling(path.read_text(), str(path.relative_to(ROOT)))
    assert found == []


# --- tokens -----------------------------------------------------------------------------------------
def _tokened(**security) -> ServerThread:
    return ServerThread(shared_engine(), ServerConfig(port=0, security=SecurityConfig(**security)))


def _health(target: str) -> int:
    with grpc.insecure_channel(target) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_bearer_tokens():
    server = _tokened(api_token=API, admin_token=ADMIN)
    _, adapters = demo_paths()
    try:
        target = server.target
        assert _health(target) == health_pb2.HealthCheckResponse.SERVING  # health needs no token
        with LoraServeClient(target) as anonymous:
            with pytest.raises(UnauthenticatedError, match="missing credentials"):
                anonymous.complete("Hi", max_new_tokens=2)
            with pytest.raises(UnauthenticatedError):
                anonymous.list_adapters()
            with pytest.raises(UnauthenticatedError):
                anonymous.load_adapter("copy", str(adapters["poet"]))
        for wrong in ("nope", API[:-1], API + "x", ""):
            with LoraServeClient(target, token=wrong or None, admin_token="x") as client:
                with pytest.raises(UnauthenticatedError):
                    client.complete("Hi", max_new_tokens=2)
        with grpc.insecure_channel(target) as ch:  # the scheme must be Bearer
            with pytest.raises(grpc.RpcError) as info:
                pb_grpc.GenerationStub(ch).ModelInfo(pb.ModelInfoRequest(), metadata=[("authorization", f"Basic {API}")])
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with LoraServeClient(target, token=API) as user:  # generation, yes; management, no
            assert user.complete("Hi", max_new_tokens=2).usage.completion_tokens == 2
            assert {"pirate", "poet", "scribe"} <= {a.name for a in user.list_adapters()}
            with pytest.raises(UnauthenticatedError, match="adapter management"):
                user.load_adapter("copy", str(adapters["poet"]))
        with LoraServeClient(target, token=API, admin_token=ADMIN) as admin:
            assert admin.load_adapter("copy", str(adapters["poet"])).name == "copy"
            admin.unload_adapter("copy")
        with LoraServeClient(target, token=ADMIN) as admin_only:  # the admin token may generate too
            assert admin_only.complete("Hi", max_new_tokens=2).usage.completion_tokens == 2
        server.wait_idle()
    finally:
        server.stop()


def test_admin_token_alone_guards_only_management():
    server = _tokened(admin_token=ADMIN)
    _, adapters = demo_paths()
    try:
        with LoraServeClient(server.target) as client:
            assert client.complete("Hi", max_new_tokens=2).usage.completion_tokens == 2
            with pytest.raises(UnauthenticatedError):
                client.unload_adapter("poet")
        with LoraServeClient(server.target, admin_token=ADMIN) as admin:
            admin.load_adapter("copy", str(adapters["poet"]))
            admin.unload_adapter("copy")
    finally:
        server.stop()


def test_adapter_management_can_be_disabled():
    server = _tokened(disable_adapter_management=True, admin_token=ADMIN)
    _, adapters = demo_paths()
    try:
        with LoraServeClient(server.target, admin_token=ADMIN) as client:
            with pytest.raises(PermissionDeniedError, match="--disable-adapter-management"):
                client.load_adapter("copy", str(adapters["poet"]))
            with pytest.raises(PermissionDeniedError):
                client.unload_adapter("poet")
            assert "poet" in {a.name for a in client.list_adapters()}  # listing is not management
            assert client.complete("Hi", adapter="poet", max_new_tokens=2).usage.completion_tokens == 2
        server.wait_idle()
    finally:
        server.stop()


# --- TLS --------------------------------------------------------------------------------------------
@functools.cache
def _pki(directory: str) -> dict:
    ca = CertificateAuthority(Path(directory))
    other = CertificateAuthority(Path(directory), "another CA")
    return {"ca": ca.pem, "server": ca.issue("server", server=True), "client": ca.issue("client", server=False),
            "stranger": other.issue("stranger", server=False)}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return _pki(str(tmp_path_factory.mktemp("pki")))


def _tls_server(pki, mutual: bool, **security) -> ServerThread:
    tls = TlsConfig(str(pki["server"].cert), str(pki["server"].key), str(pki["ca"].cert) if mutual else None)
    return ServerThread(shared_engine(), ServerConfig(port=0, security=SecurityConfig(tls=tls, **security)))


def test_tls(pki):
    server = _tls_server(pki, mutual=False)
    try:
        with LoraServeClient(server.target, tls=ClientTLS.from_files(ca=str(pki["ca"].cert))) as client:
            assert client.complete("Hi", max_new_tokens=2).usage.completion_tokens == 2
            assert client.health() == "SERVING"
        with LoraServeClient(server.target, timeout=5) as plaintext, pytest.raises(UnavailableError):
            plaintext.model_info()
        with LoraServeClient(server.target, timeout=5, tls=ClientTLS()) as untrusting:  # system roots: no
            with pytest.raises(UnavailableError):
                untrusting.model_info()
        server.wait_idle()
    finally:
        server.stop()


def test_mutual_tls(pki, capsys):
    server = _tls_server(pki, mutual=True, api_token=API)
    ca, client_pem, stranger = str(pki["ca"].cert), pki["client"], pki["stranger"]
    try:
        good = ClientTLS.from_files(ca=ca, cert=str(client_pem.cert), key=str(client_pem.key))
        with LoraServeClient(server.target, tls=good, token=API) as client:
            assert client.complete("Hi", max_new_tokens=2).usage.completion_tokens == 2
        with LoraServeClient(server.target, tls=good) as no_token, pytest.raises(UnauthenticatedError):
            no_token.complete("Hi", max_new_tokens=2)  # TLS is no substitute for the token
        for tls in (ClientTLS.from_files(ca=ca),  # no client certificate
                    ClientTLS.from_files(ca=ca, cert=str(stranger.cert), key=str(stranger.key))):  # wrong CA
            with LoraServeClient(server.target, timeout=5, tls=tls, token=API) as client:
                with pytest.raises(UnavailableError):
                    client.model_info()
        # The lora-client CLI with TLS flags and a token.
        flags = ["--target", server.target, "--tls-ca", ca, "--tls-cert", str(client_pem.cert),
                 "--tls-key", str(client_pem.key), "--token", API]
        assert client_main([*flags, "info"]) == 0
        assert "max_batch_size: 8" in capsys.readouterr().out
        assert client_main([*flags[:-2], "info"]) == 1
        assert "UNAUTHENTICATED" in capsys.readouterr().err
        server.wait_idle()
    finally:
        server.stop()
