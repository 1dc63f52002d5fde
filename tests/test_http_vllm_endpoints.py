"""vLLM's own endpoints on the HTTP door, against a real server over loopback: adapters loaded and unloaded live
through /v1/load_lora_adapter and /v1/unload_lora_adapter (the inference gateway's LoRA syncer's calls) under the
admin token and the adapter roots, then served with transformers + PEFT's tokens; /tokenize and /detokenize
against the model's tokenizer as transformers loads it (what vLLM uses); /version, /ping, /v1/models/{id}."""
from __future__ import annotations

import re
import shutil
import tomllib
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from service.security import SecurityConfig
from service.server import ServerConfig
from tests.checkpoints import make_peft_adapter, reference_greedy, write_chat_template
from tests.http_wire import post
from tests.service_harness import ServerThread, build_engine, demo_paths, shared_engine

ROOT = Path(__file__).resolve().parents[1]
API, ADMIN = "gen-secret-0123", "admin-secret-4567"
PROMPT = "Once upon a time"
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Where is the river?"}]


@dataclass
class Served:
    server: ServerThread
    model: Path      # the checkpoint (with a chat template)
    root: Path       # the only adapter root
    outside: Path    # an adapter outside it
    tokenizer: object

    @property
    def port(self) -> int:
        return self.server.server.http_port

    def call(self, path: str, body: dict | None = None, token: str | None = API, method: str = "POST"):
        headers = {"authorization": f"Bearer {token}"} if token else {}
        return post(self.port, path, body if body is not None else {}, headers, method=method)


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Served:
    """The demo model with a chat template, adapter roots and both tokens (one engine: roots are engine config)."""
    base = tmp_path_factory.mktemp("vllm-endpoints")
    model, adapters = demo_paths()
    copy = base / "demo-chat"
    shutil.copytree(model, copy)
    write_chat_template(copy, CHAT_TEMPLATE)
    root = base / "adapters"
    make_peft_adapter(copy, root / "sql", seed=7)
    outside = base / "outside" / "pirate"
    shutil.copytree(adapters["pirate"], outside)
    pickled = root / "pickled"  # (a config, and weights only in pickle form: never opened)
    pickled.mkdir()
    shutil.copy(outside / "adapter_config.json", pickled)
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04not read")
    engine = build_engine(copy, {}, adapter_roots=(str(root),))
    server = ServerThread(engine, ServerConfig(port=0, http_port=0, security=SecurityConfig(api_token=API,
                                                                                          admin_token=ADMIN)))
    yield Served(server, copy, root, outside, AutoTokenizer.from_pretrained(copy))
    server.stop()


def _openai(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{served.port}/v1", api_key=API, max_retries=0, timeout=60)


# --- adapters ------------------------------------------------------------------------------------------------
def test_load_generate_and_unload_live_through_http(served):
    name, path = "team.sql", str(served.root / "sql")
    load = {"lora_name": name, "lora_path": path, "base_model_name": "ignored"}  # (the syncer sends the last)

    # Management takes the admin token: none, or the API token, is a 401 (as the gRPC door's UNAUTHENTICATED).
    for token, says in ((None, "missing credentials"), (API, "invalid bearer token for adapter management")):
        status, body, _ = served.call("/v1/load_lora_adapter", load, token=token)
        assert (status, body["error"]["type"]) == (401, "authentication_error") and says in body["error"]["message"]

    status, body, headers = served.call("/v1/load_lora_adapter", load, token=ADMIN)
    assert (status, body) == (200, {"raw": f"Success: LoRA adapter '{name}' added successfully."})
    assert headers["content-type"].startswith("text/plain")

    ids = served.tokenizer(PROMPT)["input_ids"]
    want, _ = reference_greedy(served.model, ids, 8, adapter_dir=path)
    assert len(set(want)) > 1  # (a golden that could not tell the adapter's tokens apart is no golden)
    with _openai(served) as client:
        listed = {m.id: m for m in client.models.list().data}
        assert listed[name].parent == served.server.engine.model_name
        assert listed[name].root == str(Path(path).resolve())
        retrieved = client.models.retrieve(name)
        assert retrieved.model_dump(exclude={"created"}) == listed[name].model_dump(exclude={"created"})
        done = client.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
        assert done.choices[0].token_ids == want

        # A second load of the name is vLLM's 400, unless in place (then it replaces the idle adapter).
        status, body, _ = served.call("/v1/load_lora_adapter", load, token=ADMIN)
        assert status == 400 and body["error"]["message"] == (
            f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, set "
            "'load_inplace' to True.")
        status, _, _ = served.call("/v1/load_lora_adapter", {**load, "load_inplace": True}, token=ADMIN)
        assert status == 200
        base_name = served.server.engine.model_name
        status, body, _ = served.call("/v1/load_lora_adapter", {"lora_name": base_name, "lora_path": path},
                                      token=ADMIN)
        assert status == 400 and body["error"]["message"] == (
            f"The lora adapter '{base_name}' conflicts with a served base model.")

        for token in (None, API):
            assert served.call("/v1/unload_lora_adapter", {"lora_name": name}, token=token)[0] == 401
        status, body, _ = served.call("/v1/unload_lora_adapter", {"lora_name": name}, token=ADMIN)
        assert (status, body) == (200, {"raw": f"Success: LoRA adapter '{name}' removed successfully."})
        assert name not in {m.id for m in client.models.list().data}
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model=name, prompt=PROMPT, max_tokens=2)
    status, body, _ = served.call("/v1/unload_lora_adapter", {"lora_name": name}, token=ADMIN)
    assert status == 404 and body["error"]["message"] == f"The lora adapter '{name}' cannot be found."
    served.server.wait_idle()


