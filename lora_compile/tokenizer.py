"""tokenizer.json (Hugging Face `tokenizers`) plus the ids the engine needs: EOS."""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from .errors import CheckpointError

_RELEASE_GIL_CHARS = 4096
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# Decoder steps that work piece by piece (SentencePiece's): a token's text in context is its piece rewritten.
_PIECEWISE_STEPS = {"Replace", "ByteFallback", "Fuse", "Strip", "Metaspace"}


class Tokenizer:
    def __init__(self, model_dir: str | Path, eos_token_ids: tuple[int, ...] = ()):
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: missing; the model directory needs a tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust library raises plain Exceptions
            raise CheckpointError(f"{path}: cannot be read by the tokenizers library ({e})") from e
        eos = set(eos_token_ids) | set(_generation_eos(Path(model_dir)))
        self.eos_token_ids = frozenset(eos)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        # No token covers more characters of the text than its own string has (byte-level pieces are one char
        # per byte, SentencePiece ones one per char), so N tokens cover at most N * max_token_chars characters.
        self.max_token_chars = max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)
        self._token_bytes: dict[int, bytes] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > _RELEASE_GIL_CHARS:  # encode() holds the GIL throughout; encode_batch() releases it
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def to_json(self) -> str:
        """tokenizer.json as the tokenizers library holds it (grammar engines build their own view of it)."""
        return self._tok.to_str()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def is_special(self, token_id: int) -> bool:
        """A special token (BOS, EOS...): decoding with skip_special_tokens leaves it out of the text."""
        added = self._added.get(token_id)
        return added is not None and added.special

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes this token adds to decoded text, in context (a leading space included): raw bytes, so a
        token holding part of a multi-byte character gives that part (decode() would give U+FFFD). A special
        token gives its own text. Memoized: logprobs ask for the same few tokens again and again."""
        data = self._token_bytes.get(token_id)
        if data is None:
            data = self._token_bytes[token_id] = self._raw_bytes(token_id)
        return data

    @functools.cached_property
    def _added(self) -> dict:
        return self._tok.get_added_tokens_decoder()

    @functools.cached_property
    def _decoder_steps(self) -> list[dict]:
        """The decoder's steps, from the tokenizer's own serialization (read once, on first use)."""
        return _steps(json.loads(self._tok.to_str()).get("decoder"))

    def _raw_bytes(self, token_id: int) -> bytes:
        added = self._added.get(token_id)
        if added is not None:  # added tokens decode to their content as written
            return added.content.encode()
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        steps = self._decoder_steps
        kinds = {s.get("type") for s in steps}
        # Byte-level BPE (GPT-2, Llama 3, Qwen): each character of a piece stands for one byte.
        if "ByteLevel" in kinds and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        # SentencePiece: <0xNN> byte-fallback pieces, and the word-boundary mark for a space.
        if "ByteFallback" in kinds and (m := _BYTE_PIECE.fullmatch(piece)):
            return bytes([int(m[1], 16)])
        if kinds and kinds <= _PIECEWISE_STEPS:
            for step in steps:
                if step.get("type") == "Replace" and "String" in (step.get("pattern") or {}):
                    piece = piece.replace(step["pattern"]["String"], step.get("content", ""))
                elif step.get("type") == "Metaspace":
                    piece = piece.replace(step.get("replacement", "\u2581"), " ")
            return piece.encode()
        return self._tok.decode([token_id], skip_special_tokens=False).encode()


def _generation_eos(model_dir: Path) -> tuple[int, ...]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return ()
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, UnicodeDecodeError):
        return ()
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _steps(decoder: dict | None) -> list[dict]:
    """A decoder spec as its list of steps (a Sequence flattened)."""
    if not decoder:
        return []
    if decoder.get("type") == "Sequence":
        return [s for d in decoder.get("decoders", []) for s in _steps(d)]
    return [decoder]


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte, mapped back to the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_LEVEL = _byte_level_alphabet()
BYTE_LEVEL_CHARS = frozenset(_BYTE_LEVEL)  # the characters byte-level BPE vocabularies are spelled in
