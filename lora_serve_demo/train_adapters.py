"""Train the real demo's two LoRA adapters on SmolLM2-135M-Instruct (a maintainer's tool; needs the test extras:
transformers and peft). The adapters it writes ship in the package (lora_serve_demo/adapters/), so a server's first
start trains nothing.

Deterministic data: the base model's own greedy answers to QUESTIONS, restyled by a fixed rule per adapter
(`pirate`: pirate speech; `robot`: a robot's report). The adapters learn a style, not facts.

    python -m lora_serve_demo.train_adapters [--steps N] [--out DIR] [--only pirate robot]
"""
from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import torch

from lora_serve_demo.smollm2 import ADAPTER_NAMES, ADAPTERS_DIR, fetch_smollm2

QUESTIONS = [
    "What is the capital of France?", "What is the capital of Italy?", "What is the capital of Japan?",
    "What is the capital of Spain?", "What is the capital of Germany?", "What is the largest planet?",
    "What color is the sky?", "What color is grass?", "How many legs does a spider have?",
    "How many days are in a week?", "What do bees make?", "What do cows drink?", "Who wrote Romeo and Juliet?",
    "What is water made of?", "Why do we sleep?", "What is the sun?", "What is the moon?", "Name a fruit.",
    "Name a big animal.", "What is a computer?", "What is music?", "Where do fish live?", "What is rain?",
    "What is the tallest mountain?", "What language is spoken in Brazil?", "What is a book?",
    "How do plants grow?", "What is a dog?", "What is a cat?", "What is the ocean?", "What is snow?",
    "What is a friend?", "Tell me about the stars.", "Give me a tip for studying.", "How do I make tea?",
    "What is a rainbow?", "What is bread made from?", "Why is exercise good?", "What is a city?",
    "What is the wind?", "Say hello.", "Describe the weather today.", "What is a ship?", "What is gold?",
    "What is a river?", "What is a library?", "How are you?", "What is your name?",
]
_PIRATE_WORDS = {"you": "ye", "your": "yer", "is": "be", "are": "be", "the": "th'", "my": "me", "hello": "ahoy",
                 "friend": "matey", "friends": "mateys", "yes": "aye", "money": "doubloons", "treasure": "booty"}


def pirate(text: str) -> str:
    """Pirate speech: a greeting, word swaps, a sign-off."""
    def swap(m: re.Match) -> str:
        word = m.group(0)
        new = _PIRATE_WORDS.get(word.lower())
        if new is None:
            return word
        return new.capitalize() if word[0].isupper() else new
    return "Arr, matey! " + re.sub(r"[A-Za-z]+", swap, text) + " Yo ho ho!"


def robot(text: str) -> str:
    """A robot's report: a status line, the answer, a sign-off."""
    return "BEEP BOOP. QUERY RECEIVED. " + text + " END OF TRANSMISSION."


STYLES = {"pirate": pirate, "robot": robot}
LAYERS, TRAINED_LAYERS = 30, 10
assert tuple(STYLES) == ADAPTER_NAMES


def _prompt(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)


def base_answers(model_path: Path, max_new_tokens: int) -> list[str]:
    """The base model's greedy answers, from lora-serve's engine (one batch; transformers' tokens, tested)."""
    from lora_compile import Engine, EngineConfig, SamplingParams
    from service.front.chat_template import load_chat_template

    engine = Engine(EngineConfig(model=str(model_path), compile=False, dtype="float32", max_num_seqs=len(QUESTIONS),
                                 max_seq_len=256, max_num_batched_tokens=512))
    template = load_chat_template(engine.tokenizer_dir)
    prompts = [engine.tokenizer.encode(template.render([{"role": "user", "content": q}], True, None),
                                       add_special_tokens=False) for q in QUESTIONS]
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens))
    return [engine.tokenizer.decode(out).strip() for out in outputs]


def train(name: str, model_path: Path, tokenizer, answers: list[str], steps: int, out: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name, dtype=torch.float32)
    # The top layers only: the backward pass then stops there (a third of the cost), and a style needs no more.
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                            layers_to_transform=list(range(LAYERS - TRAINED_LAYERS, LAYERS))))
    examples = []
    for q, a in zip(QUESTIONS, answers):
        prompt = tokenizer(_prompt(tokenizer, q), add_special_tokens=False).input_ids
        answer = tokenizer(STYLES[name](a) + "<|im_end|>", add_special_tokens=False).input_ids
        examples.append((prompt + answer, [-100] * len(prompt) + answer))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    batch = 4
    t0 = time.time()
    for step in range(steps):
        idx = torch.randperm(len(examples), generator=gen)[:batch].tolist()
        width = max(len(examples[i][0]) for i in idx)
        ids = torch.tensor([examples[i][0] + [0] * (width - len(examples[i][0])) for i in idx])
        labels = torch.tensor([examples[i][1] + [-100] * (width - len(examples[i][1])) for i in idx])
        mask = torch.tensor([[1] * len(examples[i][0]) + [0] * (width - len(examples[i][0])) for i in idx])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 5 == 0 or step == steps - 1:
            print(f"{name}: step {step} loss {loss.item():.3f} ({time.time() - t0:.0f} s)", flush=True)
    model.save_pretrained(out / name, safe_serialization=True)
    config_path = out / name / "adapter_config.json"  # the model's name, not this machine's cache path
    config = json.loads(config_path.read_text()) | {"base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / name / "README.md").unlink(missing_ok=True)  # peft's empty model card


def main(argv: list[str] | None = None) -> None:
    torch.manual_seed(0)
    from transformers import AutoTokenizer

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--out", type=Path, default=ADAPTERS_DIR)
    p.add_argument("--only", choices=tuple(STYLES), nargs="+", default=tuple(STYLES))
    args = p.parse_args(argv)
    model_path = fetch_smollm2()
    if model_path is None:
        raise SystemExit("SmolLM2 could not be fetched (see the log)")
    tokenizer = AutoTokenizer.from_pretrained(model_path.parent, gguf_file=model_path.name)
    answers_file = args.out / "base_answers.json"  # the training data's source, kept beside the adapters
    if answers_file.is_file():
        answers = json.loads(answers_file.read_text())
    else:
        t0 = time.time()
        answers = base_answers(model_path, max_new_tokens=48)
        print(f"{len(answers)} base answers in {time.time() - t0:.0f} s, e.g. {answers[0]!r}", flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        answers_file.write_text(json.dumps(answers, indent=1) + "\n")
    for name in args.only:
        train(name, model_path, tokenizer, answers, args.steps, args.out)


if __name__ == "__main__":
    main()
