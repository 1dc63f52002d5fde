"""llguidance (lora-serve's grammar engine) beside xgrammar on our workload: the SmolLM2-135M tokenizer (49k tokens),
a JSON schema of the kind tenants send, and the token bitmask each step needs.

    python -m benchmarks.grammar_engines [--rounds 5] [--model-size tiny]

xgrammar is not a dependency (it needs transformers and triton at install): put it on PYTHONPATH for this run
(`pip install --no-deps --target DIR xgrammar apache-tvm-ffi triton`). For each engine: the one-time tokenizer
set-up, the schema's compile (first request) and a cached one (second request), and the mean time to fill one
sequence's bitmask, over the tokens of a valid answer fed one by one (medians of rounds).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time

import torch

from benchmarks.common import add_model_size, sized_checkpoint

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "email", "tags", "address"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0},
                         "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
                         "tags": {"type": "array", "items": {"enum": ["new", "vip", "churn"]}, "maxItems": 3},
                         "address": {"type": "object", "required": ["city", "zip"], "additionalProperties": False,
                                     "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}}}}
ANSWER = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "tags": ["vip", "new"],
          "address": {"city": "London", "zip": "W1"}}


def _llguidance(tokenizer_json: str, vocab: int, eos: int, ids: list[int]) -> dict[str, float]:
    import llguidance
    import llguidance.torch as lt

    t0 = time.perf_counter()
    tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA),
                                                            defaults={"whitespace_flexible": False})
    assert not llguidance.LLMatcher.validate_grammar(grammar, tok)
    proto = llguidance.LLMatcher(tok, grammar, log_level=0)
    t2 = time.perf_counter()
    matcher = proto.deep_copy()
    t3 = time.perf_counter()
    mask = lt.allocate_token_bitmask(1, vocab)
    fills = []
    for token in ids:
        s = time.perf_counter()
        lt.fill_next_token_bitmask(matcher, mask, 0)
        fills.append(time.perf_counter() - s)
        assert matcher.consume_token(token), token
    return {"set-up": t1 - t0, "compile": t2 - t1, "cached": t3 - t2, "fill": statistics.mean(fills)}


def _xgrammar(model_dir: str, vocab: int, ids: list[int]) -> dict[str, float]:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=f"{model_dir}/tokenizer.json")
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info)
    t1 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    t2 = time.perf_counter()
    compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))  # its cache
    t3 = time.perf_counter()
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, vocab)
    fills = []
    for token in ids:
        s = time.perf_counter()
        matcher.fill_next_token_bitmask(mask, 0)
        fills.append(time.perf_counter() - s)
        assert matcher.accept_token(token), token
    return {"set-up": t1 - t0, "compile": t2 - t1, "cached": t3 - t2, "fill": statistics.mean(fills)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    add_model_size(p)
    args = p.parse_args()
    from lora_compile.config import ModelConfig
    from lora_compile.tokenizer import Tokenizer

    model = sized_checkpoint(args.model_size)
    tokenizer = Tokenizer(model, ModelConfig.from_dir(model).eos_token_ids)
    vocab = tokenizer.vocab_size
    ids = tokenizer.encode(json.dumps(ANSWER, separators=(",", ":")), add_special_tokens=False)
    eos = min(tokenizer.eos_token_ids)
    runs = {"llguidance": lambda: _llguidance(tokenizer.to_json(), vocab, eos, ids)}
    if importlib.util.find_spec("xgrammar") is not None:
        runs["xgrammar"] = lambda: _xgrammar(str(model), vocab, ids)
    else:
        print("xgrammar is not installed: llguidance alone")
    print(f"torch {torch.__version__}; vocabulary {vocab}; answer of {len(ids)} tokens")
    results: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            results[name].append(run())
    for name, rounds in results.items():
        med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        print(f"  {name:10s} tokenizer set-up {1000 * med['set-up']:8.1f} ms  schema compile {1000 * med['compile']:7.2f} ms"
              f"  cached {1000 * med['cached']:6.3f} ms  bitmask fill {1e6 * med['fill']:7.1f} us/token")


if __name__ == "__main__":
    main()
