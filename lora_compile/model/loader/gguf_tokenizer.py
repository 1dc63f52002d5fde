"""A GGUF file's tokenizer (llama.cpp's `tokenizer.ggml.*` metadata) as a Hugging Face `tokenizers` tokenizer.json.

A GGUF carries the vocabulary, merges, token types and special ids, plus the name of the pre-tokenizer its vocabulary
was learnt with (`tokenizer.ggml.pre`). The split each name stands for is llama.cpp's (llama-vocab.cpp); byte-level
BPE (`tokenizer.ggml.model == "gpt2"`: GPT-2, Llama 3, Qwen, SmolLM) is what is built here. A SentencePiece
vocabulary (`"llama"`: Llama 2, Mistral, Gemma) is refused with the `--tokenizer DIR` remedy rather than rebuilt
approximately.
"""
from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from ...errors import CheckpointError
from ...tokenizer import BYTE_LEVEL_CHARS

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the splits applied in order before byte-level BPE (llama.cpp's table, the names it writes).
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("default", "gpt-2", "gpt2", "mpt", "olmo"), (_GPT2_SPLIT,)),
    # Digits one by one, then GPT-2's split (as the tokenizer.json of these models says: Digits(individual_digits)).
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"),
                    (r"\p{N}", _GPT2_SPLIT)),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "dbrx", "smaug-bpe", "falcon3"), (_LLAMA3_SPLIT,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), (_QWEN2_SPLIT,)),
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types


def build_tokenizer(meta: dict, source: str) -> Tokenizer:
    """tokenizer.json's content for the file whose metadata is `meta` (key -> value, arrays as lists)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(
            f"{source}: its tokenizer is {kind!r}; only byte-level BPE ('gpt2') tokenizers are read from a GGUF file. "
            f"Give the model's tokenizer.json with --tokenizer DIR")
    pre = meta.get("tokenizer.ggml.pre", "default")
    splits = PRE_TOKENIZER_SPLITS.get(pre)
    if splits is None:
        raise CheckpointError(
            f"{source}: unknown pre-tokenizer {pre!r} (tokenizer.ggml.pre); known: {', '.join(sorted(PRE_TOKENIZER_SPLITS))}. "
            f"Give the model's tokenizer.json with --tokenizer DIR")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, <|endoftext|>) are matched whole and skipped when decoding; user-defined ones
    # (<think>) are matched whole and kept. A control token spelled outside the byte alphabet is a converter's
    # mislabel that no text can produce: left as a plain vocabulary entry.
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types)
                            if k == _CONTROL and set(t) <= BYTE_LEVEL_CHARS])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types) if k == _USER_DEFINED])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        bos_token = tokens[bos]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos_token} $A", pair=f"{bos_token} $A {bos_token} $B", special_tokens=[(bos_token, bos)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def tokenizer_config(meta: dict) -> dict:
    """tokenizer_config.json's content: the chat template and the special tokens it refers to."""
    tokens = meta["tokenizer.ggml.tokens"]
    config: dict = {"add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False))}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                      ("pad_token", "padding_token_id")):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= token_id < len(tokens):
            config[name] = tokens[token_id]
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config