def test_adapter_paths_outside_the_roots_missing_or_empty_are_refused(served):
    cases = [  # body, status, param, what the message says
        ({"lora_name": "evil", "lora_path": str(served.outside)}, 400, "lora_path", "is outside the adapter roots"),
        ({"lora_name": "evil", "lora_path": f"{served.root}/../outside/pirate"}, 400, "lora_path",
         "leaves the adapter roots through '..'"),
        ({"lora_name": "ghost", "lora_path": str(served.root / "ghost")}, 404, "lora_path",
         f"Loading lora ghost failed: No adapter found for {served.root / 'ghost'}"),
        ({"lora_name": "", "lora_path": str(served.root / "sql")}, 400, None,
         "Both 'lora_name' and 'lora_path' must be provided."),
        ({"lora_name": "team/sql", "lora_path": str(served.root / "sql")}, 400, "lora_name",
         "adapter name 'team/sql' is not allowed"),
        ({"lora_name": "pirate\n", "lora_path": str(served.root / "sql")}, 400, "lora_name",
         "adapter name 'pirate\\n' is not allowed"),
        ({"lora_name": "x", "lora_path": str(served.root / "sql"), "is_3d_lora_weight": True}, 400,
         "is_3d_lora_weight", "not supported"),
        ({"lora_name": "x"}, 400, "lora_path", "Field required"),
        ({"lora_name": "pickled", "lora_path": str(served.root / "pickled")}, 400, None, "pickle files are refused"),
    ]
    for body, status, param, says in cases:
        got, answer, _ = served.call("/v1/load_lora_adapter", body, token=ADMIN)
        assert (got, answer["error"]["param"]) == (status, param), (body, answer)
        assert says in answer["error"]["message"], (body, answer)
    assert not {"evil", "ghost", "x"} & {a.name for a in served.server.server.runner.list_adapters()}
    status, body, _ = served.call("/v1/unload_lora_adapter", {"lora_name": ""}, token=ADMIN)
    assert (status, body["error"]["message"]) == (400, "'lora_name' needs to be provided to unload a LoRA adapter.")


def test_adapter_management_disabled_is_403():
    server = ServerThread(shared_engine(), ServerConfig(port=0, http_port=0, security=SecurityConfig(
        disable_adapter_management=True)))
    try:
        _, adapters = demo_paths()
        for path, body in (("/v1/load_lora_adapter", {"lora_name": "p2", "lora_path": str(adapters["pirate"])}),
                           ("/v1/unload_lora_adapter", {"lora_name": "pirate"})):
            status, answer, _ = post(server.server.http_port, path, body)
            assert (status, answer["error"]["type"]) == (403, "permission_error")
            assert "--disable-adapter-management" in answer["error"]["message"]
        assert "pirate" in {a.name for a in server.server.runner.list_adapters()}
    finally:
        server.stop()


# --- tokenizer -----------------------------------------------------------------------------------------------
def test_tokenize_prompt_and_chat_forms_match_the_tokenizer(served):
    tok = served.tokenizer
    chat_text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    cases = [  # request, the ids transformers gives
        ({"prompt": PROMPT}, tok(PROMPT)["input_ids"]),
        ({"model": "", "prompt": PROMPT, "add_special_tokens": False},
         tok(PROMPT, add_special_tokens=False)["input_ids"]),
        ({"messages": MESSAGES}, tok(chat_text, add_special_tokens=False)["input_ids"]),
        ({"model": served.server.engine.model_name, "messages": MESSAGES, "add_generation_prompt": False},
         tok(tok.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=False),
             add_special_tokens=False)["input_ids"]),
    ]
    for request, want in cases:
        status, body, _ = served.call("/tokenize", {**request, "return_token_strs": True})
        assert status == 200, (request, body)
        assert body == {"count": len(want), "max_model_len": served.server.engine.config.max_seq_len,
                        "tokens": want, "token_strs": tok.convert_ids_to_tokens(want)}, request
    assert len(set(cases[2][1])) > 10 and cases[2][1] != cases[3][1]  # (the chat form really was rendered)
    status, body, _ = served.call("/tokenize", {"prompt": PROMPT})
    assert (status, body["token_strs"]) == (200, None)  # (vLLM's default: no strings)


