"""`vllm serve`'s flags accepted by `lora-serve` (the same config as lora-serve's own names), --served-model-name
on both doors, the access log line per HTTP request and the periodic stats line (vLLM's), both off-able."""
from __future__ import annotations

import logging
import re

import grpc
import openai
import pytest

from service._proto import pb_grpc
from service.cli import _engine_config, _server_config, serve_parser
from service.cli_vllm import LoraModule, check_base_models
from service.server import LogConfig, ServerConfig
from tests.http_wire import post
from tests.service_harness import ServerThread, make_request, shared_engine, wait_for

PROMPT = "Once upon a time"
WAIT_S = 60  # generous bound on waiting for a log line: it comes as soon as the server gets to it

VLLM_FLAGS = ["--served-model-name", "my-model", "alias", "--max-model-len", "256", "--enable-lora",
              "--lora-modules", "pirate=/a", '{"name": "poet", "path": "/b", "base_model_name": "my-model"}',
              "--max-loras", "2", "--max-lora-rank", "32", "--max-num-seqs", "4", "--disable-log-stats",
              "--disable-uvicorn-access-log", "--disable-access-log-for-endpoints", "/health,/metrics"]
OUR_FLAGS = ["--served-model-name", "my-model", "alias", "--max-seq-len", "256", "--adapter", "pirate=/a",
             "--adapter", "poet=/b", "--max-loras-per-batch", "2", "--max-lora-rank", "32", "--max-num-seqs", "4",
             "--disable-log-stats", "--disable-access-log", "--disable-access-log-for-endpoints", "/health,/metrics"]


# --- flags (no server) ---------------------------------------------------------------------------------------
def test_vllm_flag_names_parse_into_the_same_config_as_ours():
    vllm, ours = serve_parser().parse_args(VLLM_FLAGS), serve_parser().parse_args(OUR_FLAGS)
    assert _engine_config(vllm, "m") == _engine_config(ours, "m")
    assert _server_config(vllm) == _server_config(ours)
    assert [(m.name, m.path) for m in vllm.adapter] == [(m.name, m.path) for m in ours.adapter]
    engine, server = _engine_config(vllm, "m"), _server_config(vllm)
    assert (engine.max_seq_len, engine.max_loras_per_batch, engine.max_lora_rank, engine.max_num_seqs) == (
        256, 2, 32, 4)
    assert server.served_model_names == ("my-model", "alias")
    assert server.logs == LogConfig(access_log=False, access_log_skip_paths=("/health", "/metrics"), log_stats=False)
    assert vllm.adapter == [LoraModule("pirate", "/a"), LoraModule("poet", "/b", "my-model")]
    defaults = _server_config(serve_parser().parse_args([]))
    assert defaults.served_model_names == () and defaults.logs == LogConfig(stats_interval_s=10.0)


@pytest.mark.parametrize("value, tokens", [("4096", 4096), ("4k", 4000), ("4K", 4096), ("25.6k", 25600)])
def test_max_model_len_takes_vllms_forms(value, tokens):
    assert serve_parser().parse_args(["--max-model-len", value]).max_seq_len == tokens


@pytest.mark.parametrize("flags, message", [
    (["--max-model-len", "auto"], "vLLM derives it from the model; give the number here"),
    (["--max-model-len", "1.5K"], "expected a number of tokens"),
    (["--lora-modules", "pirate"], "expected NAME=DIR or"),
    (["--lora-modules", '{"name": "a", "path": '], "invalid JSON for an adapter"),
    (["--lora-modules", '{"name": "a", "path": "/p", "rank": 8}'], "unknown field(s) 'rank'"),
    (["--lora-modules", '{"name": "a", "path": "/p", "is_3d_lora_weight": true}'], "is_3d_lora_weight is not"),
    (["--lora-modules", '{"name": "a"}'], "'path' must be a non-empty string"),
    (["--no-enable-lora"], "unrecognized arguments: --no-enable-lora"),
])
def test_bad_vllm_flag_values_are_refused_saying_why(flags, message, capsys):
    with pytest.raises(SystemExit):
        serve_parser().parse_args(flags)
    assert message in capsys.readouterr().err


