"""`lora-generate`: stream an offline generation to the terminal, on the demo model unless --model is given."""
from __future__ import annotations

import argparse
import sys
import time

from lora_compile import Engine, EngineConfig, SamplingParams


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lora-generate", description=__doc__)
    p.add_argument("prompt", help="text to continue")
    p.add_argument("--model", help="Hugging Face model directory or GGUF file (default: the demo model, SmolLM2)")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=DIR", help="register a PEFT adapter")
    p.add_argument("--use", metavar="NAME", help="adapter to generate with (default: the base model)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=1024, help="prompt + new tokens (at most the model's positions)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--logit-bias", action="append", default=[], metavar="TOKEN_ID=BIAS",
                   help="add BIAS (-100..100) to a token's logit; repeatable")
    p.add_argument("--prompt-logprobs", type=int, metavar="K",
                   help="after the text, print each prompt token's log-probability and the top K (stderr)")
    p.add_argument("--seed", type=int)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--no-compile", action="store_true", help="run eagerly (no warm-up compile)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    adapters = dict(a.split("=", 1) for a in args.adapter)
    if args.model is None:
        from lora_serve_demo.select import prepare_demo  # (only without --model: it may build the demo)

        demo = prepare_demo()
        model = demo.model
        adapters = {**demo.adapters, **adapters}
    else:
        model = args.model
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(model=str(model), max_batch_size=1, max_seq_len=args.max_seq_len, device=args.device,
                                 dtype=args.dtype, compile=not args.no_compile))
    for name, path in adapters.items():
        engine.adapters.register(name, path)
    print(f"[loaded {model} in {time.perf_counter() - t0:.1f}s; compiling...]", file=sys.stderr, flush=True)
    print(f"[ready after {engine.warmup():.1f}s warm-up]", file=sys.stderr, flush=True)
    bias = sorted((int(t), float(b)) for t, b in (item.split("=", 1) for item in args.logit_bias))
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                              max_new_tokens=args.max_new_tokens, min_p=args.min_p,
                              repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                              frequency_penalty=args.frequency_penalty, logit_bias=tuple(bias),
                              prompt_logprobs=args.prompt_logprobs)
    tokens: list[int] = []
    printed = ""

    def on_token(_seq_id: int, token: int) -> None:
        nonlocal printed
        tokens.append(token)
        text = engine.tokenizer.decode(tokens)
        if not text.endswith("\ufffd"):  # hold back a half-decoded multi-byte character
            print(text[len(printed):], end="", flush=True)
            printed = text

    seq = engine.generate_sequences([args.prompt], sampling, adapters=[args.use], on_token=on_token)[0]
    print()
    for token, logprob, top in zip(seq.prompt_ids[1:], seq.prompt_logprobs, seq.prompt_top_logprobs):
        alternatives = ", ".join(f"{engine.tokenizer.decode([t])!r} {lp:.3f}" for t, lp in top)
        print(f"{engine.tokenizer.decode([token])!r} {logprob:.3f}  [{alternatives}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