def test_detokenize_round_trips_and_checks_the_vocabulary(served):
    tok = served.tokenizer
    for text in (PROMPT, "Où est la rivière ? 🌊"):
        ids = served.call("/tokenize", {"prompt": text, "add_special_tokens": False})[1]["tokens"]
        assert ids == tok(text, add_special_tokens=False)["input_ids"]
        assert served.call("/detokenize", {"tokens": ids})[:2] == (200, {"prompt": text})
    with_bos = tok(PROMPT)["input_ids"]
    status, body, _ = served.call("/detokenize", {"model": "", "tokens": with_bos})
    assert (status, body) == (200, {"prompt": tok.decode(with_bos)})  # special tokens written, as vLLM's

    status, body, _ = served.call("/detokenize", {"tokens": [with_bos[1], 10**9]})
    assert (status, body["error"]["param"]) == (400, "tokens[1]")
    assert f"token id {10**9} is outside the vocabulary" in body["error"]["message"]
    status, body, _ = served.call("/detokenize", {"tokens": [-1]})
    assert status == 400 and body["error"]["param"].startswith("tokens")


def test_tokenizer_endpoints_are_authenticated_and_refuse_what_they_do_not_implement(served):
    for path, body in (("/tokenize", {"prompt": PROMPT}), ("/detokenize", {"tokens": [1, 2]})):
        status, answer, _ = served.call(path, body, token=None)
        assert (status, answer["error"]["type"]) == (401, "authentication_error")
        assert served.call(path, body, token=ADMIN)[0] == 200  # (the admin token opens what the API token does)
    for body, status, param in (
            ({"prompt": PROMPT, "model": "nope"}, 404, "model"),
            ({"messages": MESSAGES, "continue_final_message": True}, 400, "continue_final_message"),
            ({"messages": MESSAGES, "chat_template": "{{ messages }}"}, 400, "chat_template"),
            ({"prompt": 5}, 400, "prompt"),
            ({}, 400, "prompt")):
        got, answer, _ = served.call("/tokenize", body)
        assert (got, answer["error"]["param"]) == (status, param), (body, answer)
    status, answer, _ = served.call("/tokenize", {"prompt": PROMPT, "model": "nope"})
    assert answer["error"]["message"] == "The model `nope` does not exist."


# --- open endpoints, and models by id -------------------------------------------------------------------------
def test_version_and_ping(served):
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert served.call("/version", token=None, method="GET")[:2] == (200, {"version": version})
    health = served.call("/health", token=None, method="GET")[:2]
    assert health == (200, {"status": "serving"})
    for method in ("GET", "POST"):
        assert served.call("/ping", token=None, method=method)[:2] == health


def test_models_by_id(served):
    base = served.server.engine.model_name
    with _openai(served) as client:
        listed = {m.id: m.model_dump(exclude={"created"}) for m in client.models.list().data}
        assert client.models.retrieve(base).model_dump(exclude={"created"}) == listed[base]
        with pytest.raises(openai.NotFoundError) as info:
            client.models.retrieve("no-such-model")
    assert info.value.body["message"] == "The model `no-such-model` does not exist."
    assert info.value.body["param"] == "model"
    status, body, _ = served.call(f"/v1/models/{base}", token=None, method="GET")
    assert status == 401 and body["error"]["type"] == "authentication_error"  # (as /v1/models)


# --- docs/errors.md's V rows --------------------------------------------------------------------------------
CHECKED_BY = {
    "V01": test_load_generate_and_unload_live_through_http, "V02": test_adapter_management_disabled_is_403,
    "V03": test_adapter_paths_outside_the_roots_missing_or_empty_are_refused,
    "V04": test_load_generate_and_unload_live_through_http, "V05": test_load_generate_and_unload_live_through_http,
    "V06": test_adapter_paths_outside_the_roots_missing_or_empty_are_refused,
    "V07": test_adapter_paths_outside_the_roots_missing_or_empty_are_refused,
    "V08": test_adapter_paths_outside_the_roots_missing_or_empty_are_refused,
    "V09": test_adapter_paths_outside_the_roots_missing_or_empty_are_refused,
    "V10": test_load_generate_and_unload_live_through_http,
    "V11": test_tokenizer_endpoints_are_authenticated_and_refuse_what_they_do_not_implement,
    "V12": test_tokenizer_endpoints_are_authenticated_and_refuse_what_they_do_not_implement,
    "V13": test_detokenize_round_trips_and_checks_the_vocabulary,
    "V14": test_tokenizer_endpoints_are_authenticated_and_refuse_what_they_do_not_implement,
    "V15": test_models_by_id,
}


def test_every_v_row_is_checked():
    documented = re.findall(r"^\| (V\d\d) \|", (ROOT / "docs" / "errors.md").read_text(), flags=re.M)
    assert sorted(documented) == sorted(CHECKED_BY)
