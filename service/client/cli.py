"""`lora-client`: the command-line client (health, info, tokenize, adapters, generate). Torch-free, like the SDK."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

# Per-command deadline when --timeout is not given: without one, a peer that accepts but never answers holds a
# call for grpc's 20 s connect timeout. generate: none, a stream lasts as long as its generation.
DEFAULT_TIMEOUTS = {"health": 5.0, "info": 30.0, "tokenize": 30.0, "adapters": 30.0, "generate": None}


def client_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lora-client", description="Talk to a lora-serve server.")
    p.add_argument("--target", default="localhost:50051", help="server address (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=None,
                   help="per-call deadline in seconds; 0: none (default: 5 for health, 30 for info, tokenize and "
                        "adapters, none for generate)")
    p.add_argument("--token", default=None, help="bearer token for every call (or env LORA_SERVE_API_TOKEN)")
    p.add_argument("--admin-token", default=None,
                   help="bearer token for adapters load/unload (or env LORA_SERVE_ADMIN_TOKEN; default: --token)")
    p.add_argument("--tls", action="store_true", help="connect with TLS, trusting the system's CAs")
    p.add_argument("--tls-ca", metavar="PEM", help="connect with TLS, trusting this CA (implies --tls)")
    p.add_argument("--tls-cert", metavar="PEM", help="client certificate for mutual TLS (needs --tls-key)")
    p.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    p.add_argument("--tls-server-name", help="check the server certificate against this name instead")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="stream a completion to the terminal")
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true",
                   help="send the prompt as a user message, rendered with the model's chat template")
    which = g.add_mutually_exclusive_group()
    which.add_argument("--adapter", default=None, help="adapter name (default: the base model)")
    which.add_argument("--mix", action="append", default=[], type=_mix_member, metavar="NAME=WEIGHT",
                       help="a weighted mix of adapters instead: repeat for each member, in order (e.g. --mix "
                            "pirate=0.7 --mix robot=0.3; weights in -100 .. 100)")
    g.add_argument("--max-new-tokens", type=int, default=None)
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--repetition-penalty", type=float, default=None)
    g.add_argument("--presence-penalty", type=float, default=None)
    g.add_argument("--frequency-penalty", type=float, default=None)
    g.add_argument("--logit-bias", action="append", default=[], type=_logit_bias, metavar="TOKEN_ID=BIAS",
                   help="add BIAS (-100 .. 100) to a token's logit (repeatable)")
    g.add_argument("-n", type=int, default=None, help="choices from the one prompt (printed one after the other)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--stop-token-id", action="append", default=[], type=int, help="stop token id (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--prompt-logprobs", type=int, default=None, metavar="K",
                   help="print the prompt tokens' log-probabilities (and the top K) on stderr")
    so = g.add_mutually_exclusive_group()
    so.add_argument("--json-schema", type=_read_text, default=None, metavar="FILE",
                    help="hold the output to the JSON schema in FILE")
    so.add_argument("--json-object", action="store_true", help="hold the output to a JSON object")
    so.add_argument("--regex", default=None, help="hold the output to a regular expression")
    so.add_argument("--choice", action="append", default=None, help="the output is one of these (repeatable)")
    so.add_argument("--grammar", type=_read_text, default=None, metavar="FILE", help="a Lark grammar in FILE")

    a = sub.add_parser("adapters", help="list, load or unload adapters")
    asub = a.add_subparsers(dest="action", required=True)
    asub.add_parser("list")
    load = asub.add_parser("load")
    load.add_argument("name")
    load.add_argument("path", help="PEFT adapter directory, on the server's filesystem")
    unload = asub.add_parser("unload")
    unload.add_argument("name")

    sub.add_parser("info", help="the served model and its limits")
    t = sub.add_parser("tokenize", help="token ids of a text")
    t.add_argument("text")
    sub.add_parser("health", help="grpc.health.v1 status")
    return p


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {e.strerror}") from None


def _logit_bias(value: str) -> tuple[int, float]:
    token, sep, bias = value.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=BIAS (e.g. 42=-100), got {value!r}") from None


def _mix_member(value: str) -> tuple[str, float]:
    name, sep, weight = value.rpartition("=")  # (the weight never holds "=")
    try:
        if not sep or not name:
            raise ValueError
        return name, float(weight)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=WEIGHT (e.g. pirate=0.7), got {value!r}") from None


def main(argv: list[str] | None = None) -> int:
    from service.client import DeadlineExceededError, LoraServeClient, LoraServeError
    from service.client.channel import ADMIN_TOKEN_ENV, API_TOKEN_ENV, ClientTLS

    parser = client_parser()
    args = parser.parse_args(argv)
    if args.timeout is not None and args.timeout < 0:
        parser.error("--timeout must be >= 0")
    timeout = DEFAULT_TIMEOUTS[args.command] if args.timeout is None else (args.timeout or None)
    tls = None
    if args.tls or args.tls_ca or args.tls_cert or args.tls_key or args.tls_server_name:
        try:
            tls = ClientTLS.from_files(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
        except (OSError, ValueError) as e:
            parser.error(str(e))
    token = args.token or os.environ.get(API_TOKEN_ENV) or None
    admin_token = args.admin_token or os.environ.get(ADMIN_TOKEN_ENV) or None
    with LoraServeClient(args.target, timeout=timeout, token=token, admin_token=admin_token, tls=tls) as client:
        try:
            return _run_client_command(client, args)
        except LoraServeError as e:
            hint = f" (no answer from {args.target} within {timeout:g}s; --timeout)" \
                if isinstance(e, DeadlineExceededError) and timeout else ""
            print(f"error: {e}{hint}", file=sys.stderr)
            for v in e.field_violations:
                print(f"  {v.field}: {v.description}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130


def _run_client_command(client, args) -> int:
    if args.command == "generate":
        params = dict(
            adapter=args.adapter, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, min_p=args.min_p, seed=args.seed, repetition_penalty=args.repetition_penalty,
            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
            logit_bias=dict(args.logit_bias), n=args.n, stop=args.stop, stop_token_ids=args.stop_token_id,
            ignore_eos=args.ignore_eos, prompt_logprobs=args.prompt_logprobs, json_schema=args.json_schema,
            json_object=args.json_object, regex=args.regex, choice=args.choice, grammar=args.grammar,
            adapters=args.mix or None,
        )
        prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
        if (args.n or 1) > 1:  # interleaved streams would be unreadable: each choice once it is whole
            for choice in client.complete_choices(prompt, **params):
                print(f"[choice {choice.index}]\n{choice.text}")
                _print_finish(choice)
            return 0
        last, prompt_logprobs = None, []
        for chunk in client.generate(prompt, **params):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            prompt_logprobs += chunk.prompt_logprobs
            last = chunk
        sys.stdout.write("\n")
        if args.prompt_logprobs is not None:
            print(f"[prompt logprobs: {' '.join(f'{p:.3f}' for p in prompt_logprobs)}]", file=sys.stderr)
        if last is not None:
            _print_finish(last)
    elif args.command == "adapters":
        if args.action == "list":
            for a in client.list_adapters():
                slot = "-" if a.device_slot is None else a.device_slot
                print(f"{a.name}\trank={a.rank}\talpha={a.alpha:g}\tslot={slot}\tactive={a.active_requests}\t{a.path}")
        elif args.action == "load":
            a = client.load_adapter(args.name, args.path)
            print(f"loaded {a.name} (rank {a.rank}, {', '.join(a.target_modules)}) from {a.path}")
        else:
            client.unload_adapter(args.name)
            print(f"unloaded {args.name}")
    elif args.command == "info":
        for key, value in dataclasses.asdict(client.model_info()).items():
            print(f"{key}: {value}")
    elif args.command == "tokenize":
        print(" ".join(map(str, client.tokenize(args.text))))
    elif args.command == "health":
        print(client.health())
    return 0


def _print_finish(last) -> None:
    """The finish line on stderr: why it ended, the token counts, the replica (a last chunk or a Completion)."""
    if last.usage is None:
        return
    stop = f" ({last.stop!r})" if last.stop is not None else f" (token {last.stop_token_id})" \
        if last.stop_token_id is not None else ""
    replica = f"; replica {last.replica_id}" if last.replica_id else ""
    cached = f" ({last.usage.cached_tokens} cached)" if last.usage.cached_tokens else ""
    print(f"[finish: {last.finish_reason}{stop}; prompt {last.usage.prompt_tokens} tokens{cached}, "
          f"completion {last.usage.completion_tokens} tokens{replica}]", file=sys.stderr)