def test_an_adapter_for_another_base_model_is_refused():
    check_base_models([LoraModule("a", "/p", "my-model")], ("my-model", "alias"))
    with pytest.raises(ValueError, match="adapter 'a' is for base model 'other', but this server serves "
                                         "'my-model', 'alias'"):
        check_base_models([LoraModule("a", "/p", "other")], ("my-model", "alias"))


# --- one server: served names, access log, stats line ----------------------------------------------------------
@pytest.fixture(scope="module")
def served():
    config = ServerConfig(port=0, http_port=0, served_model_names=("served-demo", "demo-alias"),
                          logs=LogConfig(stats_interval_s=0.2, access_log_skip_paths=("/metrics",)))
    server = ServerThread(shared_engine(), config)
    yield server
    server.stop()


def test_served_model_names_are_reported_and_accepted_on_both_doors(served, client):
    cards = client.models.list().data
    assert [m.id for m in cards] == ["served-demo", "demo-alias", "pirate", "poet", "scribe"]
    assert {m.parent for m in cards[2:]} == {"served-demo"}
    with served.client() as grpc_client:
        assert grpc_client.model_info().model == "served-demo"
        base = grpc_client.complete(PROMPT, max_new_tokens=3, temperature=0)
    for name in ("demo-alias", "served-demo"):
        reply = client.completions.create(model=name, prompt=PROMPT, max_tokens=3, temperature=0)
        assert reply.model == "served-demo"  # the first name, as vLLM reports the base model
        assert reply.choices[0].text == base.text
    with pytest.raises(openai.NotFoundError):  # the directory's name is no longer the model's (as vLLM)
        client.completions.create(model=shared_engine().model_name, prompt=PROMPT, max_tokens=2)
    # gRPC: x-adapter-id may name the base model by any of its names.
    with grpc.insecure_channel(served.target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        chunks = list(stub.Generate(make_request(PROMPT, stopping__max_new_tokens=3), timeout=60,
                                    metadata=[("x-adapter-id", "demo-alias")]))
    assert [t for c in chunks for t in c.token_ids] == list(base.token_ids)


def _log_lines(caplog, logger: str, pattern: re.Pattern) -> list[dict]:
    """Every record of `logger` so far, each matching `pattern` whole, as its named groups."""
    found = [pattern.fullmatch(r.getMessage()) for r in caplog.records if r.name == logger]
    assert all(found), [r.getMessage() for r in caplog.records]
    return [m.groupdict() for m in found]


ACCESS = re.compile(r'127\.0\.0\.1:\d+ "(?P<method>[A-Z]+) (?P<path>\S+) HTTP/1\.1" (?P<status>\d{3})'
                    r'(?: adapter=(?P<adapter>\S+) prompt_tokens=(?P<prompt>\d+)'
                    r' completion_tokens=(?P<completion>\d+))?'
                    r' latency=(?P<latency>\d+\.\d{3})s')


def test_access_log_line_per_http_request(served, client, caplog):
    caplog.set_level(logging.INFO, logger="service.telemetry.access_log")

    def lines() -> list[dict]:
        return _log_lines(caplog, "service.telemetry.access_log", ACCESS)

    reply = client.completions.create(model="pirate", prompt=PROMPT, max_tokens=5, temperature=0)
    stream = client.completions.create(model="", prompt=PROMPT, max_tokens=4, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    usage = [c.usage for c in stream if c.usage][-1]
    assert post(served.server.http_port, "/health", b"", method="GET")[0] == 200
    assert post(served.server.http_port, "/metrics", b"", method="GET")[0] == 200  # a skipped path
    assert post(served.server.http_port, "/v1/completions", {"model": "nobody", "prompt": PROMPT})[0] == 404
    wait_for(lambda: len(lines()) >= 4, WAIT_S, "4 access log lines")
    assert len(lines()) == 4  # (/metrics: skipped)
    # (A streamed response's line may come after the next request's: matched by content, not order.)
    [completion] = [line for line in lines() if line["adapter"] == "pirate"]
    [streamed] = [line for line in lines() if line["adapter"] == "-"]
    [health] = [line for line in lines() if line["path"] == "/health"]
    [refused] = [line for line in lines() if line["status"] == "404"]
    assert completion | {"latency": None} == {
        "method": "POST", "path": "/v1/completions", "status": "200", "adapter": "pirate",
        "prompt": str(reply.usage.prompt_tokens), "completion": "5", "latency": None}
    assert (streamed["adapter"], streamed["prompt"], streamed["completion"]) == (
        "-", str(usage.prompt_tokens), str(usage.completion_tokens))
    assert (health["method"], health["path"], health["status"], health["adapter"]) == ("GET", "/health", "200", None)
    assert (refused["path"], refused["status"], refused["adapter"]) == ("/v1/completions", "404", None)


STATS = re.compile(r"Avg generation throughput: (?P<throughput>\d+\.\d) tokens/s, Running: (?P<running>\d+) reqs, "
                   r"Waiting: (?P<waiting>\d+) reqs, (?:Preemptions: \d+, )?CPU KV cache usage: \d+\.\d%"
                   r"(?:, Prefix cache hit rate: (?P<hit_rate>\d+\.\d)%)?")


def test_stats_line_every_interval(served, client, caplog):
    caplog.set_level(logging.DEBUG, logger="service.telemetry.stats_logger")

    def lines() -> list[dict]:
        return _log_lines(caplog, "service.telemetry.stats_logger", STATS)

    wait_for(lambda: len(lines()) >= 2, WAIT_S, "2 stats lines")  # idle: DEBUG, as vLLM's
    # A prompt of several KV blocks, twice: the second finds the first's blocks in the prefix cache.
    prompt = " ".join(["Once upon a time there was a lighthouse keeper"] * 6)
    for _ in range(2):
        client.completions.create(model="", prompt=prompt, max_tokens=2, temperature=0)
    wait_for(lambda: any(float(line["hit_rate"] or 0) > 0 for line in lines()), WAIT_S, "a prefix cache hit")
    wait_for(lambda: any(float(line["throughput"]) > 0 for line in lines()), WAIT_S, "a line with tokens")
    busy = [r for r in caplog.records if r.name == "service.telemetry.stats_logger"
            and float(STATS.fullmatch(r.getMessage())["throughput"]) > 0]
    assert all(r.levelno == logging.INFO for r in busy)
    idle = len(lines())
    wait_for(lambda: len(lines()) >= idle + 3, WAIT_S, "3 more stats lines")
    assert lines()[-1] | {"hit_rate": None} == {"throughput": "0.0", "running": "0", "waiting": "0", "hit_rate": None}


def test_both_logs_can_be_turned_off(served, caplog):
    caplog.set_level(logging.DEBUG, logger="service.telemetry")
    quiet = ServerThread(shared_engine(), ServerConfig(port=0, http_port=0,
                                                       logs=LogConfig(access_log=False, log_stats=False)))
    try:
        assert quiet.server.access_log is None and quiet.server.stats_logger is None
        assert post(quiet.server.http_port, "/v1/models", b"", method="GET")[0] == 200
        # The logging server's line for a later request comes; none ever comes for the quiet one's.
        assert post(served.server.http_port, "/health", b"", method="GET")[0] == 200
        wait_for(lambda: any('"GET /health' in r.getMessage() for r in caplog.records), WAIT_S, "the access line")
        assert not any('"GET /v1/models' in r.getMessage() for r in caplog.records)
    finally:
        quiet.stop()
